// KV cache write and causal GQA softmax attention over an F16 cache, for one query (decode)
// or a block of queries (prefill). Everything about the sequence comes from pos[] on the
// device: query t sees cache slots s with s <= pos[t] (and pos[t] - s < window when a window
// is set); head h reads KV head h / (H / H_kv).
//
// The rounding is the non-flash path of ggml with an F16 cache, as the goldens were recorded:
// Q is rounded to F16 for K.Q, logits are scaled in float32, the softmax is normalised and
// rounded to F16 before V.softmax. That needs the normalised probabilities before any V is
// read, so the logits of a query are kept in shared memory (n_slots floats) and the kernel
// makes two passes instead of an online softmax.
#include "common.cuh"
#include "params.cuh"

#define KV_STORE_THREADS 256
#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / WARP_SIZE)
#ifndef ATTN_SLOTS_PER_WARP
// pass 1: slots a warp has in flight at once. 4 was slower on the H200 (2026-12-01, tg128 in
// one call: Qwen3-0.6B shape 663 against 685 tok/s with 1, 30B-A3B 262.5 against 268.3).
#define ATTN_SLOTS_PER_WARP 1
#endif
#ifndef ATTN_SLOT_LANES
// 1: pass 1 takes a slot per thread (its K row read as 16-byte words, the dot product summed
// in the thread: a block's 128 slots in flight at once, no shuffles) instead of a slot per
// warp (0). On the H200 (2026-12-02, tg128 alternated in one call) it took the Qwen3-0.6B
// shape from 687 to 847 tok/s and the 30B-A3B from 272 to 312: at short contexts a decode
// step's attention was ~8 us a call, ~15 % of a 0.6B token. Needs head_dim % 8 == 0 (else
// pass 1 takes a slot per warp).
#define ATTN_SLOT_LANES 1
#endif
#ifndef ATTN_SLOT_LANES_MAX_DIM
// ... and head_dim <= this: longer rows take a slot per warp. The gains above were at head_dim
// 128; Gemma-4-26B-A4B (head_dim 256 and 512) decoded at 222.63 / 222.60 tok/s with a slot per
// thread against 224.94 / 224.94 per warp (H200, 2026-12-02, alternated): a thread's serial dot
// over 256-512 dims outweighs the slots in flight.
#define ATTN_SLOT_LANES_MAX_DIM 128
#endif

// cache[pos[t], :] = f16(x[t, :]) for rows of H_kv * Dh values.
extern "C" __global__ void __launch_bounds__(KV_STORE_THREADS)
kv_store(const float * __restrict__ x, const int * __restrict__ pos, u16 * __restrict__ cache,
         const KvStoreParams p) {
    PDL_ENTRY();
    const int t = blockIdx.y;
    const int i = blockIdx.x * KV_STORE_THREADS + threadIdx.x;
    const int slot = pos[t];
    if (i >= p.row_elems || slot < 0 || slot >= p.capacity) return;
    cache[(i64) slot * p.row_elems + i] = f32_to_f16(x[(i64) t * p.row_elems + i]);
}

// The rope and norm arguments of rope_attention (unused by attention).
struct RopeArgs {
    const float * k;          // [T, H_kv, head_dim] keys before their norm and rope
    const float * v;          // [T, H_kv, head_dim_v]
    const float * qn;         // head norm weights (when q_norm / k_norm)
    const float * kn;
    float * q_out;            // [T, H, head_dim] the roped queries (for the trace)
    float * k_out;            // [T, H_kv, head_dim] the roped keys
    int n_rot, neox, q_norm, k_norm;
    float theta_scale, freq_scale, eps;
};

