// KV cache write and causal GQA softmax attention over an F16 paged cache, for one query
// (decode) or a block of queries (prefill). Everything about the sequence comes from pos[] and
// its block table on the device: query t sees positions s with s <= pos[t] (and pos[t] - s <
// window when a window is set), position s at pool row kv_row(table, s) (common.cuh); head h
// reads KV head h / (H / H_kv).
//
// The rounding is the non-flash path of ggml with an F16 cache, as the goldens were recorded:
// Q is rounded to F16 for K.Q, logits are scaled in float32, the softmax is normalised and
// rounded to F16 before V.softmax. That needs the normalised probabilities before any V is
// read, so the kernel makes three passes instead of an online softmax: logits and their max;
// exponentials and their sum in double; probabilities rounded to F16, then V.softmax.
//
// Two forms of the same passes:
// - `attention`: one block per (head, query) keeps the query's row of logits in shared memory
//   (n_slots floats), which bounds the context by the block's shared memory (227 KiB on the
//   H100 and H200: ~57,000 slots at head dims 128), and reads the whole row serially: H blocks
//   a decode step.
// - split-K (flash-decoding), `attention_split_*`: the visible slots j = 0 .. n-1 (slot lo + j,
//   as `attention` numbers them) in splits of ATTN_SPLIT_SLOTS, taken by blocks of (head,
//   query) in each of three launches, the logits in a global scratch row:
//     1. logits: K.Q of a split's slots into the row, the split's max;
//     2. sums: the global max M (the max of the splits' maxima), e_j = expf(l_j - M) and the
//        split's double sum of them;
//     3. values: S = the splits' sums added in split order; p_j = f16(e_j / S); the split's
//        V.softmax; the last block of a (head, query) to finish (a counter per (head, query),
//        after a memory fence: the threadFenceReduction pattern) adds the splits' partial sums
//        in split order and writes the output and its Q8_1 blocks.
//   The number of splits is fixed from n_slots (a decode graph is captured once per capacity
//   and replayed while pos grows on the device), and so is the launch; a split wholly past the
//   visible slots computes nothing (no max, no sum, no K or V read).
//   Bit for bit as `attention`: each logit (the same function computes it, attn_logits), M
//   (a max, in any order) and so each e_j. Reordered: S's double additions (the splits' sums
//   added, where `attention` adds per-thread sums over the whole row: differences ~1e-16
//   relative, which can move a p_j's F16 rounding by one ulp only where e_j / S falls within
//   that of a rounding boundary) and the float32 sums of p_j * V_j (per split, then across
//   splits, where `attention` keeps one sum per warp over the whole row).
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

#ifndef ATTN_SPLIT_SLOTS
// slots a split of the split-K kernels takes, counted from a row's first visible slot (any
// size works; 256: 2 a thread in pass 1)
#define ATTN_SPLIT_SLOTS 256
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

// The visible slots of query t: slot lo + j for j = 0 .. n-1 (n <= n_slots; n <= 0 when
// the window ends before the capacity): attend_block's expressions, for the split kernels.
__device__ __forceinline__ void attn_visible(const int * pos, const int t, const AttentionParams & p, int & lo,
                                             int & n) {
    const int hi = min(pos[t], p.capacity - 1);
    lo = p.window > 0 ? max(0, pos[t] - p.window + 1) : 0;
    n = hi - lo + 1;
}

// The query row (t, h) rounded to F16, into q16 [head_dim] (shared), by the block's threads.
__device__ __forceinline__ void attn_load_q(const float * q, const int t, const int h, float * q16,
                                            const AttentionParams & p) {
    const float * qr = q + ((i64) t * p.n_heads + h) * p.head_dim;
    for (int d = threadIdx.x; d < p.head_dim; d += ATTN_THREADS) q16[d] = f16_to_f32(f32_to_f16(qr[d]));
}

