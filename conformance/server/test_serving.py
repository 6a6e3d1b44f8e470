"""Continuous batching (engine/serving.py): requests decoded together get what they get alone.

Requests with prompts of different lengths (one read in several chunks), more of them than
run at once (so some wait), greedy and sampled with their own seeds: each one's tokens equal
`Model.generate` alone. Also: the steps really were batched, a cancelled request leaves
without disturbing the others, a failing request is told and the rest go on, a full queue
refuses. numpy here; CUDA on the GPU runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.goldens import load_synthetic

SYNTH = Path(__file__).resolve().parents[2] / "golden" / "models"
MODELS = ["synth-qwen3moe", "synth-gemma3", "synth-qwen35"]
TIMEOUT = 120


@pytest.fixture(scope="module", params=[(m, b) for m in MODELS for b in ("numpy", "cuda")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    return load_synthetic(*request.param)


def alone(model, req):
    return list(model.generate(req.prompt_ids, req.max_tokens, req.sampling, stop_at_eog=False,
                               session=model.new_session(len(req.prompt_ids) + req.max_tokens)))


def alone_chunked(model, req, chunk):
    """The request alone, its prompt read in chunks of `chunk` tokens as the scheduler reads it
    (a prompt in pieces is not bit-identical to one pass: the GEMMs have other row counts).
    With prefix caching (on by default, numpy) a hybrid's read also stops at the last block
    boundary before its last token, to keep its recurrent state there (prefix_cache.snapshot_at)."""
    from brass.kv_cache import BLOCK_TOKENS
    from brass.sampling import Sampler
    s = model.new_session(len(req.prompt_ids) + req.max_tokens)
    s.graphs = False
    sampler, history = Sampler(req.sampling), list(req.prompt_ids)
    n = len(req.prompt_ids)
    hybrid = model.backend.paged_kv and s.cache.recurrent is not None
    snap = (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS if hybrid else 0
    i = 0
    while i < n:
        end = min(i + chunk, n)
        end = snap if i < snap < end else end
        logits = s.prefill(req.prompt_ids[i:end], device_logits=True)
        i = end
    out = []
    for i in range(req.max_tokens):
        tok = s.pick(logits, sampler, history)
        out.append(tok)
        history.append(tok)
        if i + 1 < req.max_tokens:
            logits = s.decode(tok)
    return out


def serve(model, reqs, setup=None, queued=False, **kw):
    """Submit the requests to a BatchScheduler(model, **kw), wait for all; the scheduler.
    `setup(scheduler)`, if given, runs before its worker starts. `queued`: every request waits
    in the queue before the worker starts, so that the first step takes as many as fit (what
    is batched then does not hang on which thread the OS runs first)."""
    from brass.serving import BatchScheduler
    sched = BatchScheduler(model, start=setup is None and not queued, **kw)
    try:
        if setup is not None:
            setup(sched)
        if queued:
            for r in reqs:
                sched.submit(r)
        if setup is not None or queued:
            sched._thread.start()
        if not queued:
            for r in reqs:
                sched.submit(r)
        for r in reqs:
            assert r.finished.wait(TIMEOUT), "a request did not finish"
    finally:
        sched.close()
    return sched


def test_batched_requests_equal_alone(model, rng):
    from brass.sampling import SamplingParams
    from brass.serving import Request
    V = model.config.n_vocab

    def prompt(n):
        return [int(t) for t in rng.integers(0, V, n)]

    reqs = [Request(prompt(5), 10), Request(prompt(23), 6), Request(prompt(3), 12),
            Request(prompt(9), 8, SamplingParams(temperature=0.9, top_k=20, seed=7)),
            Request(prompt(14), 9, SamplingParams(temperature=1.2, top_p=0.9, seed=123))]
    sched = serve(model, reqs, queued=True, parallel=3)  # every prompt in one chunk, as generate reads it
    assert sched.steps and sched.batch_rows / sched.steps > 1.5, \
        f"the steps were hardly batched ({sched.batch_rows} rows in {sched.steps} steps)"
    for i, r in enumerate(reqs):
        assert r.error is None, f"request {i}: {r.error!r}"
        want = alone(model, r)
        assert r.tokens == want, f"request {i}: {r.tokens} served, {want} alone"
    # five requests through three places: later ones ran on sessions of earlier ones (reset:
    # on synth-qwen35 a recurrent state carried over would change their tokens)
    assert sched.sessions.reused >= 2 and sched.sessions.created <= 3, \
        (sched.sessions.created, sched.sessions.reused)


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
@pytest.mark.parametrize("keep", [False, True], ids=["drop", "keep"])
def test_greedy_runs_ending_keep_or_drop_their_step_ahead(rng, keep, backend):
    """A greedy batch runs one step ahead of the host (BatchDecoder.greedy_steps on CUDA's
    bucket graphs); when a request leaves or joins, the run ends and its step run ahead is
    dropped (the scheduler's keep_ahead off: the sessions go back one position) or read for the
    rows that stay (on, the default). Either way every request gets its tokens alone. On CUDA through the real
    greedy_steps; on numpy (no bucket graphs) a decoder runs the same run_ahead protocol with
    each step computed at its launch. Requests of different lengths, more than run at once, so
    that runs end by leaves and by joins, mid-batch."""
    from brass.batch import BatchDecoder, SequenceBatch, run_ahead
    from brass.serving import Request
    import numpy as np
    m = load_synthetic("synth-qwen3", backend)
    b = m.backend

    class AheadOnNumpy(BatchDecoder):
        launches = 0

        def can_run_ahead(self, sessions):
            return len(sessions) > 1

        def greedy_steps(self, sessions, tokens):
            last = {}

            def launch(ids):
                AheadOnNumpy.launches += 1
                ids = last["best"] if ids is None else ids
                pos = np.asarray([s.n_past for s in sessions], np.int32)
                with b.rows_independent():
                    logits = m.forward(b.asarray(ids), b.asarray(pos),
                                       SequenceBatch([s.cache for s in sessions]))
                last["best"] = best = np.argmax(b.to_numpy(logits), axis=-1).astype(np.int32)
                return best.copy
            return run_ahead(sessions, np.asarray(tokens, np.int32), launch)

    V = m.config.n_vocab
    reqs = [Request([int(t) for t in rng.integers(0, V, n)], k) for n, k in
            ((5, 9), (8, 4), (3, 12), (11, 6), (6, 7), (4, 10), (9, 3))]
    def setup(sched):
        if backend == "numpy":
            sched.batch = AheadOnNumpy(m, graphs=False)
        else:
            assert sched.batch.buckets, "synth-qwen3 on CUDA takes bucket graphs (greedy_steps)"
            sched.warm_up()             # the bucket graphs captured: greedy_steps from the start
        sched.keep_ahead = keep

    sched = serve(m, reqs, setup, parallel=3)
    for i, r in enumerate(reqs):
        assert r.tokens == alone(m, r), f"request {i}: {r.tokens} served, {alone(m, r)} alone"
    ended = sched.runs_ended["kept" if keep else "dropped"]
    assert ended >= 2 and sched.runs_ended["dropped" if keep else "kept"] == 0, sched.runs_ended
    if backend == "numpy":
        assert AheadOnNumpy.launches, "the runs did not go through run_ahead"


def test_prompts_read_in_chunks_between_steps(model, rng):
    """A long prompt is read a chunk per step while the others decode: each request gets what
    it gets alone with its prompt read in the same chunks."""
    from brass.sampling import SamplingParams
    from brass.serving import Request
    V = model.config.n_vocab
    reqs = [Request([int(t) for t in rng.integers(0, V, 4)], 14),
            Request([int(t) for t in rng.integers(0, V, 29)], 6),
            Request([int(t) for t in rng.integers(0, V, 17)], 7, SamplingParams(temperature=1.0, seed=5))]
    serve(model, reqs, parallel=3, prefill_chunk=6)
    for i, r in enumerate(reqs):
        assert r.error is None, f"request {i}: {r.error!r}"
        want = alone_chunked(model, r, 6)
        assert r.tokens == want, f"request {i}: {r.tokens} served, {want} alone in chunks"


def test_cancel_and_failure_leave_the_others_alone(model, rng):
    from brass.serving import Request
    V = model.config.n_vocab

    class Failing(Request):
        def on_token(self, token):
            if len(self.tokens) == 2:
                raise RuntimeError("client handler broke")
            return super().on_token(token)

    class CancelAfter(Request):
        def on_token(self, token):
            if len(self.tokens) == 3:
                self.cancelled.set()
            return super().on_token(token)

    keep = Request([int(t) for t in rng.integers(0, V, 6)], 12)
    fail = Failing([int(t) for t in rng.integers(0, V, 4)], 12)
    gone = CancelAfter([int(t) for t in rng.integers(0, V, 7)], 12)
    sched = serve(model, (keep, fail, gone), parallel=4, prefill_chunk=8)
    assert keep.error is None and keep.tokens == alone(model, keep)
    assert isinstance(fail.error, RuntimeError) and len(fail.tokens) == 2
    assert gone.error is None and 4 <= len(gone.tokens) < 12, gone.tokens
    assert sched.counts() == (0, 0)


def test_full_queue_refuses(model):
    from brass.serving import BatchScheduler, Request
    sched = BatchScheduler(model, parallel=1, max_waiting=2, start=False)   # nothing is taken
    sched.submit(Request([1, 2], 4))
    sched.submit(Request([1, 2], 4))
    with pytest.raises(BatchScheduler.QueueFull, match="2 requests are already waiting"):
        sched.submit(Request([1, 2], 4))
    assert sched.counts() == (0, 2)
    cancelled = Request([1], 1)
    sched._waiting[0].cancelled.set()          # a client that left frees its place
    sched.submit(cancelled)
    assert sched.counts() == (0, 2)


def test_bad_requests_are_refused():
    from brass.errors import BrassError
    from brass.serving import Request
    with pytest.raises(BrassError, match="empty"):
        Request([], 4)
    with pytest.raises(BrassError, match="at least 1"):
        Request([1], 0)


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-qwen35"])
def test_a_request_alone_runs_ahead_and_yields_to_arrivals(name, rng, monkeypatch):
    """A greedy request decoding by itself on a graph backend streams through Session.greedy
    (steps run ahead on the device, no host sync per token); a request arriving meanwhile
    closes that stream and the two are batched. Both still get their tokens alone. On the CPU
    with a numpy backend that has CUDA's graph interface (conformance/harness/fakes.py)."""
    from conformance.harness.fakes import ReplayingNumpy
    from brass.model import Session
    from brass.serving import Request
    m = load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    V = m.config.n_vocab
    streams = []
    greedy = Session.greedy

    def counting(self, token, n):
        streams.append(n)
        return greedy(self, token, n)
    monkeypatch.setattr(Session, "greedy", counting)
    late = Request([int(t) for t in rng.integers(0, V, 5)], 9)
    sched = None

    class First(Request):
        def on_token(self, token):
            if len(self.tokens) == 11:
                sched.submit(late)          # arrives while the first streams alone
            return super().on_token(token)

    first = First([int(t) for t in rng.integers(0, V, 6)], 30)
    from brass.serving import BatchScheduler
    sched = BatchScheduler(m, parallel=2)
    sched.batch.graphs = False      # the fake cannot capture a batched step; those run eagerly
    try:
        sched.submit(first)
        for r in (first, late):
            assert r.finished.wait(TIMEOUT), "a request did not finish"
    finally:
        sched.close()
    assert first.error is None and late.error is None
    assert streams and streams[0] == 29, streams      # the first token comes from its prompt
    # it made way for the second (batched steps), then streamed alone again once that ended
    assert len(streams) >= 2 and sched.batch_rows > sched.steps, (streams, sched.steps, sched.batch_rows)
    monkeypatch.setattr(Session, "greedy", greedy)
    ref = load_synthetic(name, "numpy")
    assert first.tokens == alone(ref, first)
    assert late.tokens == alone(ref, late)


def test_session_pool_sizes_and_limit():
    """Sessions are made in sizes that recur (a power of two, at least MIN_POOLED_CTX, at most
    the model's context), the smallest idle one that fits is taken, and no more than `limit`
    exist at once."""
    from brass.serving import MIN_POOLED_CTX, SessionPool

    class Counted:
        def __init__(self, n_ctx):
            self.n_ctx, self.resets = n_ctx, 0

        def reset(self):
            self.resets += 1

    class Model:
        n_ctx = 4096

        def new_session(self, n_ctx):
            return Counted(n_ctx)

    pool = SessionPool(Model(), limit=2)
    assert [pool.size_for(n) for n in (1, MIN_POOLED_CTX + 1, 3000, 5000)] == \
        [MIN_POOLED_CTX, 2 * MIN_POOLED_CTX, 4096, 5000]
    a, b = pool.take(100), pool.take(700)
    assert (a.n_ctx, b.n_ctx) == (MIN_POOLED_CTX, 1024)
    pool.give(b)
    pool.give(a)
    c = pool.take(10)                   # the smallest that fits, reset
    assert c is a and a.resets == 1
    d = pool.take(2000)                 # none fits: b (idle) is dropped to stay within 2
    assert d.n_ctx == 2048 and pool.created == 3 and pool._idle == []
    pool.give(c)
    pool.give(d)
    assert len(pool._idle) == 2 and pool.taken == 0


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-qwen35"])
def test_warm_up_captures_before_the_first_request(name, rng):
    """warm_up() reads a prompt and decodes on a pooled session (its decode graph captured),
    which then serves the first request: no capture waits for it, and its tokens (after the
    warm-up's own sequence in that session) equal alone. On the CPU with a numpy backend that
    has CUDA's graph interface (conformance/harness/fakes.py); numpy itself has nothing to warm."""
    from conformance.harness.fakes import ReplayingNumpy
    from brass.serving import BatchScheduler, Request
    plain = BatchScheduler(load_synthetic(name, "numpy"), parallel=2, start=False)
    assert plain.warm_up() == 0.0 and plain.sessions.created == 0
    m = load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    sched = BatchScheduler(m, parallel=2, start=False)
    assert sched.warm_up() > 0
    (warm,) = sched.sessions._idle
    assert warm._step is not None, "the warm-up did not capture its decode graph"
    req = Request([int(t) for t in rng.integers(0, m.config.n_vocab, 7)], 12)
    sched._thread.start()
    try:
        sched.submit(req)
        assert req.finished.wait(TIMEOUT), "the request did not finish"
    finally:
        sched.close()
    assert req.error is None
    assert (sched.sessions.created, sched.sessions.reused) == (1, 1), "the warm session was not reused"
    assert req.tokens == alone(load_synthetic(name, "numpy"), req)