// One thread block per (head, query token). out is [T, H * Dv]; with write_q8 also its Q8_1
// blocks (the input of the output projection), quantized here so that no separate kernel has
// to. Dynamic shared memory: q16 [head_dim], prob [n_slots], acc [ATTN_WARPS][head_dim_v].
// per_row: token t reads the caches at k_rows[t] / v_rows[t] (each row its own sequence, all
// of capacity >= its position; capacity is the largest) instead of k_cache / v_cache.
// ROPE (rope_attention): first the block does what rope_store does for its query head and for
// its KV head (the same float operations in the same order, so the same bits), writing that KV
// head's slot of the caches itself; every block of a KV head group writes the same values there, and each
// reads its own writes after the barrier (no other kernel between). The caches are then not
// read-only in the kernel, so they are plain pointers here (no __restrict__, no .nc loads).
template <bool ROPE>
__device__ __forceinline__ void attend_block(const float * q, const u16 * k_cache, const u16 * v_cache,
                                             const int * pos, float * out, block_q8_1 * out_q,
                                             const u64 * k_rows, const u64 * v_rows, const AttentionParams & p,
                                             const RopeArgs & r) {
    extern __shared__ float smem[];
    float * q16 = smem;                       // [head_dim] the query, rounded to F16
    float * prob = smem + p.head_dim;         // [n_slots] logits, then F16-rounded probabilities
    float * part = prob + p.n_slots;          // [ATTN_WARPS][head_dim_v] per-warp V.softmax sums
    __shared__ float red_max[ATTN_WARPS];
    __shared__ double red_sum[ATTN_WARPS];

    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (p.per_row) {                          // a batched decode step: token t's own sequence
        k_cache = (const u16 *) k_rows[t];
        v_cache = (const u16 *) v_rows[t];
    }
    const int h_kv = h / (p.n_heads / p.n_kv_heads);
    const int hi = min(pos[t], p.capacity - 1);
    const int lo = p.window > 0 ? max(0, pos[t] - p.window + 1) : 0;
    const int n = hi - lo + 1;                // visible slots; n <= n_slots

    const float * qr = q + ((i64) t * p.n_heads + h) * p.head_dim;
    if (ROPE) {
        // The query head and the block's key head side by side, each with the float32 and
        // double operations norm_rope_head does (rope_store's), in its order: q, k and v read
        // at once, both sums of squares in one block reduction (each added per warp by shuffles,
        // then the warps' sums in warp order, as block_sum_f64), one angle and one sincos per
        // pair for both. part (ATTN_WARPS * head_dim_v floats, at least 2 head_dim: the launch
        // checks) holds the two heads until pass 3.
        __shared__ double rope_partial[2 * ATTN_WARPS];
        const int D = p.head_dim;
        float * rq = part, * rk = part + D;
        const int slot = pos[t];
        const bool slot_ok = slot >= 0 && slot < p.capacity;
        const i64 kh = (i64) t * p.n_kv_heads + h_kv;
        const float * kr = r.k + kh * D, * vr = r.v + kh * p.head_dim_v;
        u16 * vd = slot_ok ? (u16 *) v_cache + ((i64) slot * p.n_kv_heads + h_kv) * p.head_dim_v : nullptr;
        double sq = 0.0, sk = 0.0;
        for (int d = threadIdx.x; d < max(D, p.head_dim_v); d += ATTN_THREADS) {
            const float a = d < D ? qr[d] : 0.0f, b = d < D ? kr[d] : 0.0f;
            const float c = d < p.head_dim_v ? vr[d] : 0.0f;
            if (d < D) {
                rq[d] = a;
                rk[d] = b;
                const double x = a, y = b;
                sq += x * x;
                sk += y * y;
            }
            if (vd && d < p.head_dim_v) vd[d] = f32_to_f16(c);
        }
        sq = warp_sum_f64(sq);
        sk = warp_sum_f64(sk);
        if (lane == 0) { rope_partial[warp] = sq; rope_partial[ATTN_WARPS + warp] = sk; }
        __syncthreads();
        sq = 0.0;
        sk = 0.0;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) sq += rope_partial[w];
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) sk += rope_partial[ATTN_WARPS + w];
        const float scale_q = r.q_norm ? 1.0f / sqrtf(__fadd_rn((float) (sq / D), r.eps)) : 1.0f;
        const float scale_k = r.k_norm ? 1.0f / sqrtf(__fadd_rn((float) (sk / D), r.eps)) : 1.0f;
        for (int d = threadIdx.x; d < D; d += ATTN_THREADS) {
            if (r.q_norm) rq[d] = __fmul_rn(__fmul_rn(rq[d], scale_q), r.qn[d]);
            if (r.k_norm) rk[d] = __fmul_rn(__fmul_rn(rk[d], scale_k), r.kn[d]);
        }
        __syncthreads();
        float * qo = r.q_out + ((i64) t * p.n_heads + h) * D;
        float * ko = h % (p.n_heads / p.n_kv_heads) == 0 ? r.k_out + kh * D : nullptr;  // once a group
        u16 * kd = slot_ok ? (u16 *) k_cache + ((i64) slot * p.n_kv_heads + h_kv) * D : nullptr;
        const int half = r.n_rot / 2;
        for (int i = threadIdx.x; i < half + (D - r.n_rot); i += ATTN_THREADS) {
            if (i < half) {
                const float angle = rope_angle(slot, i, r.theta_scale, r.freq_scale);
                const float c = cosf(angle), s = sinf(angle);
                const int i0 = r.neox ? i : 2 * i;
                const int i1 = r.neox ? i + half : 2 * i + 1;
                const float q0 = rq[i0], q1 = rq[i1], k0 = rk[i0], k1 = rk[i1];
                const float yq0 = __fsub_rn(__fmul_rn(q0, c), __fmul_rn(q1, s));
                const float yq1 = __fadd_rn(__fmul_rn(q0, s), __fmul_rn(q1, c));
                const float yk0 = __fsub_rn(__fmul_rn(k0, c), __fmul_rn(k1, s));
                const float yk1 = __fadd_rn(__fmul_rn(k0, s), __fmul_rn(k1, c));
                qo[i0] = yq0;
                qo[i1] = yq1;
                q16[i0] = f16_to_f32(f32_to_f16(yq0));
                q16[i1] = f16_to_f32(f32_to_f16(yq1));
                if (ko) { ko[i0] = yk0; ko[i1] = yk1; }
                if (kd) { kd[i0] = f32_to_f16(yk0); kd[i1] = f32_to_f16(yk1); }
            } else {
                const int d = r.n_rot + (i - half);
                qo[d] = rq[d];
                q16[d] = f16_to_f32(f32_to_f16(rq[d]));
                if (ko) ko[d] = rk[d];
                if (kd) kd[d] = f32_to_f16(rk[d]);
            }
        }
    } else {
        for (int d = threadIdx.x; d < p.head_dim; d += ATTN_THREADS) q16[d] = f16_to_f32(f32_to_f16(qr[d]));
    }
    __syncthreads();                          // q16 (and with ROPE this slot's K and V) written

    // Pass 1: a warp per slot computes K.Q, each lane two adjacent dims per step (one 32-bit
    // load of two halves); lane 0 keeps the logit and the running max. A warp takes
    // ATTN_SLOTS_PER_WARP slots at a time, their loads in flight together (one slot after
    // another, each waited for before its shuffles, made a decode step's attention a chain of
    // memory latencies: ~8 us a call at short contexts on the H200); each slot's sum is the
    // same float operations as one at a time.
    const i64 k_row = (i64) p.n_kv_heads * p.head_dim;
    const int n_pairs = p.head_dim / 2;
    float m = -__int_as_float(0x7f800000);