// Pass 1 over visible slots j0 <= j < j1: logit[j] = K.Q of slot lo + j, scaled; returns the
// max of the logits the calling warp computed (every lane holds it; -inf for none). The logit
// of a slot is the same float operations whichever j range, block or thread computes it.
//
// A warp per slot computes K.Q, each lane two adjacent dims per step (one 32-bit load of two
// halves); lane 0 keeps the logit and the running max. A warp takes ATTN_SLOTS_PER_WARP slots
// at a time, their loads in flight together (one slot after another, each waited for before
// its shuffles, made a decode step's attention a chain of memory latencies at short contexts);
// each slot's sum is the same float operations as one at a time.
__device__ __forceinline__ float attn_logits(const float * q16, const u16 * k_cache, const int * table, const int lo,
                                             const int j0, const int j1, const int h_kv, float * logit,
                                             const AttentionParams & p) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 k_row = (i64) p.n_kv_heads * p.head_dim;
    const int n_pairs = p.head_dim / 2;
    float m = -__int_as_float(0x7f800000);
    if (p.head_dim % 8 == 0 && p.head_dim <= ATTN_SLOT_LANES_MAX_DIM) {
        // A thread per slot: 8 halves of its K row per 16-byte load, each pair of dims added as
        // in the warp-per-slot loop (q0 k0 + q1 k1), the pairs in dim order.
        for (int j = j0 + threadIdx.x; j < j1; j += ATTN_THREADS) {
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
            const float l = __fmul_rn(dot, p.scale);
            logit[j] = l;
            m = fmaxf(m, l);
        }
        return warp_max(m);
    }
    for (int jw = j0 + warp; jw < j1; jw += ATTN_WARPS * ATTN_SLOTS_PER_WARP) {
        float dot[ATTN_SLOTS_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = min(jw + u * ATTN_WARPS, j1 - 1);     // past j1: slot j1-1 again, unused
            const u32 * kr = (const u32 *) (k_cache + kv_row(table, lo + j) * k_row + (i64) h_kv * p.head_dim);
            dot[u] = 0.0f;
            for (int c = lane; c < n_pairs; c += WARP_SIZE) {
                const u32 kk = kr[c];
                dot[u] += q16[2 * c] * f16_to_f32((u16) (kk & 0xFFFF)) + q16[2 * c + 1] * f16_to_f32((u16) (kk >> 16));
            }
        }
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = jw + u * ATTN_WARPS;
            const float l = __fmul_rn(warp_sum(dot[u]), p.scale);
            if (j < j1) {
                if (lane == 0) logit[j] = l;
                m = fmaxf(m, l);
            }
        }
    }
    return m;
}

// The split kernels' pass 3 over slots lo .. lo + n - 1 with probabilities prob[0 .. n-1]
// (shared): attend_block's pass 3 loop, the same order (warp w takes slots w, w + ATTN_WARPS,
// ...; each lane two adjacent dims per step), so that a row with one split is summed as there;
// the warp's sums into part[w * head_dim_v ..] (shared), which the caller adds in warp order.
// attend_block keeps its own copy: calling this from there changed its machine code.
__device__ __forceinline__ void attn_values(const float * prob, const u16 * v_cache, const int * table, const int lo,
                                            const int n, const int h_kv, float * part, const AttentionParams & p) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
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

    // Pass 1: the logits into prob, their max.
    float m = attn_logits(q16, k_cache, table, lo, 0, n, h_kv, prob, p);
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

// ---- split-K: blocks (head h = blockIdx.x, b = blockIdx.y, query t = blockIdx.z) ------------
// A (t, h) row's visible slots fall in S = ceil(n_slots / ATTN_SPLIT_SLOTS) splits (split s:
// j in [s * ATTN_SPLIT_SLOTS, (s + 1) * ATTN_SPLIT_SLOTS) of those visible); its gridDim.y
// blocks take splits b, b + gridDim.y, ... (the backend launches enough blocks to fill the
// GPU, fewer than S at depth: a split past the visible slots then costs no block). What a
// split computes and where it goes do not depend on which block takes it, so neither does the
// result on gridDim.y. Scratch (global, row r = t * H + h): logit [r][S * ATTN_SPLIT_SLOTS]
// indexed by j; split_max [r][S]; split_sum [r][S] (double); part [r][S][head_dim_v]; done
// [r] (pass 3's blocks finished). Only the splits that hold visible slots (s < n_used =
// ceil(n / ATTN_SPLIT_SLOTS)) write or are read.

