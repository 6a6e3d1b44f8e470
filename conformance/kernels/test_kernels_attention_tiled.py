"""The tiled prompt attention (kernels/attention_tiled.cu: 64 queries x 64 cache slots per
block on f16 tensor cores, two passes) against the numpy reference, on the CPU and on CUDA.

The op's whole contract: causal mask from the positions (a prompt continuing a cache: pos =
p0, p0 + 1, ...), sliding windows smaller than the prompt, slots past the capacity never
seen, GQA (head h on KV head h / (H / H_kv)), head dims 64 / 128 / 256 and a V head dim of its
own, V the very buffer of K (Gemma 4), T on either side of the 64-query tile and caches much
longer than the prompt. Bound conformance.harness.cases.ATTENTION (probabilities rounded to F16; its
derivation holds for any two computations that differ only by float32 roundings before that
rounding, so also between this kernel and attention.cu). Fresh random inputs (the `rng`
fixture prints the seed), outputs poisoned (NaN, 0xFF bytes) so that an element never written
fails, cache slots no query can see NaN on the kernel's side (a tile that reads them fails),
and the Q8_1 blocks written beside the output equal, bit for bit, the numpy quantizer's
blocks of the kernel's own output (as test_kernels.assert_q8_of holds the other producers).

Without a GPU the CUDA tests skip; what runs everywhere is the kernel's own source compiled
for the CPU by g++ (conformance/harness/attn_host.py: the mma and ldmatrix fragment layouts emulated from the
PTX ISA) against the same reference, and NVRTC's compile of the source (test_nvrtc_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from conformance.harness.cases import ATTENTION, ATTENTION_UNIFORM, cuda_reference, nmse
from conformance.harness.mmq_host import built  # noqa: E402

F16, F32 = np.float16, np.float32

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the tiled attention's GPU tests run on the GPU runner; CI compiles "
           "attention_tiled.cu in test_nvrtc_compile.py and runs its source on the CPU below")

# (id, T queries, past tokens cached, H, H_kv, D, DV, window, capacity or None, scale or None)
CPU_CASES = [
    ("T70-empty-gqa2-d64", 70, 0, 4, 2, 64, 64, 0, None, None),       # two query tiles, the second of 6
    ("T37-past50-gqa4-d128", 37, 50, 8, 2, 128, 128, 0, None, None),  # a prompt continuing a cache
    ("T40-past30-d256-w16", 40, 30, 2, 1, 256, 256, 16, None, 1.0),   # window < T; logits up to ~+-30
    ("T66-past90-gqa4-d64-w40", 66, 90, 4, 1, 64, 64, 40, None, None),  # window over a past, tile edges
    ("T20-past3-d128-v64", 20, 3, 4, 2, 128, 64, 0, None, None),      # DV < D
    ("T9-past5-d64-v128", 9, 5, 2, 2, 64, 128, 0, None, None),        # DV > D, no GQA
    ("T12-past20-d128-v256", 12, 20, 2, 1, 128, 256, 0, None, None),
    ("T5-past300-cap2048-d128", 5, 300, 2, 1, 128, 128, 0, 2048, None),  # a cache much longer than the prompt
    ("T2-empty-d64", 2, 0, 2, 1, 64, 64, 0, None, None),              # the smallest prompt
]


def _case_inputs(rng, T, past, H, Hkv, D, DV, window, cap):
    from conformance.harness.attn_host import random_case, unseen_slots
    q, k, v, pos = random_case(rng, T, past, H, Hkv, D, DV, cap=cap, window=window)
    # the kernel's copies: slots no query sees are NaN (the reference masks them; they must
    # not be read, or 0 * NaN reaches P.V)
    unseen = unseen_slots(pos, k.shape[0], window)
    kk, vk = k.copy(), v.copy()
    kk[unseen] = np.nan
    vk[unseen] = np.nan
    if window:
        assert unseen[:past + T].any(), "the window hides no slot: the case tests nothing"
    return q, k, v, kk, vk, pos


def _check(got, want, what="output", bound=ATTENTION):
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    unwritten = np.isnan(got) & ~np.isnan(want)
    assert not unwritten.any(), (f"{what}: {int(unwritten.sum())} of {got.size} elements are NaN "
                                 f"(never written, or a NaN slot read), first at {np.argwhere(unwritten)[0].tolist()}")
    err = nmse(got, want)
    if not err <= bound:
        diff = np.abs(got.astype(np.float64) - want)
        i = np.unravel_index(int(np.nanargmax(diff)), diff.shape)
        off = diff > 1e-3 * np.abs(want).max()
        toks, cols = np.nonzero(off.any(axis=1))[0], np.nonzero(off.any(axis=0))[0]
        pytest.fail(f"{what}: NMSE {err:.3e} exceeds {bound:.1e}; largest difference at {list(i)}: "
                    f"got {got[i]!r}, expected {want[i]!r}; tokens off: {toks[:16].tolist()} ({toks.size}), "
                    f"columns off: {cols[:16].tolist()} ({cols.size})")
    return err


def _check_q8(blocks, got, what="Q8_1 blocks"):
    from conformance.harness.mmq_host import q8_1_blocks
    want = q8_1_blocks(got)
    blocks = np.asarray(blocks).reshape(want.shape)
    bad = np.nonzero((blocks != want).any(axis=-1))
    assert not bad[0].size, (f"{what}: {bad[0].size} of {want.shape[0] * want.shape[1]} blocks differ from "
                             f"quantize_q8_1 of the output, first (token, block) {[int(bad[0][0]), int(bad[1][0])]}")


# ---- on the CPU: the kernel source under g++ ---------------------------------------------------

@pytest.fixture(scope="module")
def host():
    from conformance.harness.attn_host import build
    return built(build)


@pytest.fixture(scope="module")
def ref():
    return cuda_reference()


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c[0])
def test_tiled_attention_on_the_cpu(host, ref, rng, case, record_property):
    from conformance.harness.attn_host import attention_tiled
    _, T, past, H, Hkv, D, DV, window, cap, scale = case
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    q, k, v, kk, vk, pos = _case_inputs(rng, T, past, H, Hkv, D, DV, window, cap)
    want = ref.attention(q, k, v, pos, scale, window)
    got, blocks = attention_tiled(host, q, kk, vk, pos, scale, window, rng=rng)
    record_property("nmse", f"{_check(got, want):.3e}")
    _check_q8(blocks, got)


def uniform_case(rng, T, past, H, Hkv, D, DV):
    """Equal logits along every row (conformance.harness.cases.ATTENTION_UNIFORM): each KV head's slots all
    hold one key; q in quarters and k in eighths, so that K.Q is exact in any order."""
    from conformance.harness.attn_host import random_case
    q, k, v, pos = random_case(rng, T, past, H, Hkv, D, DV)
    q = (rng.integers(-2, 3, q.shape) / 4).astype(F32)
    key = (rng.integers(-8, 9, (Hkv, D)) / 8).astype(F16)
    k[:past + T] = key[None]
    return q, k, v, pos


# (T, past, H, H_kv, D, DV, window): rows of every visible count 1 .. past + T, windowed ones
UNIFORM_CASES = [(70, 0, 4, 2, 64, 64, 0), (37, 50, 4, 1, 128, 128, 0), (40, 30, 2, 1, 256, 256, 23)]


@pytest.mark.parametrize("case", UNIFORM_CASES, ids=lambda c: "T%d-past%d-H%d-kv%d-d%d-v%d-w%d" % c)
def test_probabilities_normalised_before_rounding_on_the_cpu(host, ref, rng, case, record_property):
    from conformance.harness.attn_host import attention_tiled
    T, past, H, Hkv, D, DV, window = case
    q, k, v, pos = uniform_case(rng, T, past, H, Hkv, D, DV)
    scale = 1.0 / np.sqrt(D)
    want = ref.attention(q, k, v, pos, scale, window)
    got, blocks = attention_tiled(host, q, k, v, pos, scale, window, rng=rng)
    record_property("nmse", f"{_check(got, want, bound=ATTENTION_UNIFORM):.3e}")
    _check_q8(blocks, got)


def test_v_is_the_key_buffer_on_the_cpu(host, ref, rng):
    # Gemma 4 without attn_v: V is the raw key cache itself, one buffer passed twice
    from conformance.harness.attn_host import attention_tiled, random_case
    q, k, _, pos = random_case(rng, 17, 4, 4, 2, 256, 256)
    want = ref.attention(q, k, k, pos, 1.0, 8)
    got, blocks = attention_tiled(host, q, k, k, pos, 1.0, 8, rng=rng)
    _check(got, want)
    _check_q8(blocks, got)


def test_slots_past_the_capacity_are_never_seen_on_the_cpu(host, ref, rng):
    # Positions beyond the cache (capacity 6, positions 0..9): query t sees slots
    # 0..min(pos[t], capacity - 1), as the reference does with the positions clipped.
    from conformance.harness.attn_host import attention_tiled
    T, H, Hkv, D, cap = 10, 2, 1, 64, 6
    q = rng.uniform(-1, 1, (T, H, D)).astype(F32)
    k, v = (rng.uniform(-1, 1, (cap, Hkv, D)).astype(F16) for _ in range(2))
    pos = np.arange(T, dtype=np.int32)
    want = ref.attention(q, k, v, np.minimum(pos, cap - 1), 0.125, 0)
    got, blocks = attention_tiled(host, q, k, v, pos, 0.125, 0, rng=rng)
    _check(got, want)
    _check_q8(blocks, got)


def test_without_q8_blocks_on_the_cpu(host, ref, rng):
    from conformance.harness.attn_host import attention_tiled, random_case
    q, k, v, pos = random_case(rng, 3, 1, 2, 1, 64, 64)
    want = ref.attention(q, k, v, pos, 0.125, 0)
    got, blocks = attention_tiled(host, q, k, v, pos, 0.125, 0, write_q8=False, rng=rng)
    assert blocks is None
    _check(got, want)


def test_host_half_rounding_is_numpys(host, rng):
    # The emulation's float -> half (every F16 rounding of the kernel: Q, P) against numpy:
    # ties to even, subnormals, overflow to infinity, NaN.
    x = np.concatenate([
        rng.standard_normal(20000).astype(F32) * np.float32(2.0) ** rng.integers(-30, 17, 20000).astype(F32),
        # exact ties between two halves (the float halfway between neighbours), normal and subnormal
        ((np.arange(1, 4000, dtype=np.float64) + 0.5) * 2.0 ** -24).astype(F32),
        ((np.arange(1024, 5000, dtype=np.float64) + 0.5) * 2.0 ** -10).astype(F32),
        np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, 1e9, -1e9, np.inf, -np.inf, 2.0 ** -25,
                  2.0 ** -25 * 1.0000001, 5.9604645e-08, 6.1035156e-05, 6.1032e-05], F32)])
    x = np.ascontiguousarray(x, F32)
    y = np.empty(x.size, np.uint16)
    host.f32_to_f16_array(x.ctypes.data, y.ctypes.data, x.size)
    with np.errstate(over="ignore"):
        want = x.astype(F16).view(np.uint16)
    bad = np.nonzero(y != want)[0]
    assert not bad.size, f"{bad.size} roundings differ, first {x[bad[0]]!r}: {y[bad[0]]:#06x} vs {want[bad[0]]:#06x}"
    nan = np.empty(1, np.uint16)
    host.f32_to_f16_array(np.array([np.nan], F32).ctypes.data, nan.ctypes.data, 1)
    assert np.isnan(nan.view(F16)[0])


def test_kernel_table_and_shared_memory_agree(host):
    # The Python launcher's head dims and shared memory bytes are those of the source.
    pytest.importorskip("cupy", reason="the launcher module imports the CUDA backend (CuPy)")
    from conformance.harness.attn_host import kernel_head_dims
    from brass.backends.cuda import attention_tiled as at
    assert at.HEAD_DIMS == tuple(kernel_head_dims()) and len(at.HEAD_DIMS) >= 3
    assert {(64, 64), (128, 128), (256, 256)} <= set(at.HEAD_DIMS)
    for d, dv in at.HEAD_DIMS:
        assert at.smem_bytes(d, dv) == host.attn_smem_bytes(d, dv), (d, dv)
        # 99 KiB: what sm_86 / sm_89 / sm_120 allow a block (the H200 227 KiB)
        assert at.smem_bytes(d, dv) + at.STATIC_SMEM <= 99 * 1024, (d, dv)
    assert not at.takes(1, 128, 128, 227 * 1024), "one token is a decode step (attention.cu)"
    assert not at.takes(512, 96, 96, 227 * 1024) and not at.takes(512, 512, 512, 227 * 1024)
    assert at.takes(512, 128, 128, 227 * 1024) and not at.takes(512, 256, 256, 48 * 1024)


def test_every_tiled_kernel_is_in_the_image():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy's NVRTC binding is not installed")
    del nvrtc
    from brass.backends.cuda import attention_tiled as at
    from brass.backends.cuda.compiler import compile_source
    image = compile_source(at.SOURCE, "sm_90")
    for _, name in at.launched_kernels():
        assert name.encode() + b"\0" in image, f"{name} is missing from {at.SOURCE}"


# ---- on CUDA ------------------------------------------------------------------------------------

GPU_CASES = CPU_CASES + [
    ("T512-qwen3-0.6b", 512, 0, 16, 8, 128, 128, 0, None, None),      # the prompt the kernel is for
    ("T300-past1000-gqa4-d256-w256", 300, 1000, 8, 2, 256, 256, 256, None, 1.0),
    ("T129-past700-gqa4-d128-w100", 129, 700, 8, 2, 128, 128, 100, None, None),
    ("T77-past4000-d64", 77, 4000, 4, 1, 64, 64, 0, 8192, None),
]


@pytest.fixture(scope="module")
def cuda():
    from brass.backends.cuda import CudaBackend
    return CudaBackend(poison_outputs=True)


def _run_tiled(cuda, rng, q, k, v, pos, scale, window, same=False):
    """The tiled kernel over k / v paged into device pools (blocks out of order, under rng)."""
    from brass.backends.cuda.attention_tiled import Q8_1_BLOCK_BYTES, attention_tiled
    from conformance.harness.attn_host import device_sequence
    T, H, _ = q.shape
    DV = v.shape[2]
    kl, vl = device_sequence(cuda, rng, k, None if same else v)
    out = cuda._out((T, H * DV), F32)
    out_q = cuda._out((T, H * DV // 32 * Q8_1_BLOCK_BYTES), np.uint8)
    if not attention_tiled(cuda, cuda.asarray(q), kl.pool, vl.pool, kl.cache.device, cuda.asarray(pos),
                           k.shape[0], scale, window, out, out_q, True):
        pytest.skip(f"attention_tiled does not take head dims {q.shape[2]}/{DV} on this GPU "
                    f"({cuda.smem_optin_limit} bytes of shared memory per block)")
    return cuda.to_numpy(out), cuda.to_numpy(out_q)


def _old_launch(cuda, dq, kl, vl, dp, scale, window, out):
    """attention.cu's `attention` launched directly on a sequence's paged layers kl / vl (as
    CudaBackend.attention launched it for every T before the tiled kernel): whatever the
    backend now routes prompts to, this is the kernel the tiled one replaces."""
    from brass.backends.cuda.attention import ATTN_THREADS, ATTN_WARPS
    from brass.backends.cuda.params import pack
    T, H, D = dq.shape
    cap, Hkv, DV = kl.cache.n_ctx, kl.pool.shape[2], vl.pool.shape[3]
    n_slots = min(cap, window) if window > 0 else cap
    params = pack("AttentionParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=D, head_dim_v=DV,
                  capacity=cap, n_slots=n_slots, window=max(0, window), scale=scale, write_q8=0, per_row=0,
                  table_stride=0, split_fill=0)
    cuda.launch("attention.cu", "attention", (H, T), ATTN_THREADS, dq, kl.pool, vl.pool, dp, kl.cache.device,
                out, out, params=params, smem=4 * (D + n_slots + ATTN_WARPS * DV))


def _old_kernel(cuda, rng, q, k, v, pos, scale, window):
    from conformance.harness.attn_host import device_sequence
    out = cuda._out((q.shape[0], q.shape[1] * v.shape[2]), F32)
    _old_launch(cuda, cuda.asarray(q), *device_sequence(cuda, rng, k, v), cuda.asarray(pos), scale, window, out)
    return cuda.to_numpy(out)


@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_tiled_attention_on_cuda(cuda, ref, rng, case, record_property):
    _, T, past, H, Hkv, D, DV, window, cap, scale = case
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    q, k, v, kk, vk, pos = _case_inputs(rng, T, past, H, Hkv, D, DV, window, cap)
    want = ref.attention(q, k, v, pos, scale, window)
    got, blocks = _run_tiled(cuda, rng, q, kk, vk, pos, scale, window)
    record_property("nmse", f"{_check(got, want):.3e}")
    _check_q8(blocks, got)
    old = _old_kernel(cuda, rng, q, k, v, pos, scale, window)
    record_property("nmse_vs_attention_cu", f"{_check(got, old, 'against attention.cu'):.3e}")


@needs_cuda
@pytest.mark.parametrize("case", UNIFORM_CASES + [(512, 0, 16, 8, 128, 128, 0)],
                         ids=lambda c: "T%d-past%d-H%d-kv%d-d%d-v%d-w%d" % c)
def test_probabilities_normalised_before_rounding_on_cuda(cuda, ref, rng, case, record_property):
    T, past, H, Hkv, D, DV, window = case
    q, k, v, pos = uniform_case(rng, T, past, H, Hkv, D, DV)
    scale = 1.0 / np.sqrt(D)
    want = ref.attention(q, k, v, pos, scale, window)
    got, blocks = _run_tiled(cuda, rng, q, k, v, pos, scale, window)
    record_property("nmse", f"{_check(got, want, bound=ATTENTION_UNIFORM):.3e}")
    _check_q8(blocks, got)
    old = _old_kernel(cuda, rng, q, k, v, pos, scale, window)
    _check(old, want, "attention.cu", bound=ATTENTION_UNIFORM)


@needs_cuda
def test_v_is_the_key_buffer_on_cuda(cuda, ref, rng):
    from conformance.harness.attn_host import random_case
    q, k, _, pos = random_case(rng, 70, 4, 4, 2, 256, 256)
    want = ref.attention(q, k, k, pos, 1.0, 8)
    got, blocks = _run_tiled(cuda, rng, q, k, k, pos, 1.0, 8, same=True)
    _check(got, want)
    _check_q8(blocks, got)


@needs_cuda
def test_context_beyond_the_old_kernels_limit(cuda, ref, rng, record_property):
    # attention.cu keeps n_slots logits in shared memory (beyond ~57k slots it cannot launch);
    # the tiled kernel's shared memory does not depend on the context.
    from conformance.harness.attn_host import random_case
    past, T = 70000, 3
    q, k, v, pos = random_case(rng, T, past, 2, 1, 128, 128)
    want = ref.attention(q, k, v, pos, 1.0 / np.sqrt(128), 0)
    got, blocks = _run_tiled(cuda, rng, q, k, v, pos, 1.0 / np.sqrt(128), 0)
    record_property("nmse", f"{_check(got, want):.3e}")
    _check_q8(blocks, got)


@needs_cuda
def test_what_it_does_not_take(cuda, rng, monkeypatch):
    from conformance.harness.kernel_checks import record_launches
    from brass.backends.cuda.attention_tiled import attention_tiled
    launched = record_launches(cuda, monkeypatch)
    from conformance.harness.attn_host import device_sequence
    for T, D, DV in ((1, 128, 128), (8, 96, 96), (8, 512, 512), (8, 32, 32)):
        q = cuda.asarray(rng.uniform(-1, 1, (T, 2, D)).astype(F32))
        kl, vl = device_sequence(cuda, rng, rng.uniform(-1, 1, (16, 1, D)).astype(F16),
                                 rng.uniform(-1, 1, (16, 1, DV)).astype(F16))
        out = cuda._out((T, 2 * DV), F32)
        out_q = cuda._out((T, 2 * DV // 32 * 36), np.uint8)
        pos = cuda.asarray(np.arange(T, dtype=np.int32))
        assert attention_tiled(cuda, q, kl.pool, vl.pool, kl.cache.device, pos, 16, 0.1, 0, out, out_q,
                               True) is False, (T, D, DV)
    assert launched == []


@needs_cuda
def test_prompt_timing_against_attention_cu(cuda, rng, record_property):
    # Not a bound: records both kernels' times on the Qwen3-0.6B prompt (512 tokens, 16/8
    # heads of 128) for perf/NOTES.md.
    import cupy
    from brass.backends.cuda.attention_tiled import attention_tiled
    from conformance.harness.attn_host import random_case
    T, H, Hkv, D = 512, 16, 8, 128
    from conformance.harness.attn_host import device_sequence
    q, k, v, pos = random_case(rng, T, 0, H, Hkv, D, D)
    dq, dp = cuda.asarray(q), cuda.asarray(pos)
    kl, vl = device_sequence(cuda, rng, k, v)
    out = cuda._out((T, H * D), F32)
    out_q = cuda._out((T, H * D // 32 * 36), np.uint8)

    def timed(fn, reps=20):
        fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(cuda.stream)
        for _ in range(reps):
            fn()
        end.record(cuda.stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / reps * 1e3

    tiled = timed(lambda: attention_tiled(cuda, dq, kl.pool, vl.pool, kl.cache.device, dp, k.shape[0], 0.088, 0,
                                          out, out_q, True))
    old_out = cuda._out((T, H * D), F32)
    old = timed(lambda: _old_launch(cuda, dq, kl, vl, dp, 0.088, 0, old_out))
    record_property("measured", f"attention_tiled {tiled:.1f} us, attention.cu {old:.1f} us")
    print(f"T=512 H=16/8 D=128: attention_tiled {tiled:.1f} us, attention.cu {old:.1f} us")


@needs_cuda
@pytest.mark.parametrize("on", [False, True], ids=["attn_tiled-off", "default"])
def test_backend_attention_routes_prompts(cuda, rng, monkeypatch, on):
    """CudaBackend.attention sends a prompt (T >= 2, one cache) to the tiled kernel when
    its attn_tiled option is on and to attention.cu otherwise; a decode token (T = 1) always to
    attention.cu. Either way the result is the reference's, and the Q8_1 blocks it wrote
    are remembered for the output projection."""
    monkeypatch.setattr(cuda.options, "attn_tiled", on)
    launched = []
    real = cuda.launch
    monkeypatch.setattr(cuda, "launch", lambda src, name, *a, **kw: (launched.append(name), real(src, name, *a, **kw))[1])
    ref = cuda_reference()
    from conformance.harness.attn_host import device_sequence, random_case
    for T in (40, 1):
        q, k, v, pos = random_case(rng, T, 20, 4, 2, 128, 128)
        launched.clear()
        out = cuda.attention(cuda.asarray(q), *device_sequence(cuda, rng, k, v), cuda.asarray(pos), 0.088)
        want = ref.attention(q, k, v, pos, 0.088)
        assert nmse(cuda.to_numpy(out), want.reshape(T, -1)) <= ATTENTION
        tiled = [n for n in launched if n.startswith("attention_tiled")]
        assert bool(tiled) == (on and T >= 2), launched
        from brass.backends.cuda import quantize
        assert quantize.blocks_of(cuda, out) is not None, "the output's Q8_1 blocks were not remembered"
