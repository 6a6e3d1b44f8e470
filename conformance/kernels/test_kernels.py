"""Per-kernel conformance of the CUDA backend against the numpy reference backend.

Every op runs on both backends with the same fresh random inputs (the seed is printed on
failure; BRASS_TEST_SEED reruns it). CUDA outputs are poisoned with NaN before each kernel
runs, so an element a kernel forgets to write fails the test instead of passing as stale
memory. Results are judged by NMSE (llama.cpp's test-backend-ops measure) against a bound per
op (kernels/cases.py, where each bound says why it is what it is). The NMSE of every case is
recorded as a junit property (ci/gpu.sh kernels prints them as a table).

The reference is `NumpyBackend(act_mode="q8_1")` (conformance.harness.cases.cuda_reference): activations
quantized to Q8_1 blocks exactly as the CUDA quantize kernel does, so quantized mat-vecs can be
compared tightly.

Without a GPU these tests skip with the reason shown; CI still compiles every kernel
(test_nvrtc_compile.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from brass import quants
from brass.backends import cuda_available
from brass.backends.base import Backend
from brass.errors import BrassError, UnsupportedError
from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile
from conformance.harness.cases import (EXACT, F16_ROUNDED, MATMUL, MATMUL_SHAPES, OP_BOUNDS, RECURRENCE,
                           RMS_NORM, TRANSCENDENTAL,
                           WEIGHT_TYPES, write_gguf)
from conformance.harness.kernel_checks import check, kv_store_and_attention, record_launches, tname, weights

pytestmark = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the CUDA kernel tests run on the GPU runner (ci/gpu.sh suite); "
           "CI compiles every kernel in test_nvrtc_compile.py")

F16, F32 = np.float16, np.float32


# ---- activation quantization ----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 32), (3, 256), (5, 4096)], ids=str)
def test_quantize_q8_1_bit_exact(cuda, rng, shape, record_property):
    x = rng.uniform(-1, 1, shape).astype(F32)
    x[0, :32] = 0.0          # an all-zero block: d = 0 and zero quants, not NaN
    x[-1, -32:] *= 1e-3      # a block of small values
    got = cuda.to_numpy(cuda.quantize_q8_1(cuda.asarray(x))).reshape(shape[0], -1, 36)
    want = quants.quantize_q8_1_cuda(x)
    R, nb = shape[0], shape[1] // 32
    assert np.array_equal(got[..., 0:2].copy().view("<f2")[..., 0], want.d), "d differs"
    assert np.array_equal(got[..., 2:4].copy().view("<f2")[..., 0], want.s), "s = fp16(sum x) differs"
    assert np.array_equal(got[..., 4:].view(np.int8).reshape(R, nb * 32), want.qs), "quants differ"
    record_property("nmse", "bit-exact")


# ---- mat-vec / mat-mul ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "N%d-K%d-T%d" % s)
@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=tname)
def test_matmul(cuda, ref, rng, tmp_path, qtype, shape, record_property):
    N, K, T = shape
    gf = weights(tmp_path, rng, {"w": (qtype, (N, K))})
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    got = cuda.to_numpy(cuda.matmul(cuda.asarray(x), cuda.weight(gf, "w")))
    check(got, ref.matmul(x, ref.weight(gf, "w")), MATMUL, record_property)


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.F16), ids=tname)
def test_prompt_gemm_with_kept_f16_weights(rng, tmp_path, qtype):
    """A prompt's GEMM reading a float16 copy of the weight kept since the first prompt
    (the f16_weights option; an F16 weight's own bytes, always) gives the product the per-call
    dequantization gives, bit for bit (the same float16 values, the same single GEMM: N * K
    fits the scratch; a weight over GEMM_SCRATCH_BYTES goes in chunks without a copy and in
    one GEMM with it, which cuBLAS may sum in another order), on the first prompt and the
    next; a budget of 0 keeps nothing."""
    from brass.backends.cuda import CudaBackend
    plain, kept, none = CudaBackend(f16_weights=False), CudaBackend(f16_weights=True), CudaBackend(f16_weights=True)
    none._f16_budget = 0
    N, K, T = 768, 1024, 64
    gf = weights(tmp_path, rng, {"w": (qtype, (N, K))})
    wp, wk, wn = plain.weight(gf, "w"), kept.weight(gf, "w"), none.weight(gf, "w")
    for r in range(2):
        x = rng.uniform(-1, 1, (T, K)).astype(F32)
        want = plain.to_numpy(plain.matmul(plain.asarray(x), wp))
        for b, w in ((kept, wk), (none, wn)):
            got = b.to_numpy(b.matmul(b.asarray(x), w))
            assert np.array_equal(got, want), f"prompt {r}: the GEMM differs with kept weights " \
                                              f"(max |diff| {np.abs(got - want).max():.3g})"
    assert kept.f16_weight_bytes == (0 if qtype == GGMLType.F16 else 2 * N * K)
    assert none.f16_weight_bytes == 0


def test_out_of_memory_frees_the_f16_copies_then_says_so(rng, tmp_path):
    """A session's memory (a KV cache: Backend.zeros) that does not fit: the float16 weight
    copies (a cache) are freed and no more are made, prompts still give the same product
    (dequantized per call), and what still does not fit is one line (CudaError), not CuPy's
    traceback; with prompt graphs on (their GEMMs may read a copy) the copies stay."""
    from brass.backends.cuda import CudaBackend
    from brass.backends.cuda.errors import CudaError
    b = CudaBackend(f16_weights=True)
    N, K, T = 768, 1024, 64
    gf = weights(tmp_path, rng, {"w": (GGMLType.Q4_K, (N, K))})
    w = b.weight(gf, "w")
    x = b.asarray(rng.uniform(-1, 1, (T, K)).astype(F32))
    want = b.to_numpy(b.matmul(x, w))
    assert b.f16_weight_bytes == 2 * N * K
    b.options.own_cublas = True
    with pytest.raises(CudaError, match=r"^out of GPU memory: \d+ MiB do not fit"):
        b.zeros((1 << 40,), np.uint8)                  # a tebibyte
    assert b.f16_weight_bytes == 2 * N * K, "prompt graphs may read the copies: they must stay"
    b.options.own_cublas = False
    with pytest.raises(CudaError, match="a smaller context"):
        b.zeros((1 << 40,), np.uint8)
    assert b.f16_weight_bytes == 0 and not b._f16_copies
    for _ in range(2):
        assert np.array_equal(b.to_numpy(b.matmul(x, w)), want)
    assert b.f16_weight_bytes == 0, "a copy was made again after the memory ran out"


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.F16), ids=tname)
def test_prompt_gemm_on_own_cublas_handle_is_captured(ref, rng, tmp_path, qtype, record_property):
    """With its own cuBLAS handle (the own_cublas option, for prompt graphs: CuPy refuses cuBLAS calls
    during a capture) a prompt's GEMM is the product (the mat-mul bound against the
    reference), and a captured one replays, on new inputs, what the eager GEMM gives, bit for
    bit (the same handle, workspace and call)."""
    from brass.backends.cuda import CudaBackend
    b = CudaBackend(poison_outputs=True, own_cublas=True)
    N, K, T = 768, 1024, 64
    gf = weights(tmp_path, rng, {"w": (qtype, (N, K))})
    w = b.weight(gf, "w")
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    xd = b.asarray(x)
    check(b.to_numpy(b.matmul(xd, w)), ref.matmul(x, ref.weight(gf, "w")), MATMUL, record_property)
    assert b._own_blas is not None, "the GEMM did not go through the backend's own handle"
    graph = b.capture(lambda: b.matmul(xd, w))
    for _ in range(2):
        with b.activate():
            xd[...] = b.asarray(rng.uniform(-1, 1, (T, K)).astype(F32))
        graph.replay()
        got = b.to_numpy(graph.result)
        want = b.to_numpy(b.matmul(xd, w))
        assert np.array_equal(got, want), f"replayed GEMM differs (max |diff| {np.abs(got - want).max():.3g})"


@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-x", "x-per-slot"])
@pytest.mark.parametrize("qtype", (GGMLType.F16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0,
                                   GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.MXFP4), ids=tname)
def test_matmul_id(cuda, ref, rng, tmp_path, qtype, per_slot, record_property):
    E, N, K, T, k = 8, 37, 512, 5, 3
    gf = weights(tmp_path, rng, {"w": (qtype, (E, N, K))})
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.uniform(-1, 1, (T, k, K) if per_slot else (T, K)).astype(F32)
    got = cuda.to_numpy(cuda.matmul_id(cuda.asarray(x), cuda.weight(gf, "w"), cuda.asarray(ids)))
    check(got, ref.matmul_id(x, ref.weight(gf, "w"), ids), MATMUL, record_property)


@pytest.mark.parametrize("moe_mmq", [True, False], ids=["default", "moe_mmq-off"])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-x", "x-per-slot"])
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.MXFP4, GGMLType.Q8_0), ids=tname)
def test_matmul_id_prompt_gemm(cuda, ref, rng, tmp_path, qtype, per_slot, moe_mmq, monkeypatch, record_property):
    # A prompt's expert mat-muls (T >= GEMM_MIN_TOKENS): on int8 tiles planned on the device
    # (the default) or padded per-expert float16 batches on tensor cores (the moe_mmq option
    # off, and the reference rounds as each does); the experts' loads are uneven (expert 0 takes
    # many rows, some experts none).
    monkeypatch.setattr(cuda.options, "moe_mmq", moe_mmq)
    monkeypatch.setattr(ref, "moe_mmq", moe_mmq)
    E, N, K, T, k = 8, 96, 512, 40, 3
    gf = weights(tmp_path, rng, {"w": (qtype, (E, N, K))})
    ids = np.stack([rng.choice(E - 2, k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[:20, 0] = 0
    x = rng.uniform(-1, 1, (T, k, K) if per_slot else (T, K)).astype(F32)
    got = cuda.to_numpy(cuda.matmul_id(cuda.asarray(x), cuda.weight(gf, "w"), cuda.asarray(ids)))
    check(got, ref.matmul_id(x, ref.weight(gf, "w"), ids), MATMUL, record_property)


def test_matmul_id_bad_expert_gives_nan(cuda, rng, tmp_path):
    gf = weights(tmp_path, rng, {"w": (GGMLType.Q8_0, (4, 8, 64))})
    ids = np.array([[1, 4]], np.int32)          # 4 is out of range for 4 experts
    x = rng.uniform(-1, 1, (1, 64)).astype(F32)
    y = cuda.to_numpy(cuda.matmul_id(cuda.asarray(x), cuda.weight(gf, "w"), cuda.asarray(ids)))
    assert np.isfinite(y[0, 0]).all() and np.isnan(y[0, 1]).all()
    # The same on the prompt path (T >= GEMM_MIN_TOKENS).
    ids = np.tile(np.array([[1, 4]], np.int32), (40, 1))
    x = rng.uniform(-1, 1, (40, 64)).astype(F32)
    y = cuda.to_numpy(cuda.matmul_id(cuda.asarray(x), cuda.weight(gf, "w"), cuda.asarray(ids)))
    assert np.isfinite(y[:, 0]).all() and np.isnan(y[:, 1]).all()


# ---- embedding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=tname)
def test_embed_bit_exact(cuda, ref, rng, tmp_path, qtype, record_property):
    n_vocab, D = 300, 512
    gf = weights(tmp_path, rng, {"tok": (qtype, (n_vocab, D))})
    ids = np.concatenate([rng.integers(0, n_vocab, 9), [0, n_vocab - 1, 5, 5]]).astype(np.int32)
    got = cuda.to_numpy(cuda.embed(cuda.weight(gf, "tok"), cuda.asarray(ids)))
    want = ref.embed(ref.weight(gf, "tok"), ids)
    check(got, want, EXACT, record_property)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "not bit-identical"


def test_embed_bad_id_gives_nan(cuda, rng, tmp_path):
    gf = weights(tmp_path, rng, {"tok": (GGMLType.Q4_K, (10, 256))})
    y = cuda.to_numpy(cuda.embed(cuda.weight(gf, "tok"), cuda.asarray(np.array([3, 10, -1], np.int32))))
    assert np.isfinite(y[0]).all() and np.isnan(y[1:]).all()


# ---- norms and elementwise ------------------------------------------------------------------------

@pytest.mark.parametrize("shape,with_weight", [((1, 576), True), ((7, 4096), True), ((5, 8, 128), True),
                                               ((3, 2048), False)], ids=str)
def test_rms_norm(cuda, ref, rng, tmp_path, shape, with_weight, record_property):
    D = shape[-1]
    gf = weights(tmp_path, rng, {"norm": (GGMLType.F32, (D,))})
    x = (rng.uniform(-1, 1, shape) * rng.uniform(0.1, 10)).astype(F32)
    wc = cuda.weight(gf, "norm") if with_weight else None
    wr = ref.weight(gf, "norm") if with_weight else None
    got = cuda.to_numpy(cuda.rms_norm(cuda.asarray(x), wc, 1e-6))
    check(got, ref.rms_norm(x, wr, 1e-6), RMS_NORM, record_property)


def test_add_mul_scale_bit_exact(cuda, ref, rng, tmp_path, record_property):
    T, D = 6, 1000
    gf = weights(tmp_path, rng, {"bias": (GGMLType.F32, (D,))})
    a, b = (rng.uniform(-1, 1, (T, D)).astype(F32) for _ in range(2))
    row = rng.uniform(-1, 1, D).astype(F32)
    A, B, ROW = cuda.asarray(a), cuda.asarray(b), cuda.asarray(row)
    cases = {
        "add": (cuda.add(A, B), ref.add(a, b)),
        "add bias weight": (cuda.add(A, cuda.weight(gf, "bias")), ref.add(a, ref.weight(gf, "bias"))),
        "add row": (cuda.add(A, ROW), ref.add(a, row)),
        "mul": (cuda.mul(A, B), ref.mul(a, b)),
        "mul row": (cuda.mul(A, ROW), ref.mul(a, row)),
    }
    s = float(rng.uniform(0.1, 3))
    cases["scale"] = (cuda.scale(A, s), ref.scale(a, s))
    for what, (got, want) in cases.items():
        check(cuda.to_numpy(got), want, EXACT, record_property, what)


def test_graph_with_pdl_waits_for_each_kernel(rng):
    """In a captured graph the kernels are launched with programmatic dependent launch (on
    sm_90+): kernel n+1 may start while kernel n runs, and reads n's output only because
    PDL_ENTRY waits for it. A chain that alternates a slow kernel on few blocks (rms_norm: one
    block per row of 2^18 values) with a fast one on many (add), so that a kernel that did not
    wait would run while its input is being written, replayed with fresh inputs each time
    (a stale read would see the last replay's values), must equal the same chain run eagerly
    (the same kernels one after another: bit for bit). Outputs are not poisoned: a fill
    between two kernels would serialise them and hide a missing wait."""
    from brass.backends.cuda import CudaBackend
    cuda = CudaBackend()
    if cuda.cc >= 90:
        assert cuda.pdl, "the H100/H200 class launches graph kernels with PDL"
    shape = (4, 1 << 18)
    X = cuda.asarray(rng.uniform(-1, 1, shape).astype(F32))
    Y = cuda.asarray(rng.uniform(-1, 1, shape).astype(F32))

    def chain():
        v = X
        for i in range(24):
            v = cuda.add(v, Y) if i % 2 else cuda.rms_norm(v, None, 1e-6)
        return v

    graph = cuda.capture(chain)
    for r in range(4):
        with cuda.stream:                   # queued before the replay, on its stream
            X[...] = cuda.asarray(rng.uniform(-1, 1, shape).astype(F32))
        graph.replay()
        got = cuda.to_numpy(graph.result)
        want = cuda.to_numpy(chain())
        bad = int(np.count_nonzero(got != want))
        assert bad == 0, f"replay {r}: {bad} of {got.size} values differ from the eager chain's (a kernel read its input early)"


@pytest.mark.parametrize("op,bound", [("swiglu", TRANSCENDENTAL), ("geglu", F16_ROUNDED)])
def test_glu(cuda, ref, rng, op, bound, record_property):
    # Gates up to +-12 also reach GELU's identity/zero regions beyond +-10.
    g = rng.uniform(-12, 12, (5, 3000)).astype(F32)
    u = rng.uniform(-1, 1, (5, 3000)).astype(F32)
    got = cuda.to_numpy(getattr(cuda, op)(cuda.asarray(g), cuda.asarray(u)))
    check(got, getattr(ref, op)(g, u), bound, record_property)


def test_weighted_sum_bit_exact(cuda, ref, rng, record_property):
    y = rng.uniform(-1, 1, (4, 8, 777)).astype(F32)
    w = rng.uniform(0, 1, (4, 8)).astype(F32)
    got = cuda.to_numpy(cuda.weighted_sum(cuda.asarray(y), cuda.asarray(w)))
    check(got, ref.weighted_sum(y, w), EXACT, record_property)


def test_take_rows(cuda, rng):
    x = rng.uniform(-1, 1, (9, 33)).astype(F32)
    rows = np.array([8, 0, 3], np.int32)
    assert np.array_equal(cuda.to_numpy(cuda.take_rows(cuda.asarray(x), cuda.asarray(rows))), x[rows])


# ---- rope --------------------------------------------------------------------------------------

@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("head_dim,n_rot,base,freq_scale", [(64, 64, 10000.0, 1.0), (128, 128, 1e6, 1.0),
                                                            (128, 64, 10000.0, 0.25), (256, 256, 1e4, 1.0)],
                         ids=["d64", "d128-base1e6", "d128-partial-rot64-fs0.25", "d256"])
def test_rope(cuda, ref, rng, neox, head_dim, n_rot, base, freq_scale, record_property):
    T, H = 9, 4
    x = rng.uniform(-1, 1, (T, H, head_dim)).astype(F32)
    pos = np.sort(rng.integers(0, 8192, T)).astype(np.int32)
    got = cuda.to_numpy(cuda.rope(cuda.asarray(x), cuda.asarray(pos), n_rot, base, neox, freq_scale))
    want = ref.rope(x, pos, n_rot, base, neox, freq_scale)
    check(got, want, TRANSCENDENTAL, record_property)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:]), "dims past n_rot must pass through"


# ---- KV cache and attention ------------------------------------------------------------------------

# (T queries, past tokens already cached, H, H_kv, head_dim, window, scale or None = 1/sqrt(Dh))
ATTENTION_CASES = [
    (1, 100, 8, 2, 64, 0, None),          # decode, GQA 4:1
    (1, 37, 4, 4, 128, 0, None),          # decode, no GQA
    (17, 0, 8, 4, 64, 0, None),           # prefill from an empty cache: causal within the block
    (9, 20, 16, 2, 128, 0, None),         # prefill after a past, GQA 8:1
    (12, 40, 4, 1, 256, 16, 1.0),         # sliding window, head dim 256, logits up to ~+-30
    (1, 300, 8, 2, 128, 64, None),        # decode with a window
    (40, 300, 8, 2, 128, 0, None),        # a prompt after a long past: query tiles, several key chunks
    (33, 500, 4, 2, 64, 128, None),       # the same with a window, a partial last tile
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "T%d-past%d-H%d-kv%d-d%d-w%d" % c[:6])
def test_kv_store_and_attention(cuda, ref, rng, case, record_property):
    kv_store_and_attention(cuda, ref, rng, case, record_property)


# ---- router and sampling ---------------------------------------------------------------------------

def test_softmax(cuda, ref, rng, record_property):
    x = rng.uniform(-8, 8, (7, 128)).astype(F32)
    check(cuda.to_numpy(cuda.softmax(cuda.asarray(x))), ref.softmax(x), TRANSCENDENTAL, record_property)


@pytest.mark.parametrize("n_cols,k", [(8, 2), (64, 8), (128, 8), (256, 8)])
def test_topk_exact(cuda, ref, rng, n_cols, k, record_property):
    # Values on a coarse grid, so that ties occur and must go to the lower index.
    x = (rng.integers(0, 12, (6, n_cols)) / 12).astype(F32)
    ids, vals = cuda.topk(cuda.asarray(x), k)
    want_ids, want_vals = ref.topk(x, k)
    assert np.array_equal(cuda.to_numpy(ids), want_ids)
    assert np.array_equal(cuda.to_numpy(vals), want_vals)
    record_property("nmse", "exact")


@pytest.mark.parametrize("n_cols", [151936, 5000, 8193 * 4], ids=str)
def test_argmax_exact(cuda, ref, rng, n_cols, record_property):
    # Long rows go through many blocks and a final pick, short ones one block.
    x = rng.uniform(-5, 5, (4, n_cols)).astype(F32)
    x[1, [17, n_cols - 1 - 17]] = 100.0       # a tie in different blocks: the first index wins
    x[2, -1] = 100.0                          # the last column
    x[3, [4000, 4001]] = 100.0                # a tie inside one block's run
    assert np.array_equal(cuda.to_numpy(cuda.argmax(cuda.asarray(x))), ref.argmax(x))
    record_property("nmse", "exact")


# ---- errors on bad input ------------------------------------------------------------------------------

def test_bad_input_raises_brass_errors(cuda, rng, tmp_path):
    gf = weights(tmp_path, rng, {"w": (GGMLType.Q4_K, (8, 256)), "e": (GGMLType.Q8_0, (2, 8, 64))})
    w = cuda.weight(gf, "w")
    x = cuda.asarray(rng.uniform(-1, 1, (2, 512)).astype(F32))
    with pytest.raises(BrassError, match="512 features"):
        cuda.matmul(x, w)
    with pytest.raises(BrassError, match="float32"):
        cuda.matmul(x.astype(F16), w)
    with pytest.raises(BrassError, match="ids must be"):
        cuda.matmul_id(cuda.asarray(np.zeros((2, 64), F32) + 1), cuda.weight(gf, "e"), cuda.asarray(np.zeros(2, np.int32)))
    with pytest.raises(BrassError, match="n_rot"):
        cuda.rope(cuda.asarray(np.ones((1, 2, 8), F32)), cuda.asarray(np.zeros(1, np.int32)), 3, 1e4, False)
    with pytest.raises(BrassError, match="k = 9"):
        cuda.topk(cuda.asarray(np.ones((1, 8), F32)), 9)
    from conformance.harness.attn_host import device_sequence
    kc, vc = device_sequence(cuda, np.random.default_rng(0), np.zeros((4, 2, 8), F16), np.zeros((4, 2, 8), F16))
    with pytest.raises(BrassError, match="does not fit"):
        cuda.attention(cuda.asarray(np.ones((1, 3, 8), F32)), kc, vc, cuda.asarray(np.zeros(1, np.int32)), 1.0)
    with pytest.raises(BrassError, match="block pool"):      # a contiguous array is no cache here
        cuda.attention(cuda.asarray(np.ones((1, 2, 8), F32)), cuda.zeros((4, 2, 8), F16),
                       cuda.zeros((4, 2, 8), F16), cuda.asarray(np.zeros(1, np.int32)), 1.0)


def test_unsupported_weight_type(cuda, tmp_path):
    raw = np.zeros(BLOCK_SIZES[GGMLType.Q2_K][1], np.uint8)
    gf = GGUFFile(write_gguf(tmp_path / "q2k.gguf", {"w": (GGMLType.Q2_K, (1, 256), raw)}))
    with pytest.raises(UnsupportedError, match="Q2_K"):
        cuda.weight(gf, "w")


# ---- plumbing that needs a device ---------------------------------------------------------------------

def _run_python(code: str, env_extra: dict, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)


def test_debug_mode_names_the_failing_kernel():
    # A kernel that faults (a write to an unmapped address) poisons the CUDA context, so this
    # runs in its own process. With BRASS_CUDA_DEBUG=1 the fault surfaces at the launch that
    # caused it, as a CudaError naming that kernel.
    r = _run_python("""
        import cupy, numpy as np
        from brass.backends.cuda import CudaBackend
        from brass.backends.cuda.errors import CudaError
        from brass.backends.cuda.params import pack
        b = CudaBackend()
        assert b.options.debug
        x = cupy.ones(1 << 20, np.float32)
        bad = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0x10, 4, None), 0)
        try:
            b.launch("elementwise.cu", "scale", 4096, 256, x, bad, params=pack("ScaleParams", n=x.size, s=2.0))
        except CudaError as e:
            print("CAUGHT", e)
    """, {"BRASS_CUDA_DEBUG": "1"})
    assert "CAUGHT kernel scale (kernels/elementwise.cu) failed" in r.stdout, r.stdout + r.stderr


def test_weight_upload_streams_with_bounded_host_memory(tmp_path, record_property):
    # A 2.1 GiB file of weights: holding it in host memory would break the 1.5 GB bound. Peak
    # RSS (VmHWM) is measured in a fresh process, after CUDA is initialised, around the load.
    # The slowest test here (~10 s, most of it writing the file); GPU runner only.
    n_tensors, rows, K = 32, 4096, 16384          # 32 x 68 MiB of Q8_0
    tsize = BLOCK_SIZES[GGMLType.Q8_0][1]
    row_bytes = K // 32 * tsize
    rng = np.random.default_rng(0)
    raw = quants.random_blocks(GGMLType.Q8_0, rows, K, rng)
    path = write_gguf(tmp_path / "big.gguf",
                      {f"blk.{i}.w": (GGMLType.Q8_0, (rows, K), raw) for i in range(n_tensors)})
    total = n_tensors * rows * row_bytes
    r = _run_python(f"""
        import numpy as np
        from brass.backends.cuda import CudaBackend
        from brass.gguf import GGUFFile
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        b = CudaBackend()
        b.zeros(1).sum()                       # CUDA context and CuPy kernels up
        base = status("VmRSS:")
        gf = GGUFFile({str(path)!r})
        ws = {{}}
        b.load(gf, lambda name: ws.setdefault(name, b.weight(gf, name)), quiet=True)
        peak = status("VmHWM:")
        first = b.to_numpy(ws["blk.0.w"].data[:4096])
        last = b.to_numpy(ws["blk.{n_tensors - 1}.w"].data[-4096:])
        ok = bool(np.array_equal(first, gf.tensor_bytes("blk.0.w")[:4096])
                  and np.array_equal(last, gf.tensor_bytes("blk.{n_tensors - 1}.w")[-4096:]))
        print("RESULT", base, peak, ok)
    """, {})
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stdout + r.stderr
    _, base, peak, ok = line[0].split()
    growth = int(peak) - int(base)
    record_property("measured", f"{total / 2**30:.2f} GiB uploaded, peak RSS +{growth / 2**20:.0f} MiB")
    assert ok == "True", "the bytes on the device differ from the file"
    assert growth < 1.5 * 2**30, f"peak RSS grew by {growth / 2**30:.2f} GiB while uploading"


# ---- fused ops: each against the composition of ops it replaces (engine/backends/base.py) --------

def q8_blocks(cuda, blocks, rows):
    """Device Q8_1 blocks [rows, nb*36] → (d, s, qs) as quants.quantize_q8_1_cuda returns them."""
    raw = cuda.to_numpy(blocks).reshape(rows, -1, 36)
    return (raw[..., 0:2].copy().view("<f2")[..., 0], raw[..., 2:4].copy().view("<f2")[..., 0],
            raw[..., 4:].view(np.int8).reshape(rows, -1))


def assert_q8_of(cuda, x, what):
    """The Q8_1 blocks the producer kernel wrote beside x equal quantize_q8_1(x), bit for bit."""
    from brass.backends.cuda import quantize
    blocks = quantize.blocks_of(cuda, x)
    assert blocks is not None, f"{what}: no Q8_1 blocks were written beside the output"
    xs = cuda.to_numpy(x).reshape(-1, x.shape[-1])
    d, s, qs = q8_blocks(cuda, blocks, xs.shape[0])
    want = quants.quantize_q8_1_cuda(xs)
    assert np.array_equal(d, want.d) and np.array_equal(s, want.s) and np.array_equal(qs, want.qs), \
        f"{what}: its Q8_1 blocks differ from the quantize kernel's"


@pytest.mark.parametrize("shape,residual,scaled", [((1, 1024), True, False), ((5, 576), True, False),
                                                   ((3, 2048), False, False), ((2, 200), True, False),
                                                   ((4, 2816), True, True), ((1, 256), False, True)], ids=str)
def test_add_rms_norm(cuda, ref, rng, tmp_path, shape, residual, scaled, record_property):
    # scaled: the sum times one value before the norm (gemma4's layer_output_scale)
    D = shape[-1]
    gf = weights(tmp_path, rng, {"norm": (GGMLType.F32, (D,)), "scale": (GGMLType.F32, (1,))})
    a, b = (rng.uniform(-1, 1, shape).astype(F32) * rng.uniform(0.1, 10) for _ in range(2))
    s_got, y_got = cuda.add_rms_norm(cuda.asarray(a), cuda.asarray(b) if residual else None,
                                     cuda.weight(gf, "norm"), 1e-6,
                                     scale=cuda.weight(gf, "scale") if scaled else None)
    s_want, y_want = ref.add_rms_norm(a, b if residual else None, ref.weight(gf, "norm"), 1e-6,
                                      scale=ref.weight(gf, "scale") if scaled else None)
    check(cuda.to_numpy(s_got), s_want, EXACT, record_property, "sum")
    check(cuda.to_numpy(y_got), y_want, RMS_NORM, record_property, "norm")
    if D % 32 == 0:
        assert_q8_of(cuda, y_got, "add_rms_norm")


@pytest.mark.parametrize("shape", [(1, 2816), (6, 256), (2, 200)], ids=str)
def test_moe_norms(cuda, ref, rng, tmp_path, shape, record_property):
    # gemma4's experts' norm and router input norm of one residual, in one kernel
    D = shape[-1]
    gf = weights(tmp_path, rng, {"norm": (GGMLType.F32, (D,)), "router": (GGMLType.F32, (D,))})
    x = rng.uniform(-1, 1, shape).astype(F32) * rng.uniform(0.1, 50)
    factor = float(np.float32(1) / np.sqrt(np.float32(D)))
    h_got, r_got = cuda.moe_norms(cuda.asarray(x), cuda.weight(gf, "norm"), cuda.weight(gf, "router"), factor, 1e-6)
    h_want, r_want = ref.moe_norms(x, ref.weight(gf, "norm"), ref.weight(gf, "router"), factor, 1e-6)
    check(cuda.to_numpy(h_got), h_want, RMS_NORM, record_property, "experts' norm")
    check(cuda.to_numpy(r_got), r_want, RMS_NORM, record_property, "router input")
    if D % 32 == 0:
        assert_q8_of(cuda, h_got, "moe_norms")


@pytest.mark.parametrize("types", [(GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q6_K),
                                   (GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.F16),
                                   (GGMLType.BF16, GGMLType.BF16, GGMLType.BF16)], ids=str)
def test_matmul_many_decode(cuda, ref, rng, tmp_path, types, record_property):
    K = 1024
    shapes = [(2048, K), (511, K), (513, K)]       # rows that end mid-warp and mid-block
    gf = weights(tmp_path, rng, {f"w{i}": (t, s) for i, (t, s) in enumerate(zip(types, shapes))})
    x = rng.uniform(-1, 1, (1, K)).astype(F32)
    got = cuda.matmul_many(cuda.asarray(x), [cuda.weight(gf, f"w{i}") for i in range(3)])
    want = ref.matmul_many(x, [ref.weight(gf, f"w{i}") for i in range(3)])
    for i, (g, w_) in enumerate(zip(got, want)):
        check(cuda.to_numpy(g), w_, MATMUL, record_property, f"matrix {i} ({tname(types[i])})")


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_rope_store(cuda, ref, rng, tmp_path, qk_norm, neox, record_property):
    T, H, Hkv, Dh, past, n_rot = 5, 8, 2, 128, 7, 128
    gf = weights(tmp_path, rng, {"qn": (GGMLType.F32, (Dh,)), "kn": (GGMLType.F32, (Dh,))})
    q, k, v = (rng.uniform(-1, 1, (T, n, Dh)).astype(F32) for n in (H, Hkv, Hkv))
    pos = np.arange(past, past + T, dtype=np.int32)
    cap = past + T + 3
    kw = dict(eps=1e-6, n_rot=n_rot, base=1e6, neox=neox, freq_scale=1.0)
    norms = lambda be: dict(q_norm=be.weight(gf, "qn") if qk_norm else None,     # noqa: E731
                            k_norm=be.weight(gf, "kn") if qk_norm else None)
    caches_ref = [np.full((cap, Hkv, Dh), np.nan, F16) for _ in range(2)]
    qr, kr = ref.rope_store(q, k, v, pos, *caches_ref, **norms(ref), **kw)
    from conformance.harness.attn_host import device_sequence, read_back
    dev = device_sequence(cuda, rng, *(np.full((cap, Hkv, Dh), np.nan, F16) for _ in range(2)))
    Q, K_, V, P = cuda.asarray(q), cuda.asarray(k), cuda.asarray(v), cuda.asarray(pos)
    qg, kg = cuda.rope_store(Q, K_, V, P, *dev, **norms(cuda), **kw)
    check(cuda.to_numpy(qg), qr, TRANSCENDENTAL, record_property, "q")
    check(cuda.to_numpy(kg), kr, TRANSCENDENTAL, record_property, "k")
    for got_c, want_c, what in zip(dev, caches_ref, ("k cache", "v cache")):
        got_c = read_back(cuda, got_c)
        assert np.isnan(got_c[:past]).all() and np.isnan(got_c[past + T:]).all(), f"{what}: written outside pos"
        check(got_c[past:past + T].astype(F32), want_c[past:past + T].astype(F32), F16_ROUNDED,
              record_property, what)
    # Fusion changes no number: the same as the CUDA backend's own unfused ops, bit for bit.
    un = device_sequence(cuda, rng, *(np.full((cap, Hkv, Dh), np.nan, F16) for _ in range(2)))
    qu, ku = Backend.rope_store(cuda, Q, K_, V, P, *un, **norms(cuda), **kw)
    assert np.array_equal(cuda.to_numpy(qu), cuda.to_numpy(qg)), "fused q differs from rms_norm + rope"
    assert np.array_equal(cuda.to_numpy(ku), cuda.to_numpy(kg)), "fused k differs from rms_norm + rope"
    for a, b in zip(un, dev):
        assert np.array_equal(read_back(cuda, a).view(np.uint16), read_back(cuda, b).view(np.uint16)), \
            "fused cache writes differ from kv_store"


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.F16), ids=tname)
def test_ffn_glu_decode(cuda, ref, rng, tmp_path, qtype, gelu, record_property):
    N, K = 736, 1024                      # 23 blocks of 32 rows
    gf = weights(tmp_path, rng, {"g": (qtype, (N, K)), "u": (qtype, (N, K))})
    x = rng.uniform(-1, 1, (1, K)).astype(F32)
    got = cuda.ffn_glu(cuda.asarray(x), cuda.weight(gf, "g"), cuda.weight(gf, "u"), gelu)
    want = ref.ffn_glu(x, ref.weight(gf, "g"), ref.weight(gf, "u"), gelu)
    check(cuda.to_numpy(got), want, OP_BOUNDS["ffn_glu_gelu" if gelu else "ffn_glu"], record_property)
    assert_q8_of(cuda, got, "ffn_glu")


@pytest.mark.parametrize("types", [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q5_K, GGMLType.Q6_K)],
                         ids=lambda t: f"{tname(t[0])}+{tname(t[1])}")
@pytest.mark.parametrize("K", [1024, 4096])
def test_mixed_matvec_gives_the_bits_of_two_launches(cuda, rng, tmp_path, types, K, monkeypatch):
    # the mixed_matvec option: q and k of one type, v of another, in one launch (matvec_mixed_)
    # must give what the two launches give, bit for bit; and it must be the launch taken
    ta, tb = types
    gf = weights(tmp_path, rng, {"q": (ta, (2048, K)), "k": (ta, (512, K)), "v": (tb, (520, K))})
    w = [cuda.weight(gf, n) for n in "qkv"]
    x = cuda.asarray((rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32))
    out, launched = {}, record_launches(cuda, monkeypatch)
    for mixed in (True, False):
        monkeypatch.setattr(cuda.options, "mixed_matvec", mixed)
        launched.clear()
        out[mixed] = [cuda.to_numpy(y) for y in cuda.matmul_many(x, w)]
        assert any(n.startswith("matvec_mixed_") for n in launched) == mixed, launched
    for i, (a, b) in enumerate(zip(out[True], out[False])):
        assert not np.isnan(a).any(), f"matrix {i}: rows left unwritten"
        assert np.array_equal(a, b), f"matrix {i}: matvec_mixed_ differs from its own launch"


@pytest.mark.parametrize("K", [1024, 3072, 4096])
def test_coop_q6_k_gives_the_bits_of_matvec_q6_k(cuda, rng, tmp_path, K, monkeypatch):
    # matvec_coop_q6_k (the q6k_coop option, on by default) must give matvec_q6_k's floats bit for
    # bit on the GPU too (the CPU harness cannot see FMA contraction or the real shared memory):
    # three matrices in one launch, the first with more rows than the grid has warps (each warp
    # then takes several rows, the next row's first chunk loaded during the row before); and it
    # must be the launch taken
    rows = {"a": 20000 if K == 1024 else 4000, "b": 300, "c": 37}
    gf = weights(tmp_path, rng, {n: (GGMLType.Q6_K, (r, K)) for n, r in rows.items()})
    w = [cuda.weight(gf, n) for n in rows]
    x = cuda.asarray((rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32))
    out, launched = {}, record_launches(cuda, monkeypatch)
    for coop in (True, False):
        monkeypatch.setattr(cuda.options, "q6k_coop", coop)
        launched.clear()
        out[coop] = [cuda.to_numpy(y) for y in cuda.matmul_many(x, w)]
        assert ("matvec_coop_q6_k" in launched) == coop, launched
    for i, (a, b) in enumerate(zip(out[True], out[False])):
        assert not np.isnan(a).any(), f"matrix {i}: rows left unwritten"
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"matrix {i}: matvec_coop_q6_k differs from matvec_q6_k"


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0), ids=tname)
def test_split_matvec_is_launched_as_its_build_asks(rng, tmp_path, qtype, monkeypatch):
    # matvec_split_<type> (one token, K >= MV_SPLIT_MIN_K) is launched with the threads its
    # module was built for (Kernels.block_threads: the kernel's __launch_bounds__, read from the
    # loaded function), so that a build with another MV_SPLIT_WARPS (kernels/matvec.cuh) needs no
    # other change: the header's build must report the header's values (MV_SPLIT_WARPS, or
    # MV_SPLIT_WARPS_PLAIN for the kinds not preloaded), and builds of 8, 16 and 32 warps (and
    # of 16 for the preloaded kinds only, MV_SPLIT_WARPS_PLAIN=8) must give its outputs bit for
    # bit (Q4_K: the preloading loop; Q6_K, Q8_0 the plain one), every row
    # written (the outputs are poisoned)
    import re

    from brass.backends.cuda import CudaBackend
    from brass.backends.cuda.common import TYPE_NAMES
    from brass.backends.cuda.compiler import define, source_text
    header = define("matvec.cuh", "MV_SPLIT_WARPS")
    plain = re.search(r"#define MV_SPLIT_WARPS_PLAIN (\w+)", source_text("matvec.cuh")).group(1)
    plain = header if plain == "MV_SPLIT_WARPS" else int(plain)
    preloaded = qtype == GGMLType.Q4_K      # (MV_PRELOAD: the kinds MV_SPLIT_WARPS_PLAIN leaves out)
    K = 12288
    kernel = f"matvec_split_{TYPE_NAMES[qtype]}"
    gf = weights(tmp_path, rng, {"a": (qtype, (300, K)), "b": (qtype, (37, K))})
    x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
    builds = {(): header if preloaded else plain, ("-DMV_SPLIT_WARPS=8", "-DMV_SPLIT_WARPS_PLAIN=8"): 8,
              ("-DMV_SPLIT_WARPS=16", "-DMV_SPLIT_WARPS_PLAIN=16"): 16, ("-DMV_SPLIT_WARPS=32", "-DMV_SPLIT_WARPS_PLAIN=32"): 32,
              ("-DMV_SPLIT_WARPS=16", "-DMV_SPLIT_WARPS_PLAIN=8"): 16 if preloaded else 8}
    out = {}
    for defines, warps in builds.items():
        be = CudaBackend(poison_outputs=True)
        be.kernels.options += defines
        launched = record_launches(be, monkeypatch)
        ys = be.matmul_many(be.asarray(x), [be.weight(gf, "a"), be.weight(gf, "b")])
        assert kernel in launched, launched
        assert be.kernels.block_threads("matvec_q.cu", kernel) == 32 * warps, defines
        out[defines] = [be.to_numpy(y) for y in ys]
    for defines, ys in out.items():
        for i, (a, b) in enumerate(zip(ys, out[()])):
            assert not np.isnan(a).any(), f"{defines}, matrix {i}: rows left unwritten"
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{defines}, matrix {i} differs"


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.F16),
                         ids=tname)
def test_gated_kernels_wide_and_not_give_the_same_bits(cuda, rng, tmp_path, qtype, monkeypatch):
    # matvec_glu_wide_ (16 warps x 2 rows, gate and up in one loop) takes the launches of few
    # blocks and matvec_glu_ (8 x 4) the rest (backend: GLU_WIDE_MAX_BLOCKS_PER_SM); the test
    # models' launches are all small, so each kernel is forced here in turn: the same h and Q8_1
    # blocks, dense and over chosen experts, or which one a matrix takes would move numbers
    from brass.backends.cuda import matvec as mv
    E, N, K, k = 8, 736, 1024, 4
    gf = weights(tmp_path, rng, {"g": (qtype, (E, N, K)), "u": (qtype, (E, N, K)),
                                 "g2": (qtype, (N, K)), "u2": (qtype, (N, K))})
    w = {n: cuda.weight(gf, n) for n in ("g", "u", "g2", "u2")}
    x = cuda.asarray(rng.uniform(-1, 1, (1, K)).astype(F32))
    ids = cuda.asarray(rng.choice(E, (1, k), replace=False).astype(np.int32))
    out = {}
    for wide, limit in (("wide", 1 << 20), ("8x4", 0)):
        monkeypatch.setattr(mv, "GLU_WIDE_MAX_BLOCKS_PER_SM", limit)
        h, hq = mv.glu_matvec(cuda, x, w["g2"], w["u2"], False)
        he, hqe = mv.glu_matvec(cuda, x, w["g"], w["u"], False, ids=ids, what="moe_ffn")
        out[wide] = [cuda.to_numpy(a) for a in (h, he) + tuple(q for q in (hq, hqe) if q is not None)]
    for what, a, b in zip(("dense h", "experts' h", "dense Q8_1", "experts' Q8_1"), out["wide"], out["8x4"]):
        if a.dtype == F32:
            assert not np.isnan(a).any(), f"{what}: rows left unwritten"
        assert np.array_equal(a, b), f"{what}: matvec_glu_wide_ differs from matvec_glu_"


# A batched decode step's mat-vecs (matvec_cols_, matvec_glu_cols_) read each weight row once
# for up to MV_COLS tokens; each token must get the very bits the one-token kernels give it
# (a sequence's answer must not depend on which others share its step). K = 1024 and 12288
# stage 8 tokens per block, 28672 three (the staging budget, MV_COLS_STAGE_MAX_K) where the
# one-token kernel reads x from global memory; T = 13 leaves a last block of fewer tokens.
@pytest.mark.parametrize("T", [2, 5, 13])
@pytest.mark.parametrize("K", [1024, 12288, 28672])
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q8_0, GGMLType.Q4_0,
                                   GGMLType.MXFP4, GGMLType.F16, GGMLType.BF16), ids=tname)
def test_batched_mat_vecs_equal_one_token_each(cuda, rng, tmp_path, qtype, K, T):
    if qtype == GGMLType.MXFP4 and K != 1024:
        pytest.skip("one K is enough for MXFP4 (its kernel shares the skeleton)")
    from brass.backends.cuda import quantize
    # float matrices of at most SMALL_FLOAT_ROWS rows take another kernel: "a" is larger
    shapes = {"a": (qtype, (1100, K)), "b": (qtype, (513, K)), "c": (qtype, (96, K)),
              "g": (qtype, (96, K)), "u": (qtype, (96, K))}
    gf = weights(tmp_path, rng, shapes)
    w = {n: cuda.weight(gf, n) for n in shapes}
    x = (rng.uniform(-1, 1, (T, K)) * rng.uniform(0.1, 10, (T, 1))).astype(F32)
    X = cuda.asarray(x)
    with cuda.rows_independent():
        many = [cuda.to_numpy(y) for y in cuda.matmul_many(X, [w["a"], w["b"], w["c"]])]
        h = cuda.ffn_glu(X, w["g"], w["u"])
    hb = quantize.blocks_of(cuda, h)
    h = cuda.to_numpy(h)
    for t in range(T):
        xt = cuda.asarray(x[t:t + 1])
        alone = [cuda.to_numpy(y) for y in cuda.matmul_many(xt, [w["a"], w["b"], w["c"]])]
        for i, (got, want) in enumerate(zip(many, alone)):
            assert np.array_equal(got[t:t + 1], want), \
                f"token {t}, matrix {i}: batched result differs from alone (max |d| {np.abs(got[t] - want[0]).max():.3g})"
        ht = cuda.ffn_glu(xt, w["g"], w["u"])
        assert np.array_equal(h[t:t + 1], cuda.to_numpy(ht)), f"token {t}: batched glu differs from alone"
        if hb is not None:
            assert np.array_equal(cuda.to_numpy(hb)[t], cuda.to_numpy(quantize.blocks_of(cuda, ht))[0]), \
                f"token {t}: batched glu's Q8_1 blocks differ from alone"


@pytest.mark.parametrize("E,k,norm,scale", [(8, 2, True, 1.0), (128, 8, True, 1.0), (64, 6, False, 2.5)])
def test_moe_route(cuda, ref, rng, E, k, norm, scale, record_property):
    x = rng.uniform(-4, 4, (5, E)).astype(F32)
    x[0, 3] = x[0, 5] = 9.0                  # a tie: the lower expert first
    got = cuda.moe_route(cuda.asarray(x), k, norm, scale)
    want = ref.moe_route(x, k, norm, scale)
    check(cuda.to_numpy(got[0]), want[0], TRANSCENDENTAL, record_property, "probs")
    assert np.array_equal(cuda.to_numpy(got[1]), want[1]), "expert ids differ"
    check(cuda.to_numpy(got[2]), np.asarray(want[2]), TRANSCENDENTAL, record_property, "weights")


@pytest.mark.parametrize("types", [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.MXFP4, GGMLType.MXFP4),
                                   (GGMLType.Q8_0, GGMLType.Q5_0)], ids=str)
def test_moe_ffn_decode(cuda, ref, rng, tmp_path, types, record_property):
    from brass.backends.cuda import matvec
    E, N, D, k = 16, 256, 512, 4
    gu, dn = types
    gf = weights(tmp_path, rng, {"g": (gu, (E, N, D)), "u": (gu, (E, N, D)), "d": (dn, (E, D, N))})
    x = rng.uniform(-1, 1, (1, D)).astype(F32)
    ids = rng.choice(E, (1, k), replace=False).astype(np.int32)
    wts = rng.uniform(0, 1, (1, k)).astype(F32)
    cw, rw = [cuda.weight(gf, n) for n in "gud"], [ref.weight(gf, n) for n in "gud"]
    got = cuda.moe_ffn(cuda.asarray(x), *cw, cuda.asarray(ids), cuda.asarray(wts))
    # In two stages, each as tight as its arithmetic allows. The fused op re-quantizes its
    # intermediate h (the gated experts' outputs) to Q8_1 for the down projection: an h within
    # float32 rounding of a quantization boundary rounds to the neighbouring quant on one side
    # only, moving the output by a whole quant step (seen once on the H200: NMSE 1.2e-8 against
    # the end-to-end bound of 1e-8, Q8_0/Q5_0). So: (1) the kernel's h against the reference's
    # h (mat-vecs and SiLU: no re-quantization yet); (2) the output against the reference's
    # down projection of the kernel's own h (the same Q8_1 blocks on both sides: only sum order).
    h, _ = matvec.glu_matvec(cuda, cuda.asarray(x), cw[0], cw[1], False, ids=cuda.asarray(ids), what="moe_ffn")
    h = cuda.to_numpy(h).reshape(1, k, N)
    want_h = ref.swiglu(ref.matmul_id(x, rw[0], ids), ref.matmul_id(x, rw[1], ids))
    check(h, want_h, OP_BOUNDS["ffn_glu"], record_property, "h")
    want = ref.weighted_sum(ref.matmul_id(h, rw[2], ids), wts)
    check(cuda.to_numpy(got), want, MATMUL, record_property)


@pytest.mark.parametrize("types", [(GGMLType.Q4_K, GGMLType.Q5_0), (GGMLType.Q8_0, GGMLType.Q6_K)], ids=str)
def test_moe_ffn_decode_gate_up_in_one_tensor(cuda, ref, rng, tmp_path, types, monkeypatch, record_property):
    """Gemma 4's experts (its fused_experts option): gate and up in one [E, 2F, D] tensor, GELU,
    a factor per expert on the down projection's output. As test_moe_ffn_decode, in two
    stages: the kernel's h against the reference's, the output against Backend.moe_ffn's
    composition on the reference from the kernel's own h; and the fused op really ran."""
    from brass.backends.cuda import matvec
    E, F, D, k = 16, 256, 512, 4
    gu, dn = types
    gf = weights(tmp_path, rng, {"gu": (gu, (E, 2 * F, D)), "d": (dn, (E, D, F)), "s": (GGMLType.F32, (E,))})
    x = rng.uniform(-1, 1, (1, D)).astype(F32)
    ids = rng.choice(E, (1, k), replace=False).astype(np.int32)
    wts = rng.uniform(0, 1, (1, k)).astype(F32)
    cw = {n: cuda.weight(gf, n) for n in ("gu", "d", "s")}
    rw = {n: ref.weight(gf, n) for n in ("gu", "d", "s")}
    launched = record_launches(cuda, monkeypatch)
    got = cuda.moe_ffn(cuda.asarray(x), cw["gu"], None, cw["d"], cuda.asarray(ids), cuda.asarray(wts),
                       gelu=True, down_scale=cw["s"])
    assert any(n.startswith("matvec_moe_down_") for n in launched), launched
    h, _ = matvec.glu_matvec(cuda, cuda.asarray(x), cw["gu"], None, True, ids=cuda.asarray(ids), what="moe_ffn")
    h = cuda.to_numpy(h).reshape(1, k, F)
    gate_up = ref.matmul_id(x, rw["gu"], ids)
    check(h, ref.geglu(gate_up[..., :F], gate_up[..., F:]), OP_BOUNDS["ffn_glu_gelu"], record_property, "h")
    want = ref.weighted_sum(ref.mul_expert_scale(ref.matmul_id(h, rw["d"], ids), rw["s"], ids), wts)
    check(cuda.to_numpy(got), want, MATMUL, record_property)


