"""Whole models against llama.cpp's goldens, on every backend that is present:

- per-layer activations of the activation prompt (NMSE per node, bounds in tolerances.py);
- teacher-forced argmax at every prompt and generated position where llama.cpp's top-1/top-2
  margin is clear, and the top-16 logits themselves;
- free-running greedy tokens, equal up to the first near-tie.

CUDA is held to llama.cpp's CUDA goldens where they hold the model; on a model where llama.cpp's
own CPU backend would fail that (spread_rule), the bounds scale with llama.cpp's own CUDA-vs-CPU
spread (tolerances.SPREAD_ARGMAX_FACTOR; ci/cuda_spread.py prints it).
"""

from __future__ import annotations

import numpy as np
import pytest
from tabulate import tabulate

from conformance.harness.llama_spread import common_prefix, llama_spread, spread_rule
from conformance.harness import goldens, tolerances
from conformance.harness.memory import release_memory
from brass import arch as arch_registry
from brass.backends import cuda_available
from brass.llamacpp import brass_tap
from brass.model import Model

MODELS = [m.name for m in goldens.models()]
NEEDS_GPU = pytest.mark.skipif(not cuda_available(), reason="CUDA backend: no GPU on this machine")
# The CUDA backend's arithmetic on any machine: the numpy backend in q8_1 mode, the oracle every
# CUDA kernel is held to (conformance/harness/cases.py), held to llama.cpp's CUDA goldens by the CUDA
# backend's own rules (activations, teacher-forced, greedy). Where the GPU runner is scarce it is
# the part of that gate CI can run: on the real models it reproduced the H200's disagreements
# position for position (smollm2-135m long prompt, position 1: top-1 |Δ| 18.844 here, 18.839 on
# the H200); it cannot see a defect of a CUDA kernel itself (test_kernels* hold each to it).
ORACLE = "q8_1-oracle"
CASES = ([(n, "numpy") for n in MODELS] + [pytest.param(n, "cuda", marks=NEEDS_GPU) for n in MODELS]
         + [(n, ORACLE) for n in MODELS if "cuda" in goldens.references(n)])


def backend_under_test(name: str, backend: str, loaded) -> tuple[str, str, Model]:
    """(backend whose bounds apply, golden set, model) of a case: the oracle stands in for
    the CUDA backend against llama.cpp's CUDA goldens, with its bounds, rules and known defects."""
    if backend == ORACLE:
        skip_unless_supported(name, "cuda")
        return "cuda", "cuda", loaded(name, ORACLE)
    skip_unless_supported(name, backend)
    return backend, reference(name, backend), loaded(name, backend)


@pytest.fixture(scope="module")
def loaded(real_model_path):
    """The model of a case, loaded once: the cases' tests run case by case (their parameters
    are module-scoped), so only the current case's model is kept; the one before is let go
    when the next loads (a numpy model keeps its weights as float32: qwen2.5-coder-0.5b's are
    2 GB, and holding every case's model to the module's end took the process to 8 GB)."""
    cache: dict = {}

    def get(name: str, backend: str) -> Model:
        key = (name, backend)
        if key not in cache:
            cache.clear()
            release_memory()
            gm = goldens.model(name)
            path = real_model_path(name) if gm.kind == "real" else gm.path()
            cache[key] = (Model(path, backend="numpy", act_mode="q8_1", quiet=True) if backend == ORACLE
                          else Model(path, backend=backend, quiet=True))
        return cache[key]
    yield get
    cache.clear()
    release_memory()


def skip_unless_supported(name: str, backend: str):
    """Brass refuses some architectures on some backends (qwen35 on CUDA, for now): say so."""
    arch = goldens.model(name).arch
    if backend not in arch_registry.backends(arch):
        pytest.skip(f"{arch} is not yet supported on the {backend} backend")