__device__ __forceinline__ int split_count(const AttentionParams & p) {
    return (p.n_slots + ATTN_SPLIT_SLOTS - 1) / ATTN_SPLIT_SLOTS;
}

// The splits of a row that hold visible slots.
__device__ __forceinline__ int splits_used(const int n) {
    return n > 0 ? (n + ATTN_SPLIT_SLOTS - 1) / ATTN_SPLIT_SLOTS : 0;
}

// M: the max of the used splits' maxima (every thread gets it). A max is exact in any order,
// so this is `attention`'s max of the whole row (up to the sign of a zero, which changes no
// expf(l - M)).
__device__ __forceinline__ float split_global_max(const float * split_max, const int n_used, float * red_max) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    float m = -__int_as_float(0x7f800000);
    for (int s = threadIdx.x; s < n_used; s += ATTN_THREADS) m = fmaxf(m, split_max[s]);
    m = warp_max(m);
    if (lane == 0) red_max[warp] = m;
    __syncthreads();
    m = red_max[0];
#pragma unroll
    for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, red_max[w]);
    return m;
}

// Pass 1: each split's logits into the row, its max. Dynamic shared memory: q16 [head_dim].
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention_split_logits(const float * __restrict__ q, const u16 * __restrict__ k_cache, const int * __restrict__ pos,
                       const int * __restrict__ table, float * __restrict__ logit, float * __restrict__ split_max,
                       int * __restrict__ done, const AttentionParams p) {
    PDL_ENTRY();
    __shared__ float red_max[ATTN_WARPS];
    const int h = blockIdx.x, t = blockIdx.z, S = split_count(p);
    const i64 r = (i64) t * p.n_heads + h;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (blockIdx.y == 0 && threadIdx.x == 0) done[r] = 0;     // pass 3 counts from here (a kernel later)
    if (p.per_row) table += (i64) t * p.table_stride;
    int lo, n;
    attn_visible(pos, t, p, lo, n);
    const int n_used = splits_used(n);
    if ((int) blockIdx.y >= n_used) return;                   // no split of this block is visible
    extern __shared__ float smem[];
    float * q16 = smem;
    attn_load_q(q, t, h, q16, p);
    __syncthreads();
    const int h_kv = h / (p.n_heads / p.n_kv_heads);
    float * lr = logit + r * S * ATTN_SPLIT_SLOTS;
    for (int s = blockIdx.y; s < n_used; s += gridDim.y) {
        const int j0 = s * ATTN_SPLIT_SLOTS, j1 = min(n, j0 + ATTN_SPLIT_SLOTS);
        float m = attn_logits(q16, k_cache, table, lo, j0, j1, h_kv, lr, p);
        if (lane == 0) red_max[warp] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            m = red_max[0];
#pragma unroll
            for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, red_max[w]);
            split_max[r * S + s] = m;
        }
        __syncthreads();                                      // red_max read before the next split
    }
}

// Pass 2: each split's double sum of e_j = expf(l_j - M), summed as `attention` sums them
// (per thread, the warp by shuffles, the warps in order) over the split's slots.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention_split_sums(const int * __restrict__ pos, const float * __restrict__ logit,
                     const float * __restrict__ split_max, double * __restrict__ split_sum, const AttentionParams p) {
    PDL_ENTRY();
    __shared__ float red_max[ATTN_WARPS];
    __shared__ double red_sum[ATTN_WARPS];
    const int h = blockIdx.x, t = blockIdx.z, S = split_count(p);
    const i64 r = (i64) t * p.n_heads + h;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    int lo, n;
    attn_visible(pos, t, p, lo, n);
    const int n_used = splits_used(n);
    if ((int) blockIdx.y >= n_used) return;
    const float m = split_global_max(split_max + r * S, n_used, red_max);
    const float * lr = logit + r * S * ATTN_SPLIT_SLOTS;
    for (int s = blockIdx.y; s < n_used; s += gridDim.y) {
        const int j0 = s * ATTN_SPLIT_SLOTS, j1 = min(n, j0 + ATTN_SPLIT_SLOTS);
        double sum = 0.0;
        for (int j = j0 + threadIdx.x; j < j1; j += ATTN_THREADS) sum += expf(__fsub_rn(lr[j], m));
        sum = warp_sum_f64(sum);
        if (lane == 0) red_sum[warp] = sum;
        __syncthreads();
        if (threadIdx.x == 0) {
            sum = 0.0;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) sum += red_sum[w];
            split_sum[r * S + s] = sum;
        }
        __syncthreads();                                      // red_sum read before the next split
    }
}

