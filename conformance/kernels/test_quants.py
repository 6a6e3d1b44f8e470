"""engine/quants.py against its references.

- Dequantization: bit-exact with gguf-py's `gguf.quants.dequantize`, on real blocks of the
  catalog models and on random blocks of every supported type. Runs in CI.
- Activation quantization and VEC_DOT_TYPE: bit-exact with llama.cpp b11312's own CPU functions,
  called through ctypes from the libraries llama-cpp-python ships. Skips (visibly) where
  llama_cpp is not installed.
- quantize_q8_1_cuda: hand-computed cases here; on a machine with a CUDA GPU, also against a
  transcription of llama.cpp's `quantize_q8_1` kernel compiled with NVRTC.

Every test draws fresh random inputs from conftest's `rng` fixture, which prints its seed
(replay with BRASS_TEST_SEED=<seed>).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import gguf.quants as gguf_quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from brass import quants
from brass.errors import BrassError, UnsupportedError
from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile

SUPPORTED = list(quants.SUPPORTED_TYPES)
IDS = [t.name for t in SUPPORTED]


def gguf_dequantize(raw: np.ndarray, qtype: GGMLType) -> np.ndarray:
    return gguf_quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(int(qtype)))


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str):
    """Equality of float32 bit patterns: stricter than ==, and NaN compares by its payload."""
    assert got.dtype == np.float32 and want.dtype == np.float32, (got.dtype, want.dtype)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    g = np.ascontiguousarray(got).view(np.uint32).ravel()
    w = np.ascontiguousarray(want).view(np.uint32).ravel()
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {g.size} values differ; first at flat index {bad[0]}: "
        f"got {got.ravel()[bad[0]]!r} want {want.ravel()[bad[0]]!r}")


def assert_same(got: np.ndarray, want: np.ndarray, what: str):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    bad = np.argwhere(got != want)
    assert bad.size == 0, (f"{what}: {len(bad)} of {got.size} differ; first at {tuple(bad[0])}: "
                           f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")


# ------------------------------------------------------------------------------------------
# Dequantization vs gguf-py
# ------------------------------------------------------------------------------------------

# What each catalog model holds; if a model file changed, this says so instead of silently
# testing fewer types.
MODEL_TYPES = {
    "smollm2-135m": {GGMLType.F32, GGMLType.Q8_0, GGMLType.Q4_1},
    "gemma3-270m": {GGMLType.F32, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K},
    "qwen2.5-coder-0.5b": {GGMLType.F32, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K},
}
BLOCKS_PER_TYPE = 600


@pytest.mark.parametrize("model", sorted(MODEL_TYPES))
def test_dequantize_real_blocks_bit_exact(model, real_model_path, rng):
    """Random rows of up to three random tensors per type, ~600 blocks per type, and one whole
    small tensor per type through `dequantize`."""
    gf = GGUFFile(real_model_path(model))
    by_type: dict[GGMLType, list] = {}
    for info in gf.tensors.values():
        by_type.setdefault(info.type, []).append(info)
    assert set(by_type) == MODEL_TYPES[model], f"{model} holds {sorted(t.name for t in by_type)}"

    for qtype, infos in by_type.items():
        blck = BLOCK_SIZES[qtype][0]
        chosen = rng.choice(len(infos), size=min(3, len(infos)), replace=False)
        n_blocks = 0
        for i in chosen:
            info = infos[i]
            row_len = info.shape[0]
            n_rows = info.n_elements // row_len
            want_rows = max(1, BLOCKS_PER_TYPE // len(chosen) // (row_len // blck))
            rows = rng.choice(n_rows, size=min(want_rows, n_rows), replace=False)
            raw = gf.tensor_bytes(info.name)
            got = quants.dequantize_rows(raw, qtype, row_len, rows)
            want = gguf_dequantize(raw.reshape(n_rows, -1)[rows], qtype)
            assert_same_bits(got, want, f"{model} {info.name} ({qtype.name}) rows {rows[:5]}...")
            n_blocks += got.size // blck
        assert n_blocks >= min(BLOCKS_PER_TYPE // 2, sum(t.n_elements for t in infos) // blck), \
            f"{model} {qtype.name}: only {n_blocks} blocks checked"

        smallest = min(infos, key=lambda t: t.n_elements)
        raw = gf.tensor_bytes(smallest.name)
        got = quants.dequantize(raw, qtype, smallest.shape)
        n_rows = smallest.n_elements // smallest.shape[0]
        want = gguf_dequantize(raw.reshape(n_rows, -1), qtype)
        assert_same_bits(got, want.reshape(smallest.shape[::-1]),
                         f"{model} {smallest.name} ({qtype.name}) whole")


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_dequantize_random_blocks_bit_exact(qtype, rng):
    """random_blocks gives valid data of the asked shape, sized like a real model's weights,
    and it dequantizes as gguf-py does."""
    n_rows, row_len = 96, 768               # 288 super-blocks of 256, 2304 blocks of 32
    raw = quants.random_blocks(qtype, n_rows, row_len, rng)
    blck, tsize = BLOCK_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (n_rows, row_len // blck * tsize)
    got = quants.dequantize(raw, qtype, (row_len, n_rows))
    assert_same_bits(got, gguf_dequantize(raw, qtype), f"random {qtype.name}")
    assert np.isfinite(got).all(), f"random {qtype.name} blocks dequantize to NaN/Inf"
    # "Like a real model": the largest value O(1), the typical one O(0.01-0.1), few zeros.
    amax, typical = np.abs(got).max(), np.median(np.abs(got))
    assert 0.1 < amax < 2.0 and 3e-3 < typical < 0.5, (qtype.name, amax, typical)
    assert np.count_nonzero(got) > 0.8 * got.size, f"{qtype.name}: mostly zeros"


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_dequantize_arbitrary_bytes_bit_exact(qtype, rng):
    """Every byte pattern, not only sensible ones: fp16 scales that are subnormal, Inf or NaN,
    MXFP4 exponents up to 255, float payloads that are NaN. The bits must still match."""
    blck, tsize = BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, size=(64, 4 * tsize), dtype=np.uint8)
    got = quants.dequantize(raw, qtype, (4 * blck, 64))
    with np.errstate(all="ignore"):      # gguf-py multiplies Inf and NaN scales
        want = gguf_dequantize(raw, qtype)
    assert_same_bits(got, want, f"arbitrary bytes {qtype.name}")


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.BF16], ids=["F16", "BF16"])
def test_dequantize_every_16_bit_pattern(qtype):
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    got = quants.dequantize(raw, qtype, (1 << 16,))
    assert_same_bits(got, gguf_dequantize(raw, qtype), f"all {qtype.name} patterns")


def test_mxfp4_every_exponent():
    """All 256 e8m0 exponents (0 and 1 decode to subnormal scales, 255 overflows to Inf)."""
    raw = np.empty((256, 17), np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 0x11 ^ 0x8F   # every nibble in both halves
    with np.errstate(over="ignore"):
        want = gguf_dequantize(raw, GGMLType.MXFP4)
    assert_same_bits(quants.dequantize(raw, GGMLType.MXFP4, (32, 256)), want, "MXFP4 exponents")


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_dequantize_rows_matches_full(qtype, rng):
    n_rows, row_len = 40, 512
    raw = quants.random_blocks(qtype, n_rows, row_len, rng)
    full = quants.dequantize(raw, qtype, (row_len, n_rows))
    # Unsorted, with repeats, first and last row included.
    rows = np.concatenate([[0, n_rows - 1], rng.integers(0, n_rows, 9)])
    got = quants.dequantize_rows(raw, qtype, row_len, rows)
    assert_same_bits(got, full[rows], f"{qtype.name} rows {rows}")
    empty = quants.dequantize_rows(raw, qtype, row_len, np.array([], np.int64))
    assert empty.shape == (0, row_len) and empty.dtype == np.float32


def test_dequantize_rows_touches_only_the_chosen_rows(monkeypatch, rng):
    """An embedding lookup must not dequantize the table: count the blocks that reach the
    block decoder."""
    qtype, n_rows, row_len = GGMLType.Q8_0, 20000, 640
    raw = quants.random_blocks(qtype, n_rows, row_len, rng)
    seen = []
    decode = quants._DEQUANTIZERS[qtype]

    def counting(blocks):
        seen.append(blocks.shape[0])
        return decode(blocks)

    monkeypatch.setitem(quants._DEQUANTIZERS, qtype, counting)
    rows = rng.integers(0, n_rows, 5)
    quants.dequantize_rows(raw, qtype, row_len, rows)
    assert sum(seen) == 5 * row_len // 32, f"decoded {sum(seen)} blocks for 5 rows of {row_len // 32}"


def test_dequantize_bad_input_is_a_brass_error(rng):
    raw = quants.random_blocks(GGMLType.Q4_0, 4, 64, rng)
    for bad_type, name in [(GGMLType.Q2_K, "Q2_K"), (GGMLType.IQ2_XXS, "IQ2_XXS"), (GGMLType.Q8_K, "Q8_K")]:
        with pytest.raises(UnsupportedError, match=name):
            quants.dequantize(raw, bad_type, (64, 4))
        with pytest.raises(UnsupportedError, match=name):
            quants.dequantize_rows(raw, bad_type, 64, [0])
    with pytest.raises(UnsupportedError, match="unknown ggml type 99"):
        quants.dequantize(raw, 99, (64, 4))
    with pytest.raises(BrassError, match="needs 144 bytes, got 140"):
        quants.dequantize(raw[:, :-1], GGMLType.Q4_0, (64, 4))
    with pytest.raises(BrassError, match="multiple of the Q4_0 block size 32"):
        quants.dequantize(raw, GGMLType.Q4_0, (48, 6))
    with pytest.raises(BrassError, match="uint8"):
        quants.dequantize(raw.view(np.int8), GGMLType.Q4_0, (64, 4))
    with pytest.raises(BrassError, match="row 4 is out of range"):
        quants.dequantize_rows(raw, GGMLType.Q4_0, 64, [0, 4])
    with pytest.raises(BrassError, match="row -1 is out of range"):
        quants.dequantize_rows(raw, GGMLType.Q4_0, 64, [-1])
    with pytest.raises(BrassError, match="integers"):
        quants.dequantize_rows(raw, GGMLType.Q4_0, 64, [0.5])
    with pytest.raises(BrassError, match="whole number"):
        quants.dequantize_rows(raw, GGMLType.Q4_0, 96, [0])


# ------------------------------------------------------------------------------------------
# quantize (gguf-py's quantizers behind our API)
# ------------------------------------------------------------------------------------------

# Normalised mean squared error of a round trip on N(0, 1) rows, about twice what each format
# gave over 20 seeds (the measured range in the comment). It is the format's resolution: a
# b-bit block format's error is ~ (2·amax/(2^b − 1))²/12 with amax ~ 2.5σ over 32 values.
ROUND_TRIP_NMSE = {
    GGMLType.F32: 0.0,          # exact
    GGMLType.F16: 1e-7,         # 4.2e-8 .. 4.5e-8: 11-bit significand
    GGMLType.BF16: 6e-6,        # 2.7e-6 .. 2.9e-6: 8-bit significand
    GGMLType.Q8_0: 6e-5,        # 2.8e-5 .. 3.0e-5
    GGMLType.Q5_0: 4e-3,        # 1.75e-3 .. 1.9e-3
    GGMLType.Q5_1: 3e-3,        # 1.37e-3 .. 1.47e-3
    GGMLType.Q4_0: 1.5e-2,      # 7.0e-3 .. 7.7e-3
    GGMLType.Q4_1: 1.2e-2,      # 5.9e-3 .. 6.4e-3
    GGMLType.MXFP4: 2.5e-2,     # 1.27e-2 .. 1.36e-2: e2m1 grid under a power-of-two scale
}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_NMSE), ids=[t.name for t in ROUND_TRIP_NMSE])
def test_quantize_round_trip(qtype, rng):
    x = rng.standard_normal((16, 512)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    blck, tsize = BLOCK_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (16, 512 // blck * tsize)
    y = quants.dequantize(raw, qtype, (512, 16))
    nmse = float(np.sum((y.astype(np.float64) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))
    assert nmse <= ROUND_TRIP_NMSE[qtype], f"{qtype.name} round trip NMSE {nmse:.3g}"
    if qtype != GGMLType.F32:
        assert nmse > 0, f"{qtype.name} round trip is exact: did it quantize at all?"


def test_quantize_unsupported():
    with pytest.raises(UnsupportedError, match="Q4_K"):
        quants.quantize(np.ones((2, 256), np.float32), GGMLType.Q4_K)
    with pytest.raises(BrassError, match="block size 32"):
        quants.quantize(np.ones((2, 48), np.float32), GGMLType.Q8_0)


# ------------------------------------------------------------------------------------------
# Activation quantization vs llama.cpp's own CPU functions
# ------------------------------------------------------------------------------------------

class GGMLTypeTraitsCPU(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


@functools.lru_cache(maxsize=1)
def _ggml_cpu():
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib"
    # The CPU backend resolves its ggml-base symbols from the global namespace.
    ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(GGMLTypeTraitsCPU)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return cpu


@pytest.fixture
def ggml_cpu():
    cpu = _ggml_cpu()
    if cpu is None:
        pytest.skip("llama_cpp (llama-cpp-python 0.3.36) is not installed: nothing to compare with")
    return cpu


def ggml_from_float(cpu, qtype: GGMLType, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """llama.cpp's CPU conversion of float rows x [T, K] to `qtype` (the traits' from_float,
    which is what mul_mat calls on its activations), as records of `dtype`."""
    x = np.ascontiguousarray(x, np.float32)
    T, K = x.shape
    blck, tsize = BLOCK_SIZES[qtype]
    assert dtype.itemsize == tsize
    # Pre-filled with a pattern, so that a field llama.cpp leaves unwritten shows.
    out = np.full((T, K // blck * tsize), 0x5A, np.uint8)
    from_float = cpu.ggml_get_type_traits_cpu(int(qtype)).contents.from_float
    for t in range(T):
        from_float(x[t].ctypes.data, out[t].ctypes.data, K)
    return out.view(dtype)


Q8_0_RECORD = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
Q8_1_RECORD = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])
Q8_K_RECORD = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
# Exactly representable ties: with amax = 127·2^e the CPU's multiplier 127/amax is 2^-e, so
# these land on .5 exactly, where ties-to-even and ties-away-from-zero disagree.
TIES = np.array([127, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 4.5], np.float32)


def sensitive_block(rng: np.random.Generator, quant_a, quant_b) -> np.ndarray:
    """32 values (their largest magnitude amax) whose quants differ between two ways of
    computing them, quant_a(x, amax) and quant_b(x, amax): values a few ulps from the point
    where x·127/amax is a half-integer, kept where the two disagree."""
    f32 = np.float32
    for amax in rng.uniform(0.5, 100, 64).astype(f32):
        x = ((np.arange(126) + f32(0.5)) * amax / f32(127)).astype(f32)
        found = []
        for direction in (np.inf, -np.inf):
            y = x
            for _ in range(3):
                y = np.nextafter(y, f32(direction))
                found.extend(y[(quant_a(y, amax) != quant_b(y, amax)) & (y < amax)])
        if len(found) >= 8:
            break
    assert found, "no amax gave values that tell the two apart"
    picked = rng.choice(np.array(found, f32), 31, replace=len(found) < 31)
    block = np.concatenate([[amax], picked * rng.choice(f32([-1, 1]), 31)]).astype(f32)
    return rng.permutation(block)


def cpu_by_inverse(x, amax):
    """llama.cpp's AVX2 Q8_0 quants: x·(127/amax), ties to even."""
    return np.rint(x * (np.float32(127) / amax))


