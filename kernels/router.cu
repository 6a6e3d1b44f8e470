// Row-wise softmax (the MoE router), top-k selection and argmax, on the device.
// Ties in top-k and argmax go to the lower index, as a stable sort would order them.
#include "common.cuh"
#include "params.cuh"
#include "route.cuh"

#define ROW_THREADS 256

// softmax_row (route.cuh) on each row.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
softmax(const float * __restrict__ x, float * __restrict__ y, const RowParams p) {
    PDL_ENTRY();
    softmax_row<ROW_THREADS>(x + (i64) blockIdx.x * p.n_cols, y + (i64) blockIdx.x * p.n_cols, p.n_cols);
}

// topk_row (route.cuh) on each row.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
topk(const float * __restrict__ x, int * __restrict__ ids, float * __restrict__ vals, const RowParams p) {
    PDL_ENTRY();
    topk_row<ROW_THREADS>(x + (i64) blockIdx.x * p.n_cols, ids + (i64) blockIdx.x * p.k,
                          vals + (i64) blockIdx.x * p.k, p.n_cols, p.k);
}

#define ARGMAX_THREADS 1024

// One block of 1024 threads per row: an output head's 150k-260k logits are read by every
// thread of the block with coalesced loads, then reduced by shuffles and one shared round.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax(const float * __restrict__ x, int * __restrict__ ids, const RowParams p) {
    PDL_ENTRY();
    __shared__ float sv[ARGMAX_THREADS / WARP_SIZE];
    __shared__ int si[ARGMAX_THREADS / WARP_SIZE];
    const float * xr = x + (i64) blockIdx.x * p.n_cols;
    float v = 0.0f;
    int i = -1;
    for (int c = threadIdx.x; c < p.n_cols; c += ARGMAX_THREADS) better(v, i, xr[c], c);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (threadIdx.x % WARP_SIZE == 0) { sv[threadIdx.x / WARP_SIZE] = v; si[threadIdx.x / WARP_SIZE] = i; }
    __syncthreads();
    if (threadIdx.x < WARP_SIZE) {
        v = sv[threadIdx.x]; i = si[threadIdx.x];
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
            better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        if (threadIdx.x == 0) ids[blockIdx.x] = i;
    }
}

// Rows too long for one block (an output head's logits): blockIdx.x takes every gridDim.x-th
// run of ARGMAX_THREADS columns and writes its best (value, index); argmax_final picks the
// best of those. `better` is a total order (larger value, then lower index), so the two
// stages choose what one block would.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_partial(const float * __restrict__ x, float * __restrict__ pv, int * __restrict__ pi, const RowParams p) {
    PDL_ENTRY();
    __shared__ float sv[ARGMAX_THREADS / WARP_SIZE];
    __shared__ int si[ARGMAX_THREADS / WARP_SIZE];
    const float * xr = x + (i64) blockIdx.y * p.n_cols;
    float v = 0.0f;
    int i = -1;
    for (int c = blockIdx.x * ARGMAX_THREADS + threadIdx.x; c < p.n_cols; c += gridDim.x * ARGMAX_THREADS)
        better(v, i, xr[c], c);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (threadIdx.x % WARP_SIZE == 0) { sv[threadIdx.x / WARP_SIZE] = v; si[threadIdx.x / WARP_SIZE] = i; }
    __syncthreads();
    if (threadIdx.x < WARP_SIZE) {
        v = sv[threadIdx.x]; i = si[threadIdx.x];
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
            better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        if (threadIdx.x == 0) {
            pv[(i64) blockIdx.y * gridDim.x + blockIdx.x] = v;
            pi[(i64) blockIdx.y * gridDim.x + blockIdx.x] = i;
        }
    }
}

// The best of a row's n partial results (argmax_partial's), by one warp; every lane gets it.
__device__ __forceinline__ int best_of_partials(const float * __restrict__ pv, const int * __restrict__ pi, const int n) {
    float v = 0.0f;
    int i = -1;
    for (int j = threadIdx.x; j < n; j += WARP_SIZE) better(v, i, pv[j], pi[j]);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    return i;
}

// p.n_cols = partials per row.
extern "C" __global__ void __launch_bounds__(WARP_SIZE)
argmax_final(const float * __restrict__ pv, const int * __restrict__ pi, int * __restrict__ ids, const RowParams p) {
    PDL_ENTRY();
    const int i = best_of_partials(pv + (i64) blockIdx.x * p.n_cols, pi + (i64) blockIdx.x * p.n_cols, p.n_cols);
    if (threadIdx.x == 0) ids[blockIdx.x] = i;
}