// Pass 3: for each split, p_j = f16(e_j / S) of its slots, its V.softmax (its warps added in
// warp order) into part; the last of the row's gridDim.y blocks to finish adds the used
// splits' parts in split order into out and its Q8_1 blocks. Dynamic shared memory: prob
// [ATTN_SPLIT_SLOTS], then [ATTN_WARPS][head_dim_v].
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention_split_values(const u16 * __restrict__ v_cache, const int * __restrict__ pos, const int * __restrict__ table,
                       const float * __restrict__ logit, const float * __restrict__ split_max,
                       const double * __restrict__ split_sum, float * __restrict__ part, int * __restrict__ done,
                       float * __restrict__ out, block_q8_1 * __restrict__ out_q, const AttentionParams p) {
    PDL_ENTRY();
    __shared__ float red_max[ATTN_WARPS];
    __shared__ int last;
    const int h = blockIdx.x, t = blockIdx.z, S = split_count(p);
    const i64 r = (i64) t * p.n_heads + h;
    const int Dv = p.head_dim_v;
    if (p.per_row) table += (i64) t * p.table_stride;
    int lo, n;
    attn_visible(pos, t, p, lo, n);
    const int n_used = splits_used(n);
    float * parts = part + r * S * Dv;
    if ((int) blockIdx.y < n_used) {
        const float m = split_global_max(split_max + r * S, n_used, red_max);
        double sum = 0.0;                              // S: the used splits' sums in split order
        for (int u = 0; u < n_used; ++u) sum += split_sum[r * S + u];
        extern __shared__ float smem[];
        float * prob = smem;
        float * wpart = prob + ATTN_SPLIT_SLOTS;
        const float * lr = logit + r * S * ATTN_SPLIT_SLOTS;
        const int h_kv = h / (p.n_heads / p.n_kv_heads);
        for (int s = blockIdx.y; s < n_used; s += gridDim.y) {
            const int j0 = s * ATTN_SPLIT_SLOTS, j1 = min(n, j0 + ATTN_SPLIT_SLOTS);
            for (int j = j0 + threadIdx.x; j < j1; j += ATTN_THREADS) {
                const float e = expf(__fsub_rn(lr[j], m));
                prob[j - j0] = f16_to_f32(f32_to_f16((float) (e / sum)));
            }
            __syncthreads();
            attn_values(prob, v_cache, table, lo + j0, j1 - j0, h_kv, wpart, p);
            __syncthreads();
            for (int d = threadIdx.x; d < Dv; d += ATTN_THREADS) {
                float acc = wpart[d];
#pragma unroll
                for (int w = 1; w < ATTN_WARPS; ++w) acc += wpart[w * Dv + d];
                parts[(i64) s * Dv + d] = acc;
            }
            __syncthreads();                           // prob and wpart read before the next split
        }
    }
    // The threadFenceReduction pattern, fenced as the PTX memory model asks of a relaxed
    // atomicAdd (as cooperative groups' grid sync fences its count): the barrier orders every
    // thread's part stores before the counting thread's fence (a release, cumulative over
    // them), then the count; the block that counts gridDim.y - 1 fences again (an acquire)
    // before the barrier after which its threads read the other blocks' parts, through L2
    // (__ldcg: no stale L1 line).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done + r, 1) == (int) gridDim.y - 1;
        if (last) __threadfence();
    }
    __syncthreads();
    if (!last) return;
    float * o = out + r * Dv;
    // head_dim_v is a multiple of 32 when write_q8 is set, so whole warps run each round.
    for (int d = threadIdx.x; d < Dv; d += ATTN_THREADS) {
        float acc = n_used > 0 ? __ldcg(parts + d) : 0.0f;
        for (int u = 1; u < n_used; ++u) acc += __ldcg(parts + (i64) u * Dv + d);
        o[d] = acc;
        if (p.write_q8) quantize_warp_q8_1(acc, out_q + (r * Dv + d) / QK8_1);
    }
}
