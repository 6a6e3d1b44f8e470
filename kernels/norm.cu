// RMS norm over the last axis, then the optional weight multiply (ggml_rms_norm + ggml_mul),
// also used for the per-head q/k norms (rows of Dh). As ggml's CPU path: the squares summed
// in double, the mean rounded to float, 1/sqrtf(mean + eps), then two float32 products. The
// compositions the backend builds on it take their last ops here too, each the float32 op of
// the kernel it replaces in that kernel's order: a scalar scale (`scale`: l2_norm) and a gate
// silu(z) (`unary` silu, then `mul`: rms_norm_gated), so that they take one launch, not three,
// and the result's Q8_1 blocks for the mat-vec after it (no quantize launch).
#include "common.cuh"
#include "params.cuh"

#define NORM_THREADS 256

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm(const float * __restrict__ x, const float * __restrict__ w, const float * __restrict__ z,
         float * __restrict__ y, block_q8_1 * __restrict__ yq, const RmsNormParams p) {
    PDL_ENTRY();
    const float * xr = x + (i64) blockIdx.x * p.n_cols;
    const float * zr = z + (i64) blockIdx.x * p.n_cols;
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
        if (p.has_scale) v = __fmul_rn(v, p.scale);
        if (p.has_gate) {
            v = __fmul_rn(v, silu_f(zr[i]));                           // silu, as ssm.cu's unary
        }
        yr[i] = v;
        // n_cols is a multiple of 32 when write_q8 is set: whole warps take this branch, each
        // in one Q8_1 block, as the quantize kernel forms it
        if (p.write_q8) quantize_warp_q8_1(v, yq + ((i64) blockIdx.x * p.n_cols + i) / QK8_1);
    }
}