def test_attention_writes_q8_of_its_output(cuda, rng):
    T, H, Hkv, Dh, cap = 3, 4, 2, 64, 16
    from conformance.harness.attn_host import device_sequence
    cache = device_sequence(cuda, rng, *(rng.uniform(-1, 1, (cap, Hkv, Dh)).astype(F16) for _ in range(2)))
    q = cuda.asarray(rng.uniform(-1, 1, (T, H, Dh)).astype(F32))
    out = cuda.attention(q, *cache, cuda.asarray(np.array([4, 5, 6], np.int32)), 0.125)
    assert_q8_of(cuda, out, "attention")


@pytest.mark.parametrize("C", [151936, 5000], ids=["head-two-stage", "one-block"])
@pytest.mark.parametrize("start", [5, 15], ids=["history-written", "history-full"])
def test_argmax_advance_gives_the_token_position_and_history(cuda, rng, C, start):
    # the greedy advance on the device (argmax, then decode_advance): the token, the position,
    # the history and the ids, the first of two equal maxima chosen, nothing written past the
    # history's end; an output head's row (two-stage argmax) and a row of one block
    cap = 16
    x = rng.uniform(-3, 3, (1, C)).astype(F32)
    best = rng.choice(C, 2, replace=False)
    x[0, best] = 4.0                              # a tie: the lower index wins
    tok, pos = cuda.asarray(np.array([-1], np.int32)), cuda.asarray(np.array([start], np.int32))
    history = cuda.asarray(np.full(cap, -7, np.int32))
    ids = cuda.argmax(cuda.asarray(x))               # as the decode graph does (model.py)
    cuda.decode_advance(ids, tok, pos, history)
    got = [cuda.to_numpy(a).copy() for a in (ids, tok, pos, history)]
    want_hist = np.full(cap, -7, np.int32)
    if start + 1 < cap:
        want_hist[start + 1] = best.min()
    for name, a, w in zip(("ids", "tok", "pos", "history"), got,
                          ([best.min()], [best.min()], [start + 1], want_hist)):
        assert np.array_equal(a, np.asarray(w, np.int32)), f"{name}: {a}, expected {w}"