def reference(name: str, backend: str) -> str:
    """The golden set a backend is held to: CUDA against llama.cpp's CUDA backend wherever
    that set holds the model (golden/cuda/), else against the CPU set with wider bounds."""
    return "cuda" if backend == "cuda" and "cuda" in goldens.references(name) else "cpu"


def spread_bounds(name: str) -> dict:
    """role → (layer 0, any layer) NMSE bounds against the CUDA goldens (tolerances.py)."""
    entry = next(m for m in goldens.manifest("cuda")["models"] if m["name"] == name)
    f = tolerances.SPREAD_FACTOR
    return {role: (max(f * s["layer0"], tolerances.CUDA_FLOOR), max(f * s["any"], tolerances.CUDA_FLOOR))
            for role, s in entry["spread_vs_cpu"]["activations_nmse"].items()}


def q8_1_oracle(name: str, backend: str, ref_set: str) -> dict | None:
    """The figures CUDA is held to against the CPU set on the models tolerances.Q8_1_ORACLE
    holds (qwen35, gemma4: no CUDA goldens yet): those of the numpy backend in q8_1 mode, the
    CUDA kernels' oracle (ci/q8_1_oracle.py measures them); None for every other case."""
    return tolerances.Q8_1_ORACLE.get(name) if (backend, ref_set) == ("cuda", "cpu") else None


def settled_positions(name: str, k: int) -> np.ndarray:
    """Teacher-forced positions of CUDA prompt k where llama.cpp's CPU and CUDA backends agree
    on the argmax and the CPU's logit of that token lies within the CUDA margin of the CUDA's
    (where their two sequences hold the same ids), or that only the CUDA sequence has (after
    its greedy tokens part from the CPU's).

    The second condition: where llama.cpp's own two backends put the top token's logit further
    apart than the margin the test would hold Brass to, their agreeing on the argmax is luck,
    and a third backend that lands elsewhere in that spread says nothing about a defect. It
    removes 1 of 162 clear positions on smollm2-135m (long prompt, position 1: margin 1.857,
    CPU and CUDA top-1 logits 32.83 and 10.50, 22.3 apart), 1 of 431 on gemma3-270m (chat 2:
    1.31, 3.17 apart), none on qwen2.5-coder-0.5b nor on any dense synthetic model
    (tolerances.ARGMAX_EPS says more)."""
    gp, cp = goldens.prompts(name, "cuda")[k], goldens.prompts(name, "cpu")[k]
    common = common_prefix(gp.tf_ids, cp.tf_ids)
    settled = np.ones(len(gp.tf_ids), dtype=bool)
    own_gap = np.abs(cp.tf_top_logits[:common, 0] - gp.tf_top_logits[:common, 0])
    settled[:common] = (gp.tf_argmax[:common] == cp.tf_argmax[:common]) & (own_gap < gp.tf_margin[:common])
    return settled


# Known, measured defects of the CUDA backend against llama.cpp's CUDA goldens: (model, test) ->
# reason; the test runs in full as a strict xfail. Empty now. It held ("smollm2-135m",
# "teacher_forced") from 2026-12-02 to 2026-12-04: long prompt, position 1, Brass 29 against
# llama.cpp's 79 at margin 1.857 (on the H200 187/188 at margin > 1.0, worst top-1 |Δ| 18.839;
# the numpy backend in q8_1 mode, the kernels' oracle, predicted 18.844). That position is
# bistable for llama.cpp itself: its CPU backend puts the top-1 logit at 32.83, its CUDA backend
# at 10.50, and Brass (29: 30.89, 79: 29.35) lands in the CPU's regime, where the mat-muls' exact
# products land too (activations unrounded, float32 against the stored weights: 29: 30.89, 79:
# 29.36; both llama.cpp backends pick 79 only through their activation rounding). Which regime
# a row falls into is decided by rounding far upstream: in the oracle, computing position 0's layer-0
# attention mat-muls (attn_v and attn_output) on Q8_1 instead of float16 moves position 1 from
# 18.9 to 0.9 away, other rows and layers leave it 18.5-18.9 away. So it is no defect of Brass's
# arithmetic but a position where the reference is not settled (settled_positions: llama.cpp's
# own backends 22.3 apart there, 12 times the margin). Following llama.cpp's MMQ arithmetic in
# full (BRASS_MMQ=1) lands position 1 in the CUDA regime but puts the rest of the logits further
# from llama.cpp's (perf/NOTES.md, fifteenth session: rounding Q8_1 twice, on two forwards an ulp
# apart, adds two noises where the float16 GEMM adds one).
KNOWN_CUDA_DEFECTS: dict[tuple[str, str], str] = {}


