// Rotary position embedding on [T, H, Dh] (ggml_rope_ext, ext_factor 0, attn_factor 1).
// The angle of pair i is pos * theta_scale^i built by i float32 multiplications, as
// ggml_rope_cache_init does on the CPU (llama.cpp's CUDA kernel uses powf instead; the
// recurrence keeps us bit-compatible with the numpy reference and the goldens), then times
// freq_scale. Positions are read on the device.
//
// rope_ff: the same with per-pair frequency factors (ggml_rope_ext's freq_factors, Gemma 4's
// rope_freqs on its full-attention layers): the angle is divided by ff[i] before freq_scale,
// as ggml's rope_yarn(theta / ff, ...) and the numpy reference do. A factor of 1e30 leaves
// the pair (almost exactly) unrotated: "proportional" rope.
#include "common.cuh"
#include "params.cuh"

#define ROPE_THREADS 128

// One thread per pair (i, its partner) of one head of one token; dims >= n_rot are copied.
template <bool FREQ_FACTORS>
__device__ __forceinline__ void rope_head(const float * __restrict__ x, const int * __restrict__ pos,
                                          const float * __restrict__ ff, float * __restrict__ y,
                                          const RopeParams & p) {
    const int t = blockIdx.z, h = blockIdx.y;
    const int i = blockIdx.x * ROPE_THREADS + threadIdx.x;   // pair index, or pass-through dim
    const i64 base = ((i64) t * p.n_heads + h) * p.head_dim;
    const int half = p.n_rot / 2;
    if (i < half) {
        const float angle = FREQ_FACTORS ? rope_angle_ff(pos[t], i, p.theta_scale, ff[i], p.freq_scale)
                                         : rope_angle(pos[t], i, p.theta_scale, p.freq_scale);
        const float c = cosf(angle), s = sinf(angle);
        const int i0 = p.neox ? i : 2 * i;
        const int i1 = p.neox ? i + half : 2 * i + 1;
        const float x0 = x[base + i0], x1 = x[base + i1];
        y[base + i0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        y[base + i1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    } else {
        const int d = p.n_rot + (i - half);
        if (d < p.head_dim) y[base + d] = x[base + d];
    }
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope(const float * __restrict__ x, const int * __restrict__ pos, float * __restrict__ y,
     const RopeParams p) {
    PDL_ENTRY();
    rope_head<false>(x, pos, nullptr, y, p);
}

// ff holds (at least) n_rot / 2 factors, one per rotated pair.
extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_ff(const float * __restrict__ x, const int * __restrict__ pos, const float * __restrict__ ff,
        float * __restrict__ y, const RopeParams p) {
    PDL_ENTRY();
    rope_head<true>(x, pos, ff, y, p);
}
