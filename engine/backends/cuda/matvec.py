"""Decode mat-vecs (kernels/matvec_q.cu, matvec_f.cu; their templates in matvec.cuh,
matvec_q.cuh): the launchers and the rules that pick a kernel, its grid and its shared memory.

A decode step's rows (one token, or a batched step's rows inside rows_independent) take these
kernels, each row summed as a sequence decoded alone would sum it: matvec_<type> (up to three
matrices reading the same activations in one launch), its split form for long rows,
matvec_mixed_<a>_<b> (q and k of one type, v of another), matvec_coop_q6_k, the batched step's
matvec_cols_*, the gated FFN's matvec_glu_* (gate and up, the activation, h's Q8_1 blocks), the
experts' matvec_id_<type> and matvec_moe_down_<type>, and matmul_<type> for a few tokens of a
prompt. Every size a launch depends on is read from the headers (compiler.define), so that a
build with other #defines is launched as it expects.
"""

from __future__ import annotations

import numpy as np

from ...errors import BrassError, UnsupportedError
from ...gguf import GGMLType
from . import quantize
from .common import F32, FLOAT_TYPES, Q8_1_BLOCK_BYTES, TYPE_NAMES, CudaWeight, f32, matvec_source
from .compiler import define
from .errors import CudaError
from .params import pack

MATVEC_H = "matvec.cuh"
# Thread-block sizes of matvec_id_<type> and matmul_<type>; each must equal its source's.
MATVEC_THREADS, MATMUL_TILE = 128, 8
# matvec_<type>: warps per block, rows per warp (ci/gpu_tune_matvec.py: one row per warp and 8
# warps per block were fastest for both large and small matrices)
MV_WARPS, MV_ROWS = 8, 1
DOWN_WARPS, DOWN_ROWS = 8, 4        # matvec_moe_down_<type>: the chosen experts over the warps
MOE_MAX_USED = 64
SMALL_FLOAT_ROWS = 1024              # float decode mat-vecs of at most this many rows: block per row
# matvec_mixed_<a>_<b> (the mixed_matvec option): a decode step's q, k (type a) and v (type b:
# Q4_K_M gives attn_v Q6_K) in one launch, the same bits as two launches
MIXED_PAIRS = {(GGMLType.Q4_K, GGMLType.Q6_K): "q4_k_q6_k", (GGMLType.Q5_K, GGMLType.Q6_K): "q5_k_q6_k"}

# The quantized mat-vecs copy their Q8_1 activations into shared memory (at most
# STAGED_BYTES_PER_Q8 per block of 32, matvec.cuh StagedItem) for rows of up to MV_STAGE_MAX_K
# values; both read from the header so that the shared memory given at launch covers what the
# kernel writes.
MV_STAGE_MAX_K = define(MATVEC_H, "MV_STAGE_MAX_K")
Q8S_BYTES = define(MATVEC_H, "STAGED_BYTES_PER_Q8")
# matvec_cols_<type> / matvec_glu_cols_<type> (a batched decode step): tokens per block at
# most, and how many staged values (tokens x K) they stage at most.
MV_COLS = define(MATVEC_H, "MV_COLS")
MV_COLS_STAGE_MAX_K = define(MATVEC_H, "MV_COLS_STAGE_MAX_K")
MV_COLS_ROW_ITERS = define(MATVEC_H, "MV_COLS_ROW_ITERS")
# ... and the weight rows a warp (a split group) of theirs takes at once (a unit)
MV_COLS_ROWS = define(MATVEC_H, "MV_COLS_ROWS")
# ... and those of matvec_cols_many_<type>, taken by launches of two groups of tokens or more
MV_COLS_ROWS_MANY = define(MATVEC_H, "MV_COLS_ROWS_MANY")
# matvec_split_<type> / matvec_cols_split_<type>: warps that share a unit of rows, taken by
# matrices of rows of at least MV_SPLIT_MIN_K values (matvec.cuh says why); a block takes
# MV_WARPS // split units
MV_SPLIT = define(MATVEC_H, "MV_SPLIT")
MV_SPLIT_MIN_K = define(MATVEC_H, "MV_SPLIT_MIN_K")
# matvec_glu_<type>: warps x rows of a block, 32 rows = one Q8_1 block of h
GLU_WARPS = define(MATVEC_H, "GLU_WARPS")
GLU_ROWS = define(MATVEC_H, "GLU_ROWS")
# matvec_glu_wide_<type>: its warps per block, and the launches it takes (fewer blocks per SM)
GLU_WIDE_WARPS = define(MATVEC_H, "GLU_WIDE_WARPS")
GLU_WIDE_MAX_BLOCKS_PER_SM = define(MATVEC_H, "GLU_WIDE_MAX_BLOCKS_PER_SM")
# matvec_coop_q6_k (the q6k_coop option): a one-token Q6_K mat-vec whose warps read each chunk
# of 32 items of a row together into shared memory (coalesced) before each lane takes its item,
# where matvec_q6_k's lanes read their own items' words (bound by L1); the same bits. Rows of
# whole chunks only (K a multiple of 1024: row bytes a multiple of 8).
MV_COOP_WARPS = define(MATVEC_H, "MV_COOP_WARPS")
MV_COOP_ROWS = define(MATVEC_H, "MV_COOP_ROWS")      # rows a warp at once
# ... its blocks at most per SM (the warps step over the rest of the rows): 8 blocks of
# MV_COOP_WARPS = 8 warps, as many warps as an H200 SM holds (4 were slower on an output head)
COOP_BLOCKS_PER_SM = 8
# The decode mat-vec's preloads (MV_PRELOAD, MV_PRELOAD_Q6K: items a lane loads ahead) and the
# rows a warp then takes at once (MV_PRELOAD_ROWS): a launch's units of rows follow them.
MV_PRELOAD = define(MATVEC_H, "MV_PRELOAD")
MV_PRELOAD_Q6K = define(MATVEC_H, "MV_PRELOAD_Q6K")
MV_PRELOAD_ROWS = define(MATVEC_H, "MV_PRELOAD_ROWS")


