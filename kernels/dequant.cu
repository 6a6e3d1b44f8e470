// Whole weight matrices dequantized to float16: the operand of the tensor-core GEMM that
// multiplies a prompt's activations (backend.matmul for many tokens). Each value is
// dequantized to float32 exactly as get_rows does (dequant.cuh), then rounded to F16.
#include "common.cuh"
#include "dequant.cuh"
#include "params.cuh"

#define DEQUANT_THREADS 256

// Grid: (column chunks of 2 * DEQUANT_THREADS, up to 65535 row groups: rows beyond loop);
// each thread writes two adjacent values.
template <int TYPE>
__device__ __forceinline__ void dequant_rows_f16(const u8 * __restrict__ w, const int * __restrict__ experts,
                                                 u32 * __restrict__ y, const DequantParams & p) {
    const int c = 2 * (blockIdx.x * DEQUANT_THREADS + threadIdx.x);
    if (c >= p.n_cols) return;
    for (int r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
        const i64 src = p.rows_per_expert
            ? (i64) experts[r / p.rows_per_expert] * p.rows_per_expert + r % p.rows_per_expert : r;
        const u8 * row = w + src * p.row_bytes;
        const u32 lo = f32_to_f16(dequant_value<TYPE>(row, c));
        const u32 hi = f32_to_f16(dequant_value<TYPE>(row, c + 1));
        y[((i64) r * p.n_cols + c) / 2] = lo | (hi << 16);
    }
}

#define DEFINE_DEQUANT(name, TYPE)                                                                 \
extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS)                                      \
dequant_f16_##name(const u8 * __restrict__ w, const int * __restrict__ experts, u32 * __restrict__ y, \
                   const DequantParams p) {                                                        \
    PDL_ENTRY();                                                                                   \
    dequant_rows_f16<TYPE>(w, experts, y, p);                                                      \
}

DEFINE_DEQUANT(f32, F32)
DEFINE_DEQUANT(f16, F16)
DEFINE_DEQUANT(bf16, BF16)
DEFINE_DEQUANT(q4_0, Q4_0)
DEFINE_DEQUANT(q4_1, Q4_1)
DEFINE_DEQUANT(q5_0, Q5_0)
DEFINE_DEQUANT(q5_1, Q5_1)
DEFINE_DEQUANT(q8_0, Q8_0)
DEFINE_DEQUANT(q4_k, Q4_K)
DEFINE_DEQUANT(q5_k, Q5_K)
DEFINE_DEQUANT(q6_k, Q6_K)
DEFINE_DEQUANT(mxfp4, MXFP4)

// Activations to F16 for the same GEMM (round to nearest even, as numpy's astype).
extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS)
to_f16(const float * __restrict__ x, u16 * __restrict__ y, const GluParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * DEQUANT_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * DEQUANT_THREADS)
        y[i] = f32_to_f16(x[i]);
}

extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS)
gather_rows_f16(const float * __restrict__ x, const int * __restrict__ idx, u16 * __restrict__ y,
                const GatherParams p) {
    PDL_ENTRY();
    const int c = blockIdx.x * DEQUANT_THREADS + threadIdx.x;
    if (c >= p.n_cols) return;
    for (int r = blockIdx.y; r < p.n_out; r += gridDim.y) {
        const int i = idx[r];
        y[(i64) r * p.n_cols + c] = (i >= 0 && i < p.n_src_rows) ? f32_to_f16(x[(i64) i * p.n_cols + c]) : (u16) 0;
    }
}
