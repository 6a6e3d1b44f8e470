// The MoE router's arithmetic on one row, for a block of THREADS threads, shared by router.cu's
// softmax and topk kernels and moe_route (fused.cu, a block per token), so that all of them
// give the same bits.
#pragma once
#include "common.cuh"

// yr = softmax(xr) over n values: exp(x - max) summed in double and divided in double, as the
// numpy reference does. xr is read through L2 (__ldcg), as when a fused router (since removed)
// read rows written by other blocks of its launch; plain loads would give the same values.
template <int THREADS>
__device__ __forceinline__ void softmax_row(const float * xr, float * __restrict__ yr, const int n) {
    __shared__ float scratch[WARP_SIZE];
    __shared__ double scratch_d[THREADS / WARP_SIZE];
    float m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < n; i += THREADS) m = fmaxf(m, __ldcg(xr + i));
    m = block_max(m, scratch);
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const float e = expf(__fsub_rn(__ldcg(xr + i), m));
        yr[i] = e;
        sum += e;
    }
    sum = block_sum_f64<THREADS>(sum, scratch_d);
    for (int i = threadIdx.x; i < n; i += THREADS) yr[i] = (float) (yr[i] / sum);
}

// The block's best (value, index) candidate (better: larger value, then lower index); every
// thread ends with it.
template <int THREADS>
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
    for (int w = 1; w < THREADS / WARP_SIZE; ++w) better(v, i, sv[w], si[w]);
}

// The k largest of xr's n values, in (value desc, index asc) order: k rounds of a block-wide
// arg-max, each over what comes after the previous pick in that order. Thread 0 writes ids[r]
// and vals[r]. xr must not change meanwhile (the whole block reads it every round).
template <int THREADS>
__device__ __forceinline__ void topk_row(const float * xr, int * ids, float * vals, const int n, const int k) {
    int last_i = -1;
    float last_v = 0.0f;
    for (int r = 0; r < k; ++r) {
        float v = 0.0f;
        int i = -1;
        for (int c = threadIdx.x; c < n; c += THREADS) {
            const float xc = xr[c];
            if (last_i < 0 || xc < last_v || (xc == last_v && c > last_i)) better(v, i, xc, c);
        }
        block_best<THREADS>(v, i);
        if (threadIdx.x == 0) {
            ids[r] = i;
            vals[r] = v;
        }
        last_v = v; last_i = i;
    }
}

// The router of one token: probs = softmax(logits), its top k, then the chosen probabilities
// divided by their sum (clamped to F16's smallest normal, as ggml) when norm, times scale.
template <int THREADS>
__device__ __forceinline__ void route_row(const float * xr, float * __restrict__ pr, int * __restrict__ ids,
                                          float * __restrict__ weights, const int E, const int k,
                                          const int norm, const float scale) {
    __shared__ float chosen[64];
    softmax_row<THREADS>(xr, pr, E);
    __syncthreads();        // each thread re-reads other threads' probabilities below
    topk_row<THREADS>(pr, ids, chosen, E, k);
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int r = 0; r < k; ++r) total = __fadd_rn(total, chosen[r]);
        total = fmaxf(total, 6.103515625e-5f);
        for (int r = 0; r < k; ++r) {
            float wr = norm ? __fdiv_rn(chosen[r], total) : chosen[r];
            if (scale != 1.0f) wr = __fmul_rn(wr, scale);
            weights[r] = wr;
        }
    }
    __syncthreads();        // the shared arrays are reused by the next row's call
}
