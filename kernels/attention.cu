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
//   as `attention` numbers them) in splits of ATTN_SPLIT_SLOTS, taken in each of three
//   launches by blocks of (KV head, query) in passes 1 and 3 (each such block computes every
//   query head of the KV head's group, so that a K or V row is read once for the group) and of
//   (head, query) in pass 2, the logits in a global scratch row a (head, query):
//     1. logits: K.Q of a split's slots into the row, the split's max;
//     2. sums: the global max M (the max of the splits' maxima), e_j = expf(l_j - M) and the
//        split's double sum of them;
//     3. values: S = the splits' sums added in split order; p_j = f16(e_j / S); the split's
//        V.softmax; the last block of a (KV head, query) to finish (a counter per (KV head,
//        query), after a memory fence: the threadFenceReduction pattern) adds each of the
//        group's heads' splits' partial sums in split order and writes the output and its Q8_1
//        blocks.
//   The number of splits is fixed from n_slots (a decode graph is captured once per capacity
//   and replayed while pos grows on the device), and so is the launch; a split wholly past the
//   visible slots computes nothing (no max, no sum, no K or V read).
//   Bit for bit as `attention`: each logit (attn_group_logits: attn_logits' expressions), M
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

#ifndef ATTN_VALUES_SLOTS
// split-K pass 3: the V rows a warp reads before it adds them (a load per slot, each to its
// own register): with one, each slot was a dependent memory round trip, so a warp's ~18 slots
// near an empty context (64 a split at depth) were a chain of latencies. The adds keep slot
// order, so any count gives the same bits.
#define ATTN_VALUES_SLOTS 8
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

// ---- split-K: a (KV head g's block column, lane) per block, query t = blockIdx.z -------------
// A (t, h) row's visible slots fall in S = ceil(n_slots / ATTN_SPLIT_SLOTS) splits (split s:
// j in [s * ATTN_SPLIT_SLOTS, (s + 1) * ATTN_SPLIT_SLOTS) of those visible), of which the
// first n_used = ceil(n / ATTN_SPLIT_SLOTS) hold visible slots. Passes 1 and 3 take the G =
// H / H_kv query heads h = g * G .. g * G + G - 1 that read KV head g in GB block columns
// (column x = g * GB + i: heads g * G + i * G / GB, the next G / GB), so that each K row
// (pass 1) and V row (pass 3) is read once for a column's heads (in chunks of up to
// ATTN_SPLIT_HEADS heads, split_chunk_heads; each chunk reads the rows again). GB = 1 shares
// the reads most; GB = G is a block per head, the most blocks. GB is chosen here, per query,
// from the splits in use (split_columns): a graph captured for a large capacity replays near
// an empty context too, where sharing would leave most of the GPU idle. Both passes launch
// the grid (H, L, n) (block k = blockIdx.y * H + blockIdx.x of a query); under a cut of GB,
// block k is column k % (H_kv * GB) and lane k / (H_kv * GB) of lanes = min(n_used, L * G /
// GB) (at least 1: the column's combination), and a lane past them returns at once. A
// column's lanes take splits lane, lane + lanes, ... (the backend launches enough blocks to
// fill the GPU, fewer than S at depth: a split past the visible slots then costs no block).
// Pass 2 reads only logits and keeps a block per (t, h) row, its gridDim.y blocks taking the
// splits in the same way. What a split computes and where it goes do not depend on which
// block takes it, so neither does the result on the grid or GB. Each head's numbers are the
// float operations, in the order, that a block of that head alone would make (the same
// expressions per head). Scratch (global, row r = t * H + h): logit [r][S * ATTN_SPLIT_SLOTS]
// indexed by j; split_max [r][S]; split_sum [r][S] (double); part [r][S][head_dim_v]; done
// [t * H + x] (pass 3's lanes of column x finished). Only the splits in use write or are read.

