// Elementwise ops: residual add, multiply, scale, the gated activations and the weighted sum
// of expert outputs. Each mirrors the numpy reference operation by operation in float32
// (the _rn intrinsics keep the compiler from fusing a multiply and an add into one FMA,
// which would round differently).
#include "common.cuh"
#include "params.cuh"

#define EW_THREADS 256

// a + b, with b repeating every n_b elements (a bias or a row broadcast over tokens).
extern "C" __global__ void __launch_bounds__(EW_THREADS)
add(const float * __restrict__ a, const float * __restrict__ b, float * __restrict__ y, const BinaryParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fadd_rn(a[i], b[i % p.n_b]);
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
mul(const float * __restrict__ a, const float * __restrict__ b, float * __restrict__ y, const BinaryParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(a[i], b[i % p.n_b]);
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
scale(const float * __restrict__ x, float * __restrict__ y, const ScaleParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(x[i], p.s);
}

// silu(g) * u = (g / (1 + exp(-g))) * u
extern "C" __global__ void __launch_bounds__(EW_THREADS)
swiglu(const float * __restrict__ g, const float * __restrict__ u, float * __restrict__ y, const GluParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        y[i] = swiglu_value(g[i], u[i]);
    }
}

// gelu_tanh(g) * u with GELU through F16 as ggml's CPU does (gelu_f16, common.cuh).
extern "C" __global__ void __launch_bounds__(EW_THREADS)
geglu(const float * __restrict__ g, const float * __restrict__ u, float * __restrict__ y, const GluParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(gelu_f16(g[i]), u[i]);
}

// out[t, :] = sum_j w[t, j] * y[t, j, :], the products added one expert after another.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
weighted_sum(const float * __restrict__ y, const float * __restrict__ w, float * __restrict__ out,
             const WeightedSumParams p) {
    const int t = blockIdx.y;
    const int i = blockIdx.x * EW_THREADS + threadIdx.x;
    if (i >= p.n_cols) return;
    const float * yt = y + (i64) t * p.k * p.n_cols + i;
    const float * wt = w + (i64) t * p.k;
    float acc = __fmul_rn(yt[0], wt[0]);
    for (int j = 1; j < p.k; ++j) acc = __fadd_rn(acc, __fmul_rn(yt[(i64) j * p.n_cols], wt[j]));
    out[(i64) t * p.n_cols + i] = acc;
}