# -- gated delta-net ops (hybrid models) ----------------------------------------------------------

@pytest.mark.parametrize("op", ["sigmoid", "softplus", "silu"])
def test_unary(cuda, ref, rng, op, record_property):
    # beyond +-20 too: softplus's identity branch, exp overflow to inf in sigmoid/silu
    x = rng.uniform(-30, 30, (7, 1001)).astype(F32)
    got = cuda.to_numpy(getattr(cuda, op)(cuda.asarray(x)))
    check(got, getattr(ref, op)(x), TRANSCENDENTAL, record_property)


@pytest.mark.parametrize("T", [1, 7, 40, 512])     # 40, 512: several 16-token blocks
def test_ssm_conv_and_its_state(cuda, ref, rng, tmp_path, T, record_property):
    C, K = 300, 4
    gf = weights(tmp_path, rng, {"conv": (GGMLType.F32, (C, K))})
    x = rng.uniform(-1, 1, (T, C)).astype(F32)
    state = rng.uniform(-1, 1, (K - 1, C)).astype(F32)
    want_state = state.copy()
    want = ref.ssm_conv(x, want_state, ref.weight(gf, "conv"))
    dev_state = cuda.asarray(state)
    got = cuda.to_numpy(cuda.ssm_conv(cuda.asarray(x), dev_state, cuda.weight(gf, "conv")))
    check(got, want, EXACT, record_property)
    check(cuda.to_numpy(dev_state), want_state, EXACT, record_property, "state")
    assert not np.array_equal(want_state, state), "the reference did not move the window"