#ifndef ATTN_SPLIT_HEADS
// query heads of a KV group that a block of split-K pass 1 or 3 holds at once (registers:
// a dot product or two V sums a head; shared memory: a query row, a split's probabilities
// and the warps' sums a head)
#define ATTN_SPLIT_HEADS 8
#endif
static_assert(ATTN_SPLIT_HEADS == 1 || ATTN_SPLIT_HEADS == 2 || ATTN_SPLIT_HEADS == 4 || ATTN_SPLIT_HEADS == 8,
              "split_chunk's dispatch takes chunks of 1, 2, 4 or 8 heads");

__device__ __forceinline__ int split_count(const AttentionParams & p) {
    return (p.n_slots + ATTN_SPLIT_SLOTS - 1) / ATTN_SPLIT_SLOTS;
}

// The splits of a row that hold visible slots.
__device__ __forceinline__ int splits_used(const int n) {
    return n > 0 ? (n + ATTN_SPLIT_SLOTS - 1) / ATTN_SPLIT_SLOTS : 0;
}

// Passes 1 and 3's cut of a KV group: the fewest block columns GB (a divisor of G) whose
// (column, split, query) items, n_used splits a query over the launch's gridDim.z queries,
// number p.split_fill (the backend's SPLIT_GROUP_FILL an SM); G (a block a head) where none
// does. Both passes compute it from the same values, so they agree (attention.py
// split_group_blocks is the same rule at the capacity's splits: the fewest columns any
// position takes, which sizes the dynamic shared memory).
__device__ __forceinline__ int split_columns(const int G, const int n_used, const AttentionParams & p) {
    const long long items = (long long) p.n_kv_heads * n_used * gridDim.z;
    for (int gb = 1; gb < G; ++gb)
        if (G % gb == 0 && items * gb >= p.split_fill) return gb;
    return G;
}

// A block of pass 1 or 3 under its query's cut (split_columns): its column x, its lane, and
// the lanes its column has; false for a block past them (it returns at once).
struct SplitBlock {
    int GB, x, lane, lanes;
};
__device__ __forceinline__ bool split_block(const int G, const int n_used, const AttentionParams & p,
                                            SplitBlock & b) {
    b.GB = split_columns(G, n_used, p);
    const int columns = p.n_kv_heads * b.GB, k = blockIdx.y * gridDim.x + blockIdx.x;
    b.x = k % columns;
    b.lane = k / columns;
    b.lanes = max(1, min(n_used, (int) (gridDim.x * gridDim.y) / columns));
    return b.lane < b.lanes;
}

// The heads a chunk takes of `left` heads of a group still to do: the largest power of two
// up to min(left, ATTN_SPLIT_HEADS), so that a chunk's heads are a compile-time count (its
// per-head registers unrolled, no head guarded) of four: G = 6 goes as 4 + 2, 12 as 8 + 4.
// The backend sizes shared memory for the first chunk (attention.py split_chunk_heads).
__device__ __forceinline__ int split_chunk_heads(const int left) {
    const int c = min(left, ATTN_SPLIT_HEADS);
    return c >= 8 ? 8 : c >= 4 ? 4 : c >= 2 ? 2 : 1;
}

// M of NH rows: head i's max of its used splits' maxima (split_max + i * S; every thread gets
// them). A max is exact in any order, so this is `attention`'s max of the whole row (up to the
// sign of a zero, which changes no expf(l - M)). red_max: [NH][ATTN_WARPS] shared.
template <int NH>
__device__ __forceinline__ void split_global_max(const float * split_max, const int S, const int n_used,
                                                 float * red_max, float (&m)[NH]) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        m[i] = -__int_as_float(0x7f800000);
        for (int s = threadIdx.x; s < n_used; s += ATTN_THREADS) m[i] = fmaxf(m[i], split_max[i * S + s]);
        m[i] = warp_max(m[i]);
        if (lane == 0) red_max[i * ATTN_WARPS + warp] = m[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        m[i] = red_max[i * ATTN_WARPS];
#pragma unroll
        for (int w = 1; w < ATTN_WARPS; ++w) m[i] = fmaxf(m[i], red_max[i * ATTN_WARPS + w]);
    }
}

