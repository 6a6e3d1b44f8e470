// Float weights (F32, F16, BF16) × float32 activations, products and sums in float32, as
// llama.cpp's CUDA path computes them. Kernels matvec_<type>, matmul_<type>,
// matvec_id_<type>: see matvec.cuh. One item is one weight.
#include "matvec.cuh"

struct F32Kind {
    typedef float act;
    static constexpr int values_per_item = 1;
    static __device__ __forceinline__ float dot(const u8 * row, int i, const float * x) {
        return ((const float *) row)[i] * x[0];
    }
};

struct F16Kind {
    typedef float act;
    static constexpr int values_per_item = 1;
    static __device__ __forceinline__ float dot(const u8 * row, int i, const float * x) {
        return f16_to_f32(((const u16 *) row)[i]) * x[0];
    }
};

struct BF16Kind {
    typedef float act;
    static constexpr int values_per_item = 1;
    static __device__ __forceinline__ float dot(const u8 * row, int i, const float * x) {
        return bf16_to_f32(((const u16 *) row)[i]) * x[0];
    }
};

DEFINE_MATVEC(f32, F32Kind)
DEFINE_MATVEC(f16, F16Kind)
DEFINE_MATVEC(bf16, BF16Kind)