@pytest.mark.parametrize("T,Hk,Hv,D", [(1, 2, 4, 32), (9, 2, 6, 32), (1, 16, 32, 128), (5, 4, 8, 128)])
def test_gated_delta_net(cuda, ref, rng, T, Hk, Hv, D, record_property):
    def unit(a):          # L2-normed q and k, as the layer gives them
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(F32)
    q = unit(rng.standard_normal((T, Hk, D)).astype(F32))
    k = unit(rng.standard_normal((T, Hk, D)).astype(F32))
    v = rng.uniform(-1, 1, (T, Hv, D)).astype(F32)
    g = -rng.uniform(0.01, 2, (T, Hv)).astype(F32)       # softplus(.) * ssm_a <= 0
    beta = rng.uniform(0, 1, (T, Hv)).astype(F32)
    state = rng.uniform(-0.5, 0.5, (Hv, D, D)).astype(F32)
    want_state = state.copy()
    want = ref.gated_delta_net(q, k, v, g, beta, want_state)
    dev_state = cuda.asarray(state)
    got = cuda.gated_delta_net(*(cuda.asarray(a) for a in (q, k, v, g, beta)), dev_state)
    check(cuda.to_numpy(got), want, RECURRENCE, record_property)
    check(cuda.to_numpy(dev_state), want_state, RECURRENCE, record_property, "state")