// attn_logits for NH query heads of one KV head at once, over visible slots j0 <= j < j1:
// q16 [NH][head_dim] (shared), head i's logits into logit + i * row (logit[i * row + j]), the
// calling warp's max of head i's into m[i] (every lane holds it; -inf for none). Each K row is
// read once for the NH heads; each head's logit is attn_logits' float operations in its order
// (the same expression a pair of dims, the same layouts: a slot per thread or per warp).
template <int NH>
__device__ __forceinline__ void attn_group_logits(const float * q16, const u16 * k_cache, const int * table,
                                                  const int lo, const int j0, const int j1, const int h_kv,
                                                  float * logit, const i64 row, float (&m)[NH],
                                                  const AttentionParams & p) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 k_row = (i64) p.n_kv_heads * p.head_dim;
    const int Dh = p.head_dim, n_pairs = p.head_dim / 2;
#pragma unroll
    for (int i = 0; i < NH; ++i) m[i] = -__int_as_float(0x7f800000);
    if (p.head_dim % 8 == 0 && p.head_dim <= ATTN_SLOT_LANES_MAX_DIM) {
        for (int j = j0 + threadIdx.x; j < j1; j += ATTN_THREADS) {
            const uint4 * kr = (const uint4 *) (k_cache + kv_row(table, lo + j) * k_row + (i64) h_kv * p.head_dim);
            float dot[NH];
#pragma unroll
            for (int i = 0; i < NH; ++i) dot[i] = 0.0f;
            for (int c = 0; c < p.head_dim / 8; ++c) {
                const uint4 kk = kr[c];
                const u32 w4[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = 8 * c + 2 * e;
                    const float k0 = f16_to_f32((u16) (w4[e] & 0xFFFF)), k1 = f16_to_f32((u16) (w4[e] >> 16));
#pragma unroll
                    for (int i = 0; i < NH; ++i) dot[i] += q16[i * Dh + d] * k0 + q16[i * Dh + d + 1] * k1;
                }
            }
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const float l = __fmul_rn(dot[i], p.scale);
                logit[i * row + j] = l;
                m[i] = fmaxf(m[i], l);
            }
        }
#pragma unroll
        for (int i = 0; i < NH; ++i) m[i] = warp_max(m[i]);
        return;
    }
    for (int jw = j0 + warp; jw < j1; jw += ATTN_WARPS * ATTN_SLOTS_PER_WARP) {
        float dot[ATTN_SLOTS_PER_WARP][NH];
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = min(jw + u * ATTN_WARPS, j1 - 1);     // past j1: slot j1-1 again, unused
            const u32 * kr = (const u32 *) (k_cache + kv_row(table, lo + j) * k_row + (i64) h_kv * p.head_dim);
#pragma unroll
            for (int i = 0; i < NH; ++i) dot[u][i] = 0.0f;
            for (int c = lane; c < n_pairs; c += WARP_SIZE) {
                const u32 kk = kr[c];
                const float k0 = f16_to_f32((u16) (kk & 0xFFFF)), k1 = f16_to_f32((u16) (kk >> 16));
#pragma unroll
                for (int i = 0; i < NH; ++i) dot[u][i] += q16[i * Dh + 2 * c] * k0 + q16[i * Dh + 2 * c + 1] * k1;
            }
        }
#pragma unroll
        for (int u = 0; u < ATTN_SLOTS_PER_WARP; ++u) {
            const int j = jw + u * ATTN_WARPS;
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const float l = __fmul_rn(warp_sum(dot[u][i]), p.scale);
                if (j < j1) {
                    if (lane == 0) logit[i * row + j] = l;
                    m[i] = fmaxf(m[i], l);
                }
            }
        }
    }
}