def launched_kernels() -> list[tuple[str, str]]:
    ks = []
    for t, n in TYPE_NAMES.items():
        src = matvec_source(t)
        ks += [(src, f"matvec_{n}"), (src, f"matmul_{n}"), (src, f"matvec_id_{n}"),
               (src, f"matvec_glu_{n}"), (src, f"matvec_moe_down_{n}"),
               (src, f"matvec_cols_{n}"), (src, f"matvec_glu_cols_{n}"),
               (src, f"matvec_split_{n}"), (src, f"matvec_cols_split_{n}"), (src, f"matvec_glu_wide_{n}"),
               (src, f"matvec_cols_many_{n}"), (src, f"matvec_cols_split_many_{n}")]
    ks += [("matvec_q.cu", f"matvec_mixed_{n}") for n in MIXED_PAIRS.values()]
    ks += [("matvec_q.cu", "matvec_coop_q6_k")]
    return ks


# -- the rules ---------------------------------------------------------------------------------

def mv_split(k: int) -> int:
    """Warps per unit of rows of a decode mat-vec over rows of k values (1: a warp per unit).
    A matrix takes the same kernel whatever the batch, so a token's sums do not depend on it."""
    return MV_SPLIT if k >= MV_SPLIT_MIN_K else 1


def uses_q6k_coop(wtype, k: int, row_bytes: list[int]) -> bool:
    """Whether a one-token mat-vec of `wtype` over rows of k values (matrices of `row_bytes`)
    can take matvec_coop_q6_k (where the q6k_coop option is on): Q6_K, a warp per row (not
    split) and rows of whole 8-byte words (its chunks)."""
    return wtype == GGMLType.Q6_K and mv_split(k) == 1 and all(rb % 8 == 0 for rb in row_bytes)


