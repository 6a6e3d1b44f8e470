"""ggml block formats in numpy.

Three jobs, each pinned to a reference that decides what "right" means:

- Dequantization of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4,
  bit-exact with gguf-py's `gguf.quants.dequantize` (the same float32 operations in the same
  order: a scale product is rounded to float32 before it meets a quant, and no fused multiply-add).
- Activation quantization (Q8_0, Q8_1, Q8_K) as llama.cpp b11312 does it before a dot product
  against a quantized weight: on the CPU as built for x86-64 with AVX2 (the goldens' build), and
  Q8_1 as the CUDA `quantize_q8_1` kernel does it (what CUDA mat-vec kernels are checked against).
- Random valid blocks for kernel tests, and quantization (delegated to gguf-py) for round trips.

Blocks are processed in vectorised chunks; nothing loops per block in Python.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .errors import BrassError, UnsupportedError
from .gguf import BLOCK_SIZES, GGMLType

QK_K = 256

# Activation type each weight type's CPU dot product takes, from b11312's `type_traits_cpu`
# (`ggml_get_type_traits_cpu(type)->vec_dot_type`).
VEC_DOT_TYPE: dict[GGMLType, GGMLType] = {
    GGMLType.F32: GGMLType.F32,
    GGMLType.F16: GGMLType.F16,
    GGMLType.BF16: GGMLType.BF16,
    GGMLType.Q4_0: GGMLType.Q8_0,
    GGMLType.Q4_1: GGMLType.Q8_1,
    GGMLType.Q5_0: GGMLType.Q8_0,
    GGMLType.Q5_1: GGMLType.Q8_1,
    GGMLType.Q8_0: GGMLType.Q8_0,
    GGMLType.Q4_K: GGMLType.Q8_K,
    GGMLType.Q5_K: GGMLType.Q8_K,
    GGMLType.Q6_K: GGMLType.Q8_K,
    GGMLType.MXFP4: GGMLType.Q8_0,
}

# Elements per vectorised step: large enough to amortise numpy's per-call cost, small enough
# that the temporaries stay in cache.
_CHUNK_ELEMENTS = 1 << 17


# --------------------------------------------------------------------------------------------
# Dequantization. Each function takes blocks [n, type_size] uint8 and returns [n, block] f32.
# --------------------------------------------------------------------------------------------

def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at `offset` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, m] bytes → [n, 2m]: the low nibbles of all m bytes, then the high nibbles."""
    n, m = qs.shape
    q = np.empty((n, 2 * m), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :m])
    np.right_shift(qs, 4, out=q[:, m:])
    return q


def _dequant_f32(b):
    return b.view("<f4")


def _dequant_f16(b):
    return b.view("<f2").astype(np.float32)


def _dequant_bf16(b):
    return (b.view("<u2").astype(np.uint32) << 16).view(np.float32)


_Q4_0_VALUES = np.arange(-8, 8, dtype=np.float32)
_Q5_0_VALUES = np.arange(-16, 16, dtype=np.float32)
_UNSIGNED_VALUES = np.arange(0, 64, dtype=np.float32)


def _dequant_q4_0(b):
    d = _f16(b, 0)
    return d * _Q4_0_VALUES.take(_nibbles(b[:, 2:18]))


