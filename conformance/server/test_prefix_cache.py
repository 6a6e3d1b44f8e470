"""The paged KV cache and prefix caching (engine/kv_cache.py BlockPool, PagedKVCache;
engine/prefix_cache.py; engine/serving.py), on the numpy and CUDA backends and the synthetic models,
hybrids and sliding-window (gemma) ones included.

- A paged cache reads as a contiguous one: the same logits, bit for bit, whatever blocks the
  table names (the attention gathers the same values into the same array).
- A request that reuses a cached prefix gets the tokens and logits, bit for bit, of a session
  of its own that reads the same prompt pieces: the earlier request's read of the prefix,
  then the rest (the same kernels on the same values). Against the same prompt read whole
  with prefix caching off, the first token's logits are within the bound of a prompt read in
  other pieces (test_delta_net.py CARRY_NMSE: a GEMM of another row count sums in another
  order, which a Q8 rounding can turn into a step).
- The pool: reference counts never negative, every block free or cached once requests end,
  least recently used cached blocks evicted under a small pool, a request that does not fit
  now waits, one that never fits is refused at once; cached_tokens in the API's usage and
  the blocks in /metrics.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from brass.errors import BrassError
from brass.model import prompt_class
from brass.serving import Request

from conformance.harness.goldens import load_synthetic

ALL = ["synth-llama", "synth-qwen3", "synth-qwen3moe", "synth-gemma3", "synth-gemma4",
       "synth-gemma4moe", "synth-qwen35", "synth-qwen35moe"]
TIMEOUT = 120
# test_delta_net.py's bound for a prompt read in other pieces (its reason stated there)
CARRY_NMSE = 5e-2
CARRY_MARGIN = 1.0


@pytest.fixture(scope="module", params=["numpy", "cuda"])
def models(request):
    """The synthetic models on each backend (both keep their caches paged; CUDA's kernels
    read them through device block tables)."""
    got = {}

    def get(name):
        if name not in got:
            got[name] = load_synthetic(name, request.param)
        return got[name]
    return get


def _ids(model, rng, n):
    return [int(t) for t in rng.integers(0, model.config.n_vocab, n)]


class Logged(Request):
    """A greedy request that keeps the log-softmax rows its tokens were picked from."""

    logprobs = 0

    def __init__(self, prompt, max_tokens):
        super().__init__(prompt, max_tokens)
        self.rows = []

    def on_logprobs(self, row):
        self.rows.append(np.array(row))


def serve_each(sched, reqs):
    """Submit each request after the one before has finished; all of them must succeed."""
    for r in reqs:
        sched.submit(r)
        assert r.finished.wait(TIMEOUT), "a request did not finish"
        assert r.error is None, repr(r.error)
    return reqs


def scheduler(model, **kw):
    from brass.serving import BatchScheduler
    kw.setdefault("parallel", 1)
    return BatchScheduler(model, **kw)


def reference(model, pieces, max_tokens):
    """A session of its own reading `pieces` [(position, tokens)] (the session set to the
    position first: back for keys and values), then greedy decoding: (tokens, log-softmax
    rows)."""
    from brass.logprobs import log_softmax
    s = model.new_session(256)
    for pos, ids in pieces:
        s.n_past = pos
        logits = s.prefill(ids)
    rows, toks = [], []
    for i in range(max_tokens):
        row = log_softmax(logits[-1])
        rows.append(row)
        toks.append(int(np.argmax(row)))
        if i + 1 < max_tokens:
            logits = model.backend.to_numpy(s.decode(toks[-1]))
    return toks, rows


@pytest.mark.parametrize("name", ALL)
def test_paged_cache_reads_as_contiguous(models, name, rng):
    """Blocks in a scrambled order of a shared pool give the logits of a contiguous cache,
    prompt (longer than gemma's windows, across block boundaries) and decode steps."""
    m = models(name)
    ids = _ids(m, rng, 37)
    flat = m.new_session(64)            # a pool of its own: its blocks in order, all held
    pool = m.new_block_pool(9)
    paged = m.new_session(64, pool=pool)
    blocks = pool.allocate(9)
    paged.cache.assign(blocks[::-1][:3])            # 48 slots, in a session of 64
    for s in (flat, paged):
        s.out = [s.prefill(ids[:21], all_logits=True), s.prefill(ids[21:], all_logits=True)]
        s.out += [m.backend.to_numpy(s.decode(t)) for t in (3, 5, 7)]
    for a, b in zip(flat.out, paged.out):
        assert np.array_equal(a, b), f"{name}: paged logits differ (max {np.abs(a - b).max():.3g})"
    with pytest.raises(BrassError, match="past the 3 KV blocks"):
        paged.prefill(ids[:20])            # positions 48.. are past the table's slots


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-gemma3"])
def test_a_session_follows_its_new_blocks(models, name, rng):
    """A pooled session's blocks change between requests (released, others assigned): its
    next prompt and decode steps (on CUDA: the decode graph captured over the first blocks,
    reading the sequence's device table rewritten in place) give the logits of a session of
    its own reading the same tokens."""
    m = models(name)
    pool = m.new_block_pool(12)
    s = m.new_session(64, pool=pool)
    s.cache.assign(pool.allocate(3))
    s.prefill(_ids(m, rng, 20))
    for t in (3, 5, 7):
        s.decode(t)                             # captures the decode graph on CUDA
    s.cache.release()
    s.cache.assign(pool.allocate(4)[::-1])      # other blocks, out of order
    s.reset()
    alone = m.new_session(64)
    ids = _ids(m, rng, 23)
    got = [m.backend.to_numpy(x.prefill(ids, device_logits=True)).copy() for x in (s, alone)]
    for t in (2, 4, 6, 8):
        got += [m.backend.to_numpy(x.decode(t)).copy() for x in (s, alone)]
    for i in range(0, len(got), 2):
        assert np.array_equal(got[i], got[i + 1]), f"{name}: step {i // 2} differs from a session of its own"


def test_device_block_tables_are_rewritten_in_place():
    """On a backend that keeps block tables on its device (block_table / write_block_table:
    CUDA), a sequence's device table keeps its identity (a captured graph reads it) and holds
    the blocks of its table, then -1; assign, release and a too long table say so."""
    from brass.kv_cache import BlockPool, PagedKVCache

    class TableBackend:                         # numpy arrays standing for device arrays
        def zeros(self, shape, dtype):
            return np.zeros(shape, dtype)

        def activate(self):
            import contextlib
            return contextlib.nullcontext()

        def block_table(self, n):
            return np.full(n, -1, np.int32)

        def write_block_table(self, table, blocks):
            table[:] = -1
            table[:len(blocks)] = blocks

    cfg = load_synthetic("synth-qwen3", "numpy").config
    pool = BlockPool(TableBackend(), cfg, 10)
    c = PagedKVCache(pool, 50)                  # 4 blocks of room
    dev = c._t.device
    assert dev.dtype == np.int32 and dev.tolist() == [-1] * 4
    c.assign(pool.allocate(3))
    assert c._t.device is dev and dev.tolist() == c.table.tolist() + [-1]
    c.check_room(48)
    with pytest.raises(BrassError, match="position 48 is past the 3 KV blocks"):
        c.check_room(49)
    c.release()
    assert c._t.device is dev and dev.tolist() == [-1] * 4
    with pytest.raises(BrassError, match="5 KV blocks for a sequence of 50 positions"):
        c.assign(pool.allocate(5))


def test_default_pool_follows_free_device_memory():
    """A server's default pool: --parallel times the context's blocks, at most
    KV_MEMORY_SHARE of the free device memory where the backend reports it, at least one
    context's blocks."""
    import types
    from brass.kv_cache import BlockPool, blocks_for
    from brass.prefix_cache import KV_MEMORY_SHARE, default_blocks
    cfg = load_synthetic("synth-qwen3", "numpy").config
    per = BlockPool.block_bytes(cfg)
    assert per == 2 * 16 * sum(cfg.layer_n_head_kv(il) * (cfg.layer_head_dim(il) + cfg.layer_head_dim_v(il))
                               for il in range(cfg.n_layer))
    model = lambda free: types.SimpleNamespace(config=cfg, backend=types.SimpleNamespace(free_memory=lambda: free))  # noqa: E731
    assert default_blocks(4, 1000) == 4 * blocks_for(1000)
    assert default_blocks(4, 1000, model(10**12)) == 4 * blocks_for(1000)
    assert default_blocks(4, 1000, model(int(100 * per / KV_MEMORY_SHARE))) == 100
    assert default_blocks(4, 1000, model(0)) == blocks_for(1000)


def test_steps_run_ahead_keep_the_blocks_they_were_issued_with(models, rng):
    """A session's greedy steps queued ahead on the device (Session.greedy: a chunk of steps in
    flight while the one before is read) read the blocks its table named when they were
    issued: its blocks released meanwhile, taken by another session and overwritten by that
    one's prompt, change none of the tokens already issued, and the other session's logits
    are those of a session of its own. On CUDA the table's device copy is rewritten by a copy
    queued behind those steps on the backend's stream (write_block_table, from host memory the
    call has read), and the other prompt's kernels behind that."""
    m = models("synth-qwen3")
    from brass.model import GREEDY_CHUNK
    pool = m.new_block_pool(8)
    a, b = m.new_session(64, pool=pool), m.new_session(64, pool=pool)
    if not a.graphs:
        pytest.skip(f"no step runs ahead of the host without decode graphs (the {m.backend.name} "
                    f"backend, or BRASS_GRAPH=0)")
    a.cache.assign(pool.allocate(4))
    ids, other = _ids(m, rng, 20), _ids(m, rng, 40)
    ref = m.new_session(64)
    first = int(np.argmax(ref.prefill(ids)[-1]))
    want = list(ref.greedy(first, 2 * GREEDY_CHUNK))
    assert int(np.argmax(a.prefill(ids)[-1])) == first
    steps = a.greedy(first, 2 * GREEDY_CHUNK)
    got = [next(steps) for _ in range(GREEDY_CHUNK)]    # the second chunk is issued, not read
    held = [int(x) for x in a.cache.table]
    a.cache.release()
    b.cache.assign(pool.allocate(4))
    assert sorted(int(x) for x in b.cache.table) == sorted(held), "b did not take a's blocks"
    logits = m.backend.to_numpy(b.prefill(other, device_logits=True)).copy()
    got += list(steps)
    assert got == want, f"steps issued before the table changed read the new blocks: {got} != {want}"
    assert np.array_equal(logits, m.new_session(64).prefill(other)), "a's queued steps wrote into b's prompt"


@pytest.mark.parametrize("shared", [True, False], ids=["model-graph", "session-graph"])
def test_a_prompt_graph_follows_its_sessions_new_blocks(models, rng, shared):
    """A prompt graph continuing a cache, captured over some blocks and replayed after the
    session's blocks changed (released, others assigned), reads and writes the new ones: its
    logits and the decode steps after it are those of a session of its own. A pooled session
    replays the model's graph of the pool (ContinueStep, into whose table each replay copies
    the session's), or, with sharing off, its own (PromptStep). On CUDA either graph holds the
    address of a device table rewritten in place."""
    m = models("synth-qwen3")
    was, m.shared_prompt_graphs = m.shared_prompt_graphs, shared
    try:
        pool = m.new_block_pool(12)
        s, alone = m.new_session(64, pool=pool), m.new_session(64)
        blocks = [pool.allocate(4) for _ in range(3)]      # three sets, none of the others' blocks
        # the tail's class read eagerly, captured, then replayed where it is new to the model;
        # else captured at once (the head's class may take the session's own graph: not asserted)
        for i, new in enumerate(blocks):
            if i:
                s.cache.release()
            s.cache.assign(new[::-1] if i % 2 else new)
            s.reset(), alone.reset()
            head, tail = _ids(m, rng, 16), _ids(m, rng, 9)
            got = []
            for x in (s, alone):
                x.prefill(head)
                got.append(m.backend.to_numpy(x.prefill(tail, device_logits=True)).copy())
                got += [m.backend.to_numpy(x.decode(t)).copy() for t in (2, 4)]
            for j in range(3):
                assert np.array_equal(got[j], got[j + 3]), f"read {i}, step {j}: differs from a session of its own"
    finally:
        m.shared_prompt_graphs = was
    if s.graphs and m.prompt_graphs:
        cls = prompt_class(9)
        if shared:
            steps = m._continue_shelves[pool].steps if pool in m._continue_shelves else {}
            assert (cls, 64) in steps and cls not in s._prompt_steps, (
                "the prompt of 9 tokens did not replay the model's graph of the pool",
                list(steps), list(s._prompt_steps), m.continue_graphs_error)
        else:
            assert cls in s._prompt_steps, ("the prompt of 9 tokens did not replay the session's graph",
                                            s.prompt_graphs_error)


@pytest.mark.parametrize("name", ALL)
def test_cached_read_equals_the_same_pieces_uncached(models, name, rng):
    """Request b starts with request a's 48 tokens: it reads only from position 48 (a's three
    blocks cached), a hybrid from 32 (where a's read kept a state snapshot: its third block is
    cached too, but without a state after it), and its tokens and logits equal, bit for bit,
    those of a session reading a's pieces, then b's rest."""
    m = models(name)
    a_ids = _ids(m, rng, 48)
    b_ids = a_ids + _ids(m, rng, 10)
    sched = scheduler(m, prefix_cache=True)
    try:
        a, b = serve_each(sched, [Logged(a_ids, 4), Logged(b_ids, 5)])
    finally:
        sched.close()
    hybrid = sched.kv.hybrid
    assert (a.cached_tokens, b.cached_tokens) == (0, 32 if hybrid else 48), name
    # a's read: one piece, or (hybrid) stopped at its last block boundary for the snapshot;
    # b's from where it resumed, a hybrid's stopped at 48 for its own snapshot
    a_pieces = [(0, a_ids[:32]), (32, a_ids[32:])] if hybrid else [(0, a_ids)]
    b_pieces = ([(0, a_ids[:32]), (32, b_ids[32:48]), (48, b_ids[48:])] if hybrid
                else [(0, a_ids), (48, b_ids[48:])])
    for r, pieces in ((a, a_pieces), (b, b_pieces)):
        want, rows = reference(m, pieces, r.max_tokens)
        assert r.tokens == want, f"{name}: {r.tokens} served, {want} by the same pieces"
        for i, (x, y) in enumerate(zip(r.rows, rows)):
            assert np.array_equal(x, y), f"{name} token {i}: max |diff| {np.abs(x - y).max():.3g}"
    counts = sched.kv.counts()
    assert counts["used"] == 0 and counts["cached"] + counts["free"] == sched.kv.pool.n_blocks
    assert (sched.kv.pool.ref >= 0).all()


@pytest.mark.parametrize("first", [0, 48], ids=["cold", "warm"])
@pytest.mark.parametrize("name", ["synth-llama", "synth-gemma3", "synth-qwen35"])
def test_requests_begun_together_read_a_shared_prefix_once(models, name, first, rng):
    """Three requests with one 96-token prefix, begun together (queued while the worker waits
    for the lock they are queued under) and read in chunks of 32: none finds more of the prefix
    cached when it begins than an earlier request left (warm: its first 48 tokens). The first
    reads the rest of the prefix; the others take its blocks before their next chunk
    (catch_up, from position 0 or 48) and read only their own rest, as when they come one after
    another (the prefix then cached when they begin): the same cached tokens, and the same
    tokens and logits bit for bit. A hybrid takes no block after it began (its state would have
    to be restored there): each reads from where it began."""
    m = models(name)
    prefix = _ids(m, rng, 96)
    prompts = [prefix + _ids(m, rng, 7) for _ in range(3)]
    warm = [prefix[:first] + _ids(m, rng, 1)] if first else []
    together = [Logged(p, 4) for p in prompts]
    sched = scheduler(m, parallel=4, prefill_chunk=32, prefix_cache=True)
    try:
        serve_each(sched, [Logged(p, 2) for p in warm])
        with sched._cv:         # the worker admits none of them before all three are queued
            for r in together:
                sched.submit(r)
        for r in together:
            assert r.finished.wait(TIMEOUT), "a request did not finish"
            assert r.error is None, repr(r.error)
    finally:
        sched.close()
    hybrid = sched.kv.hybrid
    # a hybrid resumes at the warm request's snapshot (its read stopped at 48 to keep one)
    assert [r.cached_tokens for r in together] == ([first] * 3 if hybrid else [first, 96, 96]), name
    counts = sched.kv.counts()
    assert counts["used"] == 0 and counts["cached"] + counts["free"] == sched.kv.pool.n_blocks
    assert (sched.kv.pool.ref >= 0).all()
    if hybrid:
        return
    sched = scheduler(m, parallel=4, prefill_chunk=32, prefix_cache=True)
    try:
        apart = serve_each(sched, [Logged(p, 2) for p in warm] + [Logged(p, 4) for p in prompts])[len(warm):]
    finally:
        sched.close()
    assert [r.cached_tokens for r in apart] == [first, 96, 96]
    for i, (a, b) in enumerate(zip(together, apart)):
        assert a.tokens == b.tokens, f"{name} request {i}: {a.tokens} together, {b.tokens} one after another"
        for j, (x, y) in enumerate(zip(a.rows, b.rows)):
            assert np.array_equal(x, y), f"{name} request {i} token {j}: max |diff| {np.abs(x - y).max():.3g}"


@pytest.mark.parametrize("name", ["synth-llama", "synth-gemma3", "synth-qwen35"])
def test_cached_read_close_to_whole_read(models, name, rng):
    """The same second request with prefix caching off reads its prompt whole: its first
    token's logits and the cached read's are within the bound of a prompt in pieces."""
    m = models(name)
    a_ids = _ids(m, rng, 40)
    b_ids = a_ids[:36] + _ids(m, rng, 12)
    got = {}
    for on in (True, False):
        sched = scheduler(m, prefix_cache=on)
        try:
            _, b = serve_each(sched, [Logged(a_ids, 2), Logged(b_ids, 3)])
        finally:
            sched.close()
        got[on] = b
    assert (got[True].cached_tokens, got[False].cached_tokens) == (32, 0)
    x, y = got[True].rows[0].astype(np.float64), got[False].rows[0].astype(np.float64)
    x, y = x - x.max(), y - y.max()
    err = float(((x - y) ** 2).sum() / (y ** 2).sum())
    assert err <= CARRY_NMSE, f"{name}: logits NMSE {err:.3g}"
    top2 = np.sort(y)[-2:]
    assert top2[1] - top2[0] < CARRY_MARGIN or x.argmax() == y.argmax(), name


def test_eviction_under_a_small_pool(models, rng):
    """A pool of 8 blocks, requests of 3 blocks each (2 of them a cached prompt prefix): later
    requests evict the oldest cached blocks, least recently used first; a prompt whose blocks
    went is read whole again (the same tokens), the latest one's are still there."""
    m = models("synth-qwen3")
    prompts = [_ids(m, rng, 40) for _ in range(4)]
    sched = scheduler(m, kv_blocks=8)
    pool = sched.kv.pool
    try:
        first = serve_each(sched, [Logged(p + [1], 7) for p in prompts])
        assert [r.cached_tokens for r in first] == [0, 0, 0, 0]
        assert pool.evictions > 0 and (pool.ref >= 0).all()
        again = serve_each(sched, [Logged(prompts[-1] + [2], 7), Logged(prompts[0] + [1], 7)])
    finally:
        sched.close()
    assert again[0].cached_tokens == 32, "the latest prompt's blocks were evicted"
    assert again[1].cached_tokens == 0, "the oldest prompt's blocks outlived a full pool"
    assert again[1].tokens == first[0].tokens
    c = pool.counts()
    assert c["used"] == 0 and c["cached"] + c["free"] == 8
    pool.clear_cache()
    assert pool.counts() == {"used": 0, "cached": 0, "free": 8}


def test_a_request_waits_for_blocks_and_one_too_big_is_refused(models, rng):
    """Two requests of 3 blocks each, a pool of 3: the second waits for the first's blocks
    instead of failing; a request of more blocks than the pool holds is refused at once."""
    from brass.serving import PoolTooSmall, QueueFull
    m = models("synth-qwen3")
    sched = scheduler(m, kv_blocks=3, parallel=2, prefix_cache=False)
    reqs = [Logged(_ids(m, rng, 30), 10), Logged(_ids(m, rng, 30), 10)]
    try:
        for r in reqs:
            sched.submit(r)
        for r in reqs:
            assert r.finished.wait(TIMEOUT)
        with pytest.raises(PoolTooSmall, match="holds 48"):
            sched.submit(Logged(_ids(m, rng, 45), 10))
    finally:
        sched.close()
    assert issubclass(PoolTooSmall, QueueFull)       # the server's 503 with Retry-After
    for r in reqs:
        assert r.error is None, repr(r.error)
        assert r.tokens == reference(m, [(0, r.prompt_ids)], 10)[0]
    assert sched.kv.counts() == {"used": 0, "cached": 0, "free": 3}


def test_usage_reports_cached_tokens_and_metrics_the_blocks(models, rng):
    """Two clients' chat requests share a system prompt: the second's usage says how many
    prompt tokens were cached (non-streaming, and in a stream's final usage; completions
    too); /metrics reports the pool's blocks and the cached tokens."""
    pytest.importorskip("fastapi", reason="the server needs FastAPI")
    from brass.server import App
    from brass import http_api
    from conformance.harness.server_harness import ASGIClient, parse_prometheus
    m = models("synth-llama")
    app = App(m, "synth", None, parallel=2, max_waiting=4, prefix_cache=True)
    asgi = http_api.create_app(app)
    system = {"role": "system", "content": " ".join(["harbor light"] * 30)}

    def post(path, body):
        status, _, out = ASGIClient(asgi).request("POST", path, json.dumps(body).encode(),
                                                  {"content-type": "application/json"})
        assert status == 200, out
        return out

    try:
        first = json.loads(post("/v1/chat/completions", {
            "messages": [system, {"role": "user", "content": "sea"}], "max_tokens": 3}))
        second = json.loads(post("/v1/chat/completions", {
            "messages": [system, {"role": "user", "content": "ship"}], "max_tokens": 3}))
        stream = post("/v1/chat/completions", {
            "messages": [system, {"role": "user", "content": "storm"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}})
        prompt = "the river and the stone " * 8
        post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        completion = json.loads(post("/v1/completions", {"prompt": prompt, "max_tokens": 2}))
        _, _, metrics = ASGIClient(asgi).request("GET", "/metrics")
    finally:
        app.scheduler.close()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    events = [json.loads(line[6:]) for line in stream.decode().splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    n = completion["usage"]["prompt_tokens"]
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    samples = parse_prometheus(metrics.decode())
    blocks = {k: samples[f'brass_kv_blocks{{state="{k}"}}'] for k in ("used", "cached", "free")}
    assert blocks["used"] == 0 and sum(blocks.values()) == app.scheduler.kv.pool.n_blocks
    assert blocks["cached"] > 0
    assert samples["brass_prompt_tokens_cached_total"] == 2 * cached + (n - 1) // 16 * 16


WORDS = "sea ship storm harbor light wind stone river bread garden winter candle".split()
GREEDY_TURNS = 6


def test_chat_turn_reads_only_the_new_tokens(models):
    """`brass chat` keeps its session: from the second turn on, a turn reads no more than what
    its prompt adds to the last one (the reply as rendered and the new message), where a
    session reset every turn reads the whole conversation; the replies are the same. The
    inputs are fixed: a kept session reads the conversation in other pieces than a fresh one
    (the bound of test_cached_read_close_to_whole_read), and these give equal replies."""
    from brass.chat import Conversation
    from brass.sampling import SamplingParams
    m = models("synth-llama")
    greedy = SamplingParams(temperature=0.0)
    kept, fresh = Conversation(m, greedy, 4), Conversation(m, greedy, 4)
    words = np.random.default_rng(0)
    before = 0
    for turn in range(GREEDY_TURNS):
        text = " ".join(words.choice(WORDS, size=4))
        fresh.session.reset()
        fresh._held = []
        assert "".join(kept.reply(text)) == "".join(fresh.reply(text)), f"turn {turn + 1}"
        assert fresh.read_tokens == fresh.prompt_tokens == kept.prompt_tokens
        if turn:
            assert kept.read_tokens <= kept.prompt_tokens - before, f"turn {turn + 1}"
        before = kept.prompt_tokens
    assert kept.read_tokens * 3 < kept.prompt_tokens, (kept.read_tokens, kept.prompt_tokens)


def test_chat_hybrid_resumes_from_its_state_snapshot(models):
    """A hybrid's second turn resumes from the recurrent state kept SNAPSHOT_BACK tokens before
    the first prompt's end, and its reply is, token for token and from the same logits, that
    of a session reading the same pieces: the first prompt up to there, then the second's
    rest (up to its own snapshot, then the end)."""
    from brass.chat import SNAPSHOT_BACK, Conversation
    from brass.sampling import SamplingParams
    m = models("synth-qwen35")
    conv = Conversation(m, SamplingParams(temperature=0.0), 6)
    words = np.random.default_rng(1)
    "".join(conv.reply(" ".join(words.choice(WORDS, size=6))))
    first = conv.prompt_ids
    "".join(conv.reply(" ".join(words.choice(WORDS, size=6))))
    second = conv.prompt_ids
    a, b = len(first) - SNAPSHOT_BACK, len(second) - SNAPSHOT_BACK
    assert second[:a] == first[:a] and conv.read_tokens == len(second) - a, \
        "the second turn did not resume from the first's snapshot"
    s = m.new_session(256)
    s.prefill(first[:a])
    s.prefill(second[a:b])
    logits = s.prefill(second[b:])
    want = []
    for _ in conv.reply_ids:
        want.append(int(np.argmax(logits[-1])))
        logits = m.backend.to_numpy(s.decode(want[-1]))
    assert conv.reply_ids == want


def test_a_request_larger_than_the_pool_gets_503_with_retry_after(models, rng):
    """Over HTTP a request that needs more blocks than the pool holds is refused at once as a
    busy server's is: 503 with Retry-After (it never starts, so it never fails halfway)."""
    pytest.importorskip("fastapi", reason="the server needs FastAPI")
    from brass import http_api
    from brass.server import App
    from conformance.harness.server_harness import ASGIClient
    m = models("synth-llama")
    app = App(m, "synth", None, parallel=1, max_waiting=4, kv_blocks=2)
    try:
        body = json.dumps({"prompt": _ids(m, rng, 30), "max_tokens": 8}).encode()
        status, headers, out = ASGIClient(http_api.create_app(app)).request(
            "POST", "/v1/completions", body, {"content-type": "application/json"})
    finally:
        app.scheduler.close()
    assert status == 503 and "retry-after" in headers, (status, out)
    assert b"block pool holds 32" in out


@pytest.mark.parametrize("args, message", [
    (["--kv-blocks", "0"], "--kv-blocks must be at least 1, not 0"),
    (["--no-prefix-cache", "--kv-blocks", "-4"], "--kv-blocks must be at least 1, not -4")])
def test_serve_options_are_checked_in_one_line(args, message):
    import subprocess
    import sys
    from conformance.harness.server_harness import ROOT
    synth = ROOT / "golden" / "models" / "synth-llama.gguf"
    r = subprocess.run([sys.executable, "-m", "brass", "serve", str(synth), "--backend", "numpy",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and r.stderr.strip() == f"brass: error: {message}", r.stderr


def test_the_pool_and_prefix_caching_follow_their_variables(models, monkeypatch):
    """BRASS_KV_BLOCKS sizes the pool (unset: --parallel times the context's blocks) and
    BRASS_PREFIX_CACHE=0 turns sharing off, read when the scheduler is built."""
    m = models("synth-qwen3")
    monkeypatch.delenv("BRASS_KV_BLOCKS", raising=False)
    monkeypatch.delenv("BRASS_PREFIX_CACHE", raising=False)
    sched = scheduler(m, parallel=3, start=False)
    assert (sched.kv.pool.n_blocks, sched.kv.enabled) == (3 * m.n_ctx // 16, True)
    monkeypatch.setenv("BRASS_KV_BLOCKS", "5")
    monkeypatch.setenv("BRASS_PREFIX_CACHE", "0")
    sched = scheduler(m, parallel=3, start=False)
    assert (sched.kv.pool.n_blocks, sched.kv.enabled) == (5, False)
