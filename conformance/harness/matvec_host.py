"""The decode mat-vec kernels (kernels/matvec.cuh through matvec_q.cu) run on the CPU, for
machines without a GPU (CI, development).

As conformance/harness/mmq_host.py, conformance/harness/delta_host.py and conformance/harness/attn_host.py do for their kernels: the kernel
source itself (with its headers) compiled by g++ against the shim of CUDA device code (every
CUDA thread of a block a std::thread, __shared__ variables function statics, one block at a
time, __syncthreads a barrier of the block's threads). The dynamic shared memory the
activations are staged in becomes a host buffer poisoned with 0xFF bytes before each block;
warp shuffles go through per-warp slots and a barrier of the warp's 32 threads (a warp may
loop more often than another, as the grid-stride loops do). The L2 prefetches and PDL_ENTRY
compile to nothing on the host.

The launches are the backend's: grids, blocks and shared memory from its own helpers and
constants (engine/backends/cuda/matvec.py), parameter structs from kernels/params.py. What
this cannot check: timing, coalescing, bank conflicts, FMA contraction (g++ does not contract
here: -std=c++20 is ISO mode), the GPU's limits. It does check the item indexing, the
staging of activations, the multi-matrix units, the experts' offsets and ids, the batched
kernels' per-token sums against the one-token kernels, and the Q8_1 blocks the gated kernels
write, against the numpy reference.

    python3 conformance/harness/matvec_host.py [seed]      # a few shapes; exit 1 on a failure
conformance/kernels/test_kernels_matvec_cpu.py uses it (skips without g++).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import (HOST_HALF, HOST_RUN_GRID, HOST_WARP_SYNC, SHIM, compile_host,  # noqa: E402
                         host_headers, q8_1_blocks)

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
HEADERS = ("common.cuh", "matvec.cuh", "matvec_cols.cuh", "matvec_decode.cuh", "matvec_glu.cuh", "matvec_q.cuh",
           "params.cuh", "quant_dot.cuh")
NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
MAX_THREADS = 1024

HARNESS = r"""#include "shim.h"
#include <limits>
unsigned char * host_smem;
#include "matvec_host.cu"
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
HOST_WARP_SYNC
HOST_HALF

// Buffer i of kernel fn, cast to that parameter's type (the activations' type is the kind's).
#include <tuple>
template <int I, class R, class... A>
static auto arg(R (*)(A...), void * p) { return (std::tuple_element_t<I, std::tuple<A...>>) p; }

HOST_RUN_GRID

#define CALL7(fn, P) { P p; memcpy(&p, params, sizeof p);                                          \
    run_grid(gx, gy, threads, smem, [=] { fn(arg<0>(fn, b[0]), arg<1>(fn, b[1]), arg<2>(fn, b[2]),        \
        arg<3>(fn, b[3]), arg<4>(fn, b[4]), arg<5>(fn, b[5]), arg<6>(fn, b[6]), p); }); return 0; }
#define CALL6(fn, P) { P p; memcpy(&p, params, sizeof p);                                          \
    run_grid(gx, gy, threads, smem, [=] { fn(arg<0>(fn, b[0]), arg<1>(fn, b[1]), arg<2>(fn, b[2]),        \
        arg<3>(fn, b[3]), arg<4>(fn, b[4]), arg<5>(fn, b[5]), p); }); return 0; }
#define CALL5(fn, P) { P p; memcpy(&p, params, sizeof p);                                          \
    run_grid(gx, gy, threads, smem, [=] { fn(arg<0>(fn, b[0]), arg<1>(fn, b[1]), arg<2>(fn, b[2]),        \
        arg<3>(fn, b[3]), arg<4>(fn, b[4]), p); }); return 0; }