def _dequant_q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _UNSIGNED_VALUES.take(_nibbles(b[:, 4:20]))
    q *= d
    q += m
    return q


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants 0..31: bit j of the little-endian 32-bit qh is bit 4 of element j."""
    q = _nibbles(qs)
    q |= np.unpackbits(qh, axis=1, bitorder="little") << 4
    return q


def _dequant_q5_0(b):
    d = _f16(b, 0)
    return d * _Q5_0_VALUES.take(_five_bit(b[:, 2:6], b[:, 6:22]))


def _dequant_q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _UNSIGNED_VALUES.take(_five_bit(b[:, 4:8], b[:, 8:24]))
    q *= d
    q += m
    return q


def _dequant_q8_0(b):
    d = _f16(b, 0)
    q = b[:, 2:34].view(np.int8).astype(np.float32)
    q *= d
    return q


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block from its 12 packed bytes.

    Bytes 0-3 hold scales 0-3 in bits 0-5, bytes 4-7 mins 0-3; scales/mins 4-7 take their low
    four bits from bytes 8-11 (low/high nibble) and their top two bits from bits 6-7 of bytes
    0-3 / 4-7.
    """
    s = scales.reshape(-1, 3, 4)
    lo, hi, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_affine(b, q: np.ndarray) -> np.ndarray:
    """(d·scale)·q − dmin·min for each 32-element sub-block; q is [n, 8, 32] float32."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    q *= (d * sc)[:, :, None]
    q -= (dmin * mn)[:, :, None]
    return q.reshape(-1, QK_K)


def _dequant_q4_k(b):
    # 32 bytes feed two sub-blocks: low nibbles the first, high nibbles the second.
    qs = b[:, 16:144].reshape(-1, 32)
    q = _UNSIGNED_VALUES.take(_nibbles(qs)).reshape(-1, 8, 32)
    return _k_affine(b, q)


def _dequant_q5_k(b):
    qs = b[:, 48:176].reshape(-1, 32)
    q = _nibbles(qs).reshape(-1, 8, 32)
    # Sub-block i takes bit i of each of the 32 qh bytes as its fifth bit.
    qh = b[:, 16:48]
    q |= ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return _k_affine(b, _UNSIGNED_VALUES.take(q))


_Q6_K_VALUES = np.arange(-32, 32, dtype=np.float32)


def _dequant_q6_k(b):
    n = b.shape[0]
    # Each half of the block (128 elements) has 64 ql bytes and 32 qh bytes: ql's low nibbles
    # give elements 0-63, high nibbles 64-127; qh bits 2k..2k+1 give the top bits of 32k..32k+31.
    ql = _nibbles(b[:, 0:128].reshape(-1, 64)).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    ql |= (qh & 3) << 4
    scale = b[:, 192:208].view(np.int8).astype(np.float32) * _f16(b, 208)
    q = _Q6_K_VALUES.take(ql).reshape(n, 16, 16)
    q *= scale[:, :, None]
    return q.reshape(n, QK_K)


def _e8m0_half_table() -> np.ndarray:
    """ggml_e8m0_to_fp32_half for every byte: 2^(e-128), with e < 2 as the subnormals it gives."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


# e2m1 values doubled (the scale above is halved to match), as ggml's kvalues_mxfp4.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
# Every (exponent byte, nibble) product, so an element costs one table lookup. Exponents near
# 255 overflow to ±inf, as gguf-py's product does.
with np.errstate(over="ignore"):
    _MXFP4_TABLE = (_e8m0_half_table()[:, None] * _MXFP4_VALUES[None, :]).reshape(-1)


def _dequant_mxfp4(b):
    index = _nibbles(b[:, 1:17]).astype(np.intp)
    index += b[:, 0:1].astype(np.intp) << 4
    return _MXFP4_TABLE.take(index)


_DEQUANTIZERS = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.MXFP4: _dequant_mxfp4,
}

SUPPORTED_TYPES: tuple[GGMLType, ...] = tuple(_DEQUANTIZERS)


def _ggml_type(qtype) -> GGMLType:
    try:
        t = GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise UnsupportedError(f"unknown ggml type {qtype!r}") from None
    if t not in _DEQUANTIZERS:
        raise UnsupportedError(f"tensor type {t.name} is not supported "
                               f"(supported: {', '.join(x.name for x in SUPPORTED_TYPES)})")
    return t


def _raw_bytes(raw) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise BrassError(f"quantized data must be uint8 bytes, got {raw.dtype}")
    return raw.reshape(-1)


def _check_row_len(qtype: GGMLType, row_len: int) -> None:
    blck = BLOCK_SIZES[qtype][0]
    if row_len <= 0 or row_len % blck:
        raise BrassError(f"row length {row_len} is not a positive multiple of the "
                         f"{qtype.name} block size {blck}")


