// Row-wise softmax (the MoE router), top-k selection and argmax, on the device.
// Ties in top-k and argmax go to the lower index, as a stable sort would order them.
#include "common.cuh"
#include "params.cuh"

#define ROW_THREADS 256

// exp(x - max) summed in double and divided in double, as the numpy reference does.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
softmax(const float * __restrict__ x, float * __restrict__ y, const RowParams p) {
    PDL_ENTRY();
    __shared__ float scratch[WARP_SIZE];
    __shared__ double scratch_d[ROW_THREADS / WARP_SIZE];
    const float * xr = x + (i64) blockIdx.x * p.n_cols;
    float * yr = y + (i64) blockIdx.x * p.n_cols;
    float m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < p.n_cols; i += ROW_THREADS) m = fmaxf(m, xr[i]);
    m = block_max(m, scratch);
    double sum = 0.0;
    for (int i = threadIdx.x; i < p.n_cols; i += ROW_THREADS) {
        const float e = expf(__fsub_rn(xr[i], m));
        yr[i] = e;
        sum += e;
    }
    sum = warp_sum_f64(sum);
    if (threadIdx.x % WARP_SIZE == 0) scratch_d[threadIdx.x / WARP_SIZE] = sum;
    __syncthreads();
    sum = 0.0;
#pragma unroll
    for (int w = 0; w < ROW_THREADS / WARP_SIZE; ++w) sum += scratch_d[w];
    for (int i = threadIdx.x; i < p.n_cols; i += ROW_THREADS) yr[i] = (float) (yr[i] / sum);
}


__device__ __forceinline__ void block_best(float & v, int & i) {
    __shared__ float sv[WARP_SIZE];
    __shared__ int si[WARP_SIZE];
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads();
    if (threadIdx.x % WARP_SIZE == 0) { sv[threadIdx.x / WARP_SIZE] = v; si[threadIdx.x / WARP_SIZE] = i; }
    __syncthreads();
    v = sv[0]; i = si[0];
    for (int w = 1; w < ROW_THREADS / WARP_SIZE; ++w) better(v, i, sv[w], si[w]);
}

// k rounds of a block-wide arg-max, each excluding the indices already chosen.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
topk(const float * __restrict__ x, int * __restrict__ ids, float * __restrict__ vals, const RowParams p) {
    PDL_ENTRY();
    const float * xr = x + (i64) blockIdx.x * p.n_cols;
    int last_i = -1;
    float last_v = 0.0f;
    for (int r = 0; r < p.k; ++r) {
        float v = 0.0f;
        int i = -1;
        for (int c = threadIdx.x; c < p.n_cols; c += ROW_THREADS) {
            const float xc = xr[c];
            // Still available: after the previous pick in (value desc, index asc) order.
            if (last_i < 0 || xc < last_v || (xc == last_v && c > last_i)) better(v, i, xc, c);
        }
        block_best(v, i);
        if (threadIdx.x == 0) {
            ids[(i64) blockIdx.x * p.k + r] = i;
            vals[(i64) blockIdx.x * p.k + r] = v;
        }
        last_v = v; last_i = i;
    }
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

// p.n_cols = partials per row.
extern "C" __global__ void __launch_bounds__(WARP_SIZE)
argmax_final(const float * __restrict__ pv, const int * __restrict__ pi, int * __restrict__ ids, const RowParams p) {
    PDL_ENTRY();
    float v = 0.0f;
    int i = -1;
    for (int j = threadIdx.x; j < p.n_cols; j += WARP_SIZE)
        better(v, i, pv[(i64) blockIdx.x * p.n_cols + j], pi[(i64) blockIdx.x * p.n_cols + j]);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (threadIdx.x == 0) ids[blockIdx.x] = i;
}
