// Quantized weight × Q8_1 activations, as int8 dot products (__dp4a), the way llama.cpp's
// CUDA mat-vec does (ggml-cuda/mmvq.cu, vecdotq.cuh). The unit of work is one "item": 32
// consecutive weights of a row against the one Q8_1 block of the activation they meet.
// The weight kinds of matvec_q.cu (kernels: see matvec.cuh).
#pragma once
#include "matvec.cuh"
#include "quant_dot.cuh"

template <int TYPE, class Y>
__device__ __forceinline__ float dot_item(const u8 * __restrict__ row, const int ib,
                                          const Y * __restrict__ y) {
    const float d8 = act_d(y);
    int yq[8];
    act_qs(y, yq);
    if constexpr (TYPE == Q4_0) {
        const block_q4_0 * b = (const block_q4_0 *) row + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a2(b->qs + 4 * i);
            sumi = __dp4a(v & 0x0F0F0F0F, yq[i], sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, yq[i + 4], sumi);
        }
        // Quants are stored +8: subtract 8 * sum(x), with the sum that Q8_1 carries.
        return f16_to_f32(b->d) * (d8 * sumi - 8.0f * act_s(y));
    } else if constexpr (TYPE == Q4_1) {
        const block_q4_1 * b = (const block_q4_1 *) row + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = ((const int *) b->qs)[i];
            sumi = __dp4a(v & 0x0F0F0F0F, yq[i], sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, yq[i + 4], sumi);
        }
        return f16_to_f32(b->d) * d8 * sumi + f16_to_f32(b->m) * act_s(y);
    } else if constexpr (TYPE == Q5_0) {
        const block_q5_0 * b = (const block_q5_0 *) row + ib;
        const u32 qh = (u32) load_i32_a2(b->qh);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a2(b->qs + 4 * i);
            sumi = __dp4a((v & 0x0F0F0F0F) | spread_bits4(qh >> (4 * i)), yq[i], sumi);
            sumi = __dp4a(((v >> 4) & 0x0F0F0F0F) | spread_bits4(qh >> (16 + 4 * i)), yq[i + 4], sumi);
        }
        return f16_to_f32(b->d) * (d8 * sumi - 16.0f * act_s(y));
    } else if constexpr (TYPE == Q5_1) {
        const block_q5_1 * b = (const block_q5_1 *) row + ib;
        const u32 qh = *(const u32 *) b->qh;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = ((const int *) b->qs)[i];
            sumi = __dp4a((v & 0x0F0F0F0F) | spread_bits4(qh >> (4 * i)), yq[i], sumi);
            sumi = __dp4a(((v >> 4) & 0x0F0F0F0F) | spread_bits4(qh >> (16 + 4 * i)), yq[i + 4], sumi);
        }
        return f16_to_f32(b->d) * d8 * sumi + f16_to_f32(b->m) * act_s(y);
    } else if constexpr (TYPE == Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) row + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) sumi = __dp4a(load_i32_a2((const u8 *) b->qs + 4 * i), yq[i], sumi);
        return f16_to_f32(b->d) * d8 * sumi;
    } else if constexpr (TYPE == MXFP4) {
        const block_mxfp4 * b = (const block_mxfp4 *) row + ib;
        // E2M1 values doubled: 0 1 2 3 4 6 8 12, then the same negated.
        const u32 table[4] = {0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu};
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a1(b->qs + 4 * i);
            sumi = __dp4a(table16_lookup(v, table), yq[i], sumi);
            sumi = __dp4a(table16_lookup(v >> 4, table), yq[i + 4], sumi);
        }
        return e8m0_half_to_f32(b->e) * d8 * sumi;
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        int q[8], sc, m;
        float d, dmin;
        k45_quants<TYPE>(row, ib, q, sc, m, d, dmin);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            sumi = __dp4a(q[i], yq[i], sumi);
        }
        return d8 * (d * sc * sumi - dmin * m * act_sum(y));
    }
}

// ---- Q4_K: 64-value items -----------------------------------------------------------------
// Sub-blocks 2j and 2j+1 of a super-block share 32 bytes of qs (low and high nibbles), which
// sit 16-byte aligned (blocks are 144 bytes, qs at offset 16): one item is those 32 bytes,
// read as two 16-byte loads, against the two Q8_1 blocks they meet. Per 32 weights the float
// arithmetic is that of dot_item<Q4_K>.
struct block_q8_1x2 { block_q8_1 b[2]; };

