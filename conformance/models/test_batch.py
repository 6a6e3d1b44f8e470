"""Batched decode (engine/batch.py): every sequence of a batch gets what it gets alone.

On every synthetic model that decodes in batches, on both backends: sequences with prompts of
different lengths decode together, one joining and one leaving part-way, and each one's greedy
tokens equal those it generates alone through `Model.generate`; each batched step's logits
equal the alone step's logits bit for bit (rows are computed as alone by construction, so this
is an equality, not a tolerance). On CUDA, compositions that last more than one step are
replayed as captured graphs, so the equality covers those too. Architectures that do not batch
yet are refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.harness.goldens import load_synthetic

SYNTH = Path(__file__).resolve().parents[2] / "golden" / "models"
MODELS = sorted(p.stem for p in SYNTH.glob("synth-*.gguf"))

# (prompt length, tokens to generate, step at which the sequence joins the batch)
PLAN = [(3, 12, 0), (9, 5, 0), (5, 9, 3), (12, 6, 6)]


def pooled_sessions(model, n: int, n_ctx: int):
    """n sessions of n_ctx positions over one block pool, each holding its whole context's
    blocks (as a server's requests do): what the row kernels and bucket graphs take on CUDA
    (sessions with pools of their own are stepped a row at a time). Returns (pool, sessions)."""
    from brass.kv_cache import blocks_for
    pool = model.new_block_pool(n * blocks_for(n_ctx) + 1)
    sessions = [model.new_session(n_ctx, pool=pool) for _ in range(n)]
    for s in sessions:
        s.cache.assign(pool.allocate(blocks_for(n_ctx))[::-1])     # blocks out of order
    return pool, sessions


@pytest.fixture(scope="module", params=[(m, b) for m in MODELS for b in ("numpy", "cuda")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    from brass.batch import supports_batched_decode
    m = load_synthetic(*request.param)
    if not supports_batched_decode(m):
        pytest.skip(f"{m.gguf.architecture} does not decode in batches yet "
                    f"(test_unbatched_architecture_is_refused checks the refusal)")
    return m


def _alone(model, prompt, n):
    """Greedy tokens through Model.generate, and the logits of each step taken eagerly."""
    from brass.sampling import SamplingParams
    tokens = list(model.generate(prompt, n, SamplingParams(temperature=0.0), stop_at_eog=False,
                                 session=model.new_session(64)))
    s = model.new_session(64)
    s.graphs = False
    b = model.backend
    logits = [b.to_numpy(s.prefill(prompt, device_logits=True))[-1].copy()]
    for tok in tokens[:-1]:
        logits.append(b.to_numpy(s.decode(tok))[-1].copy())
    return tokens, logits


@pytest.mark.parametrize("buckets", [False, True], ids=["composition-graphs", "bucket-graphs"])
def test_batched_decode_equals_alone(model, rng, buckets):
    from brass.batch import BatchDecoder
    b = model.backend
    if buckets and not hasattr(b, "row_tables_override"):
        pytest.skip("bucket graphs are the CUDA backend's (rows' block tables as data)")
    dec = BatchDecoder(model, buckets=buckets)
    if buckets and not dec.buckets:
        pytest.skip(f"{model.gguf.architecture} does not take bucket graphs (its caches are not all "
                    f"reached through the row kernels: BUCKET_GRAPHS); its steps are the composition "
                    f"graphs' case")
    prompts = [[int(t) for t in rng.integers(0, model.config.n_vocab, n)] for n, _, _ in PLAN]
    alone = [_alone(model, p, n) for p, (_, n, _) in zip(prompts, PLAN)]

    _, sessions = pooled_sessions(model, len(PLAN), 64)
    got = [[] for _ in PLAN]
    got_logits = [[] for _ in PLAN]
    nxt = [None] * len(PLAN)
    sizes = set()
    step = 0
    while any(len(g) < n for g, (_, n, _) in zip(got, PLAN)):
        active = []
        for i, (p, (_, n, join)) in enumerate(zip(prompts, PLAN)):
            if step == join:                      # joins: its prompt alone, then the batch
                row = b.to_numpy(sessions[i].prefill(p, device_logits=True))[-1].copy()
                got_logits[i].append(row)
                nxt[i] = int(np.argmax(row))
                got[i].append(nxt[i])
            elif join < step and len(got[i]) < n:
                active.append(i)
        if active:
            sizes.add(len(active))
            logits, best = dec.step_argmax([sessions[i] for i in active], [nxt[i] for i in active])
            logits, best = b.to_numpy(logits), b.to_numpy(best)
            assert np.array_equal(best, np.argmax(logits, axis=-1)), "the device argmax differs from the logits'"
            for row, i in zip(logits, active):
                got_logits[i].append(row.copy())
                nxt[i] = int(np.argmax(row))
                got[i].append(nxt[i])
        step += 1
    assert max(sizes) >= 3, f"the plan never batched three sequences (batch sizes {sorted(sizes)})"
    if b.supports_graphs:   # compositions that last were captured and replayed (engine/batch.py)
        assert dec.captures >= 2 and dec.replays >= 4, (dec.captures, dec.replays)
        assert bool(dec._bucket_steps) == buckets, "the bucket graphs were (not) used"
    for i, ((tokens, logits), g, gl) in enumerate(zip(alone, got, got_logits)):
        assert g == tokens, f"sequence {i}: batched tokens {g} differ from alone {tokens}"
        for j, (a, c) in enumerate(zip(logits, gl)):
            assert np.array_equal(a, c), (f"sequence {i} step {j}: batched logits differ from "
                                          f"alone (max |diff| {np.abs(a - c).max():.3g})")
    for i, s in enumerate(sessions):
        assert s.n_past == len(prompts[i]) + PLAN[i][1] - 1



def test_greedy_steps_run_ahead_equal_alone(model, rng):
    """BatchDecoder.greedy_steps (the scheduler's greedy rows: each step fed the last step's
    argmax on the device, one step queued ahead of the read-back) over bucket graphs captured
    in advance (prepare_buckets, as the server's warm-up does): three sequences get their
    tokens alone; closing the run part-way drops the step run ahead, and the sequences go on
    through step_argmax, then through a second run, still as alone."""
    from brass.batch import BatchDecoder
    b = model.backend
    if not hasattr(b, "row_tables_override"):
        pytest.skip("bucket graphs are the CUDA backend's (rows' block tables as data)")
    dec = BatchDecoder(model, buckets=True)
    if not dec.buckets:
        pytest.skip(f"{model.gguf.architecture} does not take bucket graphs (BUCKET_GRAPHS)")
    pool, sessions = pooled_sessions(model, 3, 64)
    assert dec.prepare_buckets(4, 64, pool) >= 1 and dec.captures >= 1
    n_new = 14
    prompts = [[int(t) for t in rng.integers(0, model.config.n_vocab, n)] for n in (4, 9, 6)]
    alone = [_alone(model, p, n_new)[0] for p in prompts]
    got = []
    for s, p in zip(sessions, prompts):
        got.append([int(np.argmax(b.to_numpy(s.prefill(p, device_logits=True))[-1]))])
    captures = dec.captures
    assert dec.can_run_ahead(sessions), "the bucket graph prepared in advance is not taken"

    def run(k):                 # k steps through a run ahead, then close it
        steps = dec.greedy_steps(sessions, [g[-1] for g in got])
        for _ in range(k):
            for g, t in zip(got, next(steps)):
                g.append(int(t))
        steps.close()

    run(5)
    for s, p, g in zip(sessions, prompts, got):
        assert s.n_past == len(p) + len(g) - 1, "closing the run did not drop the step run ahead"
    _, best = dec.step_argmax(sessions, [g[-1] for g in got])
    for g, t in zip(got, b.to_numpy(best)):
        g.append(int(t))
    run(n_new - len(got[0]))
    assert dec.captures == captures, "a step captured a graph that prepare_buckets had captured"
    for i, (g, a) in enumerate(zip(got, alone)):
        assert g == a, f"sequence {i}: tokens {g} through greedy_steps, {a} alone"
    from brass.errors import BrassError
    with pytest.raises(BrassError, match="bucket graphs"):
        next(dec.greedy_steps(sessions[:1] + [model.new_session(2048)], [1, 1]))

def test_batched_step_refuses_bad_input(model):
    from brass.batch import BatchDecoder
    from brass.errors import BrassError
    dec = BatchDecoder(model)
    s = model.new_session(4)
    s.prefill([1, 2, 3])
    with pytest.raises(BrassError, match="one token per session"):
        dec.step([s], [1, 2])
    with pytest.raises(BrassError, match="twice"):
        dec.step([s, s], [1, 2])
    with pytest.raises(BrassError, match="token ids"):
        dec.step([s], [model.config.n_vocab])
    dec.step([s], [1])                             # fills the 4th and last slot
    with pytest.raises(BrassError, match="exceed the context"):
        dec.step([s], [1])
    assert s.n_past == 4


def test_unbatched_architecture_is_refused():
    """An architecture module without BATCHED_DECODE (its layers do not know a batch of
    sequences) is refused in one line, before any step."""
    import types
    from brass.batch import BatchDecoder
    from brass.errors import UnsupportedError
    fake = types.SimpleNamespace(arch=types.ModuleType("brass.arch.future"),
                                 gguf=types.SimpleNamespace(architecture="future"))
    with pytest.raises(UnsupportedError, match="future does not decode sequences in batches yet"):
        BatchDecoder(fake)


def test_row_kernels_equal_the_row_loop(model, rng, monkeypatch):
    """On CUDA a batched step writes and reads every row's cache in one launch per layer
    (the rows' block tables in a device array); the base class's loop over the rows is the
    reference.
    Same logits bit for bit, and the same caches afterwards at every position the sequences
    hold (their prompts' and the step's token). The slots after those are not compared: a
    prompt read eagerly also writes its length class's padding rows there, one replayed from
    the model's StartStep copies only the prompt's slots (either is rewritten before it is
    read), and the two loops read their prompts by different ones."""
    if model.backend.name != "cuda":
        pytest.skip("the row kernels are the CUDA backend's (numpy runs the loop)")
    from brass.batch import BatchDecoder
    b = model.backend
    V = model.config.n_vocab
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in (4, 11, 7)]
    follow = [int(t) for t in rng.integers(0, V, 3)]
    results = []
    for row_kernels in (False, True):
        monkeypatch.setattr(b.options, "row_kernels", row_kernels)
        _, sessions = pooled_sessions(model, len(prompts), 32)
        for s, p in zip(sessions, prompts):
            s.prefill(p)
        logits = b.to_numpy(BatchDecoder(model).step(sessions, follow)).copy()
        with b.activate():      # the gathers on the backend's stream, in order with its kernels
            caches = [[b.to_numpy(a[:s.n_past]).copy() for a in s.cache.k + s.cache.v if a is not None]
                      for s in sessions]
        results.append((logits, caches))
    (l0, c0), (l1, c1) = results
    assert np.array_equal(l0, l1), f"max |diff| {np.abs(l0 - l1).max():.3g}"
    for i, (a, b_) in enumerate(zip(c0, c1)):
        # where they differ, bit for bit: (array index, slots) (a NaN equals itself here;
        # NaNs anywhere are named)
        where = [(j, sorted({int(r) for r in np.nonzero(x.view(np.uint16) != y.view(np.uint16))[0]}))
                 for j, (x, y) in enumerate(zip(a, b_)) if not np.array_equal(x.view(np.uint16), y.view(np.uint16))]
        nans = [(j, sorted({int(r) for r in np.nonzero(np.isnan(x) | np.isnan(y))[0]}))
                for j, (x, y) in enumerate(zip(a, b_)) if np.isnan(x).any() or np.isnan(y).any()]
        assert not where and not nans, (f"sequence {i} ({len(prompts[i])} prompt tokens + 1 decoded): caches "
                                        f"differ at (k/v array, slots) {where[:4]}; NaN at {nans[:4]}")
