// The gated FFN's gate and up mat-vecs for one token (included by matvec.cuh): matvec_glu_<kind>
// and matvec_glu_wide_<kind> (glu_rows), dense or over the chosen experts.
#pragma once
#include "matvec.cuh"

// matvec_glu_ / matvec_glu_wide_: a block's 32 rows of h (one Q8_1 block), WARPS warps x ROWS
// rows; PAIRED (matvec_glu_wide_) reads gate and up in one loop, both matrices' loads in flight
// together, at more registers (matvec_glu_ reads one after the other). Every choice gives the
// same floats (a row's items, lanes and order do not depend on it): they move time only.
template <int WARPS, int ROWS>
__device__ __forceinline__ void glu_prefetch(const u8 * wg, const u8 * wu, const GluMatVecParams & p) {
    if (!p.has_ids && 2ll * p.n_rows * p.row_bytes <= MV_PREFETCH_MAX_BYTES) {
        const int r0 = blockIdx.x * (WARPS * ROWS) + threadIdx.x / WARP_SIZE * ROWS;
        const long long nb = (long long) max(0, min(ROWS, p.n_rows - r0)) * p.row_bytes;
        prefetch_l2_span(wg + r0 * p.row_bytes, nb);
        prefetch_l2_span(wu + r0 * p.row_bytes, nb);
    }
}

template <typename K, int WARPS, int ROWS, bool PAIRED>
__device__ __forceinline__ void glu_rows(const u8 * __restrict__ wg, const u8 * __restrict__ wu,
                                         const typename K::act * __restrict__ x, const int * __restrict__ ids,
                                         float * __restrict__ h, block_q8_1 * __restrict__ hq,
                                         const GluMatVecParams & p) {
    static_assert(WARPS * ROWS == 32, "a gated block is one Q8_1 block (32 rows) of h");
    __shared__ float hs[WARPS * ROWS];
    const int slot = blockIdx.y, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = blockIdx.x * (WARPS * ROWS), row = row0 + warp * ROWS;
    const int n_items = p.k / K::values_per_item;
    i64 off = 0;
    bool valid = true;
    if (p.has_ids) {
        const int e = ids[slot];
        valid = e >= 0 && e < p.n_experts;
        off = (i64) (valid ? e : 0) * p.expert_bytes;
    }
    const typename K::act * xr = x + (i64) (slot / p.n_used) * n_items;
    extern __shared__ int4 staged_x[];
    const void * xs = stage_act<K>(xr, 1, n_items, staged_x);
    float g[ROWS], up[ROWS];
    if constexpr (PAIRED) {
        rows_dot2<K, ROWS>(wg + off + row * p.row_bytes, wu + off + row * p.row_bytes, p.row_bytes,
                           p.n_rows - row, xr, xs, n_items, g, up);
    } else {
        rows_dot<K, ROWS>(wg + off + row * p.row_bytes, p.row_bytes, p.n_rows - row, xr, xs, n_items, g);
        rows_dot<K, ROWS>(wu + off + row * p.row_bytes, p.row_bytes, p.n_rows - row, xr, xs, n_items, up);
    }
    if (lane == 0) {
        _Pragma("unroll")
        for (int r = 0; r < ROWS; ++r)
            hs[warp * ROWS + r] = valid ? glu_value(p.gelu, g[r], up[r]) : NAN_F32;
    }
    __syncthreads();
    if (warp == 0) {
        const float v = hs[lane];
        if (row0 + lane < p.n_rows) h[(i64) slot * p.n_rows + row0 + lane] = v;
        if (p.write_q8) quantize_warp_q8_1(v, hq + (i64) slot * (p.n_rows / QK8_1) + blockIdx.x);
    }
}