// Pass 3's V.softmax of a split for NH query heads of one KV head, over its n slots, slot j at
// pool row rows[j] with probabilities prob[i * ATTN_SPLIT_SLOTS + j] (both shared):
// attend_block's pass 3 loop for each head, the same order (warp w takes slots w, w +
// ATTN_WARPS, ...; each lane two adjacent dims per step), so that a row with one split is
// summed as there, each V row read once for the NH heads; head i's warp sums into
// part[(i * ATTN_WARPS + w) * head_dim_v ..] (shared), which the caller adds in warp order. A
// warp reads ATTN_VALUES_SLOTS slots' words before adding them in slot order. attend_block keeps
// its own loop: calling a shared function from there changed its machine code.
template <int NH>
__device__ __forceinline__ void attn_group_values(const float * prob, const u16 * v_cache, const i64 * rows,
                                                  const int n, const int h_kv, float * part,
                                                  const AttentionParams & p) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 v_row = (i64) p.n_kv_heads * p.head_dim_v;
    const u16 * vbase = v_cache + (i64) h_kv * p.head_dim_v;
    const int Dv = p.head_dim_v, nv_pairs = p.head_dim_v / 2;
    for (int c = lane; c < nv_pairs; c += WARP_SIZE) {
        float a0[NH], a1[NH];
#pragma unroll
        for (int i = 0; i < NH; ++i) a0[i] = a1[i] = 0.0f;
        for (int j0 = warp; j0 < n; j0 += ATTN_WARPS * ATTN_VALUES_SLOTS) {
            u32 vv[ATTN_VALUES_SLOTS];
#pragma unroll
            for (int u = 0; u < ATTN_VALUES_SLOTS; ++u) {
                const int j = j0 + u * ATTN_WARPS;
                vv[u] = j < n ? ((const u32 *) (vbase + rows[j] * v_row))[c] : 0u;
            }
#pragma unroll
            for (int u = 0; u < ATTN_VALUES_SLOTS; ++u) {
                const int j = j0 + u * ATTN_WARPS;
                if (j >= n) break;
                const float v0 = f16_to_f32((u16) (vv[u] & 0xFFFF)), v1 = f16_to_f32((u16) (vv[u] >> 16));
#pragma unroll
                for (int i = 0; i < NH; ++i) {
                    const float pj = prob[i * ATTN_SPLIT_SLOTS + j];
                    a0[i] += pj * v0;
                    a1[i] += pj * v1;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NH; ++i) {
            part[(i * ATTN_WARPS + warp) * Dv + 2 * c] = a0[i];
            part[(i * ATTN_WARPS + warp) * Dv + 2 * c + 1] = a1[i];
        }
    }
}

// Pass 1 for the NH heads h .. h + NH - 1 (rows r .. r + NH - 1) of KV head h_kv: their query
// rows into q16 [NH][head_dim] (shared), then each split of the block's: the logits, each
// head's split max. red_max: [ATTN_SPLIT_HEADS][ATTN_WARPS] shared.
template <int NH>
__device__ __forceinline__ void split_logits_heads(const float * q, const u16 * k_cache, const int * table,
                                                   const int t, const int h, const int h_kv, const int lo,
                                                   const int n, const int n_used, const int s0, const int ds,
                                                   float * logit, float * split_max, float * q16, float * red_max,
                                                   const AttentionParams & p) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, S = split_count(p);
    const i64 r = (i64) t * p.n_heads + h, row = (i64) S * ATTN_SPLIT_SLOTS;
    const float * qr = q + r * p.head_dim;         // the NH heads' rows, one after another
    __syncthreads();                                // the previous chunk's q16 read
    for (int d = threadIdx.x; d < NH * p.head_dim; d += ATTN_THREADS) q16[d] = f16_to_f32(f32_to_f16(qr[d]));
    __syncthreads();                                // q16 written
    float * lr = logit + r * row;
    for (int s = s0; s < n_used; s += ds) {
        const int j0 = s * ATTN_SPLIT_SLOTS, j1 = min(n, j0 + ATTN_SPLIT_SLOTS);
        float m[NH];
        attn_group_logits<NH>(q16, k_cache, table, lo, j0, j1, h_kv, lr, row, m, p);
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < NH; ++i) red_max[i * ATTN_WARPS + warp] = m[i];
        }
        __syncthreads();
        if (threadIdx.x < NH) {
            const int i = threadIdx.x;
            float mi = red_max[i * ATTN_WARPS];
#pragma unroll
            for (int w = 1; w < ATTN_WARPS; ++w) mi = fmaxf(mi, red_max[i * ATTN_WARPS + w]);
            split_max[(r + i) * S + s] = mi;
        }
        __syncthreads();                            // red_max read before the next split
    }
}

