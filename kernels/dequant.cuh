// Dequantization of one value of a weight row of any supported type. The arithmetic is
// gguf-py's, in its order and rounding (engine/quants.py is the oracle, bit for bit): every
// product is rounded to float32 on its own (__fmul_rn and friends keep the compiler from
// fusing them into FMAs).
#pragma once
#include "common.cuh"

enum WeightType { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12,
                  Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };

// Value i of a row of TYPE.
template <int TYPE>
__device__ __forceinline__ float dequant_value(const u8 * __restrict__ row, const int i) {
    if constexpr (TYPE == F32) {
        return ((const float *) row)[i];
    } else if constexpr (TYPE == F16) {
        return f16_to_f32(((const u16 *) row)[i]);
    } else if constexpr (TYPE == BF16) {
        return bf16_to_f32(((const u16 *) row)[i]);
    } else if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
        const int j = i % 32;
        const u8 * b = row + (i / 32) * (TYPE == Q4_0 ? 18 : 20);
        const u8 * qs = b + (TYPE == Q4_0 ? 2 : 4);
        const int q = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        const float d = f16_to_f32(*(const u16 *) b);
        if constexpr (TYPE == Q4_0) return __fmul_rn(d, (float) (q - 8));
        else return __fadd_rn(__fmul_rn((float) q, d), f16_to_f32(*(const u16 *) (b + 2)));
    } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
        const int j = i % 32;
        const u8 * b = row + (i / 32) * (TYPE == Q5_0 ? 22 : 24);
        const u8 * qh = b + (TYPE == Q5_0 ? 2 : 4);
        const u8 * qs = qh + 4;
        const int lo = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        const int q = lo | (((qh[j / 8] >> (j % 8)) & 1) << 4);
        const float d = f16_to_f32(*(const u16 *) b);
        if constexpr (TYPE == Q5_0) return __fmul_rn(d, (float) (q - 16));
        else return __fadd_rn(__fmul_rn((float) q, d), f16_to_f32(*(const u16 *) (b + 2)));
    } else if constexpr (TYPE == Q8_0) {
        const u8 * b = row + (i / 32) * 34;
        return __fmul_rn((float) ((const i8 *) (b + 2))[i % 32], f16_to_f32(*(const u16 *) b));
    } else if constexpr (TYPE == MXFP4) {
        const int j = i % 32;
        const u8 * b = row + (i / 32) * 17;
        const int nib = j < 16 ? b[1 + j] & 0xF : b[1 + j - 16] >> 4;
        // Exact: a power of two times a small integer.
        return e8m0_half_to_f32(b[0]) * (float) mxfp4_value_x2(nib);
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        const int j = i % 256, s = j / 32, l = j % 32;
        const u8 * b = row + (i / 256) * (TYPE == Q4_K ? 144 : 176);
        const u8 * qs = b + (TYPE == Q4_K ? 16 : 48);
        int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
        if constexpr (TYPE == Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
        int sc, m;
        scale_min_k4(s, b + 4, sc, m);
        const float d = f16_to_f32(*(const u16 *) b), dmin = f16_to_f32(*(const u16 *) (b + 2));
        return __fsub_rn(__fmul_rn((float) q, __fmul_rn(d, (float) sc)), __fmul_rn(dmin, (float) m));
    } else if constexpr (TYPE == Q6_K) {
        const int j = i % 256, h = j / 128, r = (j % 128) / 32, l = j % 32;
        const u8 * b = row + (i / 256) * 210;
        const int lo = (b[64 * h + 32 * (r % 2) + l] >> (4 * (r / 2))) & 0xF;
        const int hi = (b[128 + 32 * h + l] >> (2 * r)) & 3;
        const float scale = __fmul_rn((float) ((const i8 *) (b + 192))[8 * h + 2 * r + l / 16],
                                      f16_to_f32(*(const u16 *) (b + 208)));
        return __fmul_rn((float) ((lo | (hi << 4)) - 32), scale);
    }
}

