"""A prompt's mat-muls: float16 GEMMs on tensor cores through cuBLAS (weights dequantized by
kernels/dequant.cu, or their kept float16 copies) and, for the experts of a MoE layer, int8
tiles planned on the device (kernels/mmq.cu: moe_plan, mmq_id_<type>).

Dense weights: x rounded to float16 once for every weight of a matmul_many, each weight as
float16 (an F16 weight's own bytes; a quantized one's copy kept since its first prompt while
the copies fit their budget, the f16_weights option; else dequantized a chunk of rows at a
time into a shared scratch), products summed in float32 by cuBLAS. Experts: with the moe_mmq
option, moe_plan sorts the (token, slot) pairs by expert on the device and one mmq_id launch
covers every expert's tiles (the mat-vec's integer arithmetic, no host synchronisation); else
the routing is planned on the host (moe_plan below) and each group of experts is one strided
batched GEMM.

State on the backend: `_gemm_scratch`, `_f16_copies` / `f16_weight_bytes` / `_f16_budget`,
`_own_blas`, `_gemm_scalars`, `_no_experts`, the plans `_plan` (host) and `_id_plan` (device).
"""

from __future__ import annotations

import cupy
import numpy as np

from ...gguf import GGMLType
from ..base import MMQ_BLOCK, uses_f16_gemm
from . import blas, matvec, quantize
from .common import F16, F32, TYPE_NAMES, grid_1d
from .compiler import define
from .errors import CudaError
from .params import pack

DEQUANT_THREADS = 256
GEMM_SCRATCH_BYTES = 256 << 20  # float16 weights dequantized at a time for the prompt GEMMs
# mmq_id_<type>: weight rows and tokens per thread block, threads per block; moe_plan's block
# and the experts it plans at most
MMQ_ROWS, MMQ_COLS, MMQ_THREADS = (define("mmq.cu", n) for n in ("MMQ_ROWS", "MMQ_COLS", "MMQ_THREADS"))
MOE_PLAN_THREADS, MOE_PLAN_MAX_E = define("mmq.cu", "MOE_PLAN_THREADS"), define("mmq.cu", "MOE_PLAN_MAX_E")


def launched_kernels() -> list[tuple[str, str]]:
    ks = [("dequant.cu", f"dequant_f16_{n}") for n in TYPE_NAMES.values()]
    ks += [("dequant.cu", "to_f16"), ("dequant.cu", "gather_rows_f16")]
    ks += [("mmq.cu", f"mmq_id_{TYPE_NAMES[t]}") for t in TYPE_NAMES if int(t) in MMQ_BLOCK]
    ks += [("mmq.cu", "moe_plan")]
    return ks


# -- dense weights -----------------------------------------------------------------------------

def prompt(b, x2, ws, ys, src):
    """A prompt's y = x2 @ W.T for each (W, y): the float16 GEMM where uses_f16_gemm says so (x
    converted once for all of them), matmul_<type>'s tiles otherwise (a few tokens, F32)."""
    T, K = x2.shape
    x16 = None          # x in float16, converted once for every GEMM
    for w, y in zip(ws, ys):
        if uses_f16_gemm(T, K, w.type):
            if x16 is None:
                x16 = to_f16(b, x2)
            gemm_f16(b, x2, w, y, x16)
        else:
            matvec.matmul_tiles(b, x2, w, y, src)


def to_f16(b, x2):
    """x rounded to float16 (the prompt GEMM's activations)."""
    x16 = cupy.empty(x2.shape, F16)
    b.launch("dequant.cu", "to_f16", grid_1d(x2.size, DEQUANT_THREADS), DEQUANT_THREADS, x2, x16,
             params=pack("GluParams", n=x2.size))
    return x16


