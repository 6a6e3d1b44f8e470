"""Decode steps replayed from a captured CUDA graph give what the eager path gives, on every
synthetic model (dense, MoE, sliding window, every weight type the kernels support).

The graph holds the same kernels with the same inputs as an eager step, so the comparison is
exact: the same tokens and bit-identical logits, not a tolerance. Also checked: greedy decoding
that runs ahead on the device stops where the consumer stops (the session's position stays
right for what follows), and two sessions keep their graphs apart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from brass.backends import cuda_available

pytestmark = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: decode-graph checks run on the GPU runner (ci/gpu.sh suite)")

SYNTH = Path(__file__).resolve().parents[2] / "golden" / "models"
MODELS = sorted(p.stem for p in SYNTH.glob("synth-*.gguf"))
N_GEN = 40          # more than two greedy chunks, so that chunks run ahead of the host


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    import brass
    from brass import arch
    from brass.gguf import GGUFFile
    gf = GGUFFile(SYNTH / f"{request.param}.gguf")
    name = gf.architecture
    gf.close()
    if "cuda" not in arch.backends(name):
        pytest.skip(f"{name} is not yet supported on the cuda backend")
    return brass.load(str(SYNTH / f"{request.param}.gguf"), backend="cuda", quiet=True)


def prompt(model, rng, n=9):
    return [int(t) for t in rng.integers(0, model.config.n_vocab, n)]


def eager_session(model, n_ctx=128):
    s = model.new_session(n_ctx)
    s.graphs = False
    return s


def test_graph_decode_logits_equal_eager(model, rng):
    ids = prompt(model, rng)
    follow = [int(t) for t in rng.integers(0, model.config.n_vocab, 6)]
    runs = []
    for graphs in (False, True):
        s = model.new_session(128)
        s.graphs = graphs
        s.prefill(ids)
        runs.append([model.backend.to_numpy(s.decode(t)).copy() for t in follow])
        assert s.n_past == len(ids) + len(follow)
    for i, (e, g) in enumerate(zip(*runs)):
        assert np.array_equal(e, g), f"decode step {i}: graph logits differ from eager ones " \
                                     f"(max |diff| {np.abs(e - g).max():.3g})"


def test_graph_greedy_tokens_equal_eager(model, rng):
    from brass.sampling import SamplingParams
    ids = prompt(model, rng)
    greedy = SamplingParams(temperature=0.0)
    eager = list(model.generate(ids, N_GEN, greedy, stop_at_eog=False, session=eager_session(model)))
    graph = list(model.generate(ids, N_GEN, greedy, stop_at_eog=False, session=model.new_session(128)))
    assert len(eager) == len(graph) == N_GEN
    assert graph == eager, f"graph tokens part from eager ones at {next(i for i, (a, b) in enumerate(zip(graph, eager)) if a != b)}"


def test_greedy_stops_where_the_consumer_stops(model, rng):
    ids = prompt(model, rng)
    s = model.new_session(128)
    first = int(model.backend.to_numpy(model.backend.argmax(s.prefill(ids, device_logits=True)))[-1])
    gen = s.greedy(first, 30)
    got = [next(gen) for _ in range(13)]          # the device has run ahead by then
    gen.close()
    assert s.n_past == len(ids) + 13
    # Continuing from there (eagerly) matches one uninterrupted eager run.
    more = list(s.greedy(got[-1], 5))
    e = eager_session(model)
    e.prefill(ids)
    want = list(e.greedy(first, 18))
    assert got + more == want


def test_two_sessions_keep_their_graphs_apart(model, rng):
    from brass.sampling import SamplingParams
    greedy = SamplingParams(temperature=0.0)
    a_ids, b_ids = prompt(model, rng), prompt(model, rng, 5)
    want_a = list(model.generate(a_ids, 12, greedy, stop_at_eog=False, session=eager_session(model)))
    want_b = list(model.generate(b_ids, 12, greedy, stop_at_eog=False, session=eager_session(model)))
    ga = model.generate(a_ids, 12, greedy, stop_at_eog=False, session=model.new_session(64))
    gb = model.generate(b_ids, 12, greedy, stop_at_eog=False, session=model.new_session(64))
    got_a, got_b = [], []
    for ta, tb in zip(ga, gb):                     # interleaved, as the server runs requests
        got_a.append(ta)
        got_b.append(tb)
    assert (got_a, got_b) == (want_a, want_b)


def test_sampled_decode_through_the_graph_matches_eager(model, rng):
    from brass.sampling import SamplingParams
    ids = prompt(model, rng)
    p = SamplingParams(temperature=0.9, top_k=20, seed=1234)
    eager = list(model.generate(ids, 16, p, stop_at_eog=False, session=eager_session(model)))
    graph = list(model.generate(ids, 16, p, stop_at_eog=False, session=model.new_session(128)))
    assert graph == eager


def _switch_changes_no_logit(model, rng, monkeypatch, switch: str, what: str, n_ctx: int = 128) -> dict:
    """Decode logits of `model` (eager and through the graph, each graph captured with the
    setting of its session) with the backend's `switch` off and on: asserted the same bits,
    none NaN. Returns the graph's kernels per token by setting ({False: .., True: ..})."""
    from brass.backends.cuda import backend as cb
    ids = prompt(model, rng)
    follow = [int(t) for t in rng.integers(0, model.config.n_vocab, 5)]
    runs, kernels = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(cb, switch, fused)
        for graphs in (False, True):
            s = model.new_session(n_ctx)
            s.graphs = graphs
            s.prefill(ids)
            runs[fused, graphs] = [model.backend.to_numpy(s.decode(t)).copy() for t in follow]
            if graphs:
                kernels[fused] = s._step.kernels
    for graphs in (False, True):
        for i, (a, b) in enumerate(zip(runs[True, graphs], runs[False, graphs])):
            assert not np.isnan(a).any(), f"{'graph' if graphs else 'eager'} step {i}: NaN logits"
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"{'graph' if graphs else 'eager'} step {i}: the logits moved with {what}"
    return kernels