// Pass 1: each split's logits into the rows of the block column's heads, each head's split
// max. Dynamic shared memory: q16 [split_chunk_heads(G / GB)][head_dim] (the backend sizes it
// for the fewest columns any position takes).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention_split_logits(const float * __restrict__ q, const u16 * __restrict__ k_cache, const int * __restrict__ pos,
                       const int * __restrict__ table, float * __restrict__ logit, float * __restrict__ split_max,
                       int * __restrict__ done, const AttentionParams p) {
    PDL_ENTRY();
    __shared__ float red_max[ATTN_SPLIT_HEADS * ATTN_WARPS];
    const int t = blockIdx.z, G = p.n_heads / p.n_kv_heads;
    if (p.per_row) table += (i64) t * p.table_stride;
    int lo, n;
    attn_visible(pos, t, p, lo, n);
    const int n_used = splits_used(n);
    SplitBlock sb;
    if (!split_block(G, n_used, p, sb)) return;               // past its column's lanes
    // column x of KV head g takes HB = G / GB of its heads
    const int HB = G / sb.GB, g = sb.x / sb.GB, h0 = g * G + sb.x % sb.GB * HB;
    if (sb.lane == 0 && threadIdx.x == 0) done[(i64) t * p.n_heads + sb.x] = 0;   // pass 3 counts from here
    if (sb.lane >= n_used) return;                            // no split of this block is visible
    extern __shared__ float smem[];
    const int L = sb.lane, Ls = sb.lanes;
    for (int h = h0, nh; h < h0 + HB; h += nh) {
        nh = split_chunk_heads(h0 + HB - h);
        switch (nh) {
        case 8: split_logits_heads<8>(q, k_cache, table, t, h, g, lo, n, n_used, L, Ls, logit, split_max, smem, red_max, p); break;
        case 4: split_logits_heads<4>(q, k_cache, table, t, h, g, lo, n, n_used, L, Ls, logit, split_max, smem, red_max, p); break;
        case 2: split_logits_heads<2>(q, k_cache, table, t, h, g, lo, n, n_used, L, Ls, logit, split_max, smem, red_max, p); break;
        default: split_logits_heads<1>(q, k_cache, table, t, h, g, lo, n, n_used, L, Ls, logit, split_max, smem, red_max, p);
        }
    }
}

// Pass 2: each split's double sum of e_j = expf(l_j - M), summed as `attention` sums them
// (per thread, the warp by shuffles, the warps in order) over the split's slots. A block per
// (t, h) row.
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
    float mm[1];
    split_global_max<1>(split_max + r * S, S, n_used, red_max, mm);
    const float m = mm[0];
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