def cpu_by_reciprocal_of_d(x, amax):
    return np.rint(x * (np.float32(1) / (amax / np.float32(127))))


def roundf_exact(v: np.ndarray) -> np.ndarray:
    """C's roundf in float64, where a float32's fraction is exact."""
    a = np.abs(v.astype(np.float64))
    return np.sign(v) * (np.floor(a) + (a - np.floor(a) >= 0.5))


def cuda_by_division(x, amax):
    """CUDA's quants: roundf(x / d), d = amax/127. The float64 quotient rounded to float32 is
    the correctly rounded float32 quotient (53 >= 2·24 + 2 bits), an oracle independent of the
    float32 division under test."""
    d = (np.float64(amax) / 127).astype(np.float32)
    return roundf_exact((x.astype(np.float64) / np.float64(d)).astype(np.float32))


def cuda_by_reciprocal(x, amax):
    return roundf_exact(x * (np.float32(1) / (amax / np.float32(127))))


def activation_rows(rng: np.random.Generator, T: int = 3, K: int = 4096) -> np.ndarray:
    """Activation-like rows: block scales spread over six decades, plus an all-zero
    super-block, a block of exact rounding ties, a block sensitive to how the multiplier is
    computed, and a block with a lone outlier."""
    x = rng.standard_normal((T, K)).astype(np.float32)
    x *= np.exp(rng.uniform(np.log(1e-4), np.log(1e2), (T, K // 32))).repeat(32, axis=1).astype(np.float32)
    x[0, 256:512] = 0
    ties = rng.permutation(np.resize(TIES, 32)) * np.float32(2.0 ** rng.integers(-6, 3))
    ties[np.flatnonzero(np.abs(ties) == np.abs(ties).max())[1:]] *= 0.5   # one amax
    x[1, 544:576] = ties
    # The same ties under Q8_K's rule: the max is -127·2^e, so iscale is exactly 2^-e.
    x[2, 512:768] = rng.uniform(-1, 1, 256) * np.float32(60)
    x[2, 512:512 + len(TIES)] = -TIES
    x[0, 1024 + rng.integers(32)] = 1e4
    x[1, 1024:1056] = sensitive_block(rng, cpu_by_inverse, cpu_by_reciprocal_of_d)
    return x


def test_vec_dot_type_matches_llama_cpp(ggml_cpu):
    assert set(quants.VEC_DOT_TYPE) == set(quants.SUPPORTED_TYPES)
    for wtype, act in quants.VEC_DOT_TYPE.items():
        theirs = GGMLType(ggml_cpu.ggml_get_type_traits_cpu(int(wtype)).contents.vec_dot_type)
        assert act == theirs, f"{wtype.name}: VEC_DOT_TYPE says {act.name}, llama.cpp {theirs.name}"


def test_quantize_q8_0_matches_llama_cpp(ggml_cpu, rng):
    x = activation_rows(rng)
    theirs = ggml_from_float(ggml_cpu, GGMLType.Q8_0, x, Q8_0_RECORD)
    ours = quants.quantize_q8_0(x)
    assert_same(ours.d, theirs["d"], "Q8_0 d")
    assert_same(ours.qs, theirs["qs"].reshape(x.shape), "Q8_0 qs")
    effective = (theirs["d"].astype(np.float32)[..., None] * theirs["qs"]).reshape(x.shape)
    assert_same_bits(quants.round_activations(x, GGMLType.Q8_0), effective, "round_activations Q8_0")


def test_quantize_q8_1_matches_llama_cpp(ggml_cpu, rng):
    x = activation_rows(rng)
    theirs = ggml_from_float(ggml_cpu, GGMLType.Q8_1, x, Q8_1_RECORD)
    ours = quants.quantize_q8_1(x)
    assert_same(ours.d, theirs["d"], "Q8_1 d")
    assert_same(ours.s, theirs["s"], "Q8_1 s")
    assert_same(ours.qs, theirs["qs"].reshape(x.shape), "Q8_1 qs")
    effective = (theirs["d"].astype(np.float32)[..., None] * theirs["qs"]).reshape(x.shape)
    assert_same_bits(quants.round_activations(x, GGMLType.Q8_1), effective, "round_activations Q8_1")


def test_quantize_q8_k_matches_llama_cpp(ggml_cpu, rng):
    x = activation_rows(rng)
    theirs = ggml_from_float(ggml_cpu, GGMLType.Q8_K, x, Q8_K_RECORD)
    ours = quants.quantize_q8_k(x)
    assert_same(ours.d, theirs["d"], "Q8_K d")
    assert_same(ours.qs, theirs["qs"].reshape(x.shape), "Q8_K qs")
    # llama.cpp leaves bsums unwritten in an all-zero super-block (ours are its true sums, 0).
    written = theirs["d"] != 0
    assert_same(ours.bsums.reshape(theirs["bsums"].shape)[written], theirs["bsums"][written], "Q8_K bsums")
    assert not ours.bsums.reshape(theirs["bsums"].shape)[~written].any()
    effective = theirs["d"][..., None] * theirs["qs"].astype(np.float32)
    assert_same_bits(quants.round_activations(x, GGMLType.Q8_K), effective.reshape(x.shape),
                     "round_activations Q8_K")


# ggml_quantize_mat_t<8, type>: with weight repacking on (llama.cpp's default) and AVX2, the
# CPU quantizes activations four rows at a time for Q4_0/Q4_K-style repacked weights, into
# blocks that interleave the four rows 8 quants at a time.
QUANTIZE_MAT_4x8 = {
    GGMLType.Q8_0: ("_Z19ggml_quantize_mat_tILl8EL9ggml_type8EEvPKfPvll",
                    np.dtype([("d", "<f2", 4), ("qs", "i1", 128)]), 32),
    GGMLType.Q8_K: ("_Z19ggml_quantize_mat_tILl8EL9ggml_type15EEvPKfPvll",
                    np.dtype([("d", "<f4", 4), ("qs", "i1", 1024), ("bsums", "<i2", 64)]), 256),
}


@pytest.mark.parametrize("act", list(QUANTIZE_MAT_4x8), ids=["Q8_0", "Q8_K"])
def test_repacked_path_quantizes_the_same(ggml_cpu, act, rng):
    """The four-row quantizer of the repacked path gives the values of the one-row one. (Its
    Q8_K takes the opposite sign for d when +amax and -amax both occur in a super-block, and
    negates the quants with it: same values, different fields. Planted below.)"""
    symbol, record, block = QUANTIZE_MAT_4x8[act]
    try:
        fn = getattr(ggml_cpu, symbol)
    except AttributeError:
        pytest.skip(f"this ggml build exports no {symbol}")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None
    x = np.ascontiguousarray(activation_rows(rng, T=4))
    x[3, 300], x[3, 400] = 50.0, -50.0
    out = np.zeros(x.shape[1] // block * record.itemsize, np.uint8)
    fn(x.ctypes.data, out.ctypes.data, 4, x.shape[1])
    theirs = out.view(record)
    qs = theirs["qs"].reshape(-1, block // 8, 4, 8).transpose(2, 0, 1, 3).reshape(x.shape)
    d = theirs["d"].T.astype(np.float32)
    values = (qs.reshape(4, -1, block) * d[..., None]).reshape(x.shape)
    assert_same_bits(quants.round_activations(x, act), values, f"repacked {act.name} values")
    if act == GGMLType.Q8_0:
        assert_same(quants.quantize_q8_0(x).qs, qs, "repacked Q8_0 quants")


# Values where the float conversions have rules of their own: subnormal in the target, beyond
# its range, Inf, NaN, exact ties of the target's rounding.
SPECIAL = np.array([0.0, -0.0, 1e-40, -1e-39, 6e-8, -3e-8, 65504, 65520, -1e6, 3.4e38,
                    np.inf, -np.inf, np.nan, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8], np.float32)
# Signalling NaNs whose payload sits in the low 16 bits: truncated without quieting they
# would turn into ±Inf.
SPECIAL[[0, 5]] = np.array([0x7F800001, 0xFF801234], np.uint32).view(np.float32)


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.BF16], ids=["F16", "BF16"])
def test_float_activations_match_llama_cpp(ggml_cpu, qtype, rng):
    x = rng.standard_normal((2, 256)).astype(np.float32) * np.float32(100)
    x[0, :SPECIAL.size] = SPECIAL
    x[1, -SPECIAL.size:] = SPECIAL                 # also through the vectorised path's tail
    bits = ggml_from_float(ggml_cpu, qtype, x, np.dtype("<u2"))
    if qtype == GGMLType.F16:
        theirs = bits.view("<f2").astype(np.float32)
        ours = quants.round_activations(x, qtype)
        # F16C and ggml's scalar tail quiet NaN with different payloads; NaN is NaN here.
        nan = np.isnan(theirs)
        assert (np.isnan(ours) == nan).all()
        zero = np.float32(0)
        assert_same_bits(np.where(nan, zero, ours), np.where(nan, zero, theirs), "F16 activations")
    else:
        assert_same(quants.fp32_to_bf16_bits(x), bits, "BF16 bits")
        theirs = (bits.astype(np.uint32) << 16).view(np.float32)
        assert_same_bits(quants.round_activations(x, qtype), theirs, "BF16 activations")


def test_activation_quantizers_shapes_and_errors(rng):
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    b0, b1, bk = quants.quantize_q8_0(x), quants.quantize_q8_1(x), quants.quantize_q8_k(x)
    assert b0.d.shape == (2, 3, 16) and b0.d.dtype == np.float16
    assert b0.qs.shape == x.shape and b0.qs.dtype == np.int8
    assert b1.s.shape == (2, 3, 16) and b1.s.dtype == np.float16
    assert bk.d.shape == (2, 3, 2) and bk.d.dtype == np.float32 and bk.bsums.shape == (2, 3, 32)
    assert bk.bsums.dtype == np.int16
    assert quants.round_activations(x, GGMLType.Q8_K).shape == x.shape
    for fn in (quants.quantize_q8_0, quants.quantize_q8_1, quants.quantize_q8_1_cuda):
        with pytest.raises(BrassError, match="multiple of 32"):
            fn(np.ones((2, 48), np.float32))
    with pytest.raises(BrassError, match="multiple of 256"):
        quants.quantize_q8_k(np.ones((2, 128), np.float32))
    with pytest.raises(UnsupportedError, match="Q4_0"):
        quants.round_activations(x, GGMLType.Q4_0)


# ------------------------------------------------------------------------------------------
# CUDA's quantize_q8_1
# ------------------------------------------------------------------------------------------

def test_quantize_q8_1_cuda_rounding_and_sum(rng):
    """Hand-computed: roundf ties away from zero (the CPU rounds them to even), and the
    block sum in the warp's butterfly order."""
    x = np.zeros((1, 64), np.float32)
    x[0, :12] = TIES                                   # amax 127 → d = 1
    x[0, 12] = np.float32(0.49999997)                  # not a tie: floor(x + 0.5) would say 1
    b = quants.quantize_q8_1_cuda(x)
    assert b.d[0, 0] == 1.0
    assert list(b.qs[0, :13]) == [127, 3, -3, 4, -4, 1, -1, 2, -2, 127, -127, 5, 0]
    assert list(quants.quantize_q8_1(x).qs[0, 1:9]) == [2, -2, 4, -4, 0, 0, 2, -2]
    # Second block, all zeros: d = 0, q = 0, s = 0 (no NaN from 0/0).
    assert b.d[0, 1] == 0 and not b.qs[0, 32:].any() and b.s[0, 1] == 0

    # Lane 0 holds 2^24, lane 16 -2^24, every other lane 1. The butterfly adds lanes i and
    # i+16 first (2^24 − 2^24 = 0, and 1 + 1 = 2 elsewhere) and so keeps every 1: Σ = 30. A
    # left-to-right sum loses the ones added to 2^24 and gives 15.
    y = np.ones((1, 32), np.float32)
    y[0, 0], y[0, 16] = 2.0 ** 24, -(2.0 ** 24)
    assert float(quants.quantize_q8_1_cuda(y).s[0, 0]) == 30.0
    assert float(np.cumsum(y[0], dtype=np.float32)[-1]) == 15.0


def test_quantize_q8_1_cuda_divides(rng):
    """q = roundf(x / d) with a true division (not x·(1/d), not the CPU's 127/amax), checked
    against a float64 oracle on activation rows and on blocks planted where the ways differ."""
    x = activation_rows(rng)
    x[2, 2048:2080] = sensitive_block(rng, cuda_by_division, cuda_by_reciprocal)
    x[2, 2080:2112] = sensitive_block(rng, cuda_by_division, cpu_by_inverse)
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(amax == 0, 0, cuda_by_division(xb, amax)).astype(np.int8)
    assert_same(quants.quantize_q8_1_cuda(x).qs, want.reshape(x.shape), "CUDA q8_1 quants")


def test_dequantize_q8_1(rng):
    x = rng.standard_normal((3, 128)).astype(np.float32)
    b = quants.quantize_q8_1_cuda(x)
    y = quants.dequantize_q8_1(*b)
    assert y.shape == x.shape and y.dtype == np.float32
    want = b.d.astype(np.float32).repeat(32, axis=-1) * b.qs.astype(np.float32)
    assert_same_bits(y, want, "dequantize_q8_1")
    # Each value within half a step of x (the step being fp16(d); fp16 rounding of d adds
    # at most 2^-11 relative, times |q| <= 127).
    step = b.d.astype(np.float32).repeat(32, axis=-1)
    assert (np.abs(y - x) <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all()


# llama.cpp's ggml-cuda/quantize.cu `quantize_q8_1`, for contiguous rows (its stride and
# channel arithmetic dropped), with the block layout of block_q8_1 (half2 ds, int8 qs[32]).
LLAMA_QUANTIZE_Q8_1 = r"""
#include <cuda_fp16.h>
struct block_q8_1 { half2 ds; signed char qs[32]; };
template <int width> __device__ float warp_reduce_sum(float x) {
#pragma unroll
    for (int offset = width/2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffff, x, offset, width);
    return x;
}
template <int width> __device__ float warp_reduce_max(float x) {
#pragma unroll
    for (int offset = width/2; offset > 0; offset >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset, width));
    return x;
}
extern "C" __global__ void quantize_q8_1(const float * __restrict__ x, void * __restrict__ vy,
                                         const long long n) {
    const long long i = (long long) blockDim.x*blockIdx.x + threadIdx.x;
    if (i >= n) return;
    block_q8_1 * y = (block_q8_1 *) vy;
    const long long ib = i / 32, iqs = i % 32;
    const float xi = x[i];
    float amax = fabsf(xi);
    float sum = xi;
    amax = warp_reduce_max<32>(amax);
    sum = warp_reduce_sum<32>(sum);
    const float d = amax / 127.0f;
    const signed char q = amax == 0.0f ? 0 : roundf(xi / d);
    y[ib].qs[iqs] = q;
    if (iqs > 0) return;
    y[ib].ds = make_half2(d, sum);
}
"""


def _cuda_device_or_skip():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: no CUDA comparison")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:  # CuPy raises its own runtime error classes when there is no driver
        # (cudaErrorInsufficientDriver: CUDA driver version is insufficient ...): not the reason to show
        reason = "no NVIDIA GPU or driver here" if "cudaError" in str(e) or "no device" in str(e) else str(e)
        pytest.skip(f"{reason}: the kernel comparison runs on the GPU runner")
    return cupy


@pytest.mark.parametrize("fast_math", [False, True], ids=["ieee", "fast_math"])
def test_quantize_q8_1_cuda_matches_llama_kernel(fast_math, rng):
    """On a CUDA GPU, llama.cpp's kernel compiled with NVRTC. Built with IEEE division it
    must match bit for bit; built with -use_fast_math (as llama.cpp builds it) the approximate
    division may move a quant by one where x/d sits within ulps of a half-integer: that
    build must agree on d and s, and on all but a few quants, each off by at most one."""
    cupy = _cuda_device_or_skip()
    x = activation_rows(rng, T=64, K=4096)
    options = ("--std=c++17",) + (("-use_fast_math",) if fast_math else ())
    kernel = cupy.RawKernel(LLAMA_QUANTIZE_Q8_1, "quantize_q8_1", options=options)
    xd = cupy.asarray(x)
    yd = cupy.zeros(x.size // 32 * 36, dtype=cupy.uint8)
    kernel(((x.size + 255) // 256,), (256,), (xd, yd, np.int64(x.size)))
    theirs = cupy.asnumpy(yd).view(np.dtype([("ds", "<f2", 2), ("qs", "i1", 32)])).reshape(x.shape[0], -1)
    ours = quants.quantize_q8_1_cuda(x)
    their_q = theirs["qs"].reshape(x.shape)
    assert_same(ours.s, theirs["ds"][..., 1], "CUDA q8_1 s")
    if not fast_math:
        assert_same(ours.d, theirs["ds"][..., 0], "CUDA q8_1 d")
        assert_same(ours.qs, their_q, "CUDA q8_1 qs")
        return
    # The approximate amax/127 (up to 2 ulp of float32) changes the fp16 d only when it lands
    # within 2 ulp of an fp16 rounding boundary (2^13 float32 ulps apart): ~5e-4 of blocks.
    d_ulps = np.abs(ours.d.view(np.int16).astype(np.int32) - theirs["ds"][..., 0].view(np.int16))
    assert d_ulps.max() <= 1 and np.count_nonzero(d_ulps) <= 2e-3 * d_ulps.size + 2, \
        f"fast-math d: {np.count_nonzero(d_ulps)} of {d_ulps.size} differ, by up to {d_ulps.max()} ulp"
    # A quant moves only where x/d is within ulps of a half-integer: a handful in a million.
    diff = np.abs(ours.qs.astype(np.int32) - their_q)
    assert diff.max() <= 1, f"fast-math quants off by {diff.max()}"
    assert np.count_nonzero(diff) <= 1e-4 * x.size + 2, f"{np.count_nonzero(diff)} quants differ"


@pytest.mark.parametrize("chunk", [None, 4099])      # the default, and many chunks with a ragged end
def test_round_to_f16_is_astypes_rounding_bit_for_bit(rng, monkeypatch, chunk):
    """quants.round_to_f16 (the numpy backend's fast float16 rounding) against numpy's own
    conversion: every float16 value and the float32 values around it (ties, one ulp either side,
    the edges of the subnormal and overflow ranges), then random bit patterns and weight-like
    values. Bits compared; NaN only against NaN."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    hb = h.view(np.uint32)
    near = [h]
    for d in (1, 2, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000):
        near += [(hb + np.uint32(d)).view(np.float32), (hb - np.uint32(d)).view(np.float32)]
    x = np.concatenate(near + [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                               (rng.standard_normal(1 << 20) * 0.05).astype(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    if chunk is not None:
        monkeypatch.setattr(quants, "_F16_CHUNK", chunk)
    got = quants.round_to_f16(x.reshape(-1, 64)).reshape(-1)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)[:5]
    assert same.all(), f"{(~same).sum()} values differ, e.g. {x[bad]} -> {got[bad]}, numpy {want[bad]}"