// An item's weight bytes as one lane holds them: its 32 bytes of qs (two 16-byte loads) and the
// super-block's d, dmin and 12 scale bytes. Loaded apart from the arithmetic so that a lane can
// have several items' loads in flight before it needs the first (MV_PRELOAD); q4k_pair_dot is
// the two one after the other, so both paths give the same floats.
struct Q4KPairRaw { int4 q0, q1; u32 dm, w0, w1, w2; };

__device__ __forceinline__ void q4k_pair_load(const u8 * __restrict__ row, const int ip, Q4KPairRaw & r) {
    const block_q4_K * b = (const block_q4_K *) row + ip / 4;
    const int j = ip % 4;
    r.q0 = *(const int4 *) (b->qs + 32 * j);
    r.q1 = *((const int4 *) (b->qs + 32 * j) + 1);
    /* the super-block's header (d, dmin, the 12 scale bytes): its first 16 bytes, one 128-bit
       load (four 32-bit loads touched the warp's 8 blocks' lines four times over) */
    const int4 h = *(const int4 *) b;
    r.dm = (u32) h.x; r.w0 = (u32) h.y; r.w1 = (u32) h.z; r.w2 = (u32) h.w;
}

// out[r] = item ip of rows rs[r] (its raw loads) . y, y: the item's two Q8_1 blocks (either
// form), whose quants and factors are read once for all R rows. Each row's arithmetic is the
// one-row form's (q4k_pair_math is this at R = 1).
template <int R, class Y>
__device__ __forceinline__ void q4k_pair_math_rows(const Q4KPairRaw * const (&rs)[R], const int ip,
                                                   const Y * __restrict__ y, float (&out)[R]) {
    const int j = ip % 4;
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        const Y * yb = y + h;
        int yq[8];
        act_qs(yb, yq);
        const ActTail f = act_tail(yb, yq[0]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const Q4KPairRaw & w = *rs[r];
            const int v[8] = {w.q0.x, w.q0.y, w.q0.z, w.q0.w, w.q1.x, w.q1.y, w.q1.z, w.q1.w};
            const u32 dm = w.dm, w0 = w.w0, w1 = w.w1, w2 = w.w2;
            int sc, m;
            q4k_scale_min(w0, w1, w2, s, sc, m);
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) sumi = __dp4a((v[i] >> (4 * h)) & 0x0F0F0F0F, yq[i], sumi);
            const float d = f16_to_f32((u16) (dm & 0xFFFF)), dmin = f16_to_f32((u16) (dm >> 16));
            out[r] += f.d * (d * sc * sumi - dmin * m * f.isum);
        }
    }
}

template <class Y>
__device__ __forceinline__ float q4k_pair_math(const Q4KPairRaw & r, const int ip, const Y * __restrict__ y) {
    const Q4KPairRaw * rs[1] = {&r};
    float out[1];
    q4k_pair_math_rows<1>(rs, ip, y, out);
    return out[0];
}

template <class Y>
__device__ __forceinline__ float q4k_pair_dot(const u8 * __restrict__ row, const int ip, const Y * __restrict__ y) {
    Q4KPairRaw r;
    q4k_pair_load(row, ip, r);
    return q4k_pair_math(r, ip, y);
}

struct Q4KPairKind {
    typedef block_q8_1x2 act;
    static constexpr int values_per_item = 64;
    static constexpr bool can_stage = true;
    static __device__ __forceinline__ float dot(const u8 * __restrict__ row, const int ip,
                                                const block_q8_1x2 * __restrict__ y) {
        return q4k_pair_dot(row, ip, y->b);
    }
    static __device__ __forceinline__ float sdot(const u8 * __restrict__ row, const int ip,
                                                 const q8s * __restrict__ y) {
        return q4k_pair_dot(row, ip, y);
    }
    // MV_PRELOAD: an item's loads apart from its arithmetic (y: its Q8_1 blocks, either form)
    typedef Q4KPairRaw raw;
    static __device__ __forceinline__ void load(const u8 * __restrict__ row, const int ip, raw & r) {
        q4k_pair_load(row, ip, r);
    }
    template <class Y>
    static __device__ __forceinline__ float dot_raw(const raw & r, const int ip, const Y * __restrict__ y) {
        return q4k_pair_math(r, ip, y);
    }
    // MV_PRELOAD_ROWS: the item of several rows, its activations read once (kind_dot_rows)
    static constexpr bool has_dot_rows = true;
    template <int R, class Y>
    static __device__ __forceinline__ void dot_raw_rows(const raw * const (&rs)[R], const int ip,
                                                        const Y * __restrict__ y, float (&out)[R]) {
        q4k_pair_math_rows<R>(rs, ip, y, out);
    }
};
template <> struct Preloads<Q4KPairKind> { static constexpr int depth = MV_PRELOAD; };
__device__ __forceinline__ const block_q8_1 * item_blocks(const block_q8_1x2 * y) { return y->b; }