// Pass 3 for the NH heads of rows r .. r + NH - 1 (KV head h_kv): each head's M and S (the
// used splits' sums in split order), then for each split of the block's: p_j = f16(e_j / S)
// of its slots a head, the heads' V.softmax (each head's warps added in warp order) into part;
// a row with one split in use (n_used == 1) has its output there, so it goes to out and its
// Q8_1 blocks directly, as the combine would write it (a sum of one part).
// Dynamic shared memory: prob [NH][ATTN_SPLIT_SLOTS], then [NH][ATTN_WARPS][head_dim_v].
// red_max: [ATTN_SPLIT_HEADS][ATTN_WARPS], head_sum [ATTN_SPLIT_HEADS], rows
// [ATTN_SPLIT_SLOTS] (the split's pool rows, looked up once for every warp and head) shared.
template <int NH>
__device__ __forceinline__ void split_values_heads(const u16 * v_cache, const int * table, const i64 r,
                                                   const int h_kv, const int lo, const int n, const int n_used,
                                                   const int s0, const int ds, const float * logit, const float * split_max,
                                                   const double * split_sum, float * part, float * out,
                                                   block_q8_1 * out_q, float * smem, float * red_max,
                                                   double * head_sum, i64 * rows, const AttentionParams & p) {
    const int S = split_count(p), Dv = p.head_dim_v;
    const i64 row = (i64) S * ATTN_SPLIT_SLOTS;
    if (threadIdx.x < NH) {                         // S of a head: its used splits' sums in split order
        double sum = 0.0;
        for (int u = 0; u < n_used; ++u) sum += split_sum[(r + threadIdx.x) * S + u];
        head_sum[threadIdx.x] = sum;
    }
    float m[NH];
    split_global_max<NH>(split_max + r * S, S, n_used, red_max, m);   // its barrier: head_sum written
    float * prob = smem;
    float * wpart = prob + NH * ATTN_SPLIT_SLOTS;
    const float * lr = logit + r * row;
    for (int s = s0; s < n_used; s += ds) {
        const int j0 = s * ATTN_SPLIT_SLOTS, j1 = min(n, j0 + ATTN_SPLIT_SLOTS);
        for (int j = j0 + threadIdx.x; j < j1; j += ATTN_THREADS) {
            rows[j - j0] = kv_row(table, lo + j);
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const float e = expf(__fsub_rn(lr[i * row + j], m[i]));
                prob[i * ATTN_SPLIT_SLOTS + j - j0] = f16_to_f32(f32_to_f16((float) (e / head_sum[i])));
            }
        }
        __syncthreads();
        attn_group_values<NH>(prob, v_cache, rows, j1 - j0, h_kv, wpart, p);
        __syncthreads();
        for (int x = threadIdx.x; x < NH * Dv; x += ATTN_THREADS) {
            const int i = x / Dv, d = x % Dv;
            const float * wp = wpart + i * ATTN_WARPS * Dv;
            float acc = wp[d];
#pragma unroll
            for (int w = 1; w < ATTN_WARPS; ++w) acc += wp[w * Dv + d];
            if (n_used == 1) {
                // head_dim_v is a multiple of 32 when write_q8 is set: whole warps, one Q8_1 block each
                out[r * Dv + x] = acc;
                if (p.write_q8) quantize_warp_q8_1(acc, out_q + (r * Dv + x) / QK8_1);
            } else {
                part[((r + i) * S + s) * Dv + d] = acc;
            }
        }
        __syncthreads();                            // prob, rows, wpart, head_sum and red_max read before reuse
    }
}