#if ATTN_SLOT_LANES
    if (p.head_dim % 8 == 0 && p.head_dim <= ATTN_SLOT_LANES_MAX_DIM) {
        // A thread per slot: 8 halves of its K row per 16-byte load, each pair of dims added as
        // in the warp-per-slot loop (q0 k0 + q1 k1), the pairs in dim order.
        for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
            const uint4 * kr = (const uint4 *) (k_cache + (lo + j) * k_row + (i64) h_kv * p.head_dim);
            float dot = 0.0f;
            for (int c = 0; c < p.head_dim / 8; ++c) {
                const uint4 kk = kr[c];
                const u32 w4[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int d = 8 * c + 2 * i;
                    dot += q16[d] * f16_to_f32((u16) (w4[i] & 0xFFFF)) + q16[d + 1] * f16_to_f32((u16) (w4[i] >> 16));
                }
            }
            const float logit = __fmul_rn(dot, p.scale);
            prob[j] = logit;
            m = fmaxf(m, logit);
        }
        m = warp_max(m);
    } else
#endif
    for (int j0 = warp; j0 < n; j0 += ATTN_WARPS * ATTN_SLOTS_PER_WARP) {
        float dot[ATTN_SLOTS_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = min(j0 + u * ATTN_WARPS, n - 1);      // past n: slot n-1 again, unused
            const u32 * kr = (const u32 *) (k_cache + (lo + j) * k_row + (i64) h_kv * p.head_dim);
            dot[u] = 0.0f;
            for (int c = lane; c < n_pairs; c += WARP_SIZE) {
                const u32 kk = kr[c];
                dot[u] += q16[2 * c] * f16_to_f32((u16) (kk & 0xFFFF)) + q16[2 * c + 1] * f16_to_f32((u16) (kk >> 16));
            }
        }
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = j0 + u * ATTN_WARPS;
            const float logit = __fmul_rn(warp_sum(dot[u]), p.scale);
            if (j < n) {
                if (lane == 0) prob[j] = logit;
                m = fmaxf(m, logit);
            }
        }
    }
    if (lane == 0) red_max[warp] = m;
    __syncthreads();
    m = red_max[0];
