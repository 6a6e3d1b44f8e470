"""Attention over the KV cache (kernels/attention.cu): kv_store, the attention kernel of a
decode step (one token, or a batched step's rows, each over its own cache) and of a prompt
that the tiled kernel does not take (attention_tiled.py, tried first), and the device tables
of a batched step's rows' cache addresses that these kernels and fused.cu's rope_store read.

A block per (head, query) with the query's row of logits in shared memory; the output's Q8_1
blocks (for the output projection) are written beside it and remembered.
"""

from __future__ import annotations

import cupy
import numpy as np

from ...errors import BrassError
from . import attention_tiled, quantize
from .common import F16, F32, Q8_1_BLOCK_BYTES, f32, i32
from .params import pack

KV_STORE_THREADS = 256
ATTN_THREADS = 128
ATTN_WARPS = ATTN_THREADS // 32
ROW_TABLES_KEPT = 4096          # (layer, batch composition) tables kept before they are dropped


def launched_kernels() -> list[tuple[str, str]]:
    return [("attention.cu", "kv_store"), ("attention.cu", "attention")] + attention_tiled.launched_kernels()


def no_direct_cache(b, what: str):
    """While a bucket graph is captured every cache must be reached through the row tables
    (they are rewritten before each replay); an address baked in would be that of a session
    that may be gone by the next replay."""
    if b.row_tables_override is not None:
        raise BrassError(f"{what}: a cache reached directly while a bucket graph is captured")


def row_pointers(b, layers, what: str):
    """Device arrays of the K and V cache addresses of a batched step's rows and the capacity
    that bounds them, after checking that every row's caches have the first row's layout. The
    kernels bound slots by the largest capacity (or a bucket graph's, larger): each row's
    position is checked against its own cache on the host before the step (engine/batch.py)."""
    k0, v0 = layers[0]
    for kc, vc in layers:
        if (kc.dtype != F16 or vc.dtype != F16 or not kc.flags.c_contiguous or not vc.flags.c_contiguous
                or kc.shape[1:] != k0.shape[1:] or vc.shape[1:] != v0.shape[1:]
                or kc.shape[0] != vc.shape[0]):
            raise BrassError(f"{what}: the rows' caches differ in layout ({kc.shape} / {vc.shape} "
                             f"against {k0.shape} / {v0.shape})")
    if b.row_tables_override is not None:
        return b.row_tables_override(layers)
    cap = max(kc.shape[0] for kc, _ in layers)
    key = tuple((kc.data.ptr, vc.data.ptr) for kc, vc in layers)
    dev = b._row_tables.get(key)
    if dev is not None and b._graph_refs is not None:
        b._graph_refs.append(dev)    # a captured graph reads it at every replay
    if dev is None:
        # An upload per (layer, batch composition), not per launch: rope_store and attention
        # of a layer share it, and so do the steps while the batch is unchanged.
        if len(b._row_tables) >= ROW_TABLES_KEPT:
            b._row_tables.clear()
        ptrs = np.array([[k for k, _ in key], [v for _, v in key]], np.uint64)
        dev = b._row_tables[key] = cupy.asarray(ptrs)
    return dev[0], dev[1], cap


def kv_store(b, cache, x, pos):
    no_direct_cache(b, "kv_store")
    x = f32(x, "kv_store")
    pos = i32(pos, "kv_store pos")
    if cache.dtype != F16 or not cache.flags.c_contiguous:
        raise BrassError("kv_store: the cache must be a contiguous float16 device array")
    T = pos.shape[0]
    row = int(np.prod(cache.shape[1:]))
    if x.size != T * row:
        raise BrassError(f"kv_store: x of shape {x.shape} does not fill {T} slots of {cache.shape[1:]}")
    if T:
        b.launch("attention.cu", "kv_store", (-(-row // KV_STORE_THREADS), T), KV_STORE_THREADS, x, pos, cache,
                 params=pack("KvStoreParams", n_tokens=T, row_elems=row, capacity=cache.shape[0]))


def attention(b, q, k_cache, v_cache, pos, scale, window=0, row_caches=None):
    """q's attention over the caches (each row over its own with row_caches: [(k, v)] a row);
    [T, H * Dv], its Q8_1 blocks remembered."""
    q = f32(q, "attention")
    pos = i32(pos, "attention pos")
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise BrassError("attention: expected q [T, H, Dh] and caches [n_ctx, H_kv, D]")
    T, H, Dh = q.shape
    cap, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[2]
    if Dk != Dh or v_cache.shape[:2] != (cap, Hkv) or H % Hkv:
        raise BrassError(f"attention: q {q.shape} does not fit caches {k_cache.shape} / {v_cache.shape}")
    if k_cache.dtype != F16 or v_cache.dtype != F16:
        raise BrassError("attention: the KV cache must be float16")
    if Dh % 2 or Dv % 2:
        raise BrassError(f"attention: head dims {Dh}/{Dv} must be even")
    out = b._out((T, H * Dv), F32)
    write_q8 = Dv % 32 == 0
    out_q = b._out((T, H * Dv // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else out
    if row_caches is None:
        no_direct_cache(b, "attention")
        if b.options.attn_tiled and T >= 2 and attention_tiled.attention_tiled(
                b, q, k_cache, v_cache, pos, scale, window, out, out_q, write_q8):
            if write_q8:
                quantize.remember(b, out, out_q)
            return out
    rows = row_pointers(b, row_caches, "attention") if row_caches is not None else None
    if rows is not None:
        *rows, cap = rows
    n_slots = min(cap, window) if window > 0 else cap
    params = pack("AttentionParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=Dh, head_dim_v=Dv,
                  capacity=cap, n_slots=n_slots, window=max(0, window), scale=scale, write_q8=int(write_q8),
                  per_row=int(rows is not None))
    if T:
        smem = 4 * (Dh + n_slots + ATTN_WARPS * Dv)
        k_rows, v_rows = rows if rows is not None else (pos, pos)   # unread unless per_row
        b.launch("attention.cu", "attention", (H, T), ATTN_THREADS, q, k_cache, v_cache, pos, out, out_q,
                 k_rows, v_rows, params=params, smem=smem)
    if T and write_q8:
        quantize.remember(b, out, out_q)
    return out