// Pass 3: the block column's heads' splits (split_values_heads, in chunks); the last of the
// column's lanes to finish adds each head's used splits' parts in split order into
// out and its Q8_1 blocks. A row with one split in use has one lane a column, which writes out
// itself and counts nothing (its counter stays at pass 1's 0). Dynamic shared memory: prob [split_chunk_heads(G / GB)]
// [ATTN_SPLIT_SLOTS], then [split_chunk_heads(G / GB)][ATTN_WARPS][head_dim_v].
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attention_split_values(const u16 * __restrict__ v_cache, const int * __restrict__ pos, const int * __restrict__ table,
                       const float * __restrict__ logit, const float * __restrict__ split_max,
                       const double * __restrict__ split_sum, float * __restrict__ part, int * __restrict__ done,
                       float * __restrict__ out, block_q8_1 * __restrict__ out_q, const AttentionParams p) {
    PDL_ENTRY();
    __shared__ float red_max[ATTN_SPLIT_HEADS * ATTN_WARPS];
    __shared__ double head_sum[ATTN_SPLIT_HEADS];
    __shared__ i64 rows[ATTN_SPLIT_SLOTS];
    __shared__ int last;
    const int t = blockIdx.z, S = split_count(p), G = p.n_heads / p.n_kv_heads;
    const int Dv = p.head_dim_v;
    if (p.per_row) table += (i64) t * p.table_stride;
    int lo, n;
    attn_visible(pos, t, p, lo, n);
    const int n_used = splits_used(n);
    SplitBlock sb;
    if (!split_block(G, n_used, p, sb)) return;               // past its column's lanes: not counted
    const int HB = G / sb.GB, g = sb.x / sb.GB;              // heads a block takes, its KV head
    const i64 c = (i64) t * p.n_heads + sb.x;                 // the block column's done counter
    const i64 r0 = (i64) t * p.n_heads + (i64) g * G + (i64) (sb.x % sb.GB) * HB;     // its first row
    const int L = sb.lane, Ls = sb.lanes;
    if (L < n_used) {
        extern __shared__ float smem[];
        for (int i = 0, nh; i < HB; i += nh) {
            nh = split_chunk_heads(HB - i);
            switch (nh) {
            case 8: split_values_heads<8>(v_cache, table, r0 + i, g, lo, n, n_used, L, Ls, logit, split_max, split_sum,
                                          part, out, out_q, smem, red_max, head_sum, rows, p); break;
            case 4: split_values_heads<4>(v_cache, table, r0 + i, g, lo, n, n_used, L, Ls, logit, split_max, split_sum,
                                          part, out, out_q, smem, red_max, head_sum, rows, p); break;
            case 2: split_values_heads<2>(v_cache, table, r0 + i, g, lo, n, n_used, L, Ls, logit, split_max, split_sum,
                                          part, out, out_q, smem, red_max, head_sum, rows, p); break;
            default: split_values_heads<1>(v_cache, table, r0 + i, g, lo, n, n_used, L, Ls, logit, split_max,
                                           split_sum, part, out, out_q, smem, red_max, head_sum, rows, p);
            }
        }
    }
    if (n_used == 1) return;                                  // written out above: nothing to combine
    // The threadFenceReduction pattern, fenced as the PTX memory model asks of a relaxed
    // atomicAdd (as cooperative groups' grid sync fences its count): the barrier orders every
    // thread's part stores before the counting thread's fence (a release, cumulative over
    // them), then the count; the block that counts lanes - 1 fences again (an acquire)
    // before the barrier after which its threads read the other blocks' parts, through L2
    // (__ldcg: no stale L1 line).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done + c, 1) == Ls - 1;
        if (last) __threadfence();
    }
    __syncthreads();
    if (!last) return;
    // The block column's HB rows r0 .. r0 + HB - 1, element x = (row - r0) * Dv + d. head_dim_v
    // is a multiple of 32 when write_q8 is set, so whole warps run each round, each in one Q8_1
    // block.
    for (int x = threadIdx.x; x < HB * Dv; x += ATTN_THREADS) {
        const float * parts = part + ((r0 + x / Dv) * S) * Dv + x % Dv;
        float acc = n_used > 0 ? __ldcg(parts) : 0.0f;
        for (int u = 1; u < n_used; ++u) acc += __ldcg(parts + (i64) u * Dv);
        out[r0 * Dv + x] = acc;
        if (p.write_q8) quantize_warp_q8_1(acc, out_q + (r0 * Dv + x) / QK8_1);
    }
}
