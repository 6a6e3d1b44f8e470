"""Prompt graphs (the model's prompt_graphs option, engine/model.py PromptStep): a session's prompt of a
length class (prompt_class) it has read before replays the class's captured graph, padded to
it, and gives what reading it eagerly gives. Graphs are keyed by class; lengths here that are
the last of their class (3, 7, 15, 47, ...) are read unpadded, others padded
(test_prompt_classes.py tests the padding itself).

On the CPU the session logic runs on the numpy backend with CUDA's graph interface
(conformance/harness/fakes.py: a replay re-runs the captured forward): which prefill is eager, which
captures, which replays; the ids and positions uploaded per replay (another prompt, another
start); the bound on graphs kept, one for the whole model (every session's graphs and the
model's, least recently used out first), and that a graph evicted, or its session dropped, is
freed at once (nothing else holds it: no cycle waits for the garbage collector); a capture that
fails turning prompt graphs off for the session without losing the prompt. On the GPU the same against real graphs, bit for bit
against the eager path (the same kernels on the same inputs), on every synthetic model:
dense ones capture, mixture-of-experts ones plan their routing on the host unless the
backend's moe_mmq option is on (else the capture fails and their prompts stay eager, still
right).
"""

from __future__ import annotations

import gc
import os
import weakref
from contextlib import contextmanager

import numpy as np
import pytest

from conformance.harness.fakes import ReplayingNumpy, rows_alone
from conformance.harness.goldens import load_synthetic
from brass.model import prompt_class

DENSE = ["synth-llama", "synth-qwen3", "synth-gemma3", "synth-qwen35"]
ALL = DENSE + ["synth-qwen3moe", "synth-qwen35moe", "synth-gemma4", "synth-gemma4moe"]


MiB = 1 << 20


def _on(m, **options):
    """`m` with decode and prompt graphs on, shared ones too, whatever the environment says
    (its options; on CUDA the backend's own cuBLAS handle with them), then `options` set."""
    m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
    if hasattr(m.backend, "options"):
        m.backend.options.own_cublas = True
    for k, v in options.items():
        setattr(m, k, v)
    return m


def _prompts(rng, V, n, count):
    return [[int(t) for t in rng.integers(0, V, n)] for _ in range(count)]


def _faked(name, budget_mb: float | None = None, **options):
    """(a model on the numpy backend with CUDA's graph interface faked, prompt graphs on (then
    `options`, and a budget of `budget_mb` if given), the same model plain numpy: the eager
    reference)."""
    m = load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    _on(m, **options)
    if budget_mb is not None:
        m.graph_ledger.budget = int(budget_mb * MiB)
    ref = load_synthetic(name, "numpy")
    # a graph reads a prompt padded to its class: every row as alone on both sides
    # (fakes.rows_alone says why)
    rows_alone(m.backend), rows_alone(ref.backend)
    return m, ref


def _count_captures(m, monkeypatch) -> list:
    """The keyword arguments of each capture m's backend makes from now on."""
    captures = []
    real = m.backend.capture
    monkeypatch.setattr(m.backend, "capture", lambda fn, **kw: (captures.append(kw), real(fn, **kw))[1])
    return captures


