"""The prompt mat-mul on int8 tensor cores (kernels/mmq.cu, BRASS_MMQ=1) against the decode
mat-vec kernels and against the numpy q8_1 reference.

mmq_<type> forms, per block of 32, the same integer dot products of the same quants as the
mat-vec (matvec_q.cuh dot_item) and scales them with the same float32 operations, so against
the mat-vec run row by row (matmul under rows_independent: the decode kernels) only the order
of the float32 sum over a row's K/32 blocks differs: bound MMQ_SUM_ORDER (kernels/cases.py).
Against the numpy reference in q8_1 mode (the CUDA kernels' oracle) it is held to MATMUL, as
the mat-vec is. Fresh random inputs (the `rng` fixture; the seed is printed on failure),
outputs poisoned with NaN before the kernel runs (CudaBackend(poison_outputs=True)).

Shapes: T on either side of the 64-token tile (1, 7, 32, 77, 512), N not a multiple of the
64-row tile, K from one super-block to 4096; for the 32-value block types also a K whose last
chunk of 8 blocks is partial (288 = 8 + 1 blocks).

Without a GPU the kernel tests skip; what runs everywhere: mmq.cu's own source compiled for
the CPU with g++ (ci/mmq_host.py: the mma fragments emulated as the PTX ISA lays them out)
against the numpy reference, and the moe_mmq option's routing in the numpy reference. CI also
compiles mmq.cu with NVRTC (test_nvrtc_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import base, cuda_available
from brass.gguf import GGMLType, GGUFFile
from conformance.test_kernels import check, cuda, record_launches, ref, tname  # noqa: F401  (fixtures)
from conformance.harness.cases import MATMUL, MMQ_SUM_ORDER, cuda_reference, nmse, random_weight_file
from ci.mmq_host import NoHostCompiler  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the MMQ kernel tests run on the GPU runner (ci/gpu.sh mmq); "
           "CI compiles mmq.cu in test_nvrtc_compile.py")

F32 = np.float32

# The types of the real and shape-true models first; the others share the kernel template.
MMQ_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_K,
             GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.MXFP4)
# (N, K, T)
MMQ_SHAPES = ((100, 256, 1), (67, 512, 7), (130, 1024, 32), (257, 4096, 77), (96, 2048, 512))
# K of 9 blocks of 32: one full chunk of 8 and a partial one (32-value block types only).
MMQ_SHAPES_32 = ((45, 288, 40),)
CASES = [(t, s) for t in MMQ_TYPES for s in MMQ_SHAPES] + \
        [(t, s) for t in MMQ_TYPES if base.MMQ_BLOCK[int(t)] == 32 for s in MMQ_SHAPES_32]


def _case(tmp_path, rng, qtype, shape):
    N, K, T = shape
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"w": (qtype, (N, K))}))
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    return gf, x


def _mmq(cuda, gf, x):
    X = cuda.asarray(x)
    w = cuda.weight(gf, "w")
    with cuda.activate():
        y = cuda._out((x.shape[0], w.shape[0]))
        cuda._gemm_mmq(X, w, y)
    return cuda.to_numpy(y), X, w


@needs_cuda
@pytest.mark.parametrize("qtype,shape", CASES, ids=lambda v: tname(v) if isinstance(v, GGMLType) else "N%d-K%d-T%d" % v)
def test_mmq_vs_matvec(cuda, rng, tmp_path, qtype, shape, record_property):
    gf, x = _case(tmp_path, rng, qtype, shape)
    got, X, w = _mmq(cuda, gf, x)
    with cuda.rows_independent():           # every row through the decode mat-vec kernels
        want = cuda.to_numpy(cuda.matmul(X, w))
    check(got, want, MMQ_SUM_ORDER, record_property, "mmq vs mat-vec")


@needs_cuda
@pytest.mark.parametrize("qtype,shape", CASES, ids=lambda v: tname(v) if isinstance(v, GGMLType) else "N%d-K%d-T%d" % v)
def test_mmq_vs_reference(cuda, ref, rng, tmp_path, qtype, shape, record_property):
    gf, x = _case(tmp_path, rng, qtype, shape)
    got, _, _ = _mmq(cuda, gf, x)
    with ref.rows_independent():            # the reference's Q8_1 path for every row count
        want = ref.matmul(x, ref.weight(gf, "w"))
    check(got, want, MATMUL, record_property, "mmq vs numpy q8_1")


@needs_cuda
def test_mmq_extreme_activation(cuda, ref, rng, tmp_path, record_property):
    # issue 9's case: one massive value in a block (3247 among O(1) values) makes Q8_1 round
    # its 31 neighbours to zero; MMQ must do that as the mat-vec and the reference do.
    gf, x = _case(tmp_path, rng, GGMLType.Q4_K, (96, 1024, 40))
    x[3, 70] = 3247.0
    x[17, 512] = -900.0
    got, X, w = _mmq(cuda, gf, x)
    with ref.rows_independent():
        want = ref.matmul(x, ref.weight(gf, "w"))
    check(got, want, MATMUL, record_property, "mmq vs numpy q8_1")
    with cuda.rows_independent():
        want = cuda.to_numpy(cuda.matmul(X, w))
    check(got, want, MMQ_SUM_ORDER, record_property, "mmq vs mat-vec")


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=tname)
def test_mmq_on_the_cpu(rng, tmp_path, qtype, record_property):
    # The kernel source on the CPU (ci/mmq_host.py), against the reference: two row tiles and
    # two token tiles with ragged edges, a partial K chunk for the 32-value types, issue 9's
    # massive activation. Checks everything but the hardware's mma layouts and timing.
    from ci import mmq_host
    try:
        lib = mmq_host.build()
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of mmq.cu: {e}")
    N, K, T = (67, 512, 70) if base.MMQ_BLOCK[int(qtype)] == 256 else (67, 288, 70)
    gf, x = _case(tmp_path, rng, qtype, (N, K, T))
    x[2, 5] = 3247.0
    got = mmq_host.mmq(lib, qtype, gf.tensor_bytes("w").reshape(N, -1), x)
    ref = cuda_reference()
    with ref.rows_independent():
        want = ref.matmul(x, ref.weight(gf, "w"))
    check(got, want, MATMUL, record_property, "mmq (CPU build) vs numpy q8_1")


# -- a prompt's expert mat-muls on the same tiles (mmq_id_<type>, BRASS_MOE_MMQ) ------------------
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
    return gf, x, ids


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
    # mmq.cu's moe_plan + mmq_id_<type> on the CPU (ci/mmq_host.py), against the numpy q8_1
    # reference: the device plan (counts, starts, ranks, tiles), the column mapping of a tile
    # and the NaN rows of out-of-range ids of the real source.
    from ci import mmq_host
    try:
        lib = mmq_host.build()
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of mmq.cu: {e}")
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    E = shape[0]
    got = mmq_host.mmq_id(lib, qtype, gf.tensor_bytes("w").reshape(E * shape[1], -1), x, ids, E)
    want, bad = _id_want(cuda_reference(), gf, x, ids)
    assert np.isnan(got[bad]).all(), "an out-of-range expert id must give NaN rows"
    assert not (got == 1234.5).any(), "elements left unwritten"
    check(got[~bad], want[~bad], MATMUL, record_property, "mmq_id vs numpy q8_1")


# Tile variants ci/gpu_tune_mmq.py times on the GPU (each #define of kernels/mmq.cu it may
# change): every one must compute what the default does, term for term.
# the tile as it was before MMQ_BANKS, MMQ_X_RAW, MMQ_SKIP_PAD and the register cap became the
# default (2026-12-03): the default build is compared with it bit for bit, on every type
BEFORE_BANKS = ("MMQ_BANKS=0", "MMQ_X_RAW=0", "MMQ_SKIP_PAD=0", "MMQ_MIN_BLOCKS=1")
# the weight unpack's loads issued two items at a time, the activation copies as cp.async
UNROLL_ASYNC = ("MMQ_UNPACK_UNROLL=2", "MMQ_X_ASYNC=1")
MMQ_VARIANTS = (("MMQ_KB=4",), ("MMQ_KB=2", "MMQ_PREFETCH=1"),
                ("MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MMQ_ROWS=32", "MMQ_COLS=64", "MMQ_THREADS=64"),
                ("MMQ_PACKED=1",), ("MMQ_PACKED=1", "MMQ_KB=2", "MMQ_PREFETCH=1"),
                ("MMQ_PACKED=1", "MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MMQ_ROWS_FAST=1",), ("MMQ_ROWS_FAST=1", "MMQ_KB=2"),
                ("MMQ_ROWS_FAST=1", "MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MMQ_VEC_LOADS=1",), ("MMQ_VEC_LOADS=1", "MMQ_KB=2"),
                ("MMQ_BANKS=0",), ("MMQ_BANKS=0", "MMQ_KB=2"),
                ("MMQ_BANKS=0", "MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MMQ_X_RAW=0",), ("MMQ_KB=2",),     # (KB 2: X_RAW's word-by-word copy)
                ("MMQ_SKIP_PAD=0",), ("MMQ_MIN_BLOCKS=1",), BEFORE_BANKS,
                ("MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MMQ_X_ASYNC=1",), ("MMQ_UNPACK_UNROLL=2",), UNROLL_ASYNC,
                ("MMQ_UNPACK_UNROLL=4", "MMQ_X_ASYNC=1", "MMQ_MIN_BLOCKS=4"),
                ("MMQ_UNPACK_UNROLL=2", "MMQ_X_ASYNC=1", "MMQ_KB=4"),
                ("MMQ_UNPACK_UNROLL=2", "MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
                ("MV_Q4K_SEL=0",))      # Q4_K's scale and min by a branch (matvec_q.cuh, shared)


@pytest.mark.parametrize("defines", MMQ_VARIANTS, ids=lambda d: "-".join(x.lower() for x in d))
def test_mmq_variants_compile(defines):
    # each variant builds for sm_90 with NVRTC (as ci/gpu_tune_mmq.py will build it), with
    # the moe_plan and the mmq / mmq_id kernels the backend looks up
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="no NVRTC (pip install -e '.[cuda]')")
    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    image = compile_text("mmq.cu", (KERNEL_DIR / "mmq.cu").read_text(), "sm_90",
                         tuple(f"-D{d}" for d in defines), use_cache=False)
    for name in (b"moe_plan", b"mmq_id_q4_k", b"mmq_id_q6_k", b"mmq_q8_0"):
        assert name in image, name


@pytest.mark.parametrize("defines", MMQ_VARIANTS, ids=lambda d: "-".join(x.lower() for x in d))
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0), ids=tname)
def test_mmq_variants_on_the_cpu(rng, tmp_path, qtype, defines):
    # The variants on the CPU against the default build, bit for bit: the same integer products
    # and the same float sums in K order per output, whatever the tile (a variant that mixed
    # columns, dropped a partial chunk or misplaced a warp's rows would differ). Both kernels:
    # mmq on ragged tiles, moe_plan + mmq_id on skewed routing.
    _variant_equals_default(rng, tmp_path, qtype, defines)


@pytest.mark.parametrize("qtype", [t for t in MMQ_TYPES if t not in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)],
                         ids=tname)
def test_mmq_banks_on_the_cpu_every_type(rng, tmp_path, qtype):
    # MMQ_BANKS (on by default) stores only the factors each type's block value reads (Q4_0 /
    # Q5_0 / Q4_1 / Q5_1 the activation half sum, the K-quants the quants' sum, Q6_K its
    # scales), and MMQ_X_RAW takes s from the raw block and the quants' sum from an mma: the
    # types the variants above leave out, the default build bit for bit against the tile before
    # them.
    _variant_equals_default(rng, tmp_path, qtype, BEFORE_BANKS)


@pytest.mark.parametrize("qtype", [t for t in MMQ_TYPES if t not in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)],
                         ids=tname)
def test_mmq_unroll_async_on_the_cpu_every_type(rng, tmp_path, qtype):
    # MMQ_UNPACK_UNROLL splits Q4_K's and Q6_K's unpack into loads and decoding, and keeps the
    # other types' in one; MMQ_X_ASYNC's copies are the same whatever the type: the types the
    # variants above leave out, bit for bit against the default build.
    _variant_equals_default(rng, tmp_path, qtype, UNROLL_ASYNC)


@pytest.mark.parametrize("misalign", (0, 4, 8, 12))
@pytest.mark.parametrize("x_async", (False, True), ids=("copies", "cp-async"))
def test_mmq_x_raw_copies_on_the_cpu(rng, tmp_path, misalign, x_async):
    # MMQ_X_RAW copies a token's chunk of Q8_1 blocks in 16-byte words when x and every row's
    # chunk are 16-byte aligned (MMQ_X_ASYNC: as cp.async, issued before the weights' unpack),
    # else word by word: both, bit for bit against the tile staged item by item (MMQ_X_RAW=0;
    # K of 768: 24 blocks a row, full chunks)
    from ci import mmq_host
    try:
        base_lib, lib = mmq_host.build(("MMQ_X_RAW=0",)), mmq_host.build(("MMQ_X_ASYNC=1",) if x_async else ())
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of mmq.cu: {e}")
    gf, x = _case(tmp_path, rng, GGMLType.Q4_K, (70, 768, 45))
    raw = gf.tensor_bytes("w").reshape(70, -1)
    want = mmq_host.mmq(base_lib, GGMLType.Q4_K, raw, x, misalign)
    assert np.array_equal(mmq_host.mmq(lib, GGMLType.Q4_K, raw, x, misalign), want)


def _variant_equals_default(rng, tmp_path, qtype, defines):
    from ci import mmq_host
    try:
        base_lib, lib = mmq_host.build(), mmq_host.build(defines)
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of mmq.cu: {e}")
    N, K, T = (70, 768, 45) if base.MMQ_BLOCK[int(qtype)] == 256 else (70, 288, 45)
    gf, x = _case(tmp_path, rng, qtype, (N, K, T))
    raw = gf.tensor_bytes("w").reshape(N, -1)
    want = mmq_host.mmq(base_lib, qtype, raw, x)
    assert not np.isnan(want).any()
    assert np.array_equal(mmq_host.mmq(lib, qtype, raw, x), want), f"mmq with {defines} differs from the default"
    E, k = 5, 3
    shape = (E, 70, K, 90, k, False)         # ~54 slots per expert: two tiles of 32 columns
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    raw = gf.tensor_bytes("w").reshape(E * 70, -1)
    want = mmq_host.mmq_id(base_lib, qtype, raw, x, ids, E)
    assert np.isnan(want).sum() == 2 * 70, "the two out-of-range slots' rows only"
    got = mmq_host.mmq_id(lib, qtype, raw, x, ids, E)
    assert np.array_equal(got, want, equal_nan=True), f"mmq_id with {defines} differs from the default"


def test_cpu_builds_of_variants_do_not_share_their_tiles(rng, tmp_path):
    # Two variants' CPU builds in one process, the one with the smaller shared-memory tile
    # (MMQ_KB=2) loaded first: each library must keep its own __shared__ arrays (function statics
    # on the host). g++'s unique symbols bound them together across libraries, so the MMQ_KB=8
    # variant loaded second wrote past the first's arrays: NaN results, in whichever pytest
    # worker happened to load them in this order (one GPU suite run in four).
    from ci import mmq_host
    try:
        small = mmq_host.build(("MMQ_PACKED=1", "MMQ_KB=2", "MMQ_PREFETCH=1"))
        large, base_lib = mmq_host.build(("MMQ_PACKED=1",)), mmq_host.build()
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of mmq.cu: {e}")
    gf, x = _case(tmp_path, rng, GGMLType.Q6_K, (70, 768, 45))
    raw = gf.tensor_bytes("w").reshape(70, -1)
    want = mmq_host.mmq(base_lib, GGMLType.Q6_K, raw, x)
    assert np.array_equal(mmq_host.mmq(small, GGMLType.Q6_K, raw, x), want)
    assert np.array_equal(mmq_host.mmq(large, GGMLType.Q6_K, raw, x), want), \
        "a variant's CPU build used another library's shared-memory arrays"


@needs_cuda
@pytest.mark.parametrize("qtype,shape", MMQ_ID_CASES, ids=lambda v: tname(v) if isinstance(v, GGMLType) else "E%d-N%d-K%d-T%d-k%d-%s" % v)
def test_mmq_id(cuda, ref, rng, tmp_path, qtype, shape, monkeypatch, record_property):
    # The same through the backend's matmul_id with its moe_mmq option on (the reference's own
    # moe_mmq follows it), and against the decode kernels (matvec_id: the same integer sums).
    assert cuda.options.moe_mmq and ref.moe_mmq
    gf, x, ids = _id_case(tmp_path, rng, qtype, shape)
    w = cuda.weight(gf, "w")
    X, I = cuda.asarray(x), cuda.asarray(ids)
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