// ---- Q6_K from aligned loads (quant_dot.cuh q6k_load) ---------------------------------------
// Whether an activation block carries its first half's quant sum (q8s::hsum: staged blocks).
template <class Y> struct HasHalfSum { static constexpr bool value = false; };
template <> struct HasHalfSum<q8s> { static constexpr bool value = true; };

template <class Y>
__device__ __forceinline__ float q6k_math(const Q6KRaw & r, const int ib, const Y * __restrict__ y) {
    const int q = ib % 4;
    int yq[8];
    act_qs(y, yq);
    const ActTail f = act_tail(y, yq[0]);
    const int lshift = 4 * (q / 2), hshift = 2 * q;
    int sumi[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int ql = (int) __funnelshift_r(r.wl[i], r.wl[i + 1], r.shift);
        const int qh = (int) __funnelshift_r(r.wh[i], r.wh[i + 1], r.shift);
        const int vl = (ql >> lshift) & 0x0F0F0F0F;
        const int vh = ((qh >> hshift) & 0x03030303) << 4;
        if constexpr (HasHalfSum<Y>::value) {
            // the quants unsigned (0..63): sum((v - 32) a) = sum(v a) - 32 sum(a), the same
            // integers without the per-byte subtraction (__vsubss4: several instructions each,
            // where the output head's mat-vec is bound by instruction issue)
            sumi[i / 4] = __dp4a(vl | vh, yq[i], sumi[i / 4]);
        } else {
            sumi[i / 4] = __dp4a((int) __vsubss4(vl | vh, 0x20202020), yq[i], sumi[i / 4]);
        }
    }
    if constexpr (HasHalfSum<Y>::value) {
        sumi[0] -= 32 * f.hsum;
        sumi[1] -= 32 * (f.isum - f.hsum);
    }
    const int sc0 = (int) (i8) (u8) (r.d_sc >> 16), sc1 = (int) (i8) (u8) (r.d_sc >> 24);
    return f16_to_f32((u16) (r.d_sc & 0xFFFF)) * f.d * (sc0 * sumi[0] + sc1 * sumi[1]);
}

template <class Y>
__device__ __forceinline__ float q6k_dot(const u8 * __restrict__ row, const int ib, const Y * __restrict__ y) {
    Q6KRaw r;
    q6k_load(row, ib, r);
    return q6k_math(r, ib, y);
}

struct Q6KKind {
    typedef block_q8_1 act;
    static constexpr int values_per_item = QK8_1;
    static constexpr bool can_stage = true;
    // matvec_coop_q6_k: 32 items are 4 super-blocks, 840 bytes, 105 8-byte words (rows of K a
    // multiple of 1024 only)
    static constexpr int chunk_words = 4 * (int) sizeof(block_q6_K) / 8;
    static __device__ __forceinline__ float dot(const u8 * __restrict__ row, const int ib,
                                                const block_q8_1 * __restrict__ y) {
        return q6k_dot(row, ib, y);
    }
    static __device__ __forceinline__ float sdot(const u8 * __restrict__ row, const int ib,
                                                 const q8s * __restrict__ y) {
        return q6k_dot(row, ib, y);
    }
    // MV_PRELOAD: an item's loads apart from its arithmetic (y: its Q8_1 block, either form)
    typedef Q6KRaw raw;
    static __device__ __forceinline__ void load(const u8 * __restrict__ row, const int ib, raw & r) {
        q6k_load(row, ib, r);
    }
    template <class Y>
    static __device__ __forceinline__ float dot_raw(const raw & r, const int ib, const Y * __restrict__ y) {
        return q6k_math(r, ib, y);
    }
};
static_assert(Q6KKind::chunk_words * 8 == 4 * sizeof(block_q6_K), "a chunk is whole 8-byte words");

template <int TYPE>
struct QuantKind {
    typedef block_q8_1 act;
    static constexpr int values_per_item = QK8_1;
    static constexpr bool can_stage = true;
    static __device__ __forceinline__ float dot(const u8 * row, int ib, const block_q8_1 * y) {
        return dot_item<TYPE>(row, ib, y);
    }
    static __device__ __forceinline__ float sdot(const u8 * row, int ib, const q8s * y) {
        return dot_item<TYPE>(row, ib, y);
    }
};

