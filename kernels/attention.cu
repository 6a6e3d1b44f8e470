// KV cache write and causal GQA softmax attention over an F16 paged cache, for one query
// (decode) or a block of queries (prefill). Everything about the sequence comes from pos[] and
// its block table on the device: query t sees positions s with s <= pos[t] (and pos[t] - s <
// window when a window is set), position s at pool row kv_row(table, s) (common.cuh); head h
// reads KV head h / (H / H_kv).
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
// pass 1, a slot per warp: slots a warp has in flight at once (4 was slower than 1)
#define ATTN_SLOTS_PER_WARP 1
#endif
// Pass 1 takes a slot per thread (its K row read as 16-byte words, the dot product summed in the
// thread: a block's 128 slots in flight at once, no shuffles) for rows of head_dim % 8 == 0 up to
// ATTN_SLOT_LANES_MAX_DIM, else a slot per warp; the kernel picks per launch. With a slot per
// warp a decode step's attention at short contexts was a chain of memory latencies; on longer
// rows (256, 512 dims) a thread's serial dot outweighs the slots in flight.
#ifndef ATTN_SLOT_LANES_MAX_DIM
#define ATTN_SLOT_LANES_MAX_DIM 128
#endif

// pool[kv_row(table, pos[t]), :] = f16(x[t, :]) for rows of H_kv * Dh values.
extern "C" __global__ void __launch_bounds__(KV_STORE_THREADS)
kv_store(const float * __restrict__ x, const int * __restrict__ pos, const int * __restrict__ table,
         u16 * __restrict__ pool, const KvStoreParams p) {
    PDL_ENTRY();
    const int t = blockIdx.y;
    const int i = blockIdx.x * KV_STORE_THREADS + threadIdx.x;
    const int slot = pos[t];
    if (i >= p.row_elems || slot < 0 || slot >= p.capacity || !kv_held(table, slot)) return;
    pool[kv_row(table, slot) * p.row_elems + i] = f32_to_f16(x[(i64) t * p.row_elems + i]);
}

// One thread block per (head, query token). out is [T, H * Dv]; with write_q8 also its Q8_1
// blocks (the input of the output projection), quantized here so that no separate kernel has
// to. Dynamic shared memory: q16 [head_dim], prob [n_slots], acc [ATTN_WARPS][head_dim_v].
// k_cache / v_cache: the layer's pools; table: the sequence's block table, or with per_row
// (a batched decode step, each row its own sequence in the same pools, all of capacity >= its
// position; capacity is the largest) the rows' tables, token t's at table + t * table_stride.
__device__ __forceinline__ void attend_block(const float * q, const u16 * k_cache, const u16 * v_cache,
                                             const int * pos, const int * table, float * out,
                                             block_q8_1 * out_q, const AttentionParams & p) {
    extern __shared__ float smem[];
    float * q16 = smem;                       // [head_dim] the query, rounded to F16
    float * prob = smem + p.head_dim;         // [n_slots] logits, then F16-rounded probabilities
    float * part = prob + p.n_slots;          // [ATTN_WARPS][head_dim_v] per-warp V.softmax sums
    __shared__ float red_max[ATTN_WARPS];
    __shared__ double red_sum[ATTN_WARPS];

    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (p.per_row) table += (i64) t * p.table_stride;  // a batched decode step: token t's sequence
    const int h_kv = h / (p.n_heads / p.n_kv_heads);
    const int hi = min(pos[t], p.capacity - 1);
    const int lo = p.window > 0 ? max(0, pos[t] - p.window + 1) : 0;
    const int n = hi - lo + 1;                // visible slots; n <= n_slots

    const float * qr = q + ((i64) t * p.n_heads + h) * p.head_dim;
    for (int d = threadIdx.x; d < p.head_dim; d += ATTN_THREADS) q16[d] = f16_to_f32(f32_to_f16(qr[d]));
    __syncthreads();                          // q16 written

    // Pass 1: a warp per slot computes K.Q, each lane two adjacent dims per step (one 32-bit
    // load of two halves); lane 0 keeps the logit and the running max. A warp takes
    // ATTN_SLOTS_PER_WARP slots at a time, their loads in flight together (one slot after
    // another, each waited for before its shuffles, made a decode step's attention a chain of
    // memory latencies at short contexts); each slot's sum is the same float operations as one
    // at a time.
    const i64 k_row = (i64) p.n_kv_heads * p.head_dim;
    const int n_pairs = p.head_dim / 2;
    float m = -__int_as_float(0x7f800000);
    if (p.head_dim % 8 == 0 && p.head_dim <= ATTN_SLOT_LANES_MAX_DIM) {
        // A thread per slot: 8 halves of its K row per 16-byte load, each pair of dims added as
        // in the warp-per-slot loop (q0 k0 + q1 k1), the pairs in dim order.
        for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
            const uint4 * kr = (const uint4 *) (k_cache + kv_row(table, lo + j) * k_row + (i64) h_kv * p.head_dim);
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
    for (int j0 = warp; j0 < n; j0 += ATTN_WARPS * ATTN_SLOTS_PER_WARP) {
        float dot[ATTN_SLOTS_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = min(j0 + u * ATTN_WARPS, n - 1);      // past n: slot n-1 again, unused
            const u32 * kr = (const u32 *) (k_cache + kv_row(table, lo + j) * k_row + (i64) h_kv * p.head_dim);
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
    const u16 * vbase = v_cache + (i64) h_kv * p.head_dim_v;
    const int nv_pairs = p.head_dim_v / 2;
    float * my = part + warp * p.head_dim_v;
    for (int c = lane; c < nv_pairs; c += WARP_SIZE) {
        float a0 = 0.0f, a1 = 0.0f;
        for (int j = warp; j < n; j += ATTN_WARPS) {
            const u32 vv = ((const u32 *) (vbase + kv_row(table, lo + j) * v_row))[c];
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
          const int * __restrict__ pos, const int * __restrict__ table, float * __restrict__ out,
          block_q8_1 * __restrict__ out_q, const AttentionParams p) {
    PDL_ENTRY();
    attend_block(q, k_cache, v_cache, pos, table, out, out_q, p);
}