def _refuse_captures(m, monkeypatch):
    """Every capture of m's backend fails, as a forward that synchronises with the host does."""
    def refuse(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(m.backend, "capture", refuse)


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-qwen35"])
def test_second_prompt_of_a_length_replays(name, rng, monkeypatch):
    m, ref = _faked(name)
    captures = _count_captures(m, monkeypatch)
    s, r = m.new_session(64), ref.new_session(64)
    assert s.prompt_graphs
    V = m.config.n_vocab
    for i, ids in enumerate(_prompts(rng, V, 9, 4)):
        # the second onwards continue a cache (another start position) after a reset of both
        if i == 2:
            s.reset(), r.reset()
        got = s.prefill(ids)
        want = r.prefill(ids)
        assert np.array_equal(got, want), f"prompt {i}: replayed logits differ from eager ones"
        assert s.n_past == r.n_past
        assert (prompt_class(9) in s._prompt_steps) == (i >= 1), f"prompt {i}: captured {list(s._prompt_steps)}"
    assert captures == [{"reuse_freed": True}], "one capture of the length, with its own memory pool"
    # then decoding goes on from the right position with the right cache
    tok = int(np.argmax(want[-1]))
    assert np.array_equal(s.prefill([tok]), r.prefill([tok]))


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-qwen35"])
def test_sessions_share_the_models_graph_of_a_first_prompt(name, rng, monkeypatch):
    # a server's pooled sessions (each its own cache) read a length from position 0 a few times
    # each: the model captures it once (StartStep, over a cache of its own) and every session
    # that has not read the length itself replays it, its keys, values and recurrent state
    # copied into the session's cache; a session that read the length eagerly captures its own
    m, ref = _faked(name)
    captures = _count_captures(m, monkeypatch)
    V = m.config.n_vocab
    first = m.new_session(64)
    ids = _prompts(rng, V, 9, 6)
    r = ref.new_session(64)
    assert np.array_equal(first.prefill(ids[0]), r.prefill(ids[0]))
    assert not captures, "the model's first read of a length is eager"
    others = [m.new_session(64) for _ in range(3)]
    for i, s in enumerate(others):
        r.reset()
        assert np.array_equal(s.prefill(ids[1 + i]), r.prefill(ids[1 + i])), f"session {i}: logits differ"
        assert s.n_past == r.n_past == 9
        # the cache holds the prompt: decoding on gives what it gives after an eager read
        for tok in (int(t) for t in rng.integers(0, V, 3)):
            assert np.array_equal(s.prefill([tok]), r.prefill([tok])), f"session {i}: decoding after the prompt"
    assert len(captures) == 1 and list(m._start_steps) == [(prompt_class(9), 64)], (captures, list(m._start_steps))
    assert not any(s._prompt_steps for s in others), "they replayed the model's graph, not their own"
    # again after a reset: the model's graph again (their second request), no new capture
    others[0].reset(), r.reset()
    assert np.array_equal(others[0].prefill(ids[4]), r.prefill(ids[4]))
    assert len(captures) == 1
    # the session that read the length eagerly captures its own and replays it
    for k in (4, 5):
        first.reset(), r.reset()
        assert np.array_equal(first.prefill(ids[k]), r.prefill(ids[k]))
    assert len(captures) == 2 and prompt_class(9) in first._prompt_steps
    # a session of another size does not take a graph over a cache of 64 slots
    big = m.new_session(128)
    r.reset()
    assert np.array_equal(big.prefill(ids[1]), r.prefill(ids[1]))
    assert (prompt_class(9), 128) in m._start_steps and len(captures) == 3


def _pooled(m, n, n_ctx):
    """n sessions of n_ctx positions over one block pool, each holding its whole context's
    blocks (a server's), and the pool."""
    from brass.kv_cache import blocks_for
    pool = m.new_block_pool(n * blocks_for(n_ctx) + 1)
    sessions = [m.new_session(n_ctx, pool=pool) for _ in range(n)]
    for s in sessions:
        s.cache.assign(pool.allocate(blocks_for(n_ctx))[::-1])     # blocks out of order
    return pool, sessions


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-gemma3"])
def test_pooled_sessions_share_the_models_graph_of_a_prompt_going_on(name, rng, monkeypatch):
    # a server's pooled sessions read the rest of a prompt after a cached prefix (a position
    # past 0): the model captures a class once for the pool (ContinueStep, over a block table
    # of its own into which each replay copies the session's) and every session replays it,
    # its keys and values in its own blocks; before, each session captured its own
    m, ref = _faked(name)
    captures = _count_captures(m, monkeypatch)
    V = m.config.n_vocab
    pool, sessions = _pooled(m, 4, 64)
    for i, s in enumerate(sessions):
        r = ref.new_session(64)
        head, rest = _prompts(rng, V, 5, 1)[0], _prompts(rng, V, 9, 1)[0]
        assert np.array_equal(s.prefill(head), r.prefill(head)), f"session {i}: the first prompt"
        assert np.array_equal(s.prefill(rest), r.prefill(rest)), f"session {i}: the prompt going on"
        assert s.n_past == r.n_past == 14
        for tok in (int(t) for t in rng.integers(0, V, 3)):     # decoding on reads the same cache
            assert np.array_equal(s.prefill([tok]), r.prefill([tok])), f"session {i}: decoding after it"
    steps = m._continue_shelves[pool].steps
    assert list(steps) == [(prompt_class(9), 64)], list(steps)
    # one capture of the class from position 0 (StartStep) and one going on (ContinueStep);
    # the first session read each eagerly, the others replayed the model's graphs
    assert len(captures) == 2 and not any(s._prompt_steps for s in sessions), \
        (len(captures), [list(s._prompt_steps) for s in sessions])
    # its table is the last session's: each replay copied the session's in
    assert np.array_equal(steps[(prompt_class(9), 64)].cache.table, sessions[-1].cache.table)
    # a session holding its own graph of the class keeps it; without sharing, each its own
    m.shared_prompt_graphs = False
    _, alone = _pooled(m, 2, 64)
    for s in alone:
        s.prefill(_prompts(rng, V, 5, 1)[0])
        s.prefill(_prompts(rng, V, 9, 1)[0])
    assert all(prompt_class(9) in s._prompt_steps for s in alone)


def test_a_hybrid_pooled_session_keeps_its_own_graph_going_on(rng, monkeypatch):
    # the hybrids' recurrent state is the session's own, not in the pool's blocks: a graph of
    # the pool's could not carry it; their sessions capture their own graphs as before
    m, ref = _faked("synth-qwen35")
    V = m.config.n_vocab
    pool, sessions = _pooled(m, 3, 64)
    for i, s in enumerate(sessions):
        r = ref.new_session(64)
        for n in (5, 9):
            ids = _prompts(rng, V, n, 1)[0]
            assert np.array_equal(s.prefill(ids), r.prefill(ids)), f"session {i}, {n} tokens"
    assert pool not in m._continue_shelves
    assert [prompt_class(9) in s._prompt_steps for s in sessions] == [False, True, True]


def test_a_dropped_pool_frees_its_graphs(rng):
    # the model's graphs over a pool hold the pool's arrays (on the GPU: its memory) and refer
    # to the pool object weakly: when the server's pool goes, they go with it at once
    m, _ = _faked("synth-qwen3")
    V = m.config.n_vocab
    with _without_gc():
        pool, sessions = _pooled(m, 2, 64)
        for s in sessions:
            s.prefill(_prompts(rng, V, 5, 1)[0])
            s.prefill(_prompts(rng, V, 9, 1)[0])
        st = m._continue_shelves[pool].steps[(prompt_class(9), 64)]
        gone = [weakref.ref(pool), weakref.ref(st), weakref.ref(st.graph), weakref.ref(st.cache)]
        del st, s, sessions, pool
        assert all(w() is None for w in gone), "a dropped pool or its graphs outlived it"
        assert not any(k[0] is not m._start_shelf for k in m.graph_ledger.steps), list(m.graph_ledger.steps)


def test_a_continue_graph_replays_over_the_sessions_device_table(rng):
    # On CUDA the kernels read the device copy of the block table: before each replay the
    # step's copy must hold the session's blocks (the replaying fake above reads the host
    # table). Through the fake CuPy, whose copies land in host memory standing in for the
    # device's: after each session's read the step's device table is that session's.
    from conformance.harness import fake_cupy, launch_recording as lr
    with lr.fake_cuda(fake_cupy.Recorder()):
        import cupy
        import brass
        m = _on(brass.load(str(lr.MODELS_DIR / "synth-qwen3.gguf"), backend="cuda", quiet=True))
        V = m.config.n_vocab
        pool, sessions = _pooled(m, 4, 128)
        for i, s in enumerate(sessions):
            s.prefill(_prompts(rng, V, 5, 1)[0])
            s.prefill(_prompts(rng, V, 15, 1)[0], device_logits=True)
            steps = m._continue_shelves[pool].steps if pool in m._continue_shelves else {}
            if i == 0:
                assert not steps, "the model's first read of the class is eager"
                continue
            st = steps[(prompt_class(15), 128)]
            got = cupy.asnumpy(st.cache.device_table)
            want = np.full(got.shape, -1, np.int32)
            want[:len(s.cache.table)] = s.cache.table
            assert np.array_equal(got, want), f"session {i}: the step's device table is not the session's"
        assert not any(s._prompt_steps for s in sessions)


def test_a_failed_continue_capture_leaves_the_sessions_to_themselves(rng, monkeypatch):
    m, ref = _faked("synth-qwen3")
    V = m.config.n_vocab
    _, sessions = _pooled(m, 3, 64)
    from brass import model as model_module

    def refuse(*a, **kw):       # as a capture that synchronises with the host fails
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(model_module.ContinueStep, "__init__", refuse)
    for i, s in enumerate(sessions):
        r = ref.new_session(64)
        for n in (5, 9):
            ids = _prompts(rng, V, n, 1)[0]
            assert np.array_equal(s.prefill(ids), r.prefill(ids)), f"session {i}, {n} tokens"
    assert m.continue_graphs_error and "not permitted" in m.continue_graphs_error
    # the second session's read is eager (the capture failed), the third captures its own
    assert [prompt_class(9) in s._prompt_steps for s in sessions] == [False, False, True]


def test_a_large_cache_is_not_shared(rng, monkeypatch):
    # a StartStep holds a cache of its sessions' size: for a cache over half the graphs' budget
    # the session reads eagerly and then captures its own graph, as without sharing
    from brass.kv_cache import KVCache
    m, ref = _faked("synth-qwen3")
    m.graph_ledger.budget = int(KVCache.nbytes_for(m.config, 64) * 1.5)
    V = m.config.n_vocab
    ids = _prompts(rng, V, 9, 4)
    r = ref.new_session(64)
    assert np.array_equal(m.new_session(64).prefill(ids[0]), r.prefill(ids[0]))
    s = m.new_session(64)
    for i in (1, 2, 3):
        s.reset(), r.reset()
        assert np.array_equal(s.prefill(ids[i]), r.prefill(ids[i])), f"prompt {i}"
    assert not m._start_steps and prompt_class(9) in s._prompt_steps
    small = m.new_session(16)                   # a cache of 16 slots is shared
    r.reset()
    assert np.array_equal(small.prefill(ids[1]), r.prefill(ids[1]))
    assert list(m._start_steps) == [(prompt_class(9), 16)]


def test_without_shared_graphs_each_session_captures_its_own(rng, monkeypatch):
    # shared_prompt_graphs off: a second session (a server's pooled one, with its own cache)
    # captures its first prompt of a length the model read before, and replays the next
    m, ref = _faked("synth-qwen3", shared_prompt_graphs=False)
    first, r = m.new_session(64), ref.new_session(64)
    V = m.config.n_vocab
    ids = _prompts(rng, V, 9, 3)
    assert np.array_equal(first.prefill(ids[0]), r.prefill(ids[0]))
    assert not first._prompt_steps
    second = m.new_session(64)
    for i in (1, 2):
        second.reset(), r.reset()
        assert np.array_equal(second.prefill(ids[i]), r.prefill(ids[i])), f"prompt {i}"
        assert prompt_class(9) in second._prompt_steps, f"prompt {i} of the second session was read eagerly"
    assert not m._start_steps


def test_a_failed_start_capture_leaves_the_sessions_to_themselves(rng, monkeypatch):
    # the model's capture fails (a MoE prompt planned on the host): it says why, the session's
    # prompt is read eagerly and right, and later sessions try their own graphs as before
    m, ref = _faked("synth-qwen3")
    _refuse_captures(m, monkeypatch)
    ids = _prompts(rng, m.config.n_vocab, 7, 3)
    r = ref.new_session(64)
    for i, s in enumerate(m.new_session(64) for _ in range(3)):
        r.reset()
        assert np.array_equal(s.prefill(ids[i]), r.prefill(ids[i])), f"session {i}"
    assert m.start_graphs_error and "capturing" in m.start_graphs_error and not m._start_steps


def test_what_is_never_captured(rng):
    # all logits (teacher forcing), a trace, a single token: eager, whatever the length's history
    m, _ = _faked("synth-qwen3")
    s = m.new_session(64)
    ids = _prompts(rng, m.config.n_vocab, 6, 1)[0]
    for _ in range(3):
        s.reset()
        s.prefill(ids, all_logits=True)
        s.reset()
        s.prefill(ids, trace=lambda name, x: None)
        s.reset()
        s.prefill(ids[:1])
    assert not s._prompt_steps


def test_graphs_kept_are_bounded(rng, monkeypatch):
    # a kept count of 4 (PROMPT_GRAPHS_KEPT's role, small enough that six classes exceed it on
    # a synthetic model's short context): lengths of six classes, each read twice
    from brass import model
    monkeypatch.setattr(model, "PROMPT_GRAPHS_KEPT", 4)
    m, _ = _faked("synth-llama")
    s = m.new_session(128)
    lengths = [2, 5, 9, 20, 40, 60]
    assert len({prompt_class(n) for n in lengths}) == 6
    for n in lengths + lengths:
        s.reset()
        s.prefill(_prompts(rng, m.config.n_vocab, n, 1)[0])
    assert len(s._prompt_steps) == 4
    assert list(s._prompt_steps) == [prompt_class(n) for n in lengths[-4:]], "the most recently used are kept"


def test_graphs_memory_is_bounded(rng, monkeypatch):
    # the model's graphs hold at most their budget (prompt_graphs_mb) together: the oldest make
    # room; one over the whole budget is dropped once captured and its length read eagerly after
    m, ref = _faked("synth-llama", budget_mb=5)
    m.backend.graph_bytes = 3 << 20
    captures = _count_captures(m, monkeypatch)
    s, r = m.new_session(64), ref.new_session(64)
    V = m.config.n_vocab

    def read(n):
        s.reset(), r.reset()
        ids = _prompts(rng, V, n, 1)[0]
        assert np.array_equal(s.prefill(ids), r.prefill(ids))

    for n in (5, 5, 9, 9):                  # two classes (7 and 15)
        read(n)
    assert list(s._prompt_steps) == [15], "two graphs of 3 MiB kept within 5 MiB"
    assert len(captures) == 2
    m.graph_ledger.budget = 2 * MiB
    for _ in range(3):
        read(20)
    assert 31 not in s._prompt_steps and len(captures) == 3, "a graph over the budget is captured once"
    assert s.prompt_graphs, "an oversized graph does not turn prompt graphs off"
    read(9)                                 # the kept one still replays
    assert len(captures) == 3


def test_a_bad_budget_is_refused_when_the_model_is_built(monkeypatch):
    from brass.errors import BrassError
    from brass.flags import ConfigError
    monkeypatch.setenv("BRASS_PROMPT_GRAPHS_MB", "lots")
    with pytest.raises(ConfigError, match="BRASS_PROMPT_GRAPHS_MB must be a finite number"):
        load_synthetic("synth-llama", "numpy")
    monkeypatch.delenv("BRASS_PROMPT_GRAPHS_MB")
    import brass
    from conformance.harness.goldens import GOLDEN_DIR
    with pytest.raises(BrassError, match="prompt_graphs_mb must be a finite number"):
        brass.load(str(GOLDEN_DIR / "models" / "synth-llama.gguf"), backend="numpy", quiet=True,
                   prompt_graphs_mb=float("inf"))


def test_a_failed_capture_reads_the_prompt_eagerly(rng, monkeypatch):
    m, ref = _faked("synth-qwen3")
    _refuse_captures(m, monkeypatch)
    s, r = m.new_session(64), ref.new_session(64)
    for ids in _prompts(rng, m.config.n_vocab, 7, 3):
        assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert not s.prompt_graphs and not s._prompt_steps


def test_on_by_default(monkeypatch):
    # decode graphs, prompt graphs, shared ones, 512 MiB for them: what the suite and the
    # benchmarks run; the settings turn the first three off and set the budget when the model
    # is built (the environment is read then, never at import), and options given override them
    for var in ("BRASS_GRAPH", "BRASS_PROMPT_GRAPHS", "BRASS_PROMPT_GRAPHS_MB"):
        monkeypatch.delenv(var, raising=False)
    m = load_synthetic("synth-qwen3", "numpy")
    assert m.graphs and m.prompt_graphs and m.shared_prompt_graphs and m.graph_ledger.budget == 512 * MiB
    monkeypatch.setenv("BRASS_GRAPH", "0")
    monkeypatch.setenv("BRASS_PROMPT_GRAPHS", "off")
    monkeypatch.setenv("BRASS_PROMPT_GRAPHS_MB", "64")
    m = load_synthetic("synth-qwen3", "numpy")
    assert not m.graphs and not m.prompt_graphs and m.graph_ledger.budget == 64 * MiB
    import brass
    m = brass.load(str(m.path), backend="numpy", quiet=True, graphs=True, prompt_graphs=True, prompt_graphs_mb=1)
    assert m.graphs and m.prompt_graphs and m.graph_ledger.budget == MiB


def test_a_cuda_model_gives_its_backend_the_prompt_graphs_setting(monkeypatch):
    # prompt graphs capture cuBLAS calls, which CuPy's binding refuses during a capture: a CUDA
    # model with them on asks its backend for a cuBLAS handle of its own (own_cublas), one
    # without them does not (unless given)
    from brass import model as model_mod
    from brass.backends.numpy_backend import NumpyBackend
    from conformance.harness.goldens import GOLDEN_DIR
    asked = []
    monkeypatch.setattr(model_mod, "_backend_for", lambda arch, requested: requested)
    monkeypatch.setattr(model_mod, "get_backend", lambda name, **o: (asked.append((name, o)), NumpyBackend())[1])
    path = str(GOLDEN_DIR / "models" / "synth-qwen3.gguf")
    for on in (True, False):
        model_mod.Model(path, backend="cuda", quiet=True, prompt_graphs=on)
    model_mod.Model(path, backend="cuda", quiet=True, prompt_graphs=False, own_cublas=True)
    model_mod.Model(path, backend="numpy", quiet=True, prompt_graphs=True)
    assert asked == [("cuda", {"own_cublas": True}), ("cuda", {"own_cublas": False}),
                     ("cuda", {"own_cublas": True}), ("numpy", {})]


def _reads_as_eager(m, s, e, ids, n_gen: int, what: str):
    """Session s reads `ids` (through a graph) with the logits of session e reading them
    eagerly, bit for bit, and n_gen greedy tokens after them are e's."""
    from brass.sampling import SamplingParams
    got = m.backend.to_numpy(s.prefill(ids, device_logits=True)).copy()
    want = e.prefill(ids)
    assert np.array_equal(got, want), f"{what}: logits differ (max |diff| {np.abs(got - want).max():.3g})"
    first = int(np.argmax(want[-1]))
    greedy = SamplingParams(temperature=0.0)
    a = list(m.generate([first], n_gen, greedy, stop_at_eog=False, session=s))
    b = list(m.generate([first], n_gen, greedy, stop_at_eog=False, session=e))
    assert a == b, f"{what}: decoding after the graph's read parts from eager"


@pytest.mark.parametrize("name", ALL)
def test_cuda_start_graph_equals_eager(name, rng):
    """On the GPU: sessions reading a length from position 0 through the model's graph
    (StartStep: its own cache, copied into theirs) get the eager read's logits bit for bit,
    and greedy decoding after it the same tokens."""
    m = _on(load_synthetic(name, "cuda"))
    V = m.config.n_vocab
    # lengths that are the last of their class: the graph reads them unpadded, the same kernels
    # on the same rows as the eager read, so bit for bit (padded reads: test_prompt_classes.py)
    for n in (15, 47):
        e = m.new_session(128)
        e.prompt_graphs = False
        m.new_session(128).prefill(_prompts(rng, V, n, 1)[0])     # the model's first read: eager
        for i, ids in enumerate(_prompts(rng, V, n, 3)):
            s = m.new_session(128)
            e.reset()
            _reads_as_eager(m, s, e, ids, 8, f"{name} T={n} session {i}")
        moe = m.config.n_expert > 0
        assert ((prompt_class(n), 128) in m._start_steps) == (not moe or m.backend.options.moe_mmq), \
            (name, list(m._start_steps), m.start_graphs_error)


@pytest.mark.parametrize("name", ALL)
def test_cuda_continue_graph_equals_eager(name, rng):
    """On the GPU: pooled sessions reading the rest of a prompt after a first part (a position
    past 0) through the model's graph for their pool (ContinueStep: its block table rewritten
    with each session's) get the eager read's logits bit for bit, and greedy decoding after it
    the same tokens; the hybrids' sessions take their own graphs (no ContinueStep)."""
    m = _on(load_synthetic(name, "cuda"))
    V = m.config.n_vocab
    pool, sessions = _pooled(m, 4, 128)
    e = m.new_session(128)
    e.prompt_graphs = False
    for i, s in enumerate(sessions):
        head, rest = _prompts(rng, V, 9, 1)[0], _prompts(rng, V, 15, 1)[0]
        e.reset()
        s.prefill(head), e.prefill(head)
        _reads_as_eager(m, s, e, rest, 6, f"{name} session {i}")
    hybrid = any(m.config.is_recurrent(il) for il in range(m.config.n_layer))
    moe = m.config.n_expert > 0
    shared = pool in m._continue_shelves and (prompt_class(15), 128) in m._continue_shelves[pool]
    assert shared == (not hybrid and (not moe or m.backend.options.moe_mmq)), \
        (name, shared, m.continue_graphs_error)


@pytest.mark.parametrize("name", ALL)
def test_cuda_prompt_graph_equals_eager(name, rng):
    """On the GPU: the replayed prefill's logits equal the eager prefill's bit for bit, for a
    short prompt (mat-mul tiles) and one long enough for the tensor-core GEMMs, continuing a
    cache; greedy decoding after it then gives the same tokens."""
    from brass.sampling import SamplingParams
    m = _on(load_synthetic(name, "cuda"))
    V = m.config.n_vocab
    # lengths that are the last of their class (as above)
    for n in (15, 47):
        s = m.new_session(128)
        e = m.new_session(128)
        e.prompt_graphs = False
        for i, ids in enumerate(_prompts(rng, V, n, 3)):
            if i == 2:
                s.reset(), e.reset()
            got = m.backend.to_numpy(s.prefill(ids, device_logits=True)).copy()
            want = e.prefill(ids)
            assert np.array_equal(got, want), f"{name} T={n} prompt {i}: graph logits differ " \
                                              f"(max |diff| {np.abs(got - want).max():.3g})"
        moe = m.config.n_expert > 0
        assert s.prompt_graphs == (not moe or m.backend.options.moe_mmq) and bool(s._prompt_steps) == s.prompt_graphs, \
            (name, s.prompt_graphs, list(s._prompt_steps), s.prompt_graphs_error)
        # the memory each graph holds is counted (the session's budget reads it)
        assert all(st.nbytes > 0 for st in s._prompt_steps.values()), name
        greedy = SamplingParams(temperature=0.0)
        first = int(np.argmax(want[-1]))
        a = list(m.generate([first], 12, greedy, stop_at_eog=False, session=s))
        b = list(m.generate([first], 12, greedy, stop_at_eog=False, session=e))
        assert a == b, f"{name} T={n}: decoding after a replayed prompt parts from eager"


class _Held:
    """What the ledger counts of a captured graph: its nbytes."""

    def __init__(self, n):
        self.nbytes = n


def _keep(shelf, key, nbytes=None):
    """The graph of `key` on `shelf`: kept, or captured now (a _Held of nbytes; without nbytes
    a capture fails the test)."""
    def capture():
        assert nbytes is not None, f"{key} was captured again"
        return _Held(nbytes)
    return shelf.get(key, capture, pytest.fail)


@contextmanager
def _without_gc():
    """No collection by the garbage collector meanwhile: what is freed is freed by its last
    reference going (a cycle would keep it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_graph_bytes_counts_the_sessions_and_the_model():
    """Model.graph_bytes (a server's /metrics, brass_prompt_graph_bytes): the sessions' own
    prompt graphs, the model's shared ones (first prompts; prompts going on over a pool); a
    session gone takes its graphs with it."""
    m = load_synthetic("synth-qwen3", "numpy")
    a, b = m.new_session(64), m.new_session(64)
    _keep(a._prompt_shelf, 5, 100)
    _keep(a._prompt_shelf, 9, 20)
    _keep(b._prompt_shelf, 5, 3)
    _keep(m._start_shelf, (5, 64), 4000)
    pool = m.new_block_pool(4)
    shelf = m._continue_shelves[pool] = type(m._start_shelf)(m.graph_ledger)
    _keep(shelf, (9, 64), 50)
    assert m.graph_bytes() == {"prompt": 123, "start": 4000, "continue": 50}
    with _without_gc():
        del a
        assert m.graph_bytes() == {"prompt": 3, "start": 4000, "continue": 50}


def test_one_ledger_for_every_session_and_the_model(monkeypatch):
    # the budget and the count are the model's: every session's graphs and the model's
    # StartSteps together, the least recently used out first whichever shelf it is on
    from brass import model
    m = load_synthetic("synth-qwen3", "numpy")
    m.graph_ledger.budget = 10 * MiB
    a, b = m.new_session(64), m.new_session(64)
    A, B, S = a._prompt_shelf, b._prompt_shelf, m._start_shelf
    _keep(A, 5, 3 * MiB)
    _keep(B, 5, 3 * MiB)
    _keep(S, (5, 64), 3 * MiB)
    _keep(A, 5)                                 # used again: B's is the least recently used
    _keep(A, 6, 3 * MiB)                        # 12 MiB would not fit in 10: B's goes
    assert list(m.graph_ledger.steps) == [(S, (5, 64)), (A, 5), (A, 6)]
    assert m.graph_bytes() == {"prompt": 6 * MiB, "start": 3 * MiB, "continue": 0}
    assert 5 not in B and not b._prompt_steps and list(a._prompt_steps) == [5, 6]
    _keep(B, 7, 5 * MiB)                        # 14: the model's graph goes, then A's 5
    assert list(m.graph_ledger.steps) == [(A, 6), (B, 7)] and not m._start_steps
    monkeypatch.setattr(model, "PROMPT_GRAPHS_KEPT", 2)
    _keep(S, (9, 64), 1)                        # the count too: A's 6 goes
    assert list(m.graph_ledger.steps) == [(B, 7), (S, (9, 64))]
    _keep(A, 8, 11 * MiB)                       # over the whole budget: not kept, read eagerly
    assert 8 in A.eager and len(m.graph_ledger.steps) == 2
    assert _keep(A, 8) is None
    B.clear()                                   # (a session whose capture failed)
    assert list(m.graph_ledger.steps) == [(S, (9, 64))]


def test_sessions_graphs_together_stay_within_the_budget(rng, monkeypatch):
    # four sessions each capture their own graph of a length (without shared graphs, as with
    # shared_prompt_graphs off or a prompt read in chunks): room for two of them in all
    m, ref = _faked("synth-qwen3", budget_mb=7, shared_prompt_graphs=False)
    m.backend.graph_bytes = 3 << 20
    captures = _count_captures(m, monkeypatch)
    r = ref.new_session(64)
    sessions = [m.new_session(64) for _ in range(4)]
    ids = _prompts(rng, m.config.n_vocab, 9, 8)
    for i, s in enumerate(sessions):
        for j in (0, 1):
            s.reset(), r.reset()
            assert np.array_equal(s.prefill(ids[2 * i + j]), r.prefill(ids[2 * i + j])), (i, j)
        assert sum(m.graph_bytes().values()) <= 7 << 20, f"session {i}: {m.graph_bytes()}"
    assert len(captures) == 4, "each session captured the length once (the model's first read eager)"
    assert [bool(s._prompt_steps) for s in sessions] == [False, False, True, True]


def _read(s, rng, n):
    s.reset()
    s.prefill(_prompts(rng, s.model.config.n_vocab, n, 1)[0])


def test_an_evicted_graph_is_freed_at_once(rng, monkeypatch):
    # the ledger holds the only reference to a graph it keeps (the captured function reaches
    # neither the step nor the session, whatever a backend keeps of it): evicted, the step and
    # its graph (on the GPU: its memory) are freed then and there, without the garbage collector
    from brass import model
    monkeypatch.setattr(model, "PROMPT_GRAPHS_KEPT", 1)
    m, _ = _faked("synth-qwen3")
    s, other = m.new_session(64), m.new_session(64)
    with _without_gc():
        _read(s, rng, 7), _read(s, rng, 7)      # eager (the model's first), then s's own graph
        st = s._prompt_steps[7]
        gone = [weakref.ref(st), weakref.ref(st.graph)]
        del st
        _read(other, rng, 7)                    # the model's graph of 7 evicts s's
        assert list(m._start_steps) == [(7, 64)] and not s._prompt_steps
        assert all(w() is None for w in gone), "an evicted PromptStep outlived its eviction"
        st = m._start_steps[(7, 64)]
        gone = [weakref.ref(st), weakref.ref(st.graph), weakref.ref(st.cache)]
        del st
        _read(s, rng, 7)                        # s's own again
        assert all(w() is None for w in gone), "an evicted StartStep outlived its eviction"


def test_a_dropped_session_frees_its_graphs(rng):
    # a server's pool drops idle sessions: their graphs (and the session, its decode graph
    # included) go with them at once, not when the ledger evicts them or the collector runs
    m, _ = _faked("synth-qwen3")
    s = m.new_session(64)
    with _without_gc():
        _read(s, rng, 7), _read(s, rng, 7)
        list(m.generate([1, 2], 3, session=s))  # a decode graph too (greedy, on the device)
        assert s._step is not None and 7 in s._prompt_steps
        gone = [weakref.ref(s), weakref.ref(s._prompt_steps[7]), weakref.ref(s._step)]
        del s
        assert all(w() is None for w in gone), "a dropped session or its graphs outlived it"
        assert not m.graph_ledger.steps


def test_cuda_evicted_prompt_graphs_give_their_memory_back(rng, monkeypatch):
    """On the GPU: prompt graphs captured and evicted again and again (one kept at a time, a
    new length each) leave the device's memory where it was. Issue 11: each graph's memory
    pool, dropped with the graph, kept its free blocks for good (CuPy's arenas hold them by
    references the collector cannot see), so a server capturing and evicting grew without end.
    Each graph's bytes are the blocks it holds, and nothing of its memory is left with the
    backend's memos (escaped)."""
    import cupy
    from conformance.harness.soak_measures import gpu_mb
    from brass import model
    monkeypatch.setattr(model, "PROMPT_GRAPHS_KEPT", 1)
    m = _on(load_synthetic("synth-qwen3", "cuda"))
    s = m.new_session(1024)
    pool = cupy.get_default_memory_pool()

    def used():
        # this process's own device memory (nvidia-smi's compute apps, MiB): the suite's other
        # workers share the GPU, and the device-wide figure moved by 80 MiB with them (-n 14)
        m.backend.synchronize()
        pool.free_all_blocks()
        mib, kind = gpu_mb(os.getpid())
        if kind != "process":
            pytest.skip(f"nvidia-smi does not list this process ({kind}): its own device memory cannot be read")
        return int(mib) << 20

    def capture(n):
        for _ in range(2):                      # eager (the model's first read), then captured
            _read(s, rng, n)
        assert list(s._prompt_steps) == [n]
        return s._prompt_steps[n].graph

    # Every length read and captured once first: a length's first reads load kernels and let
    # cuBLAS choose its own for the shape, which holds device memory for good (on the H200, 48
    # new lengths: +12 to 16 MiB the first time, 0 when the same lengths came again; reads
    # alone +4 MiB), and is not what is measured here.
    # (lengths that are the last of their class: read unpadded, each its own graph)
    lengths = sorted({prompt_class(n) for n in range(16, 512)})   # 23 classes, 31 .. 511
    for n in (*lengths, 575):
        capture(n)
    before = used()                             # a graph of 575 held
    held = []
    for n in lengths:                           # each captured again, evicting the one before
        g = capture(n)
        held.append(g.nbytes)
        assert g.nbytes > 0 and g.escaped == 0, (n, g.nbytes, g.escaped)
        del g
    capture(575)                                # the same graph held as at the baseline
    grown = used() - before
    # The device hands out memory in 2 MiB pages (the same loop moved it by -2 MiB once): one
    # page. Before the fix every evicted graph kept its working set (then 48 graphs of ~4.9 MiB).
    assert grown <= 2 << 20, f"{len(held)} graphs of ~{max(held) / 2**20:.1f} MiB captured and evicted: " \
                             f"the device's memory grew {grown / 2**20:.1f} MiB"


def test_graph_memory_script_runs():
    """ci/gpu_graph_memory.py (a server's worker under soak-like churn, the prompt graphs'
    memory sampled) runs on the CPU: a few requests on the numpy backend with CUDA's graph
    interface faked, so that prompt graphs are captured and counted; no verdict without a GPU.
    The script runs in a process of its own (the suite imports nothing of ci/), with the fake
    backend patched in before it starts."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    child = textwrap.dedent("""
        import runpy
        import sys
        from brass import model
        from conformance.harness.fakes import ReplayingNumpy
        real = model.Model

        def faked(*args, **kw):
            m = real(*args, **kw)
            m.backend = ReplayingNumpy()
            m.backend.graph_bytes = 1 << 20
            # decode and prompt graphs on, whatever the environment says (as _on above)
            m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
            return m
        model.Model = faked
        sys.argv = ["ci/gpu_graph_memory.py", *sys.argv[1:]]
        runpy.run_path("ci/gpu_graph_memory.py", run_name="__main__")
    """)
    r = subprocess.run([sys.executable, "-c", child, str(root / "golden" / "models" / "synth-qwen3.gguf"),
                        "--backend", "numpy", "--requests", "8", "--every", "4", "--clients", "3",
                        "--long-share", "0"], cwd=root, capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 2 and "verdict: NONE: 8 requests (0 failed)" in out, out + r.stderr[-2000:]
    end = next(line for line in out.splitlines() if line.endswith("<- end"))
    assert " 8 req " in end and "captured 0" not in end and "graphs 0 " not in end, end