def llama_topk_differs(name: str, key: str) -> np.ndarray:
    """Per token of the activation prompt: whether llama.cpp's CPU and CUDA goldens chose
    different experts at moe_topk node `key`."""
    cuda, cpu = (goldens.activations(name, r).arrays[key] for r in ("cuda", "cpu"))
    return (np.sort(cuda, axis=-1) != np.sort(cpu, axis=-1)).any(axis=-1)


def nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(((ours.astype(np.float64) - ref) ** 2).sum() / max((ref.astype(np.float64) ** 2).sum(), 1e-30))


def _tap_name(node) -> str:
    # llama.cpp's name, except the attention output projection (attn_out everywhere in
    # Brass) and gemma4's residual after attention (brass.llamacpp.brass_tap)
    return brass_tap(node.name, node.role, node.layer)


@pytest.mark.parametrize("name,backend", CASES, scope="module")      # grouped by case: see loaded
def test_activations(name, backend, loaded, record_property):
    gm = goldens.model(name)
    label = backend
    backend, ref_set, m = backend_under_test(name, backend, loaded)
    acts = goldens.activations(name, ref_set)
    traced: dict = {}
    m.score(acts.prompt_ids, trace=lambda key, x: traced.__setitem__(key, m.backend.to_numpy(x)))
    oracle = q8_1_oracle(name, backend, ref_set)
    if ref_set == "cuda":
        role_bounds = spread_bounds(name)
        fallback = (tolerances.CUDA_FLOOR, tolerances.CUDA_FLOOR)
    elif oracle is not None:
        f, floor = tolerances.Q8_1_FACTOR, tolerances.Q8_1_FLOOR
        role_bounds = {role: (max(f * l0, floor), max(f * any_, floor))
                       for role, (l0, any_) in oracle["activations"].items()}
        fallback = tolerances.ACTIVATIONS[(backend, ref_set, gm.kind)]
    else:
        role_bounds, fallback = {}, tolerances.ACTIVATIONS[(backend, ref_set, gm.kind)]
    logit_bound = role_bounds.get("result_output", (None, tolerances.LOGITS[(backend, ref_set, gm.kind)]))[1]
    rows, failures = [], []
    for key, node in acts.nodes.items():
        tap = _tap_name(node)
        assert tap in traced, f"Brass traced no {tap} (llama.cpp node {key}, role {node.role})"
        ours, ref = acts.pair(key, traced[tap])
        if node.role == "moe_topk":
            # expert choice: exact (order within the top-k does not matter to the sum), except at
            # the tokens where llama.cpp's own CPU and CUDA backends choose otherwise
            # (tolerances.py says why, after SPREAD_ARGMAX_FACTOR)
            differ = (np.sort(ours, axis=-1) != np.sort(ref, axis=-1)).any(axis=-1)
            excused = llama_topk_differs(name, key) if ref_set == "cuda" else np.zeros_like(differ)
            bad = np.nonzero(differ & ~excused)[0]
            rows.append((key, node.role, f"differ at {np.nonzero(differ)[0].tolist()}" if differ.any() else "exact",
                         f"exact but {np.nonzero(excused)[0].tolist()}" if excused.any() else "exact"))
            if bad.size:
                failures.append(f"{key}: chosen experts differ at tokens {bad.tolist()}")
            continue
        err = nmse(ours, ref)
        bound0, bound = role_bounds.get(node.role, fallback)
        limit = logit_bound if node.role == "result_output" else (bound0 if node.layer == 0 else bound)
        rows.append((key, node.role, f"{err:.2e}", f"{limit:.1e}"))
        if not err <= limit:
            failures.append(f"{key} ({node.role}): NMSE {err:.3e} > {limit:.1e}")
    print(f"{name}: Brass {label} vs llama.cpp {ref_set} goldens")
    print(tabulate(rows, headers=["node", "role", "NMSE", "bound"]))
    # the worst node against its bound (ci/gpu_summary.py --models tabulates these)
    ratios = [(float(e) / float(b), k, e) for k, role, e, b in rows if role != "moe_topk" and float(b) > 0]
    if ratios:
        _, key, err = max(ratios)
        record_property("reference", ref_set)
        record_property("worst_node", f"{key} {err}")
    assert not failures, f"{name} on {label} vs llama.cpp {ref_set}: " + "; ".join(failures[:8])