def test_delta_net_ops_refuse_bad_state(cuda, rng, tmp_path):
    gf = weights(tmp_path, rng, {"conv": (GGMLType.F32, (64, 4))})
    x = cuda.asarray(rng.uniform(-1, 1, (2, 64)).astype(F32))
    with pytest.raises(BrassError, match="state must be"):
        cuda.ssm_conv(x, cuda.asarray(np.zeros((2, 64), F32)), cuda.weight(gf, "conv"))
    q = cuda.asarray(np.ones((1, 2, 48), F32))
    v = cuda.asarray(np.ones((1, 4, 48), F32))
    gb = cuda.asarray(np.ones((1, 4), F32))
    with pytest.raises(UnsupportedError, match="state size 48"):
        cuda.gated_delta_net(q, q, v, gb, gb, cuda.asarray(np.zeros((4, 48, 48), F32)))


@pytest.mark.parametrize("T", [1, 5])
def test_matmul_by_a_vector_weight(cuda, ref, rng, tmp_path, T, record_property):
    """A one-row weight stored as a vector (qwen35moe's ffn_gate_inp_shexp [n_embd]): one
    logit per row, shaped [T] as the numpy backend gives it."""
    # Each output is one dot product of 256 random terms, which can cancel to near zero: an NMSE
    # over T <= 5 such outputs is then the relative error of a tiny number (the H200 suite once
    # saw 6.4e-10 > MATMUL for a sum of 0.0095 out of terms summing to ~64 in magnitude). So
    # each output is held to the float32 summation bound instead, for any order of the sums:
    # |got - want| <= n * 2^-24 * sum_i |x_i w_i| (n = 256: ~1.5e-5 of that magnitude, while
    # one term missing or wrong moves the sum by ~|x_i w_i|, ~1/4 on average, ~1e-2 of it).
    gf = weights(tmp_path, rng, {"gate": (GGMLType.F32, (256,))})
    x = rng.uniform(-1, 1, (T, 256)).astype(F32)
    got = cuda.to_numpy(cuda.matmul(cuda.asarray(x), cuda.weight(gf, "gate")))
    w = ref.weight(gf, "gate")
    want = ref.matmul(x, w)
    assert got.shape == want.shape == (T,), (got.shape, want.shape)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(np.asarray(w.dense(), np.float64).reshape(256))
    err = np.abs(got.astype(np.float64) - want)
    record_property("max_rel_to_magnitude", f"{(err / magnitude).max():.3e}")
    assert (err <= 256 * 2.0 ** -24 * magnitude).all(), (got, want, magnitude)
