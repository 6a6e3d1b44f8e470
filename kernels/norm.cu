// RMS norm over the last axis, then the optional weight multiply (ggml_rms_norm + ggml_mul),
// also used for the per-head q/k norms (rows of Dh). As ggml's CPU path: the squares summed
// in double, the mean rounded to float, 1/sqrtf(mean + eps), then two float32 products.
#include "common.cuh"
#include "params.cuh"

#define NORM_THREADS 256

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm(const float * __restrict__ x, const float * __restrict__ w, float * __restrict__ y,
         const RmsNormParams p) {
    PDL_ENTRY();
    const float * xr = x + (i64) blockIdx.x * p.n_cols;
    float * yr = y + (i64) blockIdx.x * p.n_cols;
    double ss = 0.0;
    for (int i = threadIdx.x; i < p.n_cols; i += NORM_THREADS) {
        const double v = xr[i];
        ss += v * v;
    }
    __shared__ double partial[NORM_THREADS / WARP_SIZE];
    ss = block_sum_f64<NORM_THREADS>(ss, partial);
    const float mean = (float) (ss / p.n_cols);
    const float scale = 1.0f / sqrtf(__fadd_rn(mean, p.eps));
    for (int i = threadIdx.x; i < p.n_cols; i += NORM_THREADS) {
        float v = __fmul_rn(xr[i], scale);
        if (p.has_weight) v = __fmul_rn(v, w[i]);
        yr[i] = v;
    }
}
