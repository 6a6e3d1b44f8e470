// The quantized weight blocks as int8 quants and their factors, shared by the decode mat-vecs
// (matvec_q.cuh) and the prompt tile (mmq.cu): both take an item's quants with the same bit
// arithmetic, so that their integer dot products against Q8_1 activations are the same.
#pragma once
#include "common.cuh"

enum WeightType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                  Q6_K = 14, MXFP4 = 39 };

// Moves bit j (j = 0..3) of h to bit 4 of byte j: the fifth bit of four 5-bit quants.
__device__ __forceinline__ int spread_bits4(u32 h) {
    return (int) (((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25));
}

// Four 4-bit indices (the low nibbles of the bytes of q) looked up in a 16-entry int8 table
// held in four words: __byte_perm picks from 8 bytes, bit 3 of each index picks the half.
__device__ __forceinline__ int table16_lookup(int q, const u32 t[4]) {
    const u32 idx = (u32) q & 0x07070707u;
    const u32 sel = (idx & 0x7) | ((idx >> 4) & 0x70) | ((idx >> 8) & 0x700) | ((idx >> 12) & 0x7000);
    const u32 lo = __byte_perm(t[0], t[1], sel);
    const u32 hi = __byte_perm(t[2], t[3], sel);
    const u32 upper = (((u32) q >> 3) & 0x01010101u) * 0xFFu;
    return (int) ((lo & ~upper) | (hi & upper));
}

// The quants of item ib of a Q4_K / Q5_K row as 8 ints of 4 (dot_item and MMQ read them
// alike): sub-block s = ib % 8 of super-block ib / 8, 32 quants in the low (s even) or high
// (s odd) nibbles of qs[32*(s/2) ..], Q5_K's fifth bit is bit s of qh[0..31]; with the
// sub-block's 6-bit scale and min and the super-block's d and dmin.
template <int TYPE>
__device__ __forceinline__ void k45_quants(const u8 * __restrict__ row, const int ib, int q[8],
                                           int & sc, int & m, float & d, float & dmin) {
    const int s = ib % 8;
    const u8 * qs;
    const u8 * scales;
    if constexpr (TYPE == Q4_K) {
        const block_q4_K * b = (const block_q4_K *) row + ib / 8;
        qs = b->qs; scales = b->scales; d = f16_to_f32(b->d); dmin = f16_to_f32(b->dmin);
    } else {
        const block_q5_K * b = (const block_q5_K *) row + ib / 8;
        qs = b->qs; scales = b->scales; d = f16_to_f32(b->d); dmin = f16_to_f32(b->dmin);
    }
    scale_min_k4(s, scales, sc, m);
    const int * q4 = (const int *) (qs + 32 * (s / 2));
    const int shift = 4 * (s % 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int v = (q4[i] >> shift) & 0x0F0F0F0F;
        if constexpr (TYPE == Q5_K) {
            const int * qh = (const int *) ((const block_q5_K *) row + ib / 8)->qh;
            v |= ((qh[i] >> s) & 0x01010101) << 4;
        }
        q[i] = v;
    }
}

// Sub-block s (0..7) of a Q4_K super-block: its 6-bit scale and min from the 12 scale bytes
// (w0, w1, w2 little-endian), as llama.cpp's get_scale_min_k4 takes them. By shifts and selects, with no branch: in the decode
// mat-vecs a lane's s is 2 (ip % 4) + h with ip % 4 = lane % 4, so a branch on s < 4 would part
// every warp in two and issue both ways, and their compute is on the critical path.
__device__ __forceinline__ void q4k_scale_min(const u32 w0, const u32 w1, const u32 w2, const int s, int & sc, int & m) {
    /* s < 4: bytes s and s + 4 (words w0, w1 at byte s); s >= 4: byte s + 4 (w2 at byte s - 4)
       for the low bits, the top two bits of bytes s - 4 (w0) and s (w1) for the high ones */
    const int sh = 8 * (s & 3);
    const u32 a = w0 >> sh, b = w1 >> sh, c = w2 >> sh;
    const bool hi = s >= 4;
    sc = (int) (hi ? ((c & 0xFu) | ((a >> 2) & 0x30u)) : (a & 63u));
    m = (int) (hi ? (((c >> 4) & 0xFu) | ((b >> 2) & 0x30u)) : (b & 63u));
}

// ---- Q6_K ----------------------------------------------------------------------------------
// Q6_K blocks are 210 bytes, so their fields are only 2-byte aligned: eight 32-bit words at a
// 2-aligned address are read as nine aligned words and funnel-shifted into place (instead of
// sixteen 16-bit loads).
// An item's weight bytes as one lane holds them (the mat-vecs' preloads, the tile's unpack):
// the nine aligned words under its 32 bytes of ql and of qh, their shift (ql and qh lie at the
// same offset mod 4 in a block), the super-block's d and the item's two int8 scales.
struct Q6KRaw { u32 wl[9], wh[9]; u32 shift; u32 d_sc; };

__device__ __forceinline__ void q6k_load(const u8 * __restrict__ row, const int ib, Q6KRaw & r) {
    const block_q6_K * b = (const block_q6_K *) row + ib / 8;
    const int h = (ib % 8) / 4, q = ib % 4;
    const u8 * ql = b->ql + 64 * h + 32 * (q % 2);
    const u32 * bl = (const u32 *) ((size_t) ql & ~(size_t) 3);
    const u32 * bh = (const u32 *) ((size_t) (b->qh + 32 * h) & ~(size_t) 3);
    r.shift = 8 * ((u32) (size_t) ql & 3);
#pragma unroll
    for (int i = 0; i < 9; ++i) {
        r.wl[i] = bl[i];
        r.wh[i] = bh[i];
    }
    const i8 * sc = b->scales + 8 * h + 2 * q;
    r.d_sc = (u32) b->d | ((u32) (u8) sc[0] << 16) | ((u32) (u8) sc[1] << 24);
}
