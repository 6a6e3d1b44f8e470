// Float weights (F32, F16, BF16) × float32 activations, products and sums in float32, as
// llama.cpp's CUDA path computes them. Kernels: see matvec.cuh.
#include "matvec.cuh"

// An item is 16 bytes of a weight row (4 float32 or 8 half / bfloat16 values), one vector
// load, against the float32 activations it meets (rows are 16-byte aligned: K is a multiple
// of 8, the backend checks).
struct f32x8 { float4 lo, hi; };

__device__ __forceinline__ float dot4(const float4 w, const float4 a) {
    return w.x * a.x + w.y * a.y + w.z * a.z + w.w * a.w;
}

struct F32Kind {
    typedef float4 act;
    static constexpr int values_per_item = 4;
    static constexpr bool can_stage = false;
    static __device__ __forceinline__ float dot(const u8 * row, int i, const float4 * x) {
        return dot4(((const float4 *) row)[i], x[0]);
    }
};

// Eight 16-bit values (low half first) as floats, through `cvt`.
template <bool BF16>
__device__ __forceinline__ void unpack8(const int4 q, float4 & lo, float4 & hi) {
    const u32 w[4] = {(u32) q.x, (u32) q.y, (u32) q.z, (u32) q.w};
    float f[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        f[2 * k] = BF16 ? bf16_to_f32((u16) (w[k] & 0xFFFF)) : f16_to_f32((u16) (w[k] & 0xFFFF));
        f[2 * k + 1] = BF16 ? bf16_to_f32((u16) (w[k] >> 16)) : f16_to_f32((u16) (w[k] >> 16));
    }
    lo = make_float4(f[0], f[1], f[2], f[3]);
    hi = make_float4(f[4], f[5], f[6], f[7]);
}

template <bool BF16>
struct Half8Kind {
    typedef f32x8 act;
    static constexpr int values_per_item = 8;
    static constexpr bool can_stage = false;
    static __device__ __forceinline__ float dot(const u8 * row, int i, const f32x8 * x) {
        float4 lo, hi;
        unpack8<BF16>(((const int4 *) row)[i], lo, hi);
        return dot4(lo, x->lo) + dot4(hi, x->hi);
    }
};

typedef Half8Kind<false> F16Kind;
typedef Half8Kind<true> BF16Kind;

DEFINE_MATVEC(f32, F32Kind)
DEFINE_MATVEC(f16, F16Kind)
DEFINE_MATVEC(bf16, BF16Kind)
