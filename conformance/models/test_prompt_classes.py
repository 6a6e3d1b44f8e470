"""Prompt graphs of length classes (engine/model.py prompt_class, _PrefillGraph): a prompt of n
tokens replays the graph of its class, N >= n rows, padded with token 0 at the positions after
its own, the real count a device word. What must hold:

- the classes: every length in exactly one, the graph's N its last length, little padding,
  and every length where the CUDA backend switches kernels starting a class (so a prompt and
  its class's graph run the same kernels);
- the real rows' logits, the cache slots of the prompt and the recurrent states are what an
  unpadded eager read gives: on the CPU through the numpy backend with CUDA's graph interface
  faked (conformance/harness/fakes.py), every row computed as alone on both sides (numpy's
  BLAS gemm sums a row in an order that depends on the row count), on every synthetic model
  (dense, MoE, the hybrids' delta-nets, gemma4's sliding window), then decoding on from the
  cache; on the GPU against the eager CUDA read (bounds below), and bit for bit against the
  class's own eager read (padded as the graph reads it: a class's first read);
- a class whose padding would run past the cache is read eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.backends.base import GEMM_MIN_TOKENS
from brass.model import prompt_class
from conformance.harness.cases import nmse
from conformance.harness.fakes import ReplayingNumpy, rows_alone
from conformance.harness.goldens import load_synthetic

ALL = ["synth-llama", "synth-qwen3", "synth-gemma3", "synth-qwen35", "synth-qwen3moe",
       "synth-qwen35moe", "synth-gemma4", "synth-gemma4moe"]

needs_cuda = pytest.mark.skipif(not cuda_available(),
                                reason="no CUDA device here: the class graphs' GPU checks run on the GPU runner")

# Three prompts of one class each: the first read of the class (eager), the capture, a replay;
# their lengths differ, so the second and third are padded. Below GEMM_MIN_TOKENS (int8 tiles,
# the sequential delta rule), in the float16 GEMMs' range, and in the chunked delta rule's.
CLASS_READS = ((9, 12, 10), (40, 45, 33), (70, 77, 66))


def _kernel_thresholds():
    from brass.backends.cuda import attention_tiled, ssm
    return (attention_tiled.MIN_TOKENS, GEMM_MIN_TOKENS, ssm.DELTA_CHUNKED_MIN_TOKENS)


def test_classes_cover_every_length_with_little_padding():
    last = 0
    for n in range(2, 40000):
        c = prompt_class(n)
        assert c >= n and c >= last, n
        assert prompt_class(c) == c, f"{n}: the graph's length {c} is not of its class"
        assert c - n <= (15 if n < 128 else n // 8), f"{n}: padded to {c}"
        last = c
    assert len({prompt_class(n) for n in range(2, 4097)}) == 51
    assert len({prompt_class(n) for n in range(2, 32769)}) == 75
    with pytest.raises(ValueError):
        prompt_class(1)


def test_kernel_switches_start_classes():
    # a prompt and its class's graph take the same kernels: no class holds lengths on both
    # sides of a length at which the CUDA backend switches kernels
    thresholds = _kernel_thresholds()
    assert thresholds == (2, 32, 64)
    for t in thresholds:
        for n in range(2, 1000):
            assert (n >= t) == (prompt_class(n) >= t), (t, n)


def _faked(name):
    m = load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
    ref = load_synthetic(name, "numpy")
    # a graph reads a prompt padded to its class: every row as alone on both sides
    # (fakes.rows_alone says why)
    rows_alone(m.backend), rows_alone(ref.backend)
    return m, ref


def _ids(rng, V, n):
    return [int(t) for t in rng.integers(0, V, n)]


@pytest.mark.parametrize("name", ALL)
def test_padded_replays_equal_eager_reads(name, rng):
    m, ref = _faked(name)
    V = m.config.n_vocab
    s, r = m.new_session(256), ref.new_session(256)
    for lengths in CLASS_READS:
        c = prompt_class(lengths[0])
        assert all(prompt_class(n) == c for n in lengths)
        for i, n in enumerate(lengths):
            # the first prompt of each class from position 0, the next continuing the cache
            # (another start: the padding goes after it)
            if i == 0:
                s.reset(), r.reset()
            ids = _ids(rng, V, n)
            got, want = s.prefill(ids), r.prefill(ids)
            assert np.array_equal(got, want), f"{name} class {c} prompt of {n}: logits differ"
            assert s.n_past == r.n_past
        assert c in s._prompt_steps, f"{name}: class {c} was not captured ({list(s._prompt_steps)})"
        # the cache (keys, values, recurrent states) is the eager read's: decoding on agrees
        for tok in _ids(rng, V, 3):
            assert np.array_equal(s.prefill([tok]), r.prefill([tok])), f"{name} class {c}: decoding on"


@pytest.mark.parametrize("name", ["synth-qwen35", "synth-gemma4"])
def test_the_models_start_graph_pads_too(name, rng):
    # a server's sessions: the model's StartStep of the class, its cache's prompt slots and
    # state copied into each session's
    m, ref = _faked(name)
    V = m.config.n_vocab
    r = ref.new_session(128)
    m.new_session(128).prefill(_ids(rng, V, 40))            # the class's first read: eager
    for n in (41, 45, 33):
        s = m.new_session(128)
        r.reset()
        ids = _ids(rng, V, n)
        assert np.array_equal(s.prefill(ids), r.prefill(ids)), f"{name} {n}"
        tok = _ids(rng, V, 1)
        assert np.array_equal(s.prefill(tok), r.prefill(tok)), f"{name} {n}: decoding on"
    assert list(m._start_steps) == [(prompt_class(40), 128)]


def test_a_class_past_the_cache_is_read_eagerly(rng, monkeypatch):
    m, ref = _faked("synth-qwen3")
    captures = []
    real = m.backend.capture
    monkeypatch.setattr(m.backend, "capture", lambda fn, **kw: (captures.append(kw), real(fn, **kw))[1])
    V = m.config.n_vocab
    s, r = m.new_session(40), ref.new_session(40)
    for _ in range(3):                  # class 47 does not fit 40 slots: never captured
        s.reset(), r.reset()
        ids = _ids(rng, V, 33)
        assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert not captures and not s._prompt_steps
    for _ in range(2):                  # 20 tokens (class 31) after 9: 9 + 31 fits, captured
        s.reset(), r.reset()
        for n in (9, 20):
            ids = _ids(rng, V, n)
            assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert 31 in s._prompt_steps
    s.reset(), r.reset()                # 20 after 15: 15 + 31 > 40, eager
    for n in (15, 20):
        ids = _ids(rng, V, n)
        assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert s.n_past == 35


def test_a_prompt_past_a_launch_grid_is_read_in_pieces():
    # The CUDA kernels put a prompt's tokens on a grid's y axis, which CUDA bounds at 65,535
    # blocks: a longer prompt is read in pieces of MAX_PREFILL_ROWS tokens, each piece's class
    # within the bound too, the last token's logits (or every token's) as one read gives them.
    # On the CPU through the fake CuPy, which refuses a launch past the bounds as the driver does
    # (its kernels do not run: what is checked is that every launch is one the GPU takes).
    from brass.model import MAX_PREFILL_ROWS
    from conformance.harness import fake_cupy, launch_recording as lr
    assert prompt_class(MAX_PREFILL_ROWS) <= fake_cupy.MAX_GRID[1]
    n = MAX_PREFILL_ROWS + 100
    with lr.fake_cuda(fake_cupy.Recorder()) as backend:
        import brass
        from brass.backends.cuda.params import pack
        m = brass.load(str(lr.MODELS_DIR / "synth-qwen3.gguf"), backend="cuda", quiet=True, n_ctx=n)
        b = m.backend
        with pytest.raises(backend.CudaError, match="did not launch: cudaErrorInvalidValue"):
            x = b.asarray(np.zeros((fake_cupy.MAX_GRID[1] + 1, 1, 1), np.float32))
            b.launch("fused.cu", "decode_set", (1, x.shape[0]), 32, x, x,
                     params=pack("DecodeSetParams", tok=0, pos=0))
        s = m.new_session(n)
        logits = s.prefill([1] * n)
        assert s.n_past == n and logits.shape == (1, m.config.n_vocab)
        assert m.score([1] * n).shape == (n, m.config.n_vocab)


# On the GPU, a class graph against the eager read of the same prompt. Below GEMM_MIN_TOKENS
# every kernel a row passes through computes it as alone (int8 tiles and mat-vecs, rowwise
# norms and activations, attention whose padding keys come after every real query, the
# delta-net over exactly the real rows): bit for bit. From GEMM_MIN_TOKENS the mat-muls are
# cuBLAS GEMMs of N rows against n: cuBLAS may pick another algorithm (another split of K) for
# another row count, which moves an f32 sum by a few ulps and now and then an activation
# across an f16 or Q8_1 rounding; one Q8_1 flip moves the mat-mul it feeds by ~1e-6..1e-5 NMSE
# (conformance/harness/tolerances.py), so over the synthetic models' two layers the logits
# stay within GEMM_RECHOICE_NMSE of each other, a few flips' worth.
GEMM_RECHOICE_NMSE = 1e-4


@needs_cuda
@pytest.mark.parametrize("name", ALL)
def test_cuda_class_graph_equals_eager(name, rng):
    from brass.sampling import SamplingParams
    m = load_synthetic(name, "cuda")
    m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
    m.backend.options.own_cublas = True
    V = m.config.n_vocab
    greedy = SamplingParams(temperature=0.0)
    for lengths in CLASS_READS:
        s, e = m.new_session(256), m.new_session(256)
        e.prompt_graphs = False
        c = prompt_class(lengths[0])
        for i, n in enumerate(lengths):
            if i == 0:
                s.reset(), e.reset()
            ids = _ids(rng, V, n)
            got = m.backend.to_numpy(s.prefill(ids, device_logits=True)).copy()
            want = e.prefill(ids)
            if n < GEMM_MIN_TOKENS:
                assert np.array_equal(got, want), f"{name} class {c} prompt of {n}: " \
                                                  f"max |diff| {np.abs(got - want).max():.3g}"
            else:
                err = nmse(got, want)
                assert err <= GEMM_RECHOICE_NMSE, f"{name} class {c} prompt of {n}: NMSE {err:.3g}"
        assert c in s._prompt_steps, (name, c, list(s._prompt_steps), s.prompt_graphs_error)
        if lengths[0] < GEMM_MIN_TOKENS:
            first = int(np.argmax(want[-1]))
            a = list(m.generate([first], 8, greedy, stop_at_eog=False, session=s))
            b = list(m.generate([first], 8, greedy, stop_at_eog=False, session=e))
            assert a == b, f"{name} class {c}: decoding after a padded replay parts from eager"


@needs_cuda
@pytest.mark.parametrize("name", ALL)
def test_cuda_class_graph_equals_the_padded_eager_read(name, rng):
    # every length: a replay of the class's graph gives what the class's eager read gives (the
    # first read of a class, or a class whose graph is over the budget), bit for bit: the same
    # kernels on the same padded rows, cuBLAS included
    def model(budget):
        m = load_synthetic(name, "cuda")
        m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
        m.backend.options.own_cublas = True
        m.graph_ledger.budget = budget
        return m
    m, p = model(512 << 20), model(0)               # p: each graph dropped, its classes eager
    V = m.config.n_vocab
    for lengths in CLASS_READS:
        s, e = m.new_session(256), p.new_session(256)
        for n in lengths:
            s.reset(), e.reset()
            ids = _ids(rng, V, n)
            got = m.backend.to_numpy(s.prefill(ids, device_logits=True)).copy()
            want = p.backend.to_numpy(e.prefill(ids, device_logits=True))
            assert np.array_equal(got, want), f"{name} prompt of {n}: max |diff| {np.abs(got - want).max():.3g}"
        assert prompt_class(lengths[0]) in s._prompt_steps and not e._prompt_steps


@needs_cuda
@pytest.mark.parametrize("name", ["synth-qwen35", "synth-qwen35moe"])
def test_cuda_padded_replay_leaves_the_states_of_the_real_rows(name, rng):
    # the hybrids' recurrent states after a padded replay are the eager read's, bit for bit
    # (the delta-net kernels run over exactly the real rows; the layers before them are
    # row-independent below GEMM_MIN_TOKENS)
    m = load_synthetic(name, "cuda")
    m.graphs = m.prompt_graphs = m.shared_prompt_graphs = True
    m.backend.options.own_cublas = True
    V = m.config.n_vocab
    s, e = m.new_session(128), m.new_session(128)
    e.prompt_graphs = False
    for n in (17, 25, 20):                              # class 31: eager, capture, replay
        s.reset(), e.reset()
        ids = _ids(rng, V, n)
        s.prefill(ids), e.prefill(ids)
    assert 31 in s._prompt_steps
    for il in s.cache.recurrent.layers:
        for a, b in zip(s.cache.recurrent.layer(il), e.cache.recurrent.layer(il)):
            assert np.array_equal(m.backend.to_numpy(a), m.backend.to_numpy(b)), f"{name} layer {il}"


def test_a_class_past_a_shared_pools_blocks_is_read_eagerly(rng):
    # a server's session over a shared block pool holds only the blocks it was given: padding
    # past them would land in no block of its own, so such a prompt is read eagerly
    from brass.kv_cache import BLOCK_TOKENS
    m, ref = _faked("synth-qwen3")
    pool = m.new_block_pool(8)
    s = m.new_session(128, pool)
    s.cache.assign(pool.allocate(2))            # 2 blocks: 2 * BLOCK_TOKENS positions
    r = ref.new_session(128)
    V = m.config.n_vocab
    n_fit = 2 * BLOCK_TOKENS - 10               # class 31 (from 16 up) fits 32 slots from 0
    assert prompt_class(n_fit) <= 2 * BLOCK_TOKENS < 9 + prompt_class(n_fit)
    for _ in range(3):
        s.reset(), r.reset()
        ids = _ids(rng, V, n_fit)
        assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert prompt_class(n_fit) in s._prompt_steps or prompt_class(n_fit) in [k[0] for k in m._start_steps]
    captured = len(m.graph_ledger.steps)
    for _ in range(3):                          # after 9 tokens the class runs past the blocks
        s.reset(), r.reset()
        for n in (9, n_fit):
            ids = _ids(rng, V, n)
            assert np.array_equal(s.prefill(ids), r.prefill(ids))
    assert len(m.graph_ledger.steps) == captured + 1, "only the 9-token prompt's class was captured"
