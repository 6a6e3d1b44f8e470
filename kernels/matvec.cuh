// The thread-block skeleton shared by every mat-vec: one weight row per thread block, its
// "items" strided over MATVEC_THREADS threads, partial sums reduced through shared memory.
// A weight kind K supplies K::act (the activation element: float, or a Q8_1 block),
// K::values_per_item and K::dot(row, item, act) for one item against its activations.
//
//   matvec_<kind>     decode: one output row per thread block, one token per blockIdx.y
//   matmul_<kind>     prefill: one output row x up to MATMUL_TILE tokens per thread block
//                     (each weight row is read once per tile of tokens)
//   matvec_id_<kind>  mul_mat_id: blockIdx.y is a (token, slot) pair and ids[slot] picks
//                     the expert matrix on the device
#pragma once
#include "common.cuh"
#include "params.cuh"

#define MATVEC_THREADS 128
#define MATMUL_TILE 8

template <class K, int NCOLS>
__device__ __forceinline__ void matvec_rows(const u8 * __restrict__ w_row, const typename K::act * __restrict__ x,
                                            float * __restrict__ y, const int n_items, const int ncols,
                                            const i64 x_stride, const i64 y_stride) {
    float acc[NCOLS];
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) acc[j] = 0.0f;
    for (int i = threadIdx.x; i < n_items; i += MATVEC_THREADS) {
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            if (j < ncols) acc[j] += K::dot(w_row, i, x + j * x_stride + i);
        }
    }
    __shared__ float partial[MATVEC_THREADS / WARP_SIZE][NCOLS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0) partial[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x < ncols) {
        float out = 0.0f;
#pragma unroll
        for (int w = 0; w < MATVEC_THREADS / WARP_SIZE; ++w) out += partial[w][threadIdx.x];
        y[threadIdx.x * y_stride] = out;
    }
}

#define DEFINE_MATVEC(name, K)                                                                     \
extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                       \
matvec_##name(const u8 * __restrict__ w, const K::act * __restrict__ x, float * __restrict__ y,    \
              const MatVecParams p) {                                                              \
    const int row = blockIdx.x, t = blockIdx.y, n_items = p.k / K::values_per_item;                \
    matvec_rows<K, 1>(w + row * p.row_bytes, x + (i64) t * n_items, y + (i64) t * p.n_rows + row,  \
                      n_items, 1, 0, 0);                                                           \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                       \
matmul_##name(const u8 * __restrict__ w, const K::act * __restrict__ x, float * __restrict__ y,    \
              const MatVecParams p) {                                                              \
    const int row = blockIdx.x, t0 = blockIdx.y * MATMUL_TILE, n_items = p.k / K::values_per_item; \
    matvec_rows<K, MATMUL_TILE>(w + row * p.row_bytes, x + (i64) t0 * n_items,                     \
                                y + (i64) t0 * p.n_rows + row, n_items,                            \
                                min(MATMUL_TILE, p.n_tokens - t0), n_items, p.n_rows);             \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                       \
matvec_id_##name(const u8 * __restrict__ w, const K::act * __restrict__ x,                         \
                 const int * __restrict__ ids, float * __restrict__ y, const MatVecParams p) {     \
    const int row = blockIdx.x, slot = blockIdx.y, n_items = p.k / K::values_per_item;             \
    const int x_row = p.x_per_slot ? slot : slot / p.n_used;                                       \
    const int expert = ids[slot];                                                                  \
    if (expert < 0 || expert >= p.n_experts) {                                                     \
        if (threadIdx.x == 0) y[(i64) slot * p.n_rows + row] = __int_as_float(0x7fc00000);         \
        return;                                                                                    \
    }                                                                                              \
    matvec_rows<K, 1>(w + expert * p.expert_bytes + row * p.row_bytes,                             \
                      x + (i64) x_row * n_items, y + (i64) slot * p.n_rows + row,                  \
                      n_items, 1, 0, 0);                                                           \
}
