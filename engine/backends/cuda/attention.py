"""Attention over the paged KV cache (kernels/attention.cu): kv_store, the attention kernel of a
decode step (one token, or a batched step's rows, each over its own sequence) and of a prompt
that the tiled kernel does not take (attention_tiled.py, tried first), and the device block
tables of a batched step's rows that these kernels and fused.cu's rope_store read.

A sequence's cache is its layer in a block pool (engine/kv_cache.py PagedLayer): the layer's
pool `[n_blocks, BLOCK_TOKENS, H_kv, D]` float16 and the sequence's device block table (int32,
kept by its BlockTable, rewritten in place when its blocks change). Every kernel reaches
position s at pool row table[s / 16] * 16 + s % 16 (kernels/common.cuh kv_row): there is no
contiguous cache on this backend.

A block per (head, query) with the query's row of logits in shared memory; or, for a decode
at depth, the split-K kernels (attention.cu's head comment): the row's slots in splits of
ATTN_SPLIT_SLOTS, three launches in which a few blocks take each row's splits in turn
(SPLIT_BLOCKS_PER_SM): in passes 1 and 3 a block column of a KV group's query heads (the
kernels cut the group by the splits in use: split_group_blocks), reading a K or V row once for
them, in pass 2 a (head, query) row; their logits and partial sums in a scratch buffer of the
backend's. The output's Q8_1 blocks (for the output projection) are written beside it
and remembered.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from ...errors import BrassError
from ...kv_cache import BLOCK_TOKENS, PagedLayer
from . import attention_tiled, quantize
from .common import F16, F32, Q8_1_BLOCK_BYTES, f32, i32
from .compiler import define
from .params import pack

KV_STORE_THREADS = 256
ATTN_THREADS = 128
ATTN_WARPS = ATTN_THREADS // 32
ROW_TABLES_KEPT = 4096          # (batch composition) tables kept before they are dropped
if define("common.cuh", "KV_BLOCK") != BLOCK_TOKENS:
    raise ImportError("kernels/common.cuh KV_BLOCK differs from engine/kv_cache.py BLOCK_TOKENS")
SPLIT_SLOTS = define("attention.cu", "ATTN_SPLIT_SLOTS")
SPLIT_HEADS = define("attention.cu", "ATTN_SPLIT_HEADS")
# The one-block kernel's static shared memory (red_max: a float a warp; red_sum: a double a
# warp; and the 1 KiB sm_90 reserves a block, counted here whether or not the driver counts
# it: a few slots fewer for the one-block kernel, never a failed launch), beside its dynamic
# 4 * (Dh + n_slots + ATTN_WARPS * Dv) bytes: together they must fit the device's opt-in limit
# per block (sharedMemPerBlockOptin: 227 KiB on the H100 and H200, ~57,000 slots at head dims
# 128), or the launch fails; past it the split kernels take the call. test_kernel_resources.py
# checks this against NVRTC's build.
ATTN_STATIC_SMEM = 1024 + 4 * ATTN_WARPS + 8 * ATTN_WARPS
# With the attn_split option at its default (None), the split kernels take every decode-sized
# call (takes_split): timed against the one-block kernel on the GPU (`ci/gpu.sh depth`), they
# were never slower, near an empty context or at any depth (figures: perf/NOTES.md), so no
# threshold (and a row takes the same kernel alone as in a batched step's bucket graph,
# whatever their capacities).
# The split kernels' scratch (logits, partial sums) for at most this many bytes of queries at
# a time: a call with more (a prompt the tiled kernel does not take, past the one-block
# kernel's shared memory or with attn_split on) is launched in groups of queries.
SPLIT_SCRATCH_BYTES = 128 << 20
SPLIT_KERNELS = ("attention_split_logits", "attention_split_sums", "attention_split_values")
# Blocks a split kernel launches for an SM (all (head, query) rows together, each row's up to
# one a split; passes 1 and 3 spread them over the block columns of the cut, each column's
# lanes taking its splits in turn, pass 2 over the rows): enough to fill the GPU (16 blocks of
# 128 threads are resident an SM), few enough that the splits past a short context (the
# number of splits comes from the capacity) cost no block. Not yet timed against others.
SPLIT_BLOCKS_PER_SM = 8
# Passes 1 and 3 share each K and V row among the query heads of a block column
# (split_group_blocks): the fewest columns a KV group whose (column, split, query) work items
# still number SPLIT_GROUP_FILL an SM. A block's heads are computed one after another, so a
# column of G heads takes about G times a head's time: where the GPU would be left part idle,
# a block per head is faster. Measured on an H100 (132 SMs), tg128 of the Qwen3-8B shape (8 KV
# heads of 4 query heads; brass bench --depth, a call of the same process, 2026-12-06): a
# column a group lost at depth 1 (266 against 299 tok/s a block a head) and at 4,096 (17
# splits: 136 items, 1.0 an SM; 191 against 229) and won at 16,384 (65 splits: 520 items, 3.9
# an SM; 171 against 131). 3 lies between; the points between were not measured. The kernels
# cut by the splits in use at the step's position, read on the device (attention.cu
# split_columns): cut by the capacity's splits instead (a graph's grid is fixed at capture),
# a capacity of 32,768 lost 8 % at depth 1 and 16 % at 1,024 against a block a head (the same
# H100, the same day); cut by the splits in use, it runs as a block a head there (294 and 239
# tok/s) and keeps the column's win at 16,384 (167 against 122).
SPLIT_GROUP_FILL = 3


def launched_kernels() -> list[tuple[str, str]]:
    return ([("attention.cu", "kv_store"), ("attention.cu", "attention")]
            + [("attention.cu", k) for k in SPLIT_KERNELS] + attention_tiled.launched_kernels())


def no_direct_cache(b, what: str):
    """While a bucket graph is captured every row's table must come from the graph's own
    block tables (rewritten before each replay); a sequence's table baked in would be that of a
    sequence that may be gone by the next replay."""
    if b.row_tables_override is not None:
        raise BrassError(f"{what}: a sequence's cache reached directly while a bucket graph is captured")


def paged(layer, what: str, width: int | None = None):
    """A sequence's layer checked: (pool, device block table, the sequence's slots)."""
    if not isinstance(layer, PagedLayer) or layer.cache.device is None:
        raise BrassError(f"{what}: the KV cache must be a sequence's layer in a device block pool "
                         f"(PagedKVCache), not {type(layer).__name__}")
    pool = layer.pool
    if (not isinstance(pool, cupy.ndarray) or pool.dtype != F16 or not pool.flags.c_contiguous
            or pool.ndim != 4 or pool.shape[1] != BLOCK_TOKENS or (width is not None and pool.shape[3] != width)):
        raise BrassError(f"{what}: a block pool must be a contiguous float16 device array "
                         f"[n_blocks, {BLOCK_TOKENS}, H_kv, D], not {getattr(pool, 'shape', None)}")
    return pool, layer.cache.device, layer.cache.n_ctx


def row_tables(b, layers, what: str):
    """For a batched step's rows (`layers`: a (k, v) layer per row): (k pool, v pool, block
    tables [rows, stride] int32 on the device, stride, the largest of the rows' slots), or
    None when the rows' sequences are not all in one pool pair (the caller then takes the rows
    one at a time). The kernels bound slots by the largest capacity (or a bucket graph's):
    each row's position is within its own sequence's (engine/batch.py checks it).

    The tables are gathered on the device from the rows' own device tables, once per step
    (CudaBackend.rows_independent counts the steps): a step captured as a graph copies them
    at every replay, so it follows the rows' blocks as they change."""
    k0, v0 = layers[0]
    kp, _, _ = paged(k0, what)
    vp, _, _ = paged(v0, what)
    for k, v in layers:
        if k.pool is not kp or v.pool is not vp or k.cache is not v.cache or k.cache.device is None:
            return None
    if b.row_tables_override is not None:
        tab, stride, cap = b.row_tables_override(layers)
        return kp, vp, tab, stride, cap
    key = tuple(id(k.cache) for k, _ in layers)
    cap = max(k.cache.n_ctx for k, _ in layers)
    got = b._row_tables.get(key)
    if got is None or got[0] != b._row_step:
        if len(b._row_tables) >= ROW_TABLES_KEPT:
            b._row_tables.clear()
        stride = max(len(k.cache.device) for k, _ in layers)
        tab = got[1] if got is not None and got[1].shape == (len(layers), stride) else None
        if tab is None:
            tab = cupy.full((len(layers), stride), -1, np.int32)
        for r, (k, _) in enumerate(layers):
            tab[r, :len(k.cache.device)] = k.cache.device
        got = b._row_tables[key] = (b._row_step, tab, stride)
    if b._graph_refs is not None:
        b._graph_refs.append(got[1])    # a captured graph reads it at every replay
    return kp, vp, got[1], got[2], cap


def kv_store(b, cache, x, pos):
    no_direct_cache(b, "kv_store")
    pool, table, cap = paged(cache, "kv_store")
    x = f32(x, "kv_store")
    pos = i32(pos, "kv_store pos")
    T = pos.shape[0]
    row = int(np.prod(pool.shape[2:]))
    if x.size != T * row:
        raise BrassError(f"kv_store: x of shape {x.shape} does not fill {T} slots of {pool.shape[2:]}")
    if T:
        b.launch("attention.cu", "kv_store", (-(-row // KV_STORE_THREADS), T), KV_STORE_THREADS, x, pos, table,
                 pool, params=pack("KvStoreParams", n_tokens=T, row_elems=row, capacity=cap))


def attention(b, q, k_cache, v_cache, pos, scale, window=0, row_caches=None):
    """q's attention over a sequence's layer (k_cache, v_cache: PagedLayers), or with
    row_caches ([(k, v)] a row, all in one pool pair: see row_tables) each row over its own;
    [T, H * Dv], its Q8_1 blocks remembered."""
    q = f32(q, "attention")
    pos = i32(pos, "attention pos")
    if q.ndim != 3:
        raise BrassError("attention: expected q [T, H, Dh]")
    T, H, Dh = q.shape
    kp, table, cap = paged(k_cache, "attention")
    vp, _, _ = paged(v_cache, "attention")
    if v_cache.cache is not k_cache.cache:
        raise BrassError("attention: keys and values of different sequences")
    Hkv, Dk, Dv = kp.shape[2], kp.shape[3], vp.shape[3]
    if Dk != Dh or vp.shape[:3] != kp.shape[:3] or H % Hkv:
        raise BrassError(f"attention: q {q.shape} does not fit pools {kp.shape} / {vp.shape}")
    if Dh % 2 or Dv % 2:
        raise BrassError(f"attention: head dims {Dh}/{Dv} must be even")
    out = b._out((T, H * Dv), F32)
    write_q8 = Dv % 32 == 0
    out_q = b._out((T, H * Dv // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else out
    stride = 0
    if row_caches is None:
        no_direct_cache(b, "attention")
        if b.options.attn_tiled and T >= 2 and attention_tiled.attention_tiled(
                b, q, kp, vp, table, pos, cap, scale, window, out, out_q, write_q8):
            if write_q8:
                quantize.remember(b, out, out_q)
            return out
    else:
        rows = row_tables(b, row_caches, "attention")
        if rows is None:
            raise BrassError("attention: the rows' sequences are not in one block pool")
        kp, vp, table, stride, cap = rows
    n_slots = min(cap, window) if window > 0 else cap
    fields = dict(n_heads=H, n_kv_heads=Hkv, head_dim=Dh, head_dim_v=Dv, capacity=cap, n_slots=n_slots,
                  window=max(0, window), scale=scale, write_q8=int(write_q8), per_row=int(row_caches is not None),
                  table_stride=stride, split_fill=split_fill(b.n_sms))
    smem = 4 * (Dh + n_slots + ATTN_WARPS * Dv)
    if T and takes_split(b, n_slots, smem, decode=T == 1 or row_caches is not None):
        attention_split(b, q, kp, vp, pos, table, out, out_q, fields, row_caches is not None)
    elif T:
        b.launch("attention.cu", "attention", (H, T), ATTN_THREADS, q, kp, vp, pos, table, out, out_q,
                 params=pack("AttentionParams", n_tokens=T, **fields), smem=smem)
    if T and write_q8:
        quantize.remember(b, out, out_q)
    return out


def takes_split(b, n_slots: int, smem: int, decode: bool) -> bool:
    """Whether the split kernels take a call over n_slots, where the one-block kernel would
    need `smem` bytes of dynamic shared memory: always where that does not fit the device (a
    correctness matter: the one-block launch would fail), else as the attn_split option says
    (None: every decode-sized call).

    Decode-sized (`decode`): one query (a step's token), or a batched step's rows, each row
    one query over its own sequence. Those are what the split serves: the one-block kernel
    gives each (head, query) one block that reads the whole context serially, H blocks a
    decode step. A prompt's T queries over one sequence already give it H * T blocks, and the
    split would add two launches for each group of queries, untimed on the GPU; so a prompt
    the tiled kernel declines keeps the one-block kernel by default."""
    if smem + ATTN_STATIC_SMEM > b.smem_optin_limit:
        return True
    on = b.options.attn_split
    return decode if on is None else bool(on)


def split_scratch(b, nbytes: int):
    """The backend's scratch of the split kernels, at least nbytes: one buffer every call
    shares (the calls run one after another on the backend's stream, graph replays too), grown
    when too small. It is allocated outside any memory pool, also during a graph capture (a
    captured graph keeps the buffer it reads, by reference, when a later call grows it), so
    that neither a capture's pool nor a replay hands it to another array."""
    buf = b._split_scratch
    if buf is None or buf.size < nbytes:
        if buf is not None and b._graph_refs is not None:
            b._graph_refs.append(buf)   # freed with the graph: no cudaFree while a stream captures
        b._split_scratch = buf = None
        mem = cupy.cuda.Memory(nbytes)
        buf = b._split_scratch = cupy.ndarray((nbytes,), np.uint8, cupy.cuda.MemoryPointer(mem, 0))
    if b._graph_refs is not None:
        b._graph_refs.append(buf)
    return buf


def split_chunk_heads(G: int) -> int:
    """attention.cu split_chunk_heads: the query heads a split block of a KV group of G holds
    at once (its first chunk's), which its shared memory is sized for: the largest power of two
    up to min(G, SPLIT_HEADS)."""
    return 1 << (min(G, SPLIT_HEADS).bit_length() - 1)


def split_fill(n_sms: int) -> int:
    """AttentionParams.split_fill: the (column, split, query) items that fill the GPU,
    SPLIT_GROUP_FILL an SM (an int32; a fill past it never shares a block column)."""
    return min(math.ceil(SPLIT_GROUP_FILL * n_sms), 2**31 - 1)


def split_group_blocks(G: int, Hkv: int, S: int, n: int, fill: int) -> int:
    """The block columns GB a KV group of G query heads is cut into in split passes 1 and 3
    when each of n queries has S splits in use (attention.cu split_columns, the same rule: each
    column's G / GB heads read a K or V row once): the smallest divisor of G whose columns give
    `fill` (column, split, query) items; G (a block a head) where none does. The kernels take
    it at each step's position; at the capacity's splits it is the fewest any position takes,
    which sizes their shared memory. The bits do not depend on it."""
    for gb in range(1, G):
        if G % gb == 0 and Hkv * gb * S * n >= fill:
            return gb
    return G


def attention_split(b, q, kp, vp, pos, table, out, out_q, fields: dict, per_row: bool):
    """The split kernels' three launches, for groups of queries whose scratch fits
    SPLIT_SCRATCH_BYTES (one group for a decode step): S = ceil(n_slots / SPLIT_SLOTS) splits
    a (head, query) row, fixed by the capacity so that a captured graph holds at every position.
    Each pass launches up to S blocks a (head, query) (SPLIT_BLOCKS_PER_SM); passes 1 and 3 cut
    each KV group into block columns on the device, by the splits in use (split_group_blocks),
    and spread those blocks over the columns. The result depends on none of it."""
    T, H, Hkv = q.shape[0], fields["n_heads"], fields["n_kv_heads"]
    Dh, Dv = fields["head_dim"], fields["head_dim_v"]
    S = -(-fields["n_slots"] // SPLIT_SLOTS)
    G = H // Hkv
    # bytes a query's rows take: logits, partial sums, split maxima (float32), split sums
    # (float64), a done counter (int32) a block column (at most one a head)
    per_query = H * S * (4 * SPLIT_SLOTS + 4 * Dv + 4 + 8) + 4 * H
    group = max(1, min(T, SPLIT_SCRATCH_BYTES // per_query))
    sizes = [group * H * S * SPLIT_SLOTS * 4, group * H * S * Dv * 4, group * H * S * 8, group * H * S * 4,
             group * H * 4]
    offsets = np.cumsum([0] + [-(-n // 256) * 256 for n in sizes])
    buf = split_scratch(b, int(offsets[-1]))
    if b.poison_outputs:     # NaN floats and doubles, counters -1: what a kernel fails to write shows
        buf[:int(offsets[-1])].fill(0xFF)
    logit, part, ssum, smax, done = (buf[int(o):int(o) + n].view(t) for o, n, t in
                                     zip(offsets, sizes, (np.float32, np.float32, np.float64, np.float32, np.int32)))
    out_rows = out.reshape(T, -1)
    q_rows = out_q.reshape(T, -1)
    for t0 in range(0, T, group):
        t1 = min(T, t0 + group)
        n = t1 - t0
        params = pack("AttentionParams", n_tokens=n, **fields)
        qt, pt = q[t0:t1], pos[t0:t1]
        tab = table[t0:t1] if per_row else table
        blocks = SPLIT_BLOCKS_PER_SM * b.n_sms
        # shared memory for the widest column any position takes (the cut at every split used)
        nh = split_chunk_heads(G // split_group_blocks(G, Hkv, S, n, fields["split_fill"]))
        grid = (H, min(S, max(1, -(-blocks // (H * n)))), n)  # every pass: up to S blocks a (head, query)
        b.launch("attention.cu", "attention_split_logits", grid, ATTN_THREADS, qt, kp, pt, tab, logit, smax, done,
                 params=params, smem=4 * nh * Dh)
        b.launch("attention.cu", "attention_split_sums", grid, ATTN_THREADS, pt, logit, smax, ssum, params=params)
        b.launch("attention.cu", "attention_split_values", grid, ATTN_THREADS, vp, pt, tab, logit, smax, ssum, part,
                 done, out_rows[t0:t1], q_rows[t0:t1], params=params,
                 smem=4 * nh * (SPLIT_SLOTS + ATTN_WARPS * Dv))