#define ENTRY(N)                                                                                     \
    if (!strcmp(name, #N)) {                                                                         \
        if (!strcmp(kernel, "matvec")) CALL7(matvec_##N, MultiMatVecParams)                          \
        if (!strcmp(kernel, "matvec_cols")) CALL7(matvec_cols_##N, MultiMatVecParams)                \
        if (!strcmp(kernel, "matvec_split")) CALL7(matvec_split_##N, MultiMatVecParams)              \
        if (!strcmp(kernel, "matvec_cols_split")) CALL7(matvec_cols_split_##N, MultiMatVecParams)    \
        if (!strcmp(kernel, "matvec_cols_many")) CALL7(matvec_cols_many_##N, MultiMatVecParams)      \
        if (!strcmp(kernel, "matvec_cols_split_many")) CALL7(matvec_cols_split_many_##N, MultiMatVecParams) \
        if (!strcmp(kernel, "matvec_glu")) CALL6(matvec_glu_##N, GluMatVecParams)                    \
        if (!strcmp(kernel, "matvec_glu_wide")) CALL6(matvec_glu_wide_##N, GluMatVecParams)          \
        if (!strcmp(kernel, "matvec_glu_cols")) CALL5(matvec_glu_cols_##N, GluMatVecParams)          \
        if (!strcmp(kernel, "matvec_moe_down")) CALL6(matvec_moe_down_##N, MoeDownParams)            \
        return 2;                                                                                    \
    }

// matvec_split_<kind>'s warps a block in this build (the GPU backend reads its __launch_bounds__)
#define SPLIT_WARPS(N) if (!strcmp(name, #N)) return matvec_split_##N##_warps;
extern "C" int mv_split_warps(const char * name) {
    SPLIT_WARPS(q4_0) SPLIT_WARPS(q4_1) SPLIT_WARPS(q5_0) SPLIT_WARPS(q5_1) SPLIT_WARPS(q8_0)
    SPLIT_WARPS(q4_k) SPLIT_WARPS(q5_k) SPLIT_WARPS(q6_k) SPLIT_WARPS(mxfp4)
    return -1;
}

extern "C" int run_kernel(const char * kernel, const char * name, void * const * b, const void * params,
                          unsigned gx, unsigned gy, unsigned threads, int smem) {
    if (!strcmp(kernel, "matvec_coop")) {
        if (!strcmp(name, "q6_k")) CALL7(matvec_coop_q6_k, MultiMatVecParams)
        return 2;
    }
    ENTRY(q4_0) ENTRY(q4_1) ENTRY(q5_0) ENTRY(q5_1) ENTRY(q8_0) ENTRY(q4_k) ENTRY(q5_k) ENTRY(q6_k)
    ENTRY(mxfp4)
    if (!strcmp(kernel, "matvec_mixed")) {
        if (!strcmp(name, "q4_k_q6_k")) CALL7(matvec_mixed_q4_k_q6_k, MultiMatVecParams)
        if (!strcmp(name, "q5_k_q6_k")) CALL7(matvec_mixed_q5_k_q6_k, MultiMatVecParams)
        return 2;
    }
    return 1;
}
"""


def _sources(defines: tuple[str, ...] = ()) -> dict[str, str]:
    out = host_headers(HEADERS)           # staged_x: host_smem (conformance/harness/mmq_host.py host_headers)
    out["matvec_host.cu"] = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + \
        (KERNEL_DIR / "matvec_q.cu").read_text()
    out["shim.h"] = SHIM
    out["harness.cpp"] = (HARNESS.replace("HOST_WARP_SYNC", HOST_WARP_SYNC).replace("HOST_HALF", HOST_HALF)
                          .replace("HOST_RUN_GRID", HOST_RUN_GRID)
                          .replace("NTHREADS", str(MAX_THREADS)).replace("MAX_THREADS", str(MAX_THREADS)))
    return out


def build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of matvec_q.cu (with `defines`, "NAME=VALUE" each, ahead
    of its #ifndef defaults); raises RuntimeError without g++."""
    so = compile_host(_sources(tuple(defines)), "matvec", "matvec_q.cu")
    so.run_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
    so.mv_split_warps.argtypes = [ctypes.c_char_p]
    return so


def _run(lib, kernel: str, qtype, buffers: list, params: np.ndarray, grid, threads: int, smem: int):
    """qtype: a weight type, or the name a kernel is instantiated under (matvec_mixed_'s pairs)."""
    from brass.backends.cuda.common import TYPE_NAMES
    arrs = [np.ascontiguousarray(a) for a in buffers]
    ptrs = (ctypes.c_void_p * len(arrs))(*[a.ctypes.data for a in arrs])
    name = qtype if isinstance(qtype, str) else TYPE_NAMES[qtype]
    rc = lib.run_kernel(kernel.encode(), name.encode(), ptrs, params.ctypes.data,
                        int(grid[0]), int(grid[1]), int(threads), int(smem))
    if rc:
        raise ValueError(f"no host {kernel} for {qtype}")
    return arrs


def matvec(lib, qtype, weights: list, x: np.ndarray, split: int | None = None,
           preload_rows: int | None = None) -> list[np.ndarray]:
    """y_i = x . W_i^T for up to three weights of one type sharing x [1, K] (the q/k/v launch of
    a decode step), as matvec.matvec launches matvec_<type> for one token. `split`: 1 for
    matvec_<type>, else the MV_SPLIT `lib` was built with, for matvec_split_<type> (default: the
    backend's choice for K, with the default MV_SPLIT); `preload_rows`: the MV_PRELOAD_ROWS `lib`
    was built with (default: the header's)."""
    from brass.backends.cuda.common import TYPE_NAMES
    from brass.backends.cuda.matvec import MV_WARPS, stage_bytes, matvec_units, mv_split
    from brass.backends.cuda.params import pack
    K = x.shape[-1]
    split = mv_split(K) if split is None else split
    # the split kernel's block: the build's MV_SPLIT_WARPS(_PLAIN) (the backend: its launch bounds)
    threads = lib.mv_split_warps(TYPE_NAMES[qtype].encode()) * 32 if split > 1 else MV_WARPS * 32
    upb = threads // 32 // split
    xb = q8_1_blocks(x.reshape(1, K))
    raws = [np.ascontiguousarray(w, np.uint8) for w in weights]
    rows = [r.shape[0] for r in raws] + [0] * (3 - len(raws))
    rbs = [r.shape[1] for r in raws] + [raws[0].shape[1]] * (3 - len(raws))
    ys = [np.full((1, n), np.nan, np.float32) for n in rows[:len(raws)]]
    units = matvec_units(qtype, rows, preload_rows)
    params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                  cols=1, row_bytes0=rbs[0], row_bytes1=rbs[1], row_bytes2=rbs[2])
    ws = raws + [raws[0]] * (3 - len(raws))
    outs = ys + [ys[0]] * (3 - len(ys))
    res = _run(lib, "matvec_split" if split > 1 else "matvec", qtype, ws + [xb] + outs, params, (-(-units // upb), 1),
               threads, stage_bytes(qtype, K))
    return res[4:4 + len(raws)]


def matvec_coop(lib, weights: list, x: np.ndarray, n_sms: int = 132, blocks: int | None = None,
                warps: int | None = None, rows_at_once: int | None = None) -> list[np.ndarray]:
    """y_i = x . W_i^T for up to three Q6_K weights sharing x [1, K] (K a multiple of 1024) by
    matvec_coop_q6_k, as matvec.matvec launches it for one token on a GPU of `n_sms` SMs
    (the H200's 132 by default); `blocks`: another grid (fewer blocks: each warp takes several
    rows); `warps`, `rows_at_once`: the MV_COOP_WARPS and MV_COOP_ROWS `lib` was built with
    (default: the header's)."""
    from brass.backends.cuda.matvec import MV_COOP_WARPS, stage_bytes, coop_blocks
    from brass.gguf import GGMLType
    from brass.backends.cuda.params import pack
    K = x.shape[-1]
    xb = q8_1_blocks(x.reshape(1, K))
    raws = [np.array(w, np.uint8) for w in weights]      # copies: numpy's own, aligned buffers
    rows = [r.shape[0] for r in raws] + [0] * (3 - len(raws))
    rbs = [r.shape[1] for r in raws] + [raws[0].shape[1]] * (3 - len(raws))
    if any(rb % 8 for rb in rbs):
        raise ValueError("matvec_coop_q6_k reads rows of whole 8-byte words")
    ys = [np.full((1, n), np.nan, np.float32) for n in rows[:len(raws)]]
    params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                  cols=1, row_bytes0=rbs[0], row_bytes1=rbs[1], row_bytes2=rbs[2])
    ws = raws + [raws[0]] * (3 - len(raws))
    outs = ys + [ys[0]] * (3 - len(ys))
    if blocks is None:          # the backend's grid (coop_blocks, for this build's warps and rows)
        blocks = coop_blocks(sum(rows), n_sms, warps, rows_at_once)
    warps = warps or MV_COOP_WARPS
    res = _run(lib, "matvec_coop", GGMLType.Q6_K, ws + [xb] + outs, params, (blocks, 1), warps * 32,
               stage_bytes(GGMLType.Q6_K, K))
    return res[4:4 + len(raws)]


def matvec_mixed(lib, qtype_a, qtype_b, weights_a: list, weight_b: np.ndarray, x: np.ndarray,
                 preload_rows: int | None = None) -> list[np.ndarray]:
    """[y_a0, (y_a1,) y_b] of matvec_mixed_<a>_<b> for one token x [1, K], as
    matvec.matvec_mixed launches it: one or two matrices of qtype_a, one of qtype_b
    (`preload_rows`: as for matvec)."""
    from brass.backends.cuda.matvec import MIXED_PAIRS, MV_WARPS, stage_bytes, mixed_blocks
    from brass.backends.cuda.params import pack
    K = x.shape[-1]
    xb = q8_1_blocks(x.reshape(1, K))
    ra = [np.ascontiguousarray(w, np.uint8) for w in weights_a]
    rb = np.ascontiguousarray(weight_b, np.uint8)
    rows = [ra[0].shape[0], ra[1].shape[0] if len(ra) > 1 else 0, rb.shape[0]]
    ya = [np.full((1, r.shape[0]), np.nan, np.float32) for r in ra]
    yb = np.full((1, rb.shape[0]), np.nan, np.float32)
    a1 = ra[1] if len(ra) > 1 else ra[0]
    params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                  cols=1, row_bytes0=ra[0].shape[1], row_bytes1=a1.shape[1], row_bytes2=rb.shape[1])
    outs = [ya[0], ya[1] if len(ya) > 1 else ya[0], yb]
    res = _run(lib, "matvec_mixed", MIXED_PAIRS[(qtype_a, qtype_b)], [ra[0], a1, rb, xb] + outs, params,
               (mixed_blocks(rows, qtype_a, qtype_b, preload_rows), 1), MV_WARPS * 32, stage_bytes(qtype_a, K))
    return [res[4]] + ([res[5]] if len(ra) > 1 else []) + [res[6]]


def matvec_cols(lib, qtype, weights: list, x: np.ndarray, split: int | None = None,
                iters: int | None = None, unit_rows: int | None = None,
                many: bool | None = None) -> list[np.ndarray]:
    """The same for T tokens of a batched decode step (matvec_cols_<type>, or with split > 1
    matvec_cols_split_<type>; with `many`, their _many_ kernels, by default as the backend
    picks them: two groups of tokens or more); `iters`: rounds of rows a block takes (default
    the header's MV_COLS_ROW_ITERS, as the backend launches it); `unit_rows`: the rows a warp of
    the kernel takes as `lib` was built (default the header's MV_COLS_ROWS / _MANY)."""
    from brass.backends.cuda.matvec import MV_COLS_ROWS_MANY, MV_WARPS, cols_per_block, cols_row_blocks, mv_split
    from brass.backends.cuda.params import pack
    T, K = x.shape
    split = mv_split(K) if split is None else split
    xb = q8_1_blocks(x)
    raws = [np.ascontiguousarray(w, np.uint8) for w in weights]
    rows = [r.shape[0] for r in raws] + [0] * (3 - len(raws))
    rbs = [r.shape[1] for r in raws] + [raws[0].shape[1]] * (3 - len(raws))
    ys = [np.full((T, n), np.nan, np.float32) for n in rows[:len(raws)]]
    cols, smem = cols_per_block(qtype, T, K)
    params = pack("MultiMatVecParams", k=K, n_tokens=T, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                  cols=cols, row_bytes0=rbs[0], row_bytes1=rbs[1], row_bytes2=rbs[2])
    ws = raws + [raws[0]] * (3 - len(raws))
    outs = ys + [ys[0]] * (3 - len(ys))
    groups = -(-T // cols)
    many = groups > 1 if many is None else many
    if unit_rows is None and many:
        unit_rows = MV_COLS_ROWS_MANY
    kernel = ("matvec_cols_split" if split > 1 else "matvec_cols") + ("_many" if many else "")
    res = _run(lib, kernel, qtype, ws + [xb] + outs, params,
               (groups, cols_row_blocks(rows, split, iters, unit_rows)), MV_WARPS * 32, smem)
    return res[4:4 + len(raws)]


def glu(lib, qtype, wg: np.ndarray, wu: np.ndarray | None, x: np.ndarray, gelu: bool = False, ids=None,
        n_experts: int = 1, expert_rows: int | None = None, warps: int | None = None, wide: bool = False):
    """(h [slots, N], its Q8_1 blocks) of matvec_glu_<type> as CudaBackend._glu_matvec launches
    it: x [T, K] one token per block row, or with ids [T, k] the chosen experts' matrices (wg,
    wu: the [E * N, row_bytes] bytes of the expert tensors; expert_rows = N). wu None: wg is
    the experts' gate and up in one tensor ([E * 2N, row_bytes], each expert's gate rows then
    its up rows), passed as the backend passes it (up = the same bytes N rows on). `warps`: the
    GLU_WARPS `lib` was built with (default: the header's); `wide`: matvec_glu_wide_<type>, the
    backend's kernel for launches of few blocks (GLU_WIDE_WARPS warps)."""
    from brass.backends.cuda.matvec import GLU_WARPS, GLU_WIDE_WARPS, stage_bytes
    warps = GLU_WIDE_WARPS if wide else (warps or GLU_WARPS)
    from brass.backends.cuda.params import pack
    T, K = x.shape
    xb = q8_1_blocks(x)
    wg = np.ascontiguousarray(wg, np.uint8)
    rb = wg.shape[1]
    N = expert_rows if ids is not None else wg.shape[0]
    fused = wu is None
    wu = wg.reshape(-1)[N * rb:] if fused else np.ascontiguousarray(wu, np.uint8)
    slots = T if ids is None else ids.size
    h = np.full((slots, N), np.nan, np.float32)
    hq = np.full((slots, N // 32, 36), 0xFF, np.uint8)
    idsa = np.zeros(1, np.int32) if ids is None else np.ascontiguousarray(ids, np.int32)
    params = pack("GluMatVecParams", n_rows=N, k=K, n_tokens=T, cols=1,
                  n_used=1 if ids is None else ids.shape[1], row_bytes=rb,
                  expert_bytes=(2 if fused else 1) * N * rb if ids is not None else 0, has_ids=int(ids is not None),
                  n_experts=n_experts if ids is not None else 1, gelu=int(bool(gelu)), write_q8=int(N % 32 == 0))
    res = _run(lib, "matvec_glu_wide" if wide else "matvec_glu", qtype, [wg, wu, xb, idsa, h, hq], params,
               (-(-N // 32), slots), warps * 32, stage_bytes(qtype, K))      # 32 rows a block
    return res[4], res[5]


def glu_cols(lib, qtype, wg: np.ndarray, wu: np.ndarray, x: np.ndarray, gelu: bool = False):
    """(h [T, N], its Q8_1 blocks) of matvec_glu_cols_<type> (a batched step's gated FFN: blocks
    of `cols` tokens, each token's h as the one-token kernel's), as matvec.glu_matvec
    launches it for T > 1 tokens without experts."""
    from brass.backends.cuda.matvec import GLU_ROWS, GLU_WARPS, cols_per_block
    from brass.backends.cuda.params import pack
    T, K = x.shape
    xb = q8_1_blocks(x)
    wg, wu = np.ascontiguousarray(wg, np.uint8), np.ascontiguousarray(wu, np.uint8)
    N, rb = wg.shape
    h = np.full((T, N), np.nan, np.float32)
    hq = np.full((T, N // 32, 36), 0xFF, np.uint8)
    cols, smem = cols_per_block(qtype, T, K)
    params = pack("GluMatVecParams", n_rows=N, k=K, n_tokens=T, cols=cols, n_used=1, row_bytes=rb,
                  expert_bytes=0, has_ids=0, n_experts=1, gelu=int(bool(gelu)), write_q8=int(N % 32 == 0))
    res = _run(lib, "matvec_glu_cols", qtype, [wg, wu, xb, h, hq], params,
               (-(-T // cols), -(-N // (GLU_WARPS * GLU_ROWS))), GLU_WARPS * 32, smem)
    return res[3], res[4]


def moe_down(lib, qtype, wd: np.ndarray, h: np.ndarray, ids: np.ndarray, wts: np.ndarray, n_experts: int,
             scales: np.ndarray | None = None):
    """out [T, D] = sum_j wts[t, j] * (h[t, j] . W_down[ids[t, j]]^T) by matvec_moe_down_<type>,
    with h [T, k, N] as Q8_1 blocks (as the gated kernel writes them); wd: [E * D, row_bytes];
    scales [E]: each expert's output times scales[e] before its weight."""
    from brass.backends.cuda.matvec import DOWN_ROWS, DOWN_WARPS, stage_bytes
    from brass.backends.cuda.params import pack
    T, k, N = h.shape
    wd = np.ascontiguousarray(wd, np.uint8)
    D = wd.shape[0] // n_experts
    rb = wd.shape[1]
    hb = q8_1_blocks(h.reshape(T * k, N))
    out = np.full((T, D), np.nan, np.float32)
    params = pack("MoeDownParams", n_rows=D, k=N, n_tokens=T, n_used=k, row_bytes=rb,
                  expert_bytes=D * rb, n_experts=n_experts, has_scale=int(scales is not None))
    sc = np.ascontiguousarray(scales if scales is not None else np.full(1, np.nan), np.float32)
    res = _run(lib, "matvec_moe_down", qtype, [wd, hb, np.ascontiguousarray(ids, np.int32),
                                                 np.ascontiguousarray(wts, np.float32), sc, out], params,
               (-(-D // DOWN_ROWS), T), DOWN_WARPS * 32, stage_bytes(qtype, k * N))
    return res[5]


def main(argv: list[str]) -> int:
    import tempfile
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import MATMUL, cuda_reference, nmse, random_weight_file
    rng = np.random.default_rng(int(argv[0]) if argv else 0)
    lib = build()
    ref = cuda_reference()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4):
            N, K = 96, 512
            gf = GGUFFile(random_weight_file(Path(tmp) / "w.gguf", rng, {"w": (qtype, (N, K))}))
            x = rng.uniform(-1, 1, (1, K)).astype(np.float32)
            (y,) = matvec(lib, qtype, [gf.tensor_bytes("w").reshape(N, -1)], x)
            with ref.rows_independent():
                want = ref.matmul(x, ref.weight(gf, "w"))
            e = nmse(y, want)
            failed += not e <= MATMUL
            print(f"matvec {qtype.name} N{N} K{K}: NMSE {e:.2e} {'ok' if e <= MATMUL else 'FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
