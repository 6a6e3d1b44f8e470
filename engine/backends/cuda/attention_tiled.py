"""A prompt's attention in tiles on tensor cores (kernels/attention_tiled.cu).

The same function as the `attention` kernel of attention.cu, with the same roundings where
they matter (Q to F16 before K.Q, float32 logits, the softmax normalised before its rounding
to F16, float32 P.V; see the kernel's header comment for the float32-ulp-level differences
and kernels/cases.py ATTENTION for the bound that covers them), for T >= 2 queries of one
sequence (one cache, positions on the device): blocks of 64 queries x 64 cache slots (32
when a head dim is 256), two passes over the slots, shared memory independent of the context
length, keys and values read through the sequence's block table (kernels/common.cuh kv_row).
The caller (CudaBackend.attention) tries it first and keeps attention.cu when it returns False:
one token (decode), a batched decode step's rows (per_row: one sequence per row, not one
prompt), head dims without a kernel, or a GPU whose shared memory is too small for the tile.
"""

from __future__ import annotations

import re

import numpy as np

from ...errors import BrassError
from .common import F16, F32, Q8_1_BLOCK_BYTES
from .compiler import define, source_text
from .params import pack

SOURCE = "attention_tiled.cu"
THREADS, BQ = define(SOURCE, "ATTN_TILED_THREADS"), define(SOURCE, "ATTN_TILED_BQ")
# (D, DV) of every attention_tiled_<D>_<DV> the source instantiates
HEAD_DIMS = tuple((int(d), int(dv)) for d, dv in
                  re.findall(r"^ATTN_TILED_KERNEL\(\w+, (\d+), (\d+)\)", source_text(SOURCE), re.M))
MIN_TOKENS = 2                          # one token is a decode step: attention.cu
# row_lo, row_hi [BQ] ints and row_sum [2][THREADS] doubles (ptxas: 2560 bytes at 128 threads)
STATIC_SMEM = 2 * 4 * BQ + 2 * 8 * THREADS


def tile_slots(d: int, dv: int) -> int:
    """Cache slots per K/V tile (ATTN_TILED_BK)."""
    return 32 if d > 128 or dv > 128 else 64


def smem_bytes(d: int, dv: int) -> int:
    """Dynamic shared memory of attention_tiled_<d>_<dv> (ATTN_TILED_SMEM): the Q tile, two K
    and two V tiles of halves, or the float32 output staging if larger."""
    return max(2 * (BQ * d + 2 * tile_slots(d, dv) * (d + dv)), 4 * BQ * (dv + 8))


def kernel_name(d: int, dv: int) -> str:
    return f"attention_tiled_{d}_{dv}"


def launched_kernels() -> list[tuple[str, str]]:
    """Every (source, kernel) attention_tiled() may launch (for backend.launched_kernels)."""
    return [(SOURCE, kernel_name(d, dv)) for d, dv in HEAD_DIMS]


def takes(n_tokens: int, d: int, dv: int, smem_limit: int) -> bool:
    """Whether attention_tiled() takes a prompt of n_tokens queries with head dims d / dv on a
    GPU that allows smem_limit bytes of shared memory per block."""
    return (n_tokens >= MIN_TOKENS and (d, dv) in HEAD_DIMS and -(-n_tokens // BQ) <= 65535
            and smem_bytes(d, dv) + STATIC_SMEM <= smem_limit)


def attention_tiled(backend, q, k_pool, v_pool, table, pos, capacity, scale, window, out, out_q, write_q8) -> bool:
    """Launch attention_tiled_<D>_<DV> on `backend` (a CudaBackend): q [T, H, D] float32, a
    layer's pools F16 [n_blocks, BLOCK_TOKENS, H_kv, D] / [..., DV] (v_pool may be k_pool
    itself), the sequence's block table (int32 on the device) and its slots `capacity`, pos [T]
    int32 on the device, out [T, H * DV] float32 and, with write_q8, out_q its Q8_1 blocks
    (T * H * DV / 32 blocks of 36 bytes). Returns False, launching nothing, for what it does
    not take (see takes(); also non-contiguous or unaligned arrays); raises BrassError for
    outputs of the wrong shape (the caller's bug)."""
    import cupy

    if not all(isinstance(a, cupy.ndarray) for a in (q, k_pool, v_pool, table, pos, out)):
        return False
    if q.ndim != 3 or k_pool.ndim != 4 or v_pool.ndim != 4:
        return False
    T, H, D = q.shape
    _, _, Hkv, Dk = k_pool.shape
    DV = v_pool.shape[3]
    if Dk != D or v_pool.shape[:3] != k_pool.shape[:3] or Hkv == 0 or H % Hkv or capacity <= 0:
        return False
    if not takes(T, D, DV, backend.smem_optin_limit):
        return False
    if q.dtype != F32 or k_pool.dtype != F16 or v_pool.dtype != F16 or table.dtype != np.int32:
        return False
    if not (q.flags.c_contiguous and k_pool.flags.c_contiguous and v_pool.flags.c_contiguous):
        return False
    if any(a.data.ptr % 16 for a in (q, k_pool, v_pool)):      # 16-byte vector loads
        return False
    if pos.shape != (T,) or pos.dtype.kind not in "iu":
        return False
    pos = cupy.ascontiguousarray(pos, dtype=np.int32)
    if out.dtype != F32 or out.shape != (T, H * DV) or not out.flags.c_contiguous:
        raise BrassError(f"attention_tiled: out must be float32 [{T}, {H * DV}], got {out.dtype} {out.shape}")
    if write_q8:
        if DV % 32:
            raise BrassError(f"attention_tiled: Q8_1 blocks need a head dim multiple of 32, not {DV}")
        if (out_q is None or out_q.dtype != np.uint8 or not out_q.flags.c_contiguous
                or out_q.size != T * H * DV // 32 * Q8_1_BLOCK_BYTES):
            raise BrassError(f"attention_tiled: out_q must hold {T * H * DV // 32} Q8_1 blocks")
    params = pack("AttentionTiledParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, capacity=int(capacity),
                  window=max(0, int(window)), scale=float(scale), write_q8=int(bool(write_q8)))
    backend.launch(SOURCE, kernel_name(D, DV), (H, -(-T // BQ)), THREADS, q, k_pool, v_pool, pos, table, out,
                   out_q if write_q8 else out, params=params, smem=smem_bytes(D, DV))
    return True