@pytest.mark.parametrize("name,backend", CASES, scope="module")      # grouped by case: see loaded
def test_teacher_forced(name, backend, loaded, request, record_property):
    gm = goldens.model(name)
    label = backend
    backend, ref_set, m = backend_under_test(name, backend, loaded)
    eps = tolerances.ARGMAX_EPS[(ref_set, gm.kind)]
    logit_bound = tolerances.LOGITS[(backend, ref_set, gm.kind)]
    allowed = tolerances.ARGMAX_MAX_DISAGREEMENT.get((backend, ref_set, "moe" if "moe" in gm.arch else "dense"), 0.0)
    never_above = np.inf        # llama.cpp margin above which no position may disagree
    oracle = q8_1_oracle(name, backend, ref_set)
    if oracle is not None:
        share, margin = oracle["argmax"]
        logit_bound = tolerances.Q8_1_FACTOR * oracle["top16"]
        allowed, never_above = tolerances.Q8_1_FACTOR * share, tolerances.Q8_1_FACTOR * margin
    spread = spread_rule(name, backend, ref_set)
    if spread is not None:
        f = tolerances.SPREAD_ARGMAX_FACTOR
        allowed, never_above = f * spread.share, f * spread.max_margin
        logit_bound = max(logit_bound, tolerances.SPREAD_LOGITS_FACTOR * spread.top16)
        print(f"{name}: llama.cpp's own CPU against its CUDA goldens differs at {spread.disagree}/"
              f"{spread.clear} clear positions (largest margin {spread.max_margin:.3f}), top-16 "
              f"NMSE {spread.top16:.2e}: Brass may differ at {allowed:.1%}, at no margin above "
              f"{never_above:.2f}, top-16 NMSE up to {logit_bound:.1e} (tolerances.SPREAD_ARGMAX_FACTOR)")
    checked = total = 0
    failures, disagreements, jumps = [], [], []
    worst_top1 = worst_top16 = 0.0
    routing_may_jump = backend == "numpy" and ref_set == "cpu" and m.config.n_expert > 0
    known = KNOWN_CUDA_DEFECTS.get((name, "teacher_forced")) if ref_set == "cuda" else None
    if known:
        # runs in full; strict: the day it passes, this marker must go
        request.applymarker(pytest.mark.xfail(strict=True, reason=known))
    for k, p in enumerate(goldens.prompts(name, ref_set)):
        logits = m.score(p.tf_ids)
        assert logits.shape == (len(p.tf_ids), gm.n_vocab)
        argmax = logits.argmax(axis=-1)
        clear = p.tf_margin > eps
        if ref_set == "cuda":
            clear &= settled_positions(name, k)
        bad = np.nonzero(clear & (argmax != p.tf_argmax))[0]
        disagreements += [f"{p.name} position {j}: Brass {argmax[j]}, llama.cpp {p.tf_argmax[j]} "
                          f"(margin {p.tf_margin[j]:.3f})" for j in bad]
        failures += [f"{p.name} position {j}: Brass {argmax[j]}, llama.cpp {p.tf_argmax[j]} at margin "
                     f"{p.tf_margin[j]:.3f} > {never_above:.2f}" for j in bad if p.tf_margin[j] > never_above]
        checked += int(clear.sum())
        total += len(clear)
        ours_top = np.take_along_axis(logits, p.tf_top_ids.astype(np.int64), axis=-1)
        ref_top = p.tf_top_logits
        j = tolerances.moe_routing_jump(name, p.name, ours_top[:, 0], ref_top[:, 0]) if routing_may_jump else None
        if j is not None:       # another expert at j (tolerances.MOE_ROUTING_JUMP): compare before it
            jumps.append(f"{p.name} from position {j} of {len(ref_top)} (top-1 off by "
                         f"{abs(float(ours_top[j, 0]) - float(ref_top[j, 0])):.2f})")
            ours_top, ref_top = ours_top[:j], ref_top[:j]
        if len(ref_top):
            worst_top1 = max(worst_top1, float(np.abs(ours_top[:, 0] - ref_top[:, 0]).max()))
        err = nmse(ours_top, ref_top) if len(ref_top) else 0.0
        worst_top16 = max(worst_top16, err)
        if not err <= logit_bound:
            failures.append(f"{p.name}: top-16 logits NMSE {err:.3e} > {logit_bound:.1e}")
    print(f"{name}: Brass {label} vs llama.cpp {ref_set}: argmax agrees at {checked - len(disagreements)}"
          f"/{checked} positions with margin > {eps}; worst |Δ| of llama.cpp's top-1 logit {worst_top1:.3f}")
    # ci/gpu_summary.py --models tabulates these
    record_property("reference", ref_set)
    record_property("argmax_agreement", f"{checked - len(disagreements)}/{checked} (margin > {eps})")
    record_property("worst_top1_delta", f"{worst_top1:.3f}")
    record_property("worst_top16_nmse", f"{worst_top16:.2e}")
    if jumps:
        print(f"routed to another expert, left out of the logit comparison: {'; '.join(jumps)}")
        if len(jumps) > tolerances.MOE_ROUTING_JUMP_PROMPTS:
            failures.append(f"{len(jumps)} prompts routed otherwise (at most "
                            f"{tolerances.MOE_ROUTING_JUMP_PROMPTS}): {'; '.join(jumps)}")
    assert checked / total >= tolerances.MIN_COVERAGE, \
        f"only {checked}/{total} positions have a clear margin: the check would be vacuous"
    if len(disagreements) > allowed * checked:
        failures = disagreements[:8] + failures
    elif disagreements:
        print(f"{len(disagreements)} of {checked} clear positions differ (allowed {allowed:.0%}): "
              + "; ".join(disagreements))
    assert not failures, f"{name} on {label}: " + "; ".join(failures[:8])


