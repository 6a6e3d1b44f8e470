// Activation quantization to Q8_1 blocks, as llama.cpp's CUDA path does before every
// int8 mat-vec (ggml-cuda/quantize.cu, quantize_q8_1): one warp per block of 32 values,
// d = max|x| / 127, q = roundf(x / d) (a true division, half away from zero), s = sum(x).
#include "common.cuh"
#include "params.cuh"

extern "C" __global__ void quantize_q8_1(const float * __restrict__ x, block_q8_1 * __restrict__ y,
                                         const QuantizeParams p) {
    PDL_ENTRY();
    const i64 i = (i64) blockIdx.x * blockDim.x + threadIdx.x;   // one thread per value
    // k is a multiple of 32, so a warp is either wholly inside or wholly past the end.
    if (i >= (i64) p.n_rows * p.k) return;
    quantize_warp_q8_1(x[i], y + i / QK8_1);
}