def _dequantize_blocks(blocks: np.ndarray, qtype: GGMLType) -> np.ndarray:
    blck = BLOCK_SIZES[qtype][0]
    fn = _DEQUANTIZERS[qtype]
    n = blocks.shape[0]
    out = np.empty((n, blck), np.float32)
    step = max(1, _CHUNK_ELEMENTS // blck)
    # NaN or Inf scales (a corrupt file) propagate into the values, as in gguf-py; warnings
    # from the arithmetic would add nothing.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, n, step):
            out[start:start + step] = fn(blocks[start:start + step]).reshape(-1, blck)
    return out


def dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """Dequantize a whole tensor.

    `raw` is its bytes (uint8, any shape), `shape` its ggml shape (ne0 first); the result is
    float32 in numpy order, `shape[::-1]`.
    """
    qtype = _ggml_type(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise BrassError(f"bad tensor shape {shape}")
    _check_row_len(qtype, shape[0])
    blck, tsize = BLOCK_SIZES[qtype]
    raw = _raw_bytes(raw)
    n = int(np.prod(shape, dtype=np.int64))
    if raw.size != n // blck * tsize:
        raise BrassError(f"{qtype.name} tensor of shape {shape} needs {n // blck * tsize} bytes, "
                         f"got {raw.size}")
    blocks = np.ascontiguousarray(raw).reshape(-1, tsize)
    return _dequantize_blocks(blocks, qtype).reshape(shape[::-1])


def dequantize_rows(raw: np.ndarray, qtype, row_len: int, rows) -> np.ndarray:
    """Dequantize only the chosen rows of a 2-D table (an embedding lookup): [len(rows), row_len]."""
    qtype = _ggml_type(qtype)
    row_len = int(row_len)
    _check_row_len(qtype, row_len)
    blck, tsize = BLOCK_SIZES[qtype]
    raw = _raw_bytes(raw)
    row_bytes = row_len // blck * tsize
    if raw.size % row_bytes:
        raise BrassError(f"{raw.size} bytes is not a whole number of {qtype.name} rows "
                         f"of {row_len} elements ({row_bytes} bytes each)")
    table = raw.reshape(-1, row_bytes)
    rows = np.asarray(rows)
    if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise BrassError(f"rows must be a 1-D array of integers, got {rows.dtype} of shape {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= table.shape[0]):
        bad = rows[(rows < 0) | (rows >= table.shape[0])][0]
        raise BrassError(f"row {bad} is out of range for a table of {table.shape[0]} rows")
    picked = table[rows.astype(np.intp)].reshape(-1, tsize)
    return _dequantize_blocks(picked, qtype).reshape(rows.size, row_len)


# --------------------------------------------------------------------------------------------
# Activation quantization, as llama.cpp b11312 computes it.
# --------------------------------------------------------------------------------------------

class Q8_0Blocks(NamedTuple):
    d: np.ndarray    # float16 [..., K/32]: the block scale as stored
    qs: np.ndarray   # int8 [..., K]


class Q8_1Blocks(NamedTuple):
    d: np.ndarray    # float16 [..., K/32]
    s: np.ndarray    # float16 [..., K/32]: the block's sum term (CPU: d·Σq, CUDA: Σx)
    qs: np.ndarray   # int8 [..., K]


class Q8_KBlocks(NamedTuple):
    d: np.ndarray      # float32 [..., K/256]
    qs: np.ndarray     # int8 [..., K]
    bsums: np.ndarray  # int16 [..., K/16]: sums of 16 quants


def _activation_blocks(x, block: int, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise BrassError(f"{name} quantizes rows whose length is a multiple of {block}; "
                         f"got shape {x.shape}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _to_f16(v: np.ndarray) -> np.ndarray:
    # Round to nearest even, as F16C's vcvtps2ph and CUDA's __float2half_rn; beyond ±65504
    # (a block with amax > 8.3e6) that is ±inf in llama.cpp too.
    with np.errstate(over="ignore"):
        return v.astype(np.float16)


def _q8_avx2(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The AVX2 `quantize_row_q8_0`/`_q8_1` core: (float32 d, int8 q) per 32-element block.

    d = amax/127 (a division), but the quants use id = 127/amax (a second division, not 1/d)
    and `_mm256_round_ps(_MM_ROUND_NEAREST)`, i.e. ties to even — where the scalar reference
    uses 1/d and roundf (ties away from zero).
    """
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    # |x·id| <= amax·(127/amax), which rounds to 127: the int8 cast never wraps (and the
    # saturating packs of the AVX2 code never act).
    return d, np.rint(xb * inv[..., None]).astype(np.int8)


def quantize_q8_0(x) -> Q8_0Blocks:
    """Q8_0 activation blocks as `quantize_row_q8_0` on x86-64 AVX2 (the from_float of Q8_0)."""
    xb = _activation_blocks(x, 32, "Q8_0")
    d, q = _q8_avx2(xb)
    return Q8_0Blocks(_to_f16(d), q.reshape(*xb.shape[:-2], -1))


def quantize_q8_1(x) -> Q8_1Blocks:
    """Q8_1 activation blocks as `quantize_row_q8_1` on x86-64 AVX2: s = fp16(d·Σq) with d
    the float32 scale before its own fp16 rounding."""
    xb = _activation_blocks(x, 32, "Q8_1")
    d, q = _q8_avx2(xb)
    s = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)
    return Q8_1Blocks(_to_f16(d), _to_f16(s), q.reshape(*xb.shape[:-2], -1))


def quantize_q8_k(x) -> Q8_KBlocks:
    """Q8_K activation blocks as `quantize_row_q8_K_ref`, which b11312's x86 build calls.

    The scale comes from the signed element of largest magnitude (the first one on ties):
    iscale = -127/max, q = min(127, nearest_int(iscale·x)) with nearest_int's ties-to-even, and
    d = 1/iscale. An all-zero block gets d = 0 and zero quants.

    With weight repacking (llama.cpp's default), Q4_K-style weights take their activations
    from `ggml_quantize_mat_q8_K_4x8` instead, four rows at a time; it gives the same values,
    but where +amax and -amax both occur in a block it may pick the other sign for d (and
    negate the quants with it).
    """
    xb = _activation_blocks(x, QK_K, "Q8_K")
    idx = np.abs(xb).argmax(axis=-1)
    vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    nonzero = vmax != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nonzero, np.float32(-127) / vmax, np.float32(0)).astype(np.float32)
        d = np.where(nonzero, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale[..., None]), 127).astype(np.int8)
    bsums = q.reshape(*q.shape[:-1], QK_K // 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    lead = xb.shape[:-2]
    return Q8_KBlocks(d, q.reshape(*lead, -1), bsums.reshape(*lead, -1))


# Elements round_to_f16 works on at a time: its temporaries (the bits, |x|, the masks) stay a few
# tens of MB beside the result, where a whole LM head at once (151,936 x 896) made 1.3 GB of them.
_F16_CHUNK = 1 << 22


def round_to_f16(a) -> np.ndarray:
    """float32 values rounded to float16 and back (`a.astype(float16).astype(float32)`), bit
    for bit, ~3x faster: the numpy backend rounds whole weight matrices this way on every
    prompt GEMM of the CUDA backend's arithmetic (q8_1 mode), where astype's conversion was
    the largest cost. In float16's normal range (2^-14 <= |x| < 65520) rounding to nearest
    even is the float32 bits rounded at bit 13; float16's subnormals, overflow to inf and NaN
    (rare: weights and activations are neither) go through astype."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty_like(a)
    flat_in, flat_out = a.reshape(-1), out.reshape(-1)
    for i in range(0, flat_in.size, _F16_CHUNK):
        x = flat_in[i:i + _F16_CHUNK]
        u = x.view(np.uint32)
        r = flat_out[i:i + _F16_CHUNK].view(np.uint32)
        np.right_shift(u, np.uint32(13), out=r)
        r &= np.uint32(1)
        r += np.uint32(0xFFF)
        r += u                              # no carry out: |x| < 65520 stays below 2^31
        r &= np.uint32(0xFFFFE000)
        mag = np.abs(x)
        rare = np.flatnonzero((mag < np.float32(2.0 ** -14)) | ~(mag < np.float32(65520.0)))
        if rare.size:
            with np.errstate(over="ignore"):
                flat_out[i + rare] = x[rare].astype(np.float16).astype(np.float32)
    return out


def _roundf(r: np.ndarray) -> np.ndarray:
    """C's roundf (ties away from zero). floor(|r| + 0.5) would be wrong: 0.49999997 + 0.5
    rounds up to 1 in float32. The fraction r - trunc(r) is exact, so compare it instead."""
    t = np.trunc(r)
    return t + np.where(np.abs(r - t) >= 0.5, np.sign(r), 0).astype(r.dtype)


def quantize_q8_1_cuda(x) -> Q8_1Blocks:
    """Q8_1 blocks as llama.cpp's CUDA `quantize_q8_1` kernel computes them.

    One warp per 32-element block: d = amax/127, q = roundf(x/d) (ties away from zero, a true
    division), and ds = half2(d, Σx) where Σx is the warp's xor-butterfly sum (offsets 16, 8,
    4, 2, 1), reproduced here in that order. llama.cpp builds its CUDA code with
    -use_fast_math, which makes x/d an approximate division; that build can differ from this
    one by one quant where x/d lies within an ulp or two of a half-integer.
    """
    xb = _activation_blocks(x, 32, "Q8_1")
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = xb / d[..., None]
        q = np.where(amax[..., None] == 0, 0, _roundf(r)).astype(np.int8)
    s = xb
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return Q8_1Blocks(_to_f16(d), _to_f16(s[..., 0]), q.reshape(*xb.shape[:-2], -1))


def dequantize_q8_1(d: np.ndarray, s: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The values Q8_1 blocks stand for, fp32(d)·q, as float32 [..., K]. (`s`, the block's sum
    term, enters a dot product only against a weight's min; it is taken so that
    `dequantize_q8_1(*blocks)` reads naturally.)"""
    q = qs.reshape(*d.shape, 32).astype(np.float32)
    return (q * d.astype(np.float32)[..., None]).reshape(qs.shape)


def fp32_to_bf16_bits(x) -> np.ndarray:
    """ggml's fp32 → bf16 (`ggml_compute_fp32_to_bf16`): round to nearest even, NaN made quiet."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16
    return np.where(nan, (u >> 16) | 64, rounded).astype(np.uint16)


def round_activations(x, vec_dot_type) -> np.ndarray:
    """The float32 values the CPU dot product effectively uses for activations `x` [..., K]
    once converted to `vec_dot_type` (see VEC_DOT_TYPE): fp16(d)·q for Q8_0/Q8_1, d·q for Q8_K,
    the value rounded to F16/BF16, x itself for F32.

    For Q8_1 the dot product also uses the block's stored s = fp16(d·Σq) against the weight's
    min, which is not a per-element value; it is in `quantize_q8_1(x).s`.
    """
    try:
        t = GGMLType(int(vec_dot_type))
    except (ValueError, TypeError):
        raise UnsupportedError(f"unknown ggml type {vec_dot_type!r}") from None
    x = np.asarray(x, dtype=np.float32)
    if t == GGMLType.F32:
        return x.copy()
    if t == GGMLType.F16:
        with np.errstate(over="ignore"):    # beyond ±65504 is ±inf in ggml's conversion too
            return x.astype(np.float16).astype(np.float32)
    if t == GGMLType.BF16:
        return (fp32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    if t in (GGMLType.Q8_0, GGMLType.Q8_1):
        # Q8_1's d and quants are Q8_0's; only its extra s field differs.
        b = quantize_q8_1(x)
        return dequantize_q8_1(*b)
    if t == GGMLType.Q8_K:
        b = quantize_q8_k(x)
        q = b.qs.reshape(*b.d.shape, QK_K).astype(np.float32)
        return (q * b.d[..., None]).reshape(x.shape)
    raise UnsupportedError(f"{t.name} is not an activation type of the CPU dot products")


# --------------------------------------------------------------------------------------------
# Random blocks and quantization for tests.
# --------------------------------------------------------------------------------------------

def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _scales(rng: np.random.Generator, n: int, lo: float, hi: float, signed: bool) -> np.ndarray:
    # Log-uniform magnitudes, as block scales spread over orders of magnitude in a real model.
    v = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    if signed:
        v *= rng.choice([-1.0, 1.0], n)
    return v


def random_blocks(qtype, n_rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random data of `n_rows` rows of `row_len` elements of `qtype`: [n_rows, row_bytes].

    Quant bits are uniformly random; fp16 scales (and the e8m0 exponent of MXFP4) are finite and
    sized so dequantized values are O(0.01-1), as in a real model. Float types get random
    values of that size (never NaN/Inf).
    """
    qtype = _ggml_type(qtype)
    row_len = int(row_len)
    _check_row_len(qtype, row_len)
    blck, tsize = BLOCK_SIZES[qtype]
    n_el = int(n_rows) * row_len
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        x = (rng.standard_normal(n_el) * 0.3).astype(np.float32)
        if qtype == GGMLType.F16:
            raw = x.astype("<f2").view(np.uint8)
        elif qtype == GGMLType.BF16:
            raw = fp32_to_bf16_bits(x).view(np.uint8)
        else:
            raw = x.view(np.uint8)
        return raw.reshape(int(n_rows), -1)
    n = n_el // blck
    b = rng.integers(0, 256, size=(n, tsize), dtype=np.uint8)
    # Scale ranges keep |scale · largest quant| at or below ~1.
    if qtype == GGMLType.Q8_0:
        _put_f16(b, 0, _scales(rng, n, 1e-4, 8e-3, signed=False))
    elif qtype in (GGMLType.Q4_0, GGMLType.Q5_0):
        top = 0.12 if qtype == GGMLType.Q4_0 else 0.06
        _put_f16(b, 0, _scales(rng, n, 1e-3, top, signed=True))
    elif qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
        top = 0.06 if qtype == GGMLType.Q4_1 else 0.03
        _put_f16(b, 0, _scales(rng, n, 1e-3, top, signed=False))
        _put_f16(b, 2, -rng.uniform(0.0, 0.5, n))
    elif qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        top = 1e-3 if qtype == GGMLType.Q4_K else 5e-4
        _put_f16(b, 0, _scales(rng, n, top / 10, top, signed=False))
        _put_f16(b, 2, _scales(rng, n, top / 10, top, signed=False))
    elif qtype == GGMLType.Q6_K:
        _put_f16(b, 208, _scales(rng, n, 2e-5, 2.4e-4, signed=False))
    elif qtype == GGMLType.MXFP4:
        # 12 · 2^(e-128) for e in [117, 124] spans ~0.006 to 0.75.
        b[:, 0] = rng.integers(117, 125, n, dtype=np.uint8)
    return b.reshape(int(n_rows), -1)


# gguf-py quantizes these; we delegate to it rather than keep a second copy.
QUANTIZABLE_TYPES: tuple[GGMLType, ...] = (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
    GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.MXFP4,
)


def quantize(x, qtype) -> np.ndarray:
    """Quantize float rows x [..., K] to `qtype` with gguf-py's `gguf.quants.quantize`
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4): bytes [..., row_bytes]."""
    # Imported here: gguf-py adds ~0.1 s to the engine's start, and only this needs it.
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype = _ggml_type(qtype)
    if qtype not in QUANTIZABLE_TYPES:
        raise UnsupportedError(f"quantizing to {qtype.name} is not supported "
                               f"(supported: {', '.join(t.name for t in QUANTIZABLE_TYPES)})")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise BrassError("quantize needs rows, got a scalar")
    _check_row_len(qtype, x.shape[-1])
    out = gguf_quantize(x, GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(out).view(np.uint8).reshape(*x.shape[:-1], -1)