@pytest.mark.parametrize("name,backend", CASES, scope="module")      # grouped by case: see loaded
def test_greedy_stream(name, backend, loaded, request):
    gm = goldens.model(name)
    label = backend
    backend, ref_set, m = backend_under_test(name, backend, loaded)
    oracle = q8_1_oracle(name, backend, ref_set)
    if oracle is not None and oracle["stream"] is not None:
        # runs in full; strict: a stream that no longer parts there means the figures changed
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            f"Q8_1 rounding parts the stream from llama.cpp's CPU one where the numpy q8_1 "
            f"oracle parts ({oracle['stream']}); needs llama.cpp's CUDA goldens (tolerances.py)")))
    eps = tolerances.STREAM_EPS[gm.kind]
    spread = spread_rule(name, backend, ref_set)
    if spread is not None:          # below this margin llama.cpp's own backends choose otherwise
        eps = max(eps, spread.max_margin)
    # against the CUDA set, only the tokens before llama.cpp's own CUDA and CPU streams part:
    # from there on the CUDA golden's tokens are not a settled reference
    shared = llama_spread(name).shared_tokens if ref_set == "cuda" else None
    compared = 0
    for k, p in enumerate(goldens.prompts(name, ref_set)):
        step_margin = p.step_top_logits[:, 0] - p.step_top_logits[:, 1]
        tf_margin = p.tf_margin[len(p.prompt_ids) - 1:]
        n = len(p.generated_ids) if shared is None else shared[k]
        # compared up to the first near-tie (past it llama.cpp's own token is a coin toss)
        clear = next((i for i in range(n) if step_margin[i] < eps or tf_margin[i] < eps), n)
        # generated only as far as compared (a greedy token does not depend on how many follow
        # it; the rest took the numpy backend minutes per model), and at least one: every
        # prompt's prefill and first pick run
        ours = list(m.generate(p.prompt_ids, max_tokens=max(clear, 1)))
        for i in range(clear):
            assert i < len(ours) and ours[i] == p.generated_ids[i], (
                f"{name} on {label}, prompt {p.name}: token {i} is "
                f"{ours[i] if i < len(ours) else 'missing'}, llama.cpp's {p.generated_ids[i]} "
                f"(margin {step_margin[i]:.3f}); Brass {ours[:i + 1]} vs {p.generated_ids[:i + 1]}")
            compared += 1
    if compared < 8 and spread is not None:
        # not a pass: reported as a skip, with what was compared
        pytest.skip(f"{name}: llama.cpp's own CUDA and CPU streams share {sum(spread.shared_tokens)} "
                    f"tokens before they part, and before a margin of {eps:.2f} (where its own "
                    f"backends choose otherwise) only {compared} remain to compare (all {compared} "
                    f"equal): fewer than 8, the greedy check means nothing on this model")
    assert compared >= 8, f"only {compared} tokens before near-ties: too few to mean anything"


