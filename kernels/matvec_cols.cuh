// A batched decode step's mat-vecs (included by matvec.cuh): matvec_cols_<kind> and
// matvec_cols_split_<kind>, and their _many_ forms (decode_cols).
#pragma once
#include "matvec.cuh"

// matvec_cols_<kind> and matvec_cols_split_<kind>: a batched step's tokens, rows as decode_rows
// in units of NR rows (MV_COLS_ROWS; the _many_ kernels MV_COLS_ROWS_MANY).
template <class K, int SPLIT, int NR>
__device__ __forceinline__ void decode_cols(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                            const u8 * __restrict__ w2, const typename K::act * __restrict__ x,
                                            float * __restrict__ y0, float * __restrict__ y1,
                                            float * __restrict__ y2, const MultiMatVecParams p) {
    constexpr int UPB = MV_WARPS / SPLIT;      /* units per block: a group of SPLIT warps each */
    constexpr int N = NR * MV_COLS;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = warp / SPLIT, s = warp % SPLIT;
    /* Tokens t0 .. t0 + n_cols of a batched step (blockIdx.x), units of NR rows on whole warp */
    /* groups as in matvec_ (blockIdx.y, grid-stride): one unit per group, the tokens' sums     */
    /* side by side, each token's items split over the group's warps as matvec_ splits them.    */
    const int units = (p.n_rows0 + NR - 1) / NR + (p.n_rows1 + NR - 1) / NR + (p.n_rows2 + NR - 1) / NR;
    const int t0 = blockIdx.x * p.cols, n_cols = min(p.cols, p.n_tokens - t0);
    const int n_items = p.k / K::values_per_item;
    extern __shared__ int4 staged_x[];
    const void * xs = stage_act<K, MV_COLS_STAGE_MAX_K>(x + (i64) t0 * n_items, n_cols, n_items, staged_x);
    __shared__ float mv_part[SPLIT > 1 ? MV_WARPS : 1][N];
    for (int ub = blockIdx.y * UPB; ub < units; ub += gridDim.y * UPB) {
        int u = ub + g;
        const bool valid = u < units;
        const MatVecUnit m = unit_matrix(u, NR, w0, w1, w2, y0, y1, y2, p);
        const int row = u * NR;
        const u8 * w[NR];
        _Pragma("unroll")
        for (int r = 0; r < NR; ++r) w[r] = m.w + min(row + r, m.n - 1) * m.rb;   /* past the end: again */
        float acc[N];
        if (valid) cols_dot_rows<K, NR, MV_COLS>(w, x + (i64) t0 * n_items, xs, n_cols, n_items, acc,
                                                 lane + s * WARP_SIZE, SPLIT * WARP_SIZE);
        if constexpr (SPLIT > 1) split_sum<N, SPLIT>(acc, mv_part, warp, s, valid);
        if (valid && s == 0) {
            _Pragma("unroll")
            for (int r = 0; r < NR; ++r)
                _Pragma("unroll")
                for (int c = 0; c < MV_COLS; ++c)
                    if (lane == c && c < n_cols && row + r < m.n) y_row(m, t0 + c, row + r) = acc[r * MV_COLS + c];
        }
    }
}

// matvec_cols_<tag><kind> / matvec_cols_split_<tag><kind>: a batched step's mat-vecs, NR rows a
// warp (a split group).
#define DEFINE_MATVEC_COLS(name, K, tag, NR)                                                       \
extern "C" __global__ void __launch_bounds__(MV_WARPS * WARP_SIZE)                                 \
matvec_cols_##tag##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1, const u8 * __restrict__ w2, \
    const K::act * __restrict__ x, float * __restrict__ y0, float * __restrict__ y1,               \
    float * __restrict__ y2, const MultiMatVecParams p) {                                          \
    prefetch_unit(w0, w1, w2, p, blockIdx.y * MV_WARPS + threadIdx.x / WARP_SIZE, NR);             \
    PDL_ENTRY();                                                                                   \
    decode_cols<K, 1, NR>(w0, w1, w2, x, y0, y1, y2, p);                                           \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(MV_WARPS * WARP_SIZE)                                 \
matvec_cols_split_##tag##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1,              \
    const u8 * __restrict__ w2, const K::act * __restrict__ x, float * __restrict__ y0,            \
    float * __restrict__ y1, float * __restrict__ y2, const MultiMatVecParams p) {                 \
    if (threadIdx.x / WARP_SIZE % MV_SPLIT == 0)   /* the first warp of each group */              \
        prefetch_unit(w0, w1, w2, p, blockIdx.y * (MV_WARPS / MV_SPLIT) + threadIdx.x / WARP_SIZE / MV_SPLIT, \
                      NR);                                                                         \
    PDL_ENTRY();                                                                                   \
    decode_cols<K, MV_SPLIT, NR>(w0, w1, w2, x, y0, y1, y2, p);                                    \
}