def coop_blocks(units: int, n_sms: int, warps: int | None = None, rows: int | None = None) -> int:
    """matvec_coop_q6_k's blocks for `units` rows: MV_COOP_ROWS rows per warp, at most
    COOP_BLOCKS_PER_SM blocks an SM (the kernel's warps step over the rest); `warps` and `rows`:
    another build's MV_COOP_WARPS and MV_COOP_ROWS (the header's by default)."""
    per_block = (warps or MV_COOP_WARPS) * (rows or MV_COOP_ROWS)
    return max(1, min(-(-units // per_block), n_sms * COOP_BLOCKS_PER_SM))


def cols_row_blocks(rows: list[int], split: int, iters: int | None = None,
                    unit_rows: int | None = None) -> int:
    """blockIdx.y's extent of a batched step's mat-vec over matrices of `rows` rows (matvec_cols_,
    split or not): units of MV_COLS_ROWS rows of each matrix, MV_COLS_ROW_ITERS rounds of a
    block's units each (the kernel strides over the rest)."""
    iters = MV_COLS_ROW_ITERS if iters is None else iters
    unit_rows = MV_COLS_ROWS if unit_rows is None else unit_rows
    units = sum(-(-n // unit_rows) for n in rows)
    return max(1, min(-(-units // (MV_WARPS // split * iters)), 65535))


def unit_rows(wtype, preload_rows: int | None = None) -> int:
    """Rows of a unit of a one-token matvec_<type> launch (a warp's, or a split group's, at
    once; the kernel's unit_rows<K>): MV_PRELOAD_ROWS for the kinds the kernels preload (Q4_K
    with MV_PRELOAD, Q6_K with MV_PRELOAD_Q6K), MV_ROWS for the others. preload_rows: another
    build's MV_PRELOAD_ROWS."""
    preloaded = (wtype == GGMLType.Q4_K and MV_PRELOAD > 0) or (wtype == GGMLType.Q6_K and MV_PRELOAD_Q6K > 0)
    return (preload_rows or MV_PRELOAD_ROWS) if preloaded and MV_ROWS == 1 else MV_ROWS


def matvec_units(wtype, rows: list[int], preload_rows: int | None = None) -> int:
    """The units of rows of a one-token matvec_<type> launch over matrices of `rows` rows."""
    r = unit_rows(wtype, preload_rows)
    return sum(-(-n // r) for n in rows)


def mixed_blocks(rows: list[int], type_a, type_b, preload_rows: int | None = None) -> int:
    """matvec_mixed_'s blocks for rows [n0, n1, n2] (matrices 0, 1 of type_a, 2 of type_b):
    matvec_<a>'s launch over 0 and 1, then matvec_<b>'s over 2 (the kernel's split)."""
    return (-(-matvec_units(type_a, rows[:2], preload_rows) // MV_WARPS)
            + -(-matvec_units(type_b, rows[2:], preload_rows) // MV_WARPS))


def stage_bytes(wtype, n_values: int) -> int:
    """Shared memory for a quantized mat-vec whose staged activations are `n_values` long
    (0: a float weight, or too long to stage: the kernel reads them from global memory)."""
    if wtype in FLOAT_TYPES or n_values > MV_STAGE_MAX_K:
        return 0
    return n_values // 32 * Q8S_BYTES


def cols_per_block(wtype, n_tokens: int, k: int) -> tuple[int, int]:
    """(tokens per block, shared memory) of a batched step's mat-vec: as many tokens as the
    kernel has accumulators for, and, for staged kinds, as fit MV_COLS_STAGE_MAX_K together
    (so that every block, the last one's fewer tokens too, stages exactly when smem is given)."""
    if wtype in FLOAT_TYPES:
        return min(MV_COLS, n_tokens), 0
    cols = max(1, min(MV_COLS, n_tokens, MV_COLS_STAGE_MAX_K // k))
    return cols, (cols * k // 32 * Q8S_BYTES if cols * k <= MV_COLS_STAGE_MAX_K else 0)


def mixed_pair(T: int, K: int, by_type: dict):
    """(type of matrices 0 and 1, type of matrix 2) when one matvec_mixed_ launch takes the
    decode groups `by_type` (one token, two types of a MIXED_PAIRS pair, at most two
    matrices of the first and one of the second, rows not split), else None."""
    if T != 1 or len(by_type) != 2 or mv_split(K) != 1:
        return None
    a, b = by_type
    for ta, tb in ((a, b), (b, a)):
        if (ta, tb) in MIXED_PAIRS and len(by_type[ta]) <= 2 and len(by_type[tb]) == 1:
            return ta, tb
    return None


def check_matrix(x, w, what: str, ndim: int):
    """That `w` is an ndim-D weight whose rows x's rows can be multiplied by."""
    if not isinstance(w, CudaWeight) or len(w.shape) != ndim:
        raise BrassError(f"{what}: expected a {ndim}-D weight, got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    if w.type in FLOAT_TYPES and w.shape[-1] % 8:
        # The float mat-vecs read 16-byte vectors of a row.
        raise UnsupportedError(f"{what}: {w.name} has {w.shape[-1]} columns; the cuda backend "
                               f"needs a multiple of 8 for {w.type.name} weights")
    if x.shape[-1] != w.shape[-1]:
        raise BrassError(f"{what}: input has {x.shape[-1]} features but {w.name} "
                         f"expects {w.shape[-1]}")


def fusable(a: CudaWeight, b: CudaWeight) -> bool:
    """Whether gate and up take one matvec_glu_ launch (one type, one shape)."""
    return a.type == b.type and a.shape == b.shape


# -- the launchers -----------------------------------------------------------------------------

def decode(b, x2, ws, ys, src):
    """A decode step's mat-vecs y = x2 @ W.T for each (W, y): matrices of one type that read the
    same activations share a launch (a mixed pair one launch in all, with the mixed_matvec
    option); a small float matrix (a MoE router) takes a block per row."""
    T, K = x2.shape
    by_type: dict = {}
    for w, y in zip(ws, ys):
        if w.type in FLOAT_TYPES and w.shape[0] <= SMALL_FLOAT_ROWS:
            # A MoE router (F32, one row per expert): a warp per row would leave most SMs idle
            # and each warp K/128 loads deep; a block per row is not.
            matmul_tiles(b, x2, w, y, src)
        else:
            by_type.setdefault(w.type, []).append((w, y))
    pair = mixed_pair(T, K, by_type) if b.options.mixed_matvec else None
    if pair is not None:
        matvec_mixed(b, x2, by_type[pair[0]], by_type[pair[1]], src)
        by_type = {}
    for group in by_type.values():
        for i in range(0, len(group), 3):
            matvec(b, x2, group[i:i + 3], src)


def matvec_mixed(b, x2, group_a, group_b, src):
    """matvec_mixed_<a>_<b>: group_a's one or two matrices and group_b's one, one token, in
    one launch: the blocks of matvec_<a>'s launch over group_a, then matvec_<b>'s over group_b."""
    (wb, yb), = group_b
    wa0 = group_a[0][0]
    xa = quantize.activations(b, x2, wa0, src)      # the same Q8_1 blocks for both kinds
    wa1, ya1 = group_a[1] if len(group_a) > 1 else (wa0, group_a[0][1])
    rows = [wa0.shape[0], wa1.shape[0] if len(group_a) > 1 else 0, wb.shape[0]]
    K = x2.shape[1]
    params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                  cols=1, row_bytes0=wa0.row_bytes, row_bytes1=wa1.row_bytes, row_bytes2=wb.row_bytes)
    b.launch("matvec_q.cu", f"matvec_mixed_{MIXED_PAIRS[(wa0.type, wb.type)]}",
             (mixed_blocks(rows, wa0.type, wb.type), 1),
             MV_WARPS * 32, wa0.data, wa1.data, wb.data, xa, group_a[0][1], ya1, yb, params=params,
             smem=stage_bytes(wa0.type, K))


def matvec(b, x2, group, src):
    """One decode mat-vec launch over up to three (weight, output) pairs of one type."""
    w0 = group[0][0]
    xa = quantize.activations(b, x2, w0, src)
    ws = [w for w, _ in group] + [w0] * (3 - len(group))
    outs = [y for _, y in group] + [group[0][1]] * (3 - len(group))
    rows = [w.shape[0] for w, _ in group] + [0] * (3 - len(group))
    units = matvec_units(w0.type, rows)
    T, K = x2.shape
    src_file = matvec_source(w0.type)
    split = mv_split(K)
    if T == 1:
        params = pack("MultiMatVecParams", k=K, n_tokens=T, n_rows0=rows[0], n_rows1=rows[1],
                      n_rows2=rows[2], cols=1, row_bytes0=ws[0].row_bytes, row_bytes1=ws[1].row_bytes,
                      row_bytes2=ws[2].row_bytes)
        # matvec_coop_q6_k reads its chunks as 8-byte words: the buffers too must be 8-aligned
        if b.options.q6k_coop and uses_q6k_coop(w0.type, K, [w.row_bytes for w in ws]) \
                and all(w.data.data.ptr % 8 == 0 for w in ws):
            b.launch(src_file, "matvec_coop_q6_k", (coop_blocks(sum(rows), b.n_sms), T), MV_COOP_WARPS * 32,
                     ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params,
                     smem=stage_bytes(w0.type, K))
            return
        name = f"matvec_{'split_' if split > 1 else ''}{TYPE_NAMES[w0.type]}"
        threads = b.kernels.block_threads(src_file, name) if split > 1 else MV_WARPS * 32
        if threads % (32 * split):      # (a build whose warps are not whole split groups)
            raise CudaError(f"kernel {name} (kernels/{src_file}) was built for {threads} threads a block, "
                             f"not whole groups of {split} warps")
        b.launch(src_file, name, (-(-units // (threads // 32 // split)), T), threads,
                 ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params,
                 smem=stage_bytes(w0.type, K))
        return
    # A batched step: blocks of `cols` tokens (blockIdx.x, adjacent, so that the groups of one
    # weight row run together and the later ones find it in L2), each token summed as if
    # alone; MV_COLS_ROWS rows per warp (per `split` warps), MV_COLS_ROWS_MANY when there are
    # two groups of tokens or more (the same bits: only the rows a warp takes at once differ).
    cols, smem = cols_per_block(w0.type, T, K)
    params = pack("MultiMatVecParams", k=K, n_tokens=T, n_rows0=rows[0], n_rows1=rows[1],
                  n_rows2=rows[2], cols=cols, row_bytes0=ws[0].row_bytes, row_bytes1=ws[1].row_bytes,
                  row_bytes2=ws[2].row_bytes)
    groups = -(-T // cols)
    many = groups > 1
    b.launch(src_file, f"matvec_cols_{'split_' if split > 1 else ''}{'many_' if many else ''}"
                       f"{TYPE_NAMES[w0.type]}",
             (groups, cols_row_blocks(rows, split, unit_rows=MV_COLS_ROWS_MANY if many else None)),
             MV_WARPS * 32, ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params, smem=smem)


def matmul_tiles(b, x2, w, y, src):
    """A few tokens: each weight row read once per tile of MATMUL_TILE tokens."""
    T, K = x2.shape
    N = w.shape[0]
    xa = quantize.activations(b, x2, w, src)
    params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=1, row_bytes=w.row_bytes,
                  expert_bytes=0, x_per_slot=0, n_experts=1)
    b.launch(matvec_source(w.type), f"matmul_{TYPE_NAMES[w.type]}", (N, -(-T // MATMUL_TILE)), MATVEC_THREADS,
             w.data, xa, y, params=params)


def matvec_id(b, x, w, ids, per_slot: bool, y):
    """The chosen experts' mat-vecs (a decode step's, or a prompt's that takes neither the
    int8 tiles nor the GEMMs): y [T, k, N], each (token, slot) against its expert's rows."""
    E, N, K = w.shape
    T, k = ids.shape
    xa = quantize.activations(b, x.reshape(-1, K), w)
    params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=k, row_bytes=w.row_bytes,
                  expert_bytes=N * w.row_bytes, x_per_slot=int(per_slot), n_experts=E)
    b.launch(matvec_source(w.type), f"matvec_id_{TYPE_NAMES[w.type]}", (N, T * k), MATVEC_THREADS,
             w.data, xa, ids, y, params=params)


def glu_matvec(b, x, w_gate, w_up, gelu, ids=None, what="ffn_glu"):
    """matvec_glu: h = act(x W_gate^T) * (x W_up^T) [rows, N] and its Q8_1 blocks. With ids
    and w_up None, w_gate holds each expert's gate rows then its up rows ([E, 2N, K]): the
    up matrix is the same bytes N rows on, every expert 2N rows apart."""
    src = x
    x = f32(x, what)
    K = x.shape[-1]
    fused = w_up is None
    N = w_gate.shape[-2] // (2 if fused else 1)
    up_data = w_gate.data[N * w_gate.row_bytes:] if fused else w_up.data
    stride = (2 if fused else 1) * N * w_gate.row_bytes      # bytes from one expert to the next
    x2 = x.reshape(-1, K)
    slots = x2.shape[0] if ids is None else ids.size
    h = b._out((slots, N), F32)
    write_q8 = N % 32 == 0      # for a quantized down projection (unused by a float one)
    hq = b._out((slots, N // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else h
    xa = quantize.activations(b, x2, w_gate, src)
    # A batched step (no experts) takes blocks of `cols` tokens, each token's h as the
    # one-token kernel's.
    batched = ids is None and slots > 1
    cols, smem = cols_per_block(w_gate.type, slots, K) if batched else (1, stage_bytes(w_gate.type, K))
    params = pack("GluMatVecParams", n_rows=N, k=K, n_tokens=x2.shape[0], cols=cols,
                  n_used=1 if ids is None else ids.shape[1], row_bytes=w_gate.row_bytes,
                  expert_bytes=stride if ids is not None else 0,
                  has_ids=int(ids is not None), n_experts=w_gate.shape[0] if ids is not None else 1,
                  gelu=int(bool(gelu)), write_q8=int(write_q8))
    src_file = matvec_source(w_gate.type)
    if batched:
        b.launch(src_file, f"matvec_glu_cols_{TYPE_NAMES[w_gate.type]}",
                 (-(-slots // cols), -(-N // (GLU_WARPS * GLU_ROWS))), GLU_WARPS * 32,
                 w_gate.data, up_data, xa, h, hq, params=params, smem=smem)
    elif slots:
        # a launch of few blocks (a small model's FFN, a token's chosen experts) takes more
        # warps a block, gate and up in one loop: the same floats, more loads in flight
        blocks = -(-N // 32) * slots
        wide = blocks < GLU_WIDE_MAX_BLOCKS_PER_SM * b.n_sms
        b.launch(src_file, f"matvec_glu_{'wide_' if wide else ''}{TYPE_NAMES[w_gate.type]}",
                 (-(-N // 32), slots), (GLU_WIDE_WARPS if wide else GLU_WARPS) * 32,
                 w_gate.data, up_data, xa, x if ids is None else ids, h, hq,
                 params=params, smem=stage_bytes(w_gate.type, K))
    return h, (hq if write_q8 else None)


def ffn_glu(b, x, w_gate, w_up, gelu):
    """A decode step's gated FFN up to h (one matvec_glu_ launch), h's Q8_1 blocks remembered
    for the down projection."""
    check_matrix(f32(x, "ffn_glu"), w_gate, "ffn_glu", 2)
    h, hq = glu_matvec(b, x, w_gate, w_up, gelu)
    h = h.reshape(*x.shape[:-1], h.shape[-1])
    if hq is not None:
        quantize.remember(b, h, hq)
    return h


def fuses_moe_ffn(b, x, w_gate, w_up, w_down, ids, weights, down_scale=None) -> bool:
    """Whether moe_ffn runs these operands as the two fused decode kernels (the experts'
    gate/up mat-vecs writing h's Q8_1 blocks, then the down projection with the weighted
    sum) rather than Backend.moe_ffn's composition (a prompt, float down weights, ...)."""
    T = x.shape[0] if x.ndim == 2 else 0
    fused = w_up is None                # w_gate is [E, 2F, D]: each expert's gate rows, then up
    return not (x.ndim != 2 or not b._decode_rows(T) or ids.shape != weights.shape or ids.shape[0] != T
                or len(w_gate.shape) != 3 or (not fused and not fusable(w_gate, w_up))
                or (fused and w_gate.shape[1] % 2) or w_down.type in FLOAT_TYPES
                or (w_gate.shape[1] // (2 if fused else 1)) % 32 or ids.shape[-1] > MOE_MAX_USED
                or (down_scale is not None and (not isinstance(down_scale, CudaWeight)
                                                or down_scale.dense is None
                                                or down_scale.dense.shape != (w_gate.shape[0],))))


def moe_ffn(b, x, w_gate, w_up, w_down, ids, weights, gelu, down_scale):
    """A decode step's experts as two kernels (fuses_moe_ffn): the chosen experts' gate/up
    (matvec_glu_, h's Q8_1 blocks), then their down projections, each expert's output scaled
    and weighted and the k of a token summed (matvec_moe_down_)."""
    T = x.shape[0]
    fused = w_up is None                # w_gate is [E, 2F, D]: each expert's gate rows, then up
    check_matrix(x, w_gate, "moe_ffn", 3)
    E, N, K = w_gate.shape
    N //= 2 if fused else 1
    D = w_down.shape[1]
    if w_down.shape != (E, D, N):
        raise BrassError(f"moe_ffn: down {w_down.shape} does not match gate {w_gate.shape}")
    k = ids.shape[1]
    _, hq = glu_matvec(b, x, w_gate, w_up, gelu, ids=ids, what="moe_ffn")
    out = b._out((T, D), F32)
    b.launch("matvec_q.cu", f"matvec_moe_down_{TYPE_NAMES[w_down.type]}",
             (-(-D // DOWN_ROWS), T), DOWN_WARPS * 32, w_down.data, hq, ids, weights,
             down_scale.dense if down_scale is not None else weights, out,
             params=pack("MoeDownParams", n_rows=D, k=N, n_tokens=T, n_used=k, row_bytes=w_down.row_bytes,
                         expert_bytes=D * w_down.row_bytes, n_experts=E,
                         has_scale=int(down_scale is not None)),
             smem=stage_bytes(w_down.type, k * N))
    return out