def test_rope_attention_changes_no_logit(model, rng, monkeypatch):
    # BRASS_ROPE_ATTENTION folds rope_store into the decode step's attention kernel: a whole
    # model's decode logits (eager and through the graph, captured with the setting of its
    # session) must be the same bits with it on as off, and the graph one launch a layer
    # shorter where the architecture takes it (rope_store in the step, no q scale between).
    kernels = _switch_changes_no_logit(model, rng, monkeypatch, "ROPE_ATTENTION", "rope_attention")
    # the architectures whose every layer attends through common.attention with no q scale
    saved = model.config.n_layer if model.config.arch in ("llama", "qwen2", "qwen3", "qwen3moe") else 0
    assert kernels[False] - kernels[True] == saved, kernels


def _norm_launches_saved(model) -> int:
    """Decode launches BRASS_NORM_MATVEC takes away from a token of `model`: per layer of an
    architecture that norms through common.pre_norm_decoder, the attention norm where one
    quantized launch takes q, k and v (one type, not matvec_coop_q6_k's; or a mixed pair),
    and the FFN norm of a dense layer whose gate and up share a quantized type."""
    from brass.backends.cuda import backend as cb
    cfg = model.config
    if cfg.arch not in ("llama", "qwen2", "qwen3", "qwen3moe"):
        return 0
    gf, saved = model.gguf, 0
    D = cfg.n_embd
    if D % 32 or D > cb.MV_STAGE_MAX_K or cb.mv_split(D) != 1:
        return 0
    for il in range(cfg.n_layer):
        qkv = [gf.tensors[f"blk.{il}.attn_{k}.weight"] for k in "qkv"]
        types = [t.type for t in qkv]
        if not any(t in cb.FLOAT_TYPES for t in types):
            if len(set(types)) == 1:
                saved += not cb.uses_q6k_coop(types[0], D, [t.nbytes // t.shape[1] for t in qkv])
            elif len(set(types)) == 2:
                a, b = sorted(set(types), key=types.count, reverse=True)
                saved += (a, b) in cb.MIXED_PAIRS and types.count(b) == 1
        if not cfg.n_expert:
            g, u = gf.tensors[f"blk.{il}.ffn_gate.weight"], gf.tensors[f"blk.{il}.ffn_up.weight"]
            saved += g.type == u.type and g.type not in cb.FLOAT_TYPES and tuple(g.shape) == tuple(u.shape)
    return saved


def test_norm_matvec_changes_no_logit(model, rng, monkeypatch):
    # BRASS_NORM_MATVEC folds each decode norm into the launch after it: a whole model's decode
    # logits (eager and through the graph) must be the same bits with it on as off, and the
    # graph shorter by the launches it takes (_norm_launches_saved)
    kernels = _switch_changes_no_logit(model, rng, monkeypatch, "NORM_MATVEC", "the norms in the launches")
    assert kernels[False] - kernels[True] == _norm_launches_saved(model), kernels


@pytest.mark.parametrize("shape, saved", [("qwen3-0.6b", 4), ("qwen3-30b-a3b", 2)])
def test_norm_matvec_on_a_q4_k_m_shape(shape, saved, rng, tmp_path, monkeypatch):
    # The synthetic models give q, k and v three types (to reach every kernel), so no launch
    # there takes both of a layer's norms: a shape-true file (conformance/harness/shape_models.py: Q4_K q, k,
    # gate, up, Q6_K v; two layers, a small vocabulary) does. Decode logits eager and through
    # the graph the same bits with BRASS_NORM_MATVEC on as off; the graph shorter by both
    # norms of each dense layer, by the attention norm of each MoE layer.
    import sys
    import brass
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from conformance.harness import shape_models
    path = shape_models.write(shape, tmp_path, layers=2, vocab=4096, experts=8)
    model = brass.load(str(path), backend="cuda", quiet=True)
    kernels = _switch_changes_no_logit(model, rng, monkeypatch, "NORM_MATVEC", "the norms in the launches", 64)
    assert kernels[False] - kernels[True] == saved == _norm_launches_saved(model), kernels
