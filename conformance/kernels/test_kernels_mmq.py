"""A MoE prompt's expert mat-muls on int8 tensor cores (kernels/mmq.cu: moe_plan then
mmq_id_<type>, the moe_mmq option) against the decode mat-vec kernels and against the numpy q8_1
reference.

mmq_id_<type> forms, per block of 32, the same integer dot products of the same quants as the
mat-vec (matvec_q.cuh) and scales them with the same float32 operations, so against the
mat-vec run row by row (matmul_id under rows_independent: the decode kernels) only the order
of the float32 sum over a row's K/32 blocks differs: bound MMQ_SUM_ORDER (conformance/harness/cases.py).
Against the numpy reference in q8_1 mode (the CUDA kernels' oracle) it is held to MATMUL, as
the mat-vec is. Fresh random inputs (the `rng` fixture; the seed is printed on failure).

Without a GPU the kernel tests skip; what runs everywhere: mmq.cu's own source compiled for
the CPU with g++ (conformance/harness/mmq_host.py: the mma fragments emulated as the PTX ISA lays them out)
against the numpy reference and, in other tile sizes, against the default build; and the
switch's routing in the numpy reference. CI also compiles mmq.cu with NVRTC
(test_nvrtc_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import base, cuda_available
from brass.gguf import GGMLType, GGUFFile
from conformance.harness.kernel_checks import check, record_launches, tname
from conformance.harness.cases import MATMUL, MMQ_SUM_ORDER, cuda_reference, nmse, random_weight_file
from conformance.harness.mmq_host import built  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the MMQ kernel tests run on the GPU runner; "
           "CI compiles mmq.cu in test_nvrtc_compile.py")

F32 = np.float32

# The types of the real and shape-true models first; the others share the kernel template.
MMQ_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_K,
             GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.MXFP4)


def _lib(defines=()):
    from conformance.harness import mmq_host
    return built(mmq_host.build, defines)


# (E, N, K, T, k, x per slot): experts left without a token (E > T * k / 4), tiles of an
# expert partly filled, T * k not a multiple of the 64-slot tile, N not a multiple of 64 rows.
MMQ_ID_CASES = [(GGMLType.Q4_K, (16, 70, 256, 40, 4, False)), (GGMLType.Q6_K, (5, 64, 512, 33, 3, True)),
                (GGMLType.Q8_0, (32, 96, 288, 50, 2, False)), (GGMLType.MXFP4, (4, 40, 256, 70, 2, True)),
                (GGMLType.Q5_K, (8, 130, 256, 36, 8, False)), (GGMLType.Q4_0, (3, 64, 256, 100, 2, False))]
# (the last: ~67 slots per expert, so experts span a full tile and part of another)


def _id_case(tmp_path, rng, qtype, shape):
    E, N, K, T, k, per_slot = shape
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"w": (qtype, (E, N, K))}))
    x = rng.uniform(-1, 1, (T, k, K) if per_slot else (T, K)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[3, 0], ids[5, k - 1] = -1, E + 2          # out of range: NaN rows, as the mat-vecs give
    x.reshape(-1, K)[2, 5] = 3247.0               # issue 9's massive activation (Q8_1 rounds its
    return gf, x, ids                             # block's other values to zero)


def cuda_full(shape, value, dtype):
    import cupy
    return cupy.full(shape, value, dtype)


def _id_want(ref, gf, x, ids):
    E = ref.weight(gf, "w").shape[0]
    bad = (ids < 0) | (ids >= E)
    with ref.rows_independent():                  # the mat-vec's rounding, as MMQ's
        want = ref.matmul_id(x, ref.weight(gf, "w"), np.where(bad, 0, ids))
    return want, bad


@pytest.mark.parametrize("qtype,shape", MMQ_ID_CASES, ids=lambda v: tname(v) if isinstance(v, GGMLType) else "E%d-N%d-K%d-T%d-k%d-%s" % v)
def test_mmq_id_on_the_cpu(rng, tmp_path, qtype, shape, record_property):
    # mmq.cu's moe_plan + mmq_id_<type> on the CPU (conformance/harness/mmq_host.py), against the numpy q8_1
    # reference: the device plan (counts, starts, ranks, tiles), the column mapping of a tile
    # and the NaN rows of out-of-range ids of the real source.
    from conformance.harness import mmq_host
    lib = _lib()
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    E = shape[0]
    got = mmq_host.mmq_id(lib, qtype, gf.tensor_bytes("w").reshape(E * shape[1], -1), x, ids, E)
    want, bad = _id_want(cuda_reference(), gf, x, ids)
    assert np.isnan(got[bad]).all(), "an out-of-range expert id must give NaN rows"
    assert not (got == 1234.5).any(), "elements left unwritten"
    check(got[~bad], want[~bad], MATMUL, record_property, "mmq_id vs numpy q8_1")


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=tname)
def test_mmq_id_every_type_on_the_cpu(rng, tmp_path, qtype, record_property):
    # Every type's unpack and block value: two row tiles with a ragged edge, experts' tiles
    # partly filled, a partial K chunk for the 32-value types (288 = 8 + 1 blocks)
    from conformance.harness import mmq_host
    K = 512 if base.MMQ_BLOCK[int(qtype)] == 256 else 288
    shape = (3, 67, K, 70, 2, False)
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    got = mmq_host.mmq_id(_lib(), qtype, gf.tensor_bytes("w").reshape(3 * 67, -1), x, ids, 3)
    want, bad = _id_want(cuda_reference(), gf, x, ids)
    assert np.isnan(got[bad]).all() and not (got == 1234.5).any()
    check(got[~bad], want[~bad], MATMUL, record_property, "mmq_id vs numpy q8_1")


# Tile sizes ci/gpu_tune_mmq.py times on the GPU (each a #define of kernels/mmq.cu it may
# change): every one must compute what the default does, term for term. (KB 2: the activation
# tile copied word by word, not in 16-byte words.)
MMQ_SIZES = (("MMQ_KB=4",), ("MMQ_KB=2",), ("MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
             ("MMQ_ROWS=32", "MMQ_COLS=64", "MMQ_THREADS=64"))


@pytest.mark.parametrize("defines", MMQ_SIZES + (("MMQ_MIN_BLOCKS=1",),), ids=lambda d: "-".join(x.lower() for x in d))
def test_mmq_sizes_compile(defines):
    # each size builds for sm_90 with NVRTC (as ci/gpu_tune_mmq.py will build it), with the
    # moe_plan and mmq_id kernels the backend looks up (the register cap, MMQ_MIN_BLOCKS, is
    # ptxas's alone: the CPU builds cannot see it)
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="no NVRTC (pip install -e '.[cuda]')")
    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    image = compile_text("mmq.cu", (KERNEL_DIR / "mmq.cu").read_text(), "sm_90",
                         tuple(f"-D{d}" for d in defines), use_cache=False)
    for name in (b"moe_plan", b"mmq_id_q4_k", b"mmq_id_q6_k", b"mmq_id_q8_0"):
        assert name in image, name


@pytest.mark.parametrize("defines", MMQ_SIZES, ids=lambda d: "-".join(x.lower() for x in d))
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0), ids=tname)
def test_mmq_sizes_on_the_cpu(rng, tmp_path, qtype, defines):
    # The sizes on the CPU against the default build, bit for bit: the same integer products
    # and the same float sums in K order per output, whatever the tile (a tile that mixed
    # columns, dropped a partial chunk or misplaced a warp's rows would differ), on skewed
    # routing (~54 slots per expert: a full tile and part of another at 32 columns)
    _mmq_id_equals(rng, tmp_path, qtype, _lib(), _lib(defines), f"{defines}")


@pytest.mark.parametrize("misalign", (4, 8, 12))
def test_mmq_activation_copies_on_the_cpu(rng, tmp_path, misalign):
    # The tile copies a token's chunk of Q8_1 blocks in 16-byte words when x and every row's
    # chunk are 16-byte aligned, else word by word (x `misalign` bytes past a 64-byte boundary):
    # the two bit for bit (K of 768: 24 blocks a row, full chunks)
    lib = _lib()
    _mmq_id_equals(rng, tmp_path, GGMLType.Q4_K, lib, lib, f"x {misalign} bytes off", misalign)


def _mmq_id_equals(rng, tmp_path, qtype, base_lib, lib, what, misalign=0):
    from conformance.harness import mmq_host
    K = 768 if base.MMQ_BLOCK[int(qtype)] == 256 else 288
    E, k = 5, 3
    gf, x, ids = _id_case(tmp_path, rng, qtype, (E, 70, K, 90, k, False))
    raw = gf.tensor_bytes("w").reshape(E * 70, -1)
    want = mmq_host.mmq_id(base_lib, qtype, raw, x, ids, E)
    assert np.isnan(want).sum() == 2 * 70, "the two out-of-range slots' rows only"
    got = mmq_host.mmq_id(lib, qtype, raw, x, ids, E, misalign)
    assert np.array_equal(got, want, equal_nan=True), f"mmq_id with {what} differs from the default"


def test_cpu_builds_of_sizes_do_not_share_their_tiles(rng, tmp_path):
    # Two sizes' CPU builds in one process, the one with the smaller shared-memory tile
    # (MMQ_KB=2) loaded first: each library must keep its own __shared__ arrays (function statics
    # on the host). g++'s unique symbols bound them together across libraries, so an MMQ_KB=8
    # build loaded second wrote past the first's arrays: NaN results, in whichever pytest
    # worker happened to load them in this order. (MMQ_MIN_BLOCKS, nothing on the CPU, makes
    # these builds libraries of their own, loaded here first.)
    small = _lib(("MMQ_KB=2", "MMQ_MIN_BLOCKS=1"))
    large = _lib(("MMQ_KB=8", "MMQ_MIN_BLOCKS=1"))
    _mmq_id_equals(rng, tmp_path, GGMLType.Q6_K, _lib(), small, "MMQ_KB=2")
    _mmq_id_equals(rng, tmp_path, GGMLType.Q6_K, _lib(), large, "MMQ_KB=8, loaded after MMQ_KB=2")


@needs_cuda
@pytest.mark.parametrize("qtype,shape", MMQ_ID_CASES, ids=lambda v: tname(v) if isinstance(v, GGMLType) else "E%d-N%d-K%d-T%d-k%d-%s" % v)
def test_mmq_id(cuda, ref, rng, tmp_path, qtype, shape, monkeypatch, record_property):
    # The same through the backend's matmul_id with its moe_mmq option on (the reference's own
    # moe_mmq follows it), and against the decode kernels (matvec_id: the same integer sums).
    assert cuda.options.moe_mmq and ref.moe_mmq
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    w = cuda.weight(gf, "w")
    X, I = cuda.asarray(x), cuda.asarray(ids)  # noqa: E741 (the name the kernel and the math use)
    launched = record_launches(cuda, monkeypatch)
    # the fixture poisons outputs with NaN: the NaN rows must be the kernel's own, so the
    # output is poisoned with a finite value here instead
    monkeypatch.setattr(cuda, "_out", lambda shape, dtype=F32: cuda_full(shape, 1234.5, dtype))
    got = cuda.to_numpy(cuda.matmul_id(X, w, I))
    assert f"mmq_id_{tname(qtype).lower()}" in launched and "moe_plan" in launched, launched
    want, bad = _id_want(ref, gf, x, ids)
    assert np.isnan(got[bad]).all(), "an out-of-range expert id must give NaN rows"
    assert not (got == 1234.5).any(), "elements left unwritten"
    monkeypatch.undo()
    check(got[~bad], want[~bad], MATMUL, record_property, "mmq_id vs numpy q8_1")
    with cuda.rows_independent():
        dec = cuda.to_numpy(cuda.matmul_id(cuda.asarray(x), w, cuda.asarray(np.where(bad, 0, ids))))
    check(got[~bad], dec[~bad], MMQ_SUM_ORDER, record_property, "mmq_id vs matvec_id")


def test_moe_mmq_option_routes_the_reference(rng, tmp_path):
    # uses_mmq_id: a prompt (GEMM_MIN_TOKENS tokens or more) against experts of a type with an
    # mmq kernel, K a multiple of its block. With its moe_mmq option on (the default, as the
    # CUDA backend's), the q8_1 reference rounds such an expert mat-mul as the mat-vec (Q8_1
    # activations, no float16 rounding); off, as the float16 GEMM.
    assert base.uses_mmq_id(64, 512, GGMLType.Q4_K) and not base.uses_mmq_id(31, 512, GGMLType.Q4_K)
    assert not base.uses_mmq_id(64, 512, GGMLType.F16) and not base.uses_mmq_id(64, 288, GGMLType.Q6_K)
    E, N, K, T, k = 4, 48, 512, 40, 2
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"w": (GGMLType.Q4_K, (E, N, K))}))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    ref = cuda_reference()
    w = ref.weight(gf, "w")
    with ref.rows_independent():
        q8_rows = ref.matmul_id(x, w, ids)
    assert ref.moe_mmq
    assert nmse(ref.matmul_id(x, w, ids), q8_rows) <= MATMUL
    ref.moe_mmq = False
    assert nmse(ref.matmul_id(x, w, ids), q8_rows) > 1e-7      # the float16 GEMM's rounding