def gemm_f16(b, x2, w, y, x16=None):
    """A prompt's mat-mul on tensor cores: x rounded to float16 (x16, if the caller already
    has it), the weight dequantized to float16 a chunk of rows at a time
    (GEMM_SCRATCH_BYTES) or its kept copy, products summed in float32 by cuBLAS.
    y [T, N] = x [T, K] @ W.T."""
    from cupy_backends.cuda.api import runtime
    cublas = blas.cupy_binding()
    T, K = x2.shape
    N = w.shape[0]
    if x16 is None:
        x16 = to_f16(b, x2)
    gemm = handle(b)
    alpha, beta = b._gemm_scalars
    kept = weight_f16(b, w)
    if kept is not None:        # the whole float16 matrix, dequantized by an earlier prompt
        chunk, scratch = N, kept
    else:
        chunk = max(1, min(N, GEMM_SCRATCH_BYTES // (2 * K)))
        scratch = scratch_f16(b, chunk * K)
    for r0 in range(0, N, chunk):
        n = min(chunk, N - r0)
        if kept is None:
            dequant_f16(b, w, r0, n, scratch)
        # Column-major view: C^T [n, T] (ld N) = W_chunk [n, K] . x^T; W_chunk is K x n
        # column-major (transposed), x^T is K x T column-major.
        gemm.gemmEx(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, T, K,
                    alpha.ctypes.data, scratch.data.ptr, runtime.CUDA_R_16F, K,
                    x16.data.ptr, runtime.CUDA_R_16F, K,
                    beta.ctypes.data, y.data.ptr + 4 * r0, runtime.CUDA_R_32F, N,
                    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)


def handle(b):
    """The cuBLAS calls of b's stream: CuPy's binding, or a handle of b's own with its own
    workspace (the own_cublas option: calls that a stream capture may record)."""
    if b._own_blas is None and b.options.own_cublas:
        if b._graph_refs is not None:
            # its workspace would come from the capture's memory: an eager prompt makes it
            raise CudaError("the cuBLAS handle is made by an eager prompt, not inside a capture")
        b._own_blas = blas.Handle(b.stream.ptr)
    if b._own_blas is not None:
        return b._own_blas
    return blas.CupyHandle(b.stream.ptr)


def dequant_f16(b, w, r0: int, n: int, out):
    """Rows r0 .. r0 + n of the 2-D weight w as float16 into out [n, K]."""
    K = w.shape[-1]
    b.launch("dequant.cu", f"dequant_f16_{TYPE_NAMES[w.type]}",
             (-(-K // (2 * DEQUANT_THREADS)), min(n, 65535)), DEQUANT_THREADS,
             w.data[r0 * w.row_bytes:], b._no_experts, out,
             params=pack("DequantParams", n_rows=n, n_cols=K, row_bytes=w.row_bytes, rows_per_expert=0))


def weight_f16(b, w):
    """The float16 matrix [N, K] of the 2-D weight w for the prompt GEMM without dequantizing:
    an F16 weight's own bytes; for other types the copy kept since the first prompt, made
    while the copies fit their budget (the f16_weights option); else None (dequantize per call)."""
    if len(w.shape) != 2:
        return None
    if w.type == GGMLType.F16:      # already float16, row-major [N, K]: no copy needed
        return w.data
    if not b.options.f16_weights:
        return None
    entry = b._f16_copies.get(id(w))
    if entry is not None:
        return entry[1]
    if b._graph_refs is not None:    # no copy is made inside a capture (nor kept by it)
        return None
    N, K = w.shape
    nbytes = 2 * N * K
    if b._f16_budget is None:
        gib = b.options.f16_weights_gb
        if gib is not None:
            b._f16_budget = int(gib * 2**30)
        else:
            free, _ = cupy.cuda.runtime.memGetInfo()
            pool = cupy.get_default_memory_pool()
            b._f16_budget = (free + pool.free_bytes()) // 2
    if b.f16_weight_bytes + nbytes > b._f16_budget:
        return None
    try:
        copy = cupy.empty((N, K), F16)
    except cupy.cuda.memory.OutOfMemoryError:
        # the budget was an estimate (KV caches allocated since take their share): keep what
        # is kept, make no more copies, dequantize per call from here on
        b._f16_budget = b.f16_weight_bytes
        return None
    dequant_f16(b, w, 0, N, copy)
    b._f16_copies[id(w)] = (w, copy)
    b.f16_weight_bytes += nbytes
    return copy


def drop_f16_weights(b) -> bool:
    """Free the float16 weight copies and make no more (prompts then dequantize per call,
    with the same results). Not while prompt graphs may hold them (the own_cublas option: a
    captured GEMM reads its copy at every replay). Whether anything was freed."""
    if not b._f16_copies or b.options.own_cublas:
        return False
    b._f16_copies.clear()
    b.f16_weight_bytes = 0
    b._f16_budget = 0
    with b.activate():
        b.stream.synchronize()       # no queued GEMM still reads a copy
        cupy.get_default_memory_pool().free_all_blocks()
    return True


def scratch_f16(b, n: int):
    """The float16 scratch of at least n values that weights are dequantized into."""
    if (b._gemm_scratch is None or b._gemm_scratch.size < n) and b._graph_refs is not None:
        # the scratch is shared by every prompt, eager or captured: it must not come from
        # (and die with) one graph's memory
        raise CudaError("the float16 GEMM scratch would be allocated inside a graph capture")
    if b._gemm_scratch is None or b._gemm_scratch.size < n:
        b._gemm_scratch = None
        b._gemm_scratch = cupy.empty(max(n, GEMM_SCRATCH_BYTES // 2), F16)
    return b._gemm_scratch


# -- experts -------------------------------------------------------------------------------------

def tiles_take(b, n_slots: int, n_experts: int) -> bool:
    """Whether mmq_id's launch covers a prompt's expert mat-mul of n_slots (token, slot) pairs
    over n_experts: int8 mma (compute capability 8.0), a grid within bounds, experts moe_plan
    plans. Where it does not, the mat-vec kernels take it, which round as the reference then
    expects (not the float16 GEMM)."""
    return (b.cc >= 80 and -(-n_slots // MMQ_COLS) + min(n_experts, n_slots) < 65535
            and n_experts <= MOE_PLAN_MAX_E)


def matmul_id_tiles(b, x, w, ids, per_slot, y):
    """A prompt's expert mat-muls on int8 tiles (the moe_mmq option): moe_plan sorts the (token,
    slot) pairs by expert on the device (kept while the same ids come back: gate, up and
    down of one layer), then one mmq_id launch covers every expert's tiles. No host
    synchronisation."""
    E, N, K = w.shape
    T, k = ids.shape
    S = T * k
    max_tiles = -(-S // MMQ_COLS) + min(E, S)
    if b._id_plan is not None and b._id_plan[0] is ids and b._id_plan[1] == E:
        plan = b._id_plan[2]
    else:
        plan = cupy.empty(2 * E + 2 * S + 1 + 2 * max_tiles, np.int32)
        b.launch("mmq.cu", "moe_plan", 1, MOE_PLAN_THREADS, ids, plan,
                 params=pack("MoePlanParams", n_slots=S, n_experts=E, max_tiles=max_tiles))
        b._id_plan = (ids, E, plan)
    x2 = x.reshape(-1, K)
    xa = quantize.activations(b, x2, w, x)
    b.launch("mmq.cu", f"mmq_id_{TYPE_NAMES[w.type]}", (-(-N // MMQ_ROWS), max_tiles + 1),
             MMQ_THREADS, w.data, xa, plan, y,
             params=pack("MmqIdParams", n_rows=N, k=K, n_slots=S, n_used=k, row_bytes=w.row_bytes,
                         expert_bytes=N * w.row_bytes, n_experts=E, x_per_slot=int(per_slot),
                         max_tiles=max_tiles))


def moe_plan(b, ids, n_experts: int):
    """Where each (token, slot) goes in the per-expert batches of a prompt's expert GEMMs.
    Experts with rows are grouped by their row count rounded up to a power of two (at
    least 16); each group is one strided batched GEMM of that many rows per expert, so
    padding at most doubles the work however uneven the routing, and experts no token
    chose are neither dequantized nor multiplied. Reads ids on the host (a prompt may
    synchronise; decode never comes here); reused while the same ids array comes back
    (gate, up and down of one layer)."""
    if b._plan is not None and b._plan[0] is ids:
        return b._plan[1]
    flat = b.to_numpy(ids).reshape(-1)
    valid = (flat >= 0) & (flat < n_experts)
    order = np.argsort(np.where(valid, flat, n_experts), kind="stable")
    n_valid = int(valid.sum())
    slots = order[:n_valid]                       # valid slots, by expert
    counts = np.bincount(flat[valid], minlength=n_experts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    used = np.nonzero(counts)[0]
    caps = np.maximum(16, 1 << np.ceil(np.log2(np.maximum(counts[used], 1))).astype(np.int64))
    pad_pos = np.empty(n_valid, np.int64)
    groups, row = [], 0
    for cap in np.unique(caps):
        experts = used[caps == cap]
        for q, e in enumerate(experts):
            pad_pos[first[e]:first[e] + counts[e]] = row + q * cap + np.arange(counts[e])
        groups.append((int(cap), experts.astype(np.int32), row))
        row += len(experts) * int(cap)
    plan = dict(rows=max(row, 1), groups=groups, slots_h=slots, pad_pos_h=pad_pos,
                slots=cupy.asarray(slots.astype(np.int32)), pad_pos=cupy.asarray(pad_pos.astype(np.int32)),
                invalid=cupy.asarray(np.nonzero(~valid)[0].astype(np.int32)))
    b._plan = (ids, plan)
    return plan


def matmul_id_gemm(b, x, w, ids, per_slot, y):
    """A prompt's expert mat-muls on tensor cores: each chosen expert's (token, slot) rows
    gathered into a padded batch (float16), the chosen experts' weights dequantized to
    float16 (as many as the scratch holds at a time), one strided batched GEMM per group
    of experts with the same padded row count (moe_plan)."""
    from cupy_backends.cuda.api import runtime
    cublas = blas.cupy_binding()
    E, N, K = w.shape
    T, k = ids.shape
    plan = moe_plan(b, ids, E)
    R = plan["rows"]
    gidx = np.full(R, -1, np.int32)
    gidx[plan["pad_pos_h"]] = plan["slots_h"] if per_slot else plan["slots_h"] // k
    gidx = cupy.asarray(gidx)
    x2 = x.reshape(-1, K)
    xpad = cupy.empty((R, K), F16)
    b.launch("dequant.cu", "gather_rows_f16", (-(-K // DEQUANT_THREADS), min(R, 65535)), DEQUANT_THREADS,
             x2, gidx, xpad, params=pack("GatherParams", n_out=R, n_cols=K, n_src_rows=x2.shape[0]))
    cpad = cupy.empty((R, N), F32)
    per_chunk = max(1, GEMM_SCRATCH_BYTES // (2 * N * K))
    scratch = scratch_f16(b, min(per_chunk, E) * N * K)
    gemm = handle(b)
    alpha, beta = b._gemm_scalars
    for cap, experts, row0 in plan["groups"]:
        for c0 in range(0, len(experts), per_chunk):
            chunk = experts[c0:c0 + per_chunk]
            ne = len(chunk)
            b.launch("dequant.cu", f"dequant_f16_{TYPE_NAMES[w.type]}",
                     (-(-K // (2 * DEQUANT_THREADS)), min(ne * N, 65535)), DEQUANT_THREADS,
                     w.data, cupy.asarray(chunk), scratch,
                     params=pack("DequantParams", n_rows=ne * N, n_cols=K, row_bytes=w.row_bytes,
                                 rows_per_expert=N))
            r0 = row0 + c0 * cap
            gemm.gemmStridedBatchedEx(
                cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, cap, K,
                alpha.ctypes.data, scratch.data.ptr, runtime.CUDA_R_16F, K, N * K,
                xpad.data.ptr + 2 * r0 * K, runtime.CUDA_R_16F, K, cap * K,
                beta.ctypes.data, cpad.data.ptr + 4 * r0 * N, runtime.CUDA_R_32F, N, cap * N,
                ne, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    y2 = y.reshape(T * k, N)
    y2[plan["slots"]] = cpad[plan["pad_pos"]]
    if plan["invalid"].size:
        y2[plan["invalid"]] = np.nan       # as the mat-vec kernels: an expert id out of range