@pytest.mark.skipif(not cuda_available(), reason="CUDA backend: no GPU on this machine")
def test_two_cuda_models_in_one_process():
    """Two CUDA backends alive at once, generating in turns, from two threads: each one's
    work stays on its own stream (a model created later once made its stream current for the
    whole thread, and the first model's host copies and array ops raced its kernels)."""
    import threading
    a = Model(goldens.model("synth-qwen3").path(), backend="cuda", quiet=True)
    b = Model(goldens.model("synth-llama").path(), backend="cuda", quiet=True)
    pa, pb = goldens.prompts("synth-qwen3")[1], goldens.prompts("synth-llama")[1]
    expect_a = list(a.generate(pa.prompt_ids, max_tokens=12))
    expect_b = list(b.generate(pb.prompt_ids, max_tokens=12))
    got = {}

    def run(key, m, p):
        got[key] = [list(m.generate(p.prompt_ids, max_tokens=12)) for _ in range(3)]
    threads = [threading.Thread(target=run, args=("a", a, pa)), threading.Thread(target=run, args=("b", b, pb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["a"] == [expect_a] * 3 and got["b"] == [expect_b] * 3
    # and the streams agree with llama.cpp up to the first near-tie (as test_greedy_stream)
    for m_name, p, ours in (("synth-qwen3", pa, expect_a), ("synth-llama", pb, expect_b)):
        first = len(p.prompt_ids) - 1          # teacher-forced row predicting generated token 0
        k = min(12, len(p.generated_ids))
        margin = np.minimum(p.step_top_logits[:k, 0] - p.step_top_logits[:k, 1],
                            p.tf_margin[first:first + k])
        tie = margin < tolerances.STREAM_EPS["synthetic"]
        n = int(np.argmax(tie)) if tie.any() else k
        assert ours[:n] == p.generated_ids[:n], m_name