#pragma unroll
    for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, red_max[w]);

    // Pass 2: exponentials and their sum (in double, as the reference sums them).
    double sum = 0.0;
    for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
        const float e = expf(__fsub_rn(prob[j], m));
        prob[j] = e;
        sum += e;
    }
    sum = warp_sum_f64(sum);
    if (lane == 0) red_sum[warp] = sum;
    __syncthreads();
    sum = 0.0;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) sum += red_sum[w];
    for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
        prob[j] = f16_to_f32(f32_to_f16((float) (prob[j] / sum)));
    }
    __syncthreads();

    // Pass 3: V.softmax. Warp w takes slots w, w + ATTN_WARPS, ...; each lane two adjacent
    // dims per step; then the warps' sums are added in warp order.
    const i64 v_row = (i64) p.n_kv_heads * p.head_dim_v;
    const u16 * vbase = v_cache + lo * v_row + (i64) h_kv * p.head_dim_v;
    const int nv_pairs = p.head_dim_v / 2;
    float * my = part + warp * p.head_dim_v;
    for (int c = lane; c < nv_pairs; c += WARP_SIZE) {
        float a0 = 0.0f, a1 = 0.0f;
        for (int j = warp; j < n; j += ATTN_WARPS) {
            const u32 vv = ((const u32 *) (vbase + j * v_row))[c];
            const float pj = prob[j];
            a0 += pj * f16_to_f32((u16) (vv & 0xFFFF));
            a1 += pj * f16_to_f32((u16) (vv >> 16));
        }
        my[2 * c] = a0;
        my[2 * c + 1] = a1;
    }
    __syncthreads();
    float * o = out + ((i64) t * p.n_heads + h) * p.head_dim_v;
    // head_dim_v is a multiple of 32 when write_q8 is set, so whole warps run each round.
    for (int d = threadIdx.x; d < p.head_dim_v; d += ATTN_THREADS) {
        float acc = part[d];
#pragma unroll
        for (int w = 1; w < ATTN_WARPS; ++w) acc += part[w * p.head_dim_v + d];
        o[d] = acc;
        if (p.write_q8) quantize_warp_q8_1(acc, out_q + (((i64) t * p.n_heads + h) * p.head_dim_v + d) / QK8_1);
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention(const float * __restrict__ q, const u16 * __restrict__ k_cache, const u16 * __restrict__ v_cache,
          const int * __restrict__ pos, float * __restrict__ out, block_q8_1 * __restrict__ out_q,
          const u64 * __restrict__ k_rows, const u64 * __restrict__ v_rows, const AttentionParams p) {
    PDL_ENTRY();
    attend_block<false>(q, k_cache, v_cache, pos, out, out_q, k_rows, v_rows, p, RopeArgs{});
}

// rope_store and attention in one launch, for one token per sequence (a decode step: T = 1, or
// a batched step's rows, each its own caches): the launch a decode layer saves.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
rope_attention(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v,
               const float * __restrict__ qn, const float * __restrict__ kn, const int * __restrict__ pos,
               float * __restrict__ q_out, float * __restrict__ k_out, u16 * k_cache, u16 * v_cache,
               float * __restrict__ out, block_q8_1 * __restrict__ out_q, const u64 * __restrict__ k_rows,
               const u64 * __restrict__ v_rows, const RopeAttentionParams rp) {
    PDL_ENTRY();
    AttentionParams p;
    p.n_tokens = rp.n_tokens; p.n_heads = rp.n_heads; p.n_kv_heads = rp.n_kv_heads; p.head_dim = rp.head_dim;
    p.head_dim_v = rp.head_dim_v; p.capacity = rp.capacity; p.n_slots = rp.n_slots; p.window = rp.window;
    p.scale = rp.scale; p.write_q8 = rp.write_q8; p.per_row = rp.per_row; p.pad0 = 0;
    RopeArgs r;
    r.k = k; r.v = v; r.qn = qn; r.kn = kn; r.q_out = q_out; r.k_out = k_out;
    r.n_rot = rp.n_rot; r.neox = rp.neox; r.q_norm = rp.q_norm; r.k_norm = rp.k_norm;
    r.theta_scale = rp.theta_scale; r.freq_scale = rp.freq_scale; r.eps = rp.eps;
    attend_block<true>(q, k_cache, v_cache, pos, out, out_q, k_rows, v_rows, p, r);
}
