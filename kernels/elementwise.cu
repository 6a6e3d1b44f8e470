// Elementwise ops: residual add, multiply, scale, the gated activations, the weighted sum
// of expert outputs, and Gemma 4's tanh, final logit softcap and per-expert output scale.
// Each mirrors the numpy reference operation by operation in float32 (the _rn intrinsics
// keep the compiler from fusing a multiply and an add into one FMA, which would round
// differently).
#include "common.cuh"
#include "params.cuh"

#define EW_THREADS 256

// a + b, with b repeating every n_b elements (a bias or a row broadcast over tokens).
extern "C" __global__ void __launch_bounds__(EW_THREADS)
add(const float * __restrict__ a, const float * __restrict__ b, float * __restrict__ y, const BinaryParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fadd_rn(a[i], b[i % p.n_b]);
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
mul(const float * __restrict__ a, const float * __restrict__ b, float * __restrict__ y, const BinaryParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(a[i], b[i % p.n_b]);
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
scale(const float * __restrict__ x, float * __restrict__ y, const ScaleParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(x[i], p.s);
}

// silu(g) * u = (g / (1 + exp(-g))) * u
extern "C" __global__ void __launch_bounds__(EW_THREADS)
swiglu(const float * __restrict__ g, const float * __restrict__ u, float * __restrict__ y, const GluParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        y[i] = swiglu_value(g[i], u[i]);
    }
}

// Backend.sigmoid_gate, x * sigmoid(g) (qwen35's attention output gate), and qwen35moe's
// shared expert added under its per-token gate, a + x * sigmoid(g[t]), in one pass: sigmoid as
// ssm.cu's unary computes it, then the mul and add kernels' float32 ops in their order.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
sigmoid_gate(const float * __restrict__ x, const float * __restrict__ g, const float * __restrict__ a,
             float * __restrict__ y, const SigmoidGateParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        const float gv = g[p.row_gate ? i / p.row : i];
        float v = __fmul_rn(x[i], sigmoid_f(gv));
        if (p.has_a) v = __fadd_rn(a[i], v);
        y[i] = v;
    }
}

// gelu_tanh(g) * u with GELU through F16 as ggml's CPU does (gelu_f16, common.cuh).
extern "C" __global__ void __launch_bounds__(EW_THREADS)
geglu(const float * __restrict__ g, const float * __restrict__ u, float * __restrict__ y, const GluParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(gelu_f16(g[i]), u[i]);
}

// out[t, :] = sum_j w[t, j] * y[t, j, :], the products added one expert after another.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
weighted_sum(const float * __restrict__ y, const float * __restrict__ w, float * __restrict__ out,
             const WeightedSumParams p) {
    PDL_ENTRY();
    const int t = blockIdx.y;
    const int i = blockIdx.x * EW_THREADS + threadIdx.x;
    if (i >= p.n_cols) return;
    const float * yt = y + (i64) t * p.k * p.n_cols + i;
    const float * wt = w + (i64) t * p.k;
    float acc = __fmul_rn(yt[0], wt[0]);
    for (int j = 1; j < p.k; ++j) acc = __fadd_rn(acc, __fmul_rn(yt[(i64) j * p.n_cols], wt[j]));
    out[(i64) t * p.n_cols + i] = acc;
}

// ---- Gemma 4 ---------------------------------------------------------------------------------
// (The kernel is not called tanh: that would clash with the C math function.)
extern "C" __global__ void __launch_bounds__(EW_THREADS)
tanh_f32(const float * __restrict__ x, float * __restrict__ y, const GluParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = tanhf(x[i]);
}

// Final logit softcap, cap * tanh(x * (1 / cap)) with p.s = cap: the three operations of
// Backend.softcap (scale by the float32 quotient 1 / cap, tanh, scale by cap) in one pass,
// each rounded as there (1.0f / cap is an IEEE division: no fast math).
extern "C" __global__ void __launch_bounds__(EW_THREADS)
softcap(const float * __restrict__ x, float * __restrict__ y, const ScaleParams p) {
    PDL_ENTRY();
    const float inv = __fdiv_rn(1.0f, p.s);
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS)
        y[i] = __fmul_rn(tanhf(__fmul_rn(x[i], inv)), p.s);
}

// out[t, j, :] = y[t, j, :] * s[ids[t, j]]: the per-expert scale of an expert mat-mul's output
// (ffn_down_exps.scale). blockIdx.x is the (token, slot) pair (x: a long prompt's T * k can
// pass grid.y's 65535); an id outside [0, n_experts) gives NaN, as the expert mat-vecs do.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
mul_expert_scale(const float * __restrict__ y, const float * __restrict__ s, const int * __restrict__ ids,
                 float * __restrict__ out, const ExpertScaleParams p) {
    PDL_ENTRY();
    const int slot = blockIdx.x;
    const int i = blockIdx.y * EW_THREADS + threadIdx.x;
    if (i >= p.n_cols) return;
    const int e = ids[slot];
    const i64 at = (i64) slot * p.n_cols + i;
    out[at] = (e >= 0 && e < p.n_experts) ? __fmul_rn(y[at], s[e]) : __int_as_float(0x7fc00000);
}
