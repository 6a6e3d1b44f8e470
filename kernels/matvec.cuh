// The mat-vec skeletons shared by every weight kind. A kind K supplies K::act (the activation
// element: float, or a Q8_1 block), K::values_per_item and K::dot(row, item, act) for one
// item of a weight row against its activations (for quantized kinds an item is 32 weights
// against the one Q8_1 block they meet).
//
//   matvec_<kind>       decode: up to three matrices sharing one activation row (q, k, v),
//                       R rows per warp, the row's items strided over the warp's lanes;
//                       blockIdx.y is the token
//   matvec_split_<kind> the same with each unit's items split over MV_SPLIT warps (long rows:
//                       K >= MV_SPLIT_MIN_K; see MV_SPLIT)
//   matvec_coop_<kind>  matvec_<kind> (a row a warp, one token) with each chunk of 32 items of
//                       a row read by the warp together into shared memory (see MV_COOP_WARPS)
//   matvec_glu_<kind>   gate and up with the gated activation fused (and h's Q8_1 blocks);
//                       with ids, the chosen experts' matrices (MoE); matvec_glu_wide_<kind>
//                       the same for small launches (more warps a block)
//   matvec_moe_down_<kind>  MoE down projection over the chosen experts with their weighted
//                       sum fused (and, with has_scale, a factor per expert before the weight)
//   matmul_<kind>       prefill: one output row x up to MATMUL_TILE tokens per thread block
//   matvec_id_<kind>    mul_mat_id: blockIdx.y is a (token, slot) pair and ids[slot] picks
//                       the expert matrix on the device
//   matvec_cols_<kind>, matvec_glu_cols_<kind>
//                       a batched decode step (several sequences' tokens): as matvec_ and
//                       matvec_glu_, but a block takes up to MV_COLS tokens (blockIdx.x the
//                       group of tokens, blockIdx.y the rows), so each weight row is read once
//                       for all of them; each token's sum is the single-token kernel's, term
//                       for term in the same order, so a sequence's results do not depend on
//                       which others share its step
//
// Decode reads every weight byte once per token, so these kernels are bound by memory
// bandwidth: a warp per group of rows keeps many independent loads in flight and needs no
// shared memory or block barrier for its sums (a warp reduction by shuffles).
#pragma once
#include "common.cuh"
#include "params.cuh"

#define MATVEC_THREADS 128
#define MATMUL_TILE 8
#ifndef MV_WARPS
#define MV_WARPS 8          // matvec_<kind>: warps per block
#endif
#ifndef MV_ROWS
#define MV_ROWS 1           // matvec_<kind>: rows per warp
#endif
#ifndef MV_UNROLL
#define MV_UNROLL 1         // items of a row a lane has in flight (1: best with staged activations)
#endif
#ifndef MV_SPLIT
// matvec_split_<kind> / matvec_cols_split_<kind>: the warps that share a unit of rows (split-K),
// warp s of the group taking items lane + 32 s, lane + 32 (s + MV_SPLIT), ...; their warp sums
// added in the order s = 0, 1, ... through shared memory. matvec_<kind> / matvec_cols_<kind>
// keep a warp per unit. Why: a warp per long row leaves the GPU short of loads in flight (the
// Q4_K mat-vec stalled on memory latency at low occupancy), and llama.cpp's mmvq splits a row
// over its block's warps likewise. But a short row split leaves lanes idle (at K = 1024, 32 Q8_1
// items, the second warp of a pair has nothing to read: the output head of a small model slowed
// down), and 4 warps a row lost on every shape. Hence the backend splits rows of K >=
// MV_SPLIT_MIN_K only: of Qwen3-8B's matrices only the down projection (K 12288), which holds
// nearly all of the gain; splitting from 4096 gained nothing more and cost the 30B-A3B shape. Another order of the same sums than
// a warp per row: within the mat-mul bound of the reference, not bit for bit the unsplit kernel
// (a matrix takes one of the two always, so a token's result still does not depend on the batch
// it is in).
#define MV_SPLIT 2
#endif
#ifndef MV_SPLIT_MIN_K
#define MV_SPLIT_MIN_K 8192      // the backend's rule, read from here (engine/backends/cuda/backend.py)
#endif
static_assert(MV_WARPS % MV_SPLIT == 0, "MV_SPLIT must divide MV_WARPS");
#ifndef MV_SPLIT_WARPS
// matvec_split_<kind> (one token, rows of K >= MV_SPLIT_MIN_K): warps a block, MV_SPLIT_WARPS /
// MV_SPLIT units of rows. The backend launches the threads the kernel was built for (its
// __launch_bounds__, read from the loaded function), so a build with another value needs no
// other change. Why more than MV_WARPS might pay: every block stages all of x (K = 12288: 384
// Q8_1 blocks, 13.8 KB read from L2) before its first row, a large share of the split Q4_K
// kernel's stalls; a block of 16 warps stages once for 8 units where two blocks of 8 stage
// twice, at the same warps an SM. It did not: the kernel was slower at 16, 32 and 4 warps than
// at 8 (one staging for more units is not what it waits for). Every row's sum is the same (the
// split group's warps, items and order do not change): the same bits.
#define MV_SPLIT_WARPS 8
#endif
#ifndef MV_SPLIT_WARPS_PLAIN
// MV_SPLIT_WARPS for the kinds whose rows are not preloaded (Q6_K, Q8_0, Q5_K, ...; MV_PRELOAD).
// Why apart: at 16 and 32 warps ptxas gives matvec_split_q6_k more registers (fewer resident
// warps an SM), where matvec_split_q4_k keeps its count. The same bits.
#define MV_SPLIT_WARPS_PLAIN MV_SPLIT_WARPS
#endif
static_assert(MV_SPLIT_WARPS % MV_SPLIT == 0 && MV_SPLIT_WARPS <= 32 && MV_SPLIT_WARPS_PLAIN % MV_SPLIT == 0
              && MV_SPLIT_WARPS_PLAIN <= 32, "MV_SPLIT_WARPS(_PLAIN): whole split groups, 1024 threads at most");
#ifndef GLU_WARPS
// matvec_glu_<kind> / matvec_glu_cols_<kind>: GLU_WARPS warps x GLU_ROWS rows = 32 rows a block,
// one Q8_1 block of h. Each row's sums are the same floats whatever the split (a row's items,
// lanes and order do not depend on it), so these move time only.
#define GLU_WARPS 8
#endif
#ifndef GLU_ROWS
#define GLU_ROWS 4
#endif
static_assert(GLU_WARPS * GLU_ROWS == 32, "a gated block is one Q8_1 block (32 rows) of h");
#ifndef GLU_WIDE_WARPS
// matvec_glu_wide_<kind>: GLU_WIDE_WARPS warps x 32 / GLU_WIDE_WARPS rows, gate and up in one
// loop, for launches of fewer than GLU_WIDE_MAX_BLOCKS_PER_SM blocks per SM (the backend's rule):
// a small launch (a small model's gate/up, a MoE expert's few blocks) leaves SMs short of warps,
// and the wide blocks with both matrices' loads in flight fill them; a large launch (Qwen3-8B's
// 384 blocks) is faster with 8 x 4 one matrix after the other, whose loop takes fewer registers.
// The backend picks the kernel per launch.
#define GLU_WIDE_WARPS 16
#endif
#ifndef GLU_WIDE_MAX_BLOCKS_PER_SM
#define GLU_WIDE_MAX_BLOCKS_PER_SM 2
#endif
static_assert(32 % GLU_WIDE_WARPS == 0, "matvec_glu_wide_'s warps share one Q8_1 block of h");
#define DOWN_WARPS 8        // matvec_moe_down_<kind>: warps per block (over the chosen experts)
#define DOWN_ROWS 4         //   output rows per block
#define MOE_MAX_USED 64     //   chosen experts per token at most (moe_route's bound)

#ifndef MV_STAGE_MAX_K
#define MV_STAGE_MAX_K 24576     // quantized kinds stage x in shared memory up to this K (48 B per 32)
#endif
#ifndef MV_COLS
#define MV_COLS 8                // matvec_cols_<kind>: tokens per block at most (accumulators per lane)
#endif
#ifndef MV_COLS_STAGE_MAX_K
// ... and their staged values (tokens x K) at most (~172 KB): at half this, Qwen3-8B's down
// projection (K = 12288) took 4 tokens a block instead of 8, and batched steps of 8 and more
// sequences were slower.
#define MV_COLS_STAGE_MAX_K 98304
#endif
#ifndef MV_COLS_ROWS
// matvec_cols_<kind> / matvec_cols_split_<kind>: weight rows a warp (a split group) takes at
// once, each item of the tokens' activations read once for all of them. Why: the batched
// kernels read every token's activations from shared memory once per row, and per item that
// is more shared-memory traffic than the item's arithmetic (Q4_K: ~20 wavefronts of 128 bytes
// against ~12 cycles of dp4a and float work per warp, item and token), so at 1 row a warp they
// wait on shared memory. 2 gained most at 16 sequences; 3 gained a little more there but lost at
// 2 to 8 sequences, and 4 lost (128 registers). Each (row, token) sum keeps its terms and order:
// the same bits for any value.
#define MV_COLS_ROWS 2
#endif
#ifndef MV_COLS_ROWS_MANY
// matvec_cols_many_<kind> / matvec_cols_split_many_<kind>: the same with this many rows a warp,
// which the backend takes for a launch of two groups of tokens or more (blockIdx.x > 1: twice
// the blocks, so fewer rows a block still fill the GPU): where 3 rows gained (16 sequences), not
// where they lost (one group of 4).
#define MV_COLS_ROWS_MANY 3
#endif
#ifndef MV_COLS_ROW_ITERS
// matvec_cols_<kind> / matvec_cols_split_<kind>: rounds of rows a block takes (the backend's
// grid: blockIdx.y over units / (units per block x this); the kernels stride over the rest).
// Why more than 1 might pay: each block stages its tokens' activations (the 8B's down
// projection, K = 12288: 4 tokens, ~55 KB from L2) for the rows it then reads, so a block of few
// rows reads more staged bytes than weight bytes (split 2 halves a block's rows, and the batched
// step was slower with the down projection split). Each row's sums do not depend on which block
// takes it: the same bits for any value. Untimed: 1.
#define MV_COLS_ROW_ITERS 1
#endif

#ifndef MV_PRELOAD
// matvec_<kind> / matvec_split_<kind> with one row per warp, for kinds whose loads stand apart
// from their arithmetic (K::raw, K::load, K::dot_raw; Preloads<K>::depth items, MV_PRELOAD for
// Q4_K): each lane loads its first `depth` items of the row before PDL_ENTRY and the staging of
// the activations (weights only: inside a decode graph they are in flight while the previous
// kernel ends), and keeps `depth` items in flight after (each item's loads issued `depth` items
// before its arithmetic), where the plain loop waits for every item's loads before it issues
// the next item's. Why: the Q4_K mat-vec spent half its stalls waiting on memory latency, far
// below DRAM's throughput. The same terms in the same order as warp_dot_rows: the same floats.
// Deeper takes more registers than it saves latency (4: a smaller model slower), and so did
// Q6_K's preload (21 registers an item): Q6_K's rows are not preloaded (matvec_coop_q6_k takes
// them where it can). 0: the plain loop.
// With two rows a warp (MV_PRELOAD_ROWS, below) a depth of 1 a row keeps as many items in
// flight as 2 did with one.
#define MV_PRELOAD 1
#endif
// Q6_K's rows are not preloaded (above); the backend's unit_rows reads this 0.
#define MV_PRELOAD_Q6K 0
#ifndef MV_PRELOAD_ROWS
// matvec_<kind> / matvec_split_<kind> of the preloaded kinds (MV_PRELOAD): rows a warp (a split
// group) takes at once, each item of the staged activations read once for all of them (their
// weight loads in flight together). Why: the Q4_K mat-vec was bound by its L1 wavefronts, not
// DRAM: per 32 weight bytes a lane read ~88 bytes of staged activations. At 2 rows with a depth
// of 1 it gained on every Q4_K shape (at depth 2, twice the preloaded registers, it lost). Each
// row's items, lanes and order are the one-row kernel's: the same bits. The backend's units
// (unit_rows) follow it; a matrix of an odd row count reads its last row twice and drops one.
#define MV_PRELOAD_ROWS 2
#endif
static_assert(MV_PRELOAD_ROWS == 1 || MV_PRELOAD_ROWS == 2, "a unit's rows past its matrix: one row again");
#ifndef MV_MIN_BLOCKS
// matvec_<kind> / matvec_split_<kind>: resident blocks an SM asked of ptxas (__launch_bounds__'s
// second argument, a register cap: 4 blocks of MV_WARPS = 8 warps leave 64 registers a thread).
// Why it might pay: with two rows a warp matvec_split_q4_k takes 70 registers (NVRTC 13.5,
// sm_90; ci/kernel_resources.py), so 3 blocks fit an SM, and a 4096 x 12288 launch (512 blocks)
// then runs in two waves where 4 an SM would hold it in one. 0: no cap (untimed; the same
// arithmetic either way).
#define MV_MIN_BLOCKS 0
#endif
// (the preloaded kinds only: Q6_K's 48 registers would grow to the cap's 64, 5 blocks -> 4;
// 0 is __launch_bounds__'s "no minimum": the same registers as without it)
#define MV_BOUNDS(K) __launch_bounds__(MV_WARPS * WARP_SIZE, MvMinBlocks<K>::value)
// matvec_split_<kind>'s: its MV_SPLIT_WARPS, at the same register cap or a tighter one (the
// blocks scaled, rounded up: rounded down, 1 of 16 warps or 3 of 32 would lift the cap)
// (through MvSplitBounds: a template's comma inside __launch_bounds__ would split its arguments)
#define MV_SPLIT_BOUNDS(K) __launch_bounds__(MvSplitBounds<K>::threads, MvSplitBounds<K>::min_blocks)
template <class K> struct Preloads { static constexpr int depth = 0; };
template <class K> struct MvMinBlocks { static constexpr int value = Preloads<K>::depth > 0 ? MV_MIN_BLOCKS : 0; };
// The warps of a decode_rows block: matvec_split_<kind>'s (MV_SPLIT_WARPS, or _PLAIN for the
// kinds not preloaded), or matvec_<kind>'s and its forms' (MV_WARPS).
template <class K, int SPLIT> struct MvBlockWarps {
    static constexpr int value = SPLIT == 1 ? MV_WARPS : Preloads<K>::depth > 0 ? MV_SPLIT_WARPS : MV_SPLIT_WARPS_PLAIN;
};
template <class K> struct MvSplitBounds {
    static constexpr int warps = MvBlockWarps<K, MV_SPLIT>::value;
    static constexpr int threads = warps * WARP_SIZE;
    static constexpr int min_blocks = (MvMinBlocks<K>::value * MV_WARPS + warps - 1) / warps;
};

#ifndef MV_COOP_WARPS
// matvec_coop_<kind>: warps per block, a row each at a time. Why the kernel: matvec_q6_k's lanes
// each read their own item's 9 + 9 aligned words from global memory, and as the warp's 32 items
// lie in four 210-byte blocks, each such warp-wide load touches ~7 cache lines (~126 L1
// wavefronts a row): bound by L1, not DRAM (a small model's Q6_K output head ran at under half
// the copy rate). matvec_coop_ reads a row a chunk (the 32 items the lanes take next:
// K::chunk_words 8-byte words) at a time, lane l the words l + 32 k (coalesced: each line once),
// into its warp's buffer in shared memory, and each lane then runs K::load / K::dot_raw on its
// item there, loading the next chunk into registers meanwhile. The same items on the same lanes
// in the same order as matvec_<kind>, the same quants and floats: the same bits. Rows of whole
// chunks only (the backend's rule). 8: untimed.
#define MV_COOP_WARPS 8
#endif
#ifndef MV_COOP_ROWS
// matvec_coop_<kind>: rows a warp works on at once (1 or 2). With 2 the warp takes rows r and
// r + one grid step together, chunk by chunk: two chunks in flight and two independent sums, for
// the instruction-level parallelism a warp lacks at one row (the kernel stayed near half the
// copy rate whatever the resident warps or L2 prefetches ahead). Each row's items, lanes and
// order are the one-row kernel's: the same bits. Untimed: 1.
#define MV_COOP_ROWS 1
#endif

// Sum of the 32 int8 activations of a Q8_1 block (for the K-quants' min term).
__device__ __forceinline__ int q8_sum(const block_q8_1 * y) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(0x01010101, y->qs[i], s);
    return s;
}

// A Q8_1 block as the mat-vecs read it from shared memory (`Staged<K>` below): the 32 quants
// 16-byte aligned, so a lane reads them in two 128-bit loads, the scale and sum already
// converted from half, and the quants' integer sum (the K-quants' min term) counted once per
// block instead of once per weight row. From global memory a block_q8_1's quants are only
// 4-byte aligned: eight 32-bit loads per block, and as the lanes of a warp read different
// items, each load touches as many cache lines as there are lanes (L1 wavefronts, not DRAM,
// then bound the mat-vec).
// hsum: the integer sum of the first 16 quants (Q6_K's scales cover halves of a block: its dot
// takes the quants unsigned and 32 times each half's sum off after, q6k_math).
struct __align__(16) q8s { int4 q[2]; float d; float s; int isum; int hsum; };
static_assert(sizeof(q8s) == 48, "q8s");

// Accessors that read either form of a Q8_1 block with the same arithmetic afterwards.
__device__ __forceinline__ void act_qs(const block_q8_1 * y, int (&q)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = y->qs[i];
}
__device__ __forceinline__ void act_qs(const q8s * y, int (&q)[8]) {
    const int4 a = y->q[0], b = y->q[1];
    q[0] = a.x; q[1] = a.y; q[2] = a.z; q[3] = a.w; q[4] = b.x; q[5] = b.y; q[6] = b.z; q[7] = b.w;
}
__device__ __forceinline__ float act_d(const block_q8_1 * y) { return f16_to_f32(y->d); }
__device__ __forceinline__ float act_d(const q8s * y) { return y->d; }
__device__ __forceinline__ float act_s(const block_q8_1 * y) { return f16_to_f32(y->s); }
__device__ __forceinline__ float act_s(const q8s * y) { return y->s; }
__device__ __forceinline__ int act_sum(const block_q8_1 * y) { return q8_sum(y); }
__device__ __forceinline__ int act_sum(const q8s * y) { return y->isum; }

// A block's four factors, for the kinds that use several of them per block.
struct ActTail { float d; float s; int isum; int hsum; };
__device__ __forceinline__ ActTail act_tail(const block_q8_1 * y, int) {
    return {act_d(y), act_s(y), act_sum(y), 0};     // (what a caller leaves unused is not computed)
}
__device__ __forceinline__ ActTail act_tail(const q8s * y, int) {
    return {y->d, y->s, y->isum, y->hsum};
}

// The staged activations of one item (the blocks_per_item Q8_1 blocks it meets). A lane reads
// its item's quants as 128-bit words, eight lanes per shared-memory wavefront: at a stride of
// 48 bytes (12 banks) those eight land on distinct banks; two-block items are padded from 96
// to 112 bytes (28 banks) for the same reason (96 would put lanes 0 and 4 on the same banks).
template <int BPI> struct StagedItem { q8s b[BPI]; };
template <> struct StagedItem<2> { q8s b[2]; int4 pad; };
#define STAGED_BYTES_PER_Q8 56      // the largest sizeof(StagedItem<n>) / n (backend: Q8S_BYTES)

#ifndef MV_STAGE_BATCH
// stage_q8_1: blocks a thread loads before it converts and stores any of them (the blocks
// b, b + blockDim.x, ...). 1: one at a time, each load waited for before the next is issued.
// Why more: a long row's launch (K = 12288: 384 blocks, 256 threads) takes two rounds of L2
// latency per block of threads before its first weight is used. But the batch's registers cost
// the unsplit kernels more than it saves them: 1 here, 2 for the split kernels (below). The
// same values: the same bits.
#define MV_STAGE_BATCH 1
#endif

#ifndef MV_STAGE_BATCH_SPLIT
// MV_STAGE_BATCH for the split one-token mat-vecs alone (matvec_split_<kind>: rows of K >=
// MV_SPLIT_MIN_K, where a thread converts two or more rounds of blocks). Why apart: the batch of
// 2 took time off the split Q4_K kernel (3 lost) but its registers cost the unsplit ones
// (MV_STAGE_BATCH above); each kernel is its own instance, so the split ones can batch while the
// others do not. The same values: the same bits.
#define MV_STAGE_BATCH_SPLIT 2
#endif

// A Q8_1 block as the mat-vecs stage it, from its quants q and its first word ds (d, then s),
// every field from these registers (q8_sum over q is q8_sum over the block's quants): what
// stage_q8_1's batched form stores.
__device__ __forceinline__ q8s staged_q8s(const int (&q)[8], const u32 ds) {
    q8s o;
    o.q[0] = make_int4(q[0], q[1], q[2], q[3]);
    o.q[1] = make_int4(q[4], q[5], q[6], q[7]);
    o.d = f16_to_f32((u16) (ds & 0xFFFF));
    o.s = f16_to_f32((u16) (ds >> 16));
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) isum = __dp4a(0x01010101, q[i], isum);
    o.isum = isum;
    o.hsum = __dp4a(q[3], 0x01010101, __dp4a(q[2], 0x01010101, __dp4a(q[1], 0x01010101,
                                                                    __dp4a(q[0], 0x01010101, 0))));
    return o;
}

// Blocks x[0 .. n_q8) into shared memory as items of BPI blocks, one block per thread in turn
// (the whole block takes part; the caller synchronises before reading).
// NB: MV_STAGE_BATCH (or MV_STAGE_BATCH_SPLIT, the split kernels').
template <int BPI, int NB = MV_STAGE_BATCH>
__device__ __forceinline__ void stage_q8_1(const block_q8_1 * __restrict__ x, StagedItem<BPI> * __restrict__ s,
                                           const int n_q8) {
    if constexpr (NB > 1) {
    for (int b0 = threadIdx.x; b0 < n_q8; b0 += NB * blockDim.x) {
        int q[NB][8];
        u32 ds[NB];
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int b = b0 + k * blockDim.x;
            if (b < n_q8) {
                act_qs(x + b, q[k]);
                ds[k] = *(const u32 *) (x + b);      /* d, then s (block_q8_1's first 4 bytes) */
            }
        }
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int b = b0 + k * blockDim.x;
            if (b < n_q8) s[b / BPI].b[b % BPI] = staged_q8s(q[k], ds[k]);
        }
    }
    } else {
    for (int b = threadIdx.x; b < n_q8; b += blockDim.x) {
        const block_q8_1 * y = x + b;
        int q[8];
        act_qs(y, q);
        q8s o;
        o.q[0] = make_int4(q[0], q[1], q[2], q[3]);
        o.q[1] = make_int4(q[4], q[5], q[6], q[7]);
        o.d = f16_to_f32(y->d);
        o.s = act_s(y);
        o.isum = q8_sum(y);
        o.hsum = __dp4a(q[3], 0x01010101, __dp4a(q[2], 0x01010101, __dp4a(q[1], 0x01010101,
                                                                        __dp4a(q[0], 0x01010101, 0))));
        s[b / BPI].b[b % BPI] = o;
    }
    }
}

// A kind K read through its staged activations: K::sdot(row, item, blocks) gets the item's
// Q8_1 blocks from shared memory. Float kinds (can_stage false) are never staged.
template <class K>
struct Staged {
    static constexpr int blocks_per_item = K::values_per_item / QK8_1;
    typedef StagedItem<blocks_per_item> act;
    static constexpr int values_per_item = K::values_per_item;
    static __device__ __forceinline__ float dot(const u8 * __restrict__ row, const int i, const act * __restrict__ x) {
        return K::sdot(row, i, x->b);
    }
};

// Stages the n_rows rows of n_items items of x (consecutive) into smem and synchronises the
// block when K can be staged and the rows are short enough (a condition uniform over the
// block); returns the staged copy, or nullptr when x is read from global memory. The launch
// gives the shared memory (backend: _stage_bytes).
template <class K, int MAX_K = MV_STAGE_MAX_K, int NB = MV_STAGE_BATCH>
__device__ __forceinline__ const void * stage_act(const typename K::act * __restrict__ x, const int n_rows,
                                                  const int n_items, void * __restrict__ smem) {
    if constexpr (K::can_stage) {
        const int n_q8 = n_rows * n_items * Staged<K>::blocks_per_item;
        if (n_q8 * QK8_1 <= MAX_K) {
            stage_q8_1<Staged<K>::blocks_per_item, NB>((const block_q8_1 *) x, (typename Staged<K>::act *) smem, n_q8);
            __syncthreads();
            return smem;
        }
    }
    return nullptr;
}

// Row r of staged rows of n_items items (nullptr stays nullptr).
template <class K>
__device__ __forceinline__ const void * staged_row(const void * xs, const int r, const int n_items) {
    if constexpr (K::can_stage) {
        if (xs != nullptr) return (const typename Staged<K>::act *) xs + (i64) r * n_items;
    }
    return nullptr;
}

// acc[r] = row r (r < n_valid) of w0 (rows row_bytes apart) . x over the items first, first +
// step, ... (a lane's: first = lane, step = WARP_SIZE, or its share of a split row), summed
// over the warp; every lane ends with the warp's sums.
template <class K, int R>
__device__ __forceinline__ void warp_dot_rows(const u8 * __restrict__ w0, const i64 row_bytes, const int n_valid,
                                              const typename K::act * __restrict__ x, const int n_items,
                                              float (&acc)[R], const int first, const int step) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll MV_UNROLL
    for (int i = first; i < n_items; i += step) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < n_valid) acc[r] += K::dot(w0 + r * row_bytes, i, x + i);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

// warp_dot_rows of two matrices' rows (gate and up) in one loop: the loads of both in flight
// together, where two calls would wait for the first's sums (its shuffles) before the second's
// loads. Each sum takes its terms in the order warp_dot_rows takes them: the same floats.
template <class K, int R>
__device__ __forceinline__ void warp_dot_rows2(const u8 * __restrict__ wa, const u8 * __restrict__ wb,
                                               const i64 row_bytes, const int n_valid,
                                               const typename K::act * __restrict__ x, const int n_items,
                                               float (&a)[R], float (&b)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) a[r] = b[r] = 0.0f;
#pragma unroll MV_UNROLL
    for (int i = threadIdx.x % WARP_SIZE; i < n_items; i += WARP_SIZE) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < n_valid) {
                a[r] += K::dot(wa + r * row_bytes, i, x + i);
                b[r] += K::dot(wb + r * row_bytes, i, x + i);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        a[r] = warp_sum(a[r]);
        b[r] = warp_sum(b[r]);
    }
}

// warp_dot_rows2 on the staged activations xs when there are.
template <class K, int R>
__device__ __forceinline__ void rows_dot2(const u8 * __restrict__ wa, const u8 * __restrict__ wb, const i64 row_bytes,
                                          const int n_valid, const typename K::act * __restrict__ x,
                                          const void * __restrict__ xs, const int n_items, float (&a)[R],
                                          float (&b)[R]) {
    if constexpr (K::can_stage) {
        if (xs != nullptr) {
            warp_dot_rows2<Staged<K>, R>(wa, wb, row_bytes, n_valid, (const typename Staged<K>::act *) xs,
                                         n_items, a, b);
            return;
        }
    }
    warp_dot_rows2<K, R>(wa, wb, row_bytes, n_valid, x, n_items, a, b);
}

// warp_dot_rows on the staged activations xs when there are (xs: the row's staged items;
// x + i and xs + i are the same item's activations).
template <class K, int R>
__device__ __forceinline__ void rows_dot(const u8 * __restrict__ w0, const i64 row_bytes, const int n_valid,
                                         const typename K::act * __restrict__ x, const void * __restrict__ xs,
                                         const int n_items, float (&acc)[R],
                                         const int first = threadIdx.x % WARP_SIZE, const int step = WARP_SIZE) {
    if constexpr (K::can_stage) {
        if (xs != nullptr) {
            warp_dot_rows<Staged<K>, R>(w0, row_bytes, n_valid, (const typename Staged<K>::act *) xs, n_items, acc,
                                        first, step);
            return;
        }
    }
    warp_dot_rows<K, R>(w0, row_bytes, n_valid, x, n_items, acc, first, step);
}

// acc[r * C + c] = w[r] . x_c for R rows (w[r]: a row's weights, any matrix; a caller with
// fewer rows passes a real row again and drops its sums: a branch per row would keep the
// compiler from reading each item once) and the n_cols tokens c (rows of x n_items apart),
// summed over the warp, with each token's item read once for all rows. Token c's sum takes the
// same terms in the same order as warp_dot_rows for that token alone (the lane's items, then the
// shuffle tree), so it is the same float: a sequence's results do not depend on the batch.
template <class K, int R, int C>
__device__ __forceinline__ void warp_dot_cols_rows(const u8 * const (&w)[R],
                                                   const typename K::act * __restrict__ x, const int n_cols,
                                                   const int n_items, float (&acc)[R * C], const int first,
                                                   const int step) {
#pragma unroll
    for (int j = 0; j < R * C; ++j) acc[j] = 0.0f;
    for (int i = first; i < n_items; i += step) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const typename K::act * xc = x + (i64) min(c, n_cols - 1) * n_items + i;
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r * C + c] += K::dot(w[r], i, xc);
        }
    }
#pragma unroll
    for (int j = 0; j < R * C; ++j) acc[j] = warp_sum(acc[j]);
}

// warp_dot_cols_rows on the staged activations xs when there are.
template <class K, int R, int C>
__device__ __forceinline__ void cols_dot_rows(const u8 * const (&w)[R], const typename K::act * __restrict__ x, const void * __restrict__ xs,
                                              const int n_cols, const int n_items, float (&acc)[R * C],
                                              const int first = threadIdx.x % WARP_SIZE,
                                              const int step = WARP_SIZE) {
    if constexpr (K::can_stage) {
        if (xs != nullptr) {
            warp_dot_cols_rows<Staged<K>, R, C>(w, (const typename Staged<K>::act *) xs, n_cols, n_items, acc,
                                                first, step);
            return;
        }
    }
    warp_dot_cols_rows<K, R, C>(w, x, n_cols, n_items, acc, first, step);
}

// The old block-per-row skeleton, kept for prefill tiles and mul_mat_id: one weight row per
// thread block, items strided over MATVEC_THREADS threads, partial sums through shared memory.
template <class K, int NCOLS>
__device__ __forceinline__ void matvec_rows(const u8 * __restrict__ w_row, const typename K::act * __restrict__ x,
                                            float * __restrict__ y, const int n_items, const int ncols,
                                            const i64 x_stride, const i64 y_stride) {
    float acc[NCOLS];
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) acc[j] = 0.0f;
    for (int i = threadIdx.x; i < n_items; i += MATVEC_THREADS) {
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            if (j < ncols) acc[j] += K::dot(w_row, i, x + j * x_stride + i);
        }
    }
    __shared__ float partial[MATVEC_THREADS / WARP_SIZE][NCOLS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0) partial[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x < ncols) {
        float out = 0.0f;
#pragma unroll
        for (int w = 0; w < MATVEC_THREADS / WARP_SIZE; ++w) out += partial[w][threadIdx.x];
        y[threadIdx.x * y_stride] = out;
    }
}

// The decode mat-vecs prefetch a warp's first weight rows into L2 before PDL_ENTRY, for launches
// of at most this many weight bytes. Inside a decode graph the prefetch lets a small matrix
// stream in while the previous kernel ends; on large ones (whose later blocks prefetch just
// before their own loads) it only doubles the L2 requests, and Qwen3-8B's shape decoded slower
// with it on every mat-vec.
#ifndef MV_PREFETCH_MAX_BYTES
#define MV_PREFETCH_MAX_BYTES (8ll << 20)
#endif

// Matrix unit u of a matvec_ / matvec_cols_ launch (matrices 0, 1, 2 one after another, units
// of `rows` rows): its weights, output, row count and row bytes; u becomes the unit's index
// within its matrix.
struct MatVecUnit { const u8 * w; float * y; int n; i64 rb; };
__device__ __forceinline__ MatVecUnit unit_matrix(int & u, const int rows, const u8 * w0, const u8 * w1,
                                                  const u8 * w2, float * y0, float * y1, float * y2,
                                                  const MultiMatVecParams & p) {
    const int u0 = (p.n_rows0 + rows - 1) / rows, u1 = (p.n_rows1 + rows - 1) / rows;
    if (u < u0) return {w0, y0, p.n_rows0, p.row_bytes0};
    if ((u -= u0) < u1) return {w1, y1, p.n_rows1, p.row_bytes1};
    u -= u1;
    return {w2, y2, p.n_rows2, p.row_bytes2};
}

// Output element (token t, row r) of a unit's matrix.
__device__ __forceinline__ float & y_row(const MatVecUnit & m, const int t, const int r) {
    return m.y[(i64) t * m.n + r];
}

// SPLIT > 1: the warp sums acc[N] of a group's SPLIT warps (warp = g * SPLIT + s) added
// into warp s = 0's, in the order s = 0, 1, ..., through part[warps of the block][N]. Every thread of the
// block calls it (two barriers); `valid`: the group has a unit this round.
template <int N, int SPLIT>
__device__ __forceinline__ void split_sum(float (&acc)[N], float (*part)[N], const int warp, const int s,
                                          const bool valid) {
    if (valid && threadIdx.x % WARP_SIZE == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) part[warp][i] = acc[i];
    }
    __syncthreads();
    if (valid && s == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i)
            for (int j = 1; j < SPLIT; ++j) acc[i] += part[warp + j][i];
    }
    __syncthreads();    // part is written again next round
}

// L2 prefetch of `rows` weight rows from row `row` of matrix unit u of a matvec_ / matvec_cols_
// launch (matrices 0, 1, 2 one after another, units of `rows` rows): the bytes a warp reads
// first. Weights only, so it may run before PDL_ENTRY (common.cuh).
__device__ __forceinline__ void prefetch_unit(const u8 * w0, const u8 * w1, const u8 * w2,
                                              const MultiMatVecParams & p, int u, const int rows) {
    const int u0 = (p.n_rows0 + rows - 1) / rows, u1 = (p.n_rows1 + rows - 1) / rows;
    const int u2 = (p.n_rows2 + rows - 1) / rows;
    if (u >= u0 + u1 + u2 || (long long) p.n_rows0 * p.row_bytes0 + (long long) p.n_rows1 * p.row_bytes1
                             + (long long) p.n_rows2 * p.row_bytes2 > MV_PREFETCH_MAX_BYTES) return;
    const MatVecUnit m = unit_matrix(u, rows, w0, w1, w2, nullptr, nullptr, nullptr, p);
    const int row = u * rows;
    prefetch_l2_span(m.w + row * m.rb, (long long) min(rows, m.n - row) * m.rb);
}

// The Q8_1 blocks of one item, whatever form the activations have (a block, a pair of blocks,
// a staged item).
__device__ __forceinline__ const block_q8_1 * item_blocks(const block_q8_1 * y) { return y; }
template <int B> __device__ __forceinline__ const q8s * item_blocks(const StagedItem<B> * y) { return y->b; }

// The kernels' bodies by family, then the kernels of a weight kind (DEFINE_MATVEC) from them.
#include "matvec_decode.cuh"
#include "matvec_cols.cuh"
#include "matvec_glu.cuh"

#define DEFINE_MATVEC(name, K)                                                                     \
constexpr int matvec_split_##name##_warps = MvSplitBounds<K>::warps;  /* (the CPU harness) */     \
extern "C" __global__ void MV_BOUNDS(K)                                                            \
matvec_##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1, const u8 * __restrict__ w2,  \
    const K::act * __restrict__ x, float * __restrict__ y0, float * __restrict__ y1,               \
    float * __restrict__ y2, const MultiMatVecParams p) {                                          \
    PreloadBuf<K> pb;                                                                              \
    prefetch_unit(w0, w1, w2, p, blockIdx.x * MV_WARPS + threadIdx.x / WARP_SIZE, unit_rows<K>()); \
    decode_preload<K, 1>(w0, w1, w2, p, blockIdx.x, pb);                                           \
    PDL_ENTRY();                                                                                   \
    decode_rows<K, 1>(w0, w1, w2, x, y0, y1, y2, p, blockIdx.x, gridDim.x, pb);                    \
}                                                                                                  \
extern "C" __global__ void MV_SPLIT_BOUNDS(K)                                                      \
matvec_split_##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1, const u8 * __restrict__ w2, \
    const K::act * __restrict__ x, float * __restrict__ y0, float * __restrict__ y1,               \
    float * __restrict__ y2, const MultiMatVecParams p) {                                          \
    PreloadBuf<K> pb;                                                                              \
    if (threadIdx.x / WARP_SIZE % MV_SPLIT == 0)   /* the first warp of each group */              \
        prefetch_unit(w0, w1, w2, p, blockIdx.x * (MvSplitBounds<K>::warps / MV_SPLIT)              \
                      + threadIdx.x / WARP_SIZE / MV_SPLIT,                                        \
                      unit_rows<K>());                                                             \
    decode_preload<K, MV_SPLIT>(w0, w1, w2, p, blockIdx.x, pb);                                    \
    PDL_ENTRY();                                                                                   \
    decode_rows<K, MV_SPLIT>(w0, w1, w2, x, y0, y1, y2, p, blockIdx.x, gridDim.x, pb);             \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(GLU_WARPS * WARP_SIZE)                                \
matvec_glu_##name(const u8 * __restrict__ wg, const u8 * __restrict__ wu, const K::act * __restrict__ x, \
                  const int * __restrict__ ids, float * __restrict__ h, block_q8_1 * __restrict__ hq, \
                  const GluMatVecParams p) {                                                       \
    glu_prefetch<GLU_WARPS, GLU_ROWS>(wg, wu, p);                                                  \
    PDL_ENTRY();                                                                                   \
    glu_rows<K, GLU_WARPS, GLU_ROWS, false>(wg, wu, x, ids, h, hq, p);                        \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(GLU_WIDE_WARPS * WARP_SIZE)                           \
matvec_glu_wide_##name(const u8 * __restrict__ wg, const u8 * __restrict__ wu,                     \
                       const K::act * __restrict__ x, const int * __restrict__ ids,                \
                       float * __restrict__ h, block_q8_1 * __restrict__ hq, const GluMatVecParams p) { \
    glu_prefetch<GLU_WIDE_WARPS, 32 / GLU_WIDE_WARPS>(wg, wu, p);                                  \
    PDL_ENTRY();                                                                                   \
    glu_rows<K, GLU_WIDE_WARPS, 32 / GLU_WIDE_WARPS, true>(wg, wu, x, ids, h, hq, p);              \
}                                                                                                  \
DEFINE_MATVEC_COLS(name, K, , MV_COLS_ROWS)                                                       \
DEFINE_MATVEC_COLS(name, K, many_, MV_COLS_ROWS_MANY)                                              \
extern "C" __global__ void __launch_bounds__(GLU_WARPS * WARP_SIZE)                                \
matvec_glu_cols_##name(const u8 * __restrict__ wg, const u8 * __restrict__ wu,                     \
                       const K::act * __restrict__ x, float * __restrict__ h,                      \
                       block_q8_1 * __restrict__ hq, const GluMatVecParams p) {                    \
    if (2ll * p.n_rows * p.row_bytes <= MV_PREFETCH_MAX_BYTES) {                    \
        const int r0 = blockIdx.y * (GLU_WARPS * GLU_ROWS) + threadIdx.x / WARP_SIZE * GLU_ROWS;   \
        const long long nb = (long long) max(0, min(GLU_ROWS, p.n_rows - r0)) * p.row_bytes;       \
        prefetch_l2_span(wg + r0 * p.row_bytes, nb);                                               \
        prefetch_l2_span(wu + r0 * p.row_bytes, nb);                                               \
    }                                                                                              \
    PDL_ENTRY();                                                                                   \
    /* matvec_glu_ (no experts) for the tokens t0 .. t0 + n_cols (blockIdx.x); a block takes   */  \
    /* 32 rows (blockIdx.y) = one Q8_1 block of each token's h, warp w its rows w*4 .. w*4+3.  */  \
    __shared__ float hs[MV_COLS][GLU_WARPS * GLU_ROWS];                                            \
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;                      \
    const int t0 = blockIdx.x * p.cols, n_cols = min(p.cols, p.n_tokens - t0);                     \
    const int row0 = blockIdx.y * (GLU_WARPS * GLU_ROWS);                                          \
    const int n_items = p.k / K::values_per_item;                                                  \
    const K::act * xr = x + (i64) t0 * n_items;                                                    \
    extern __shared__ int4 staged_x[];                                                             \
    const void * xs = stage_act<K, MV_COLS_STAGE_MAX_K>(xr, n_cols, n_items, staged_x);            \
    for (int r = 0; r < GLU_ROWS; ++r) {                                                           \
        const int row = row0 + warp * GLU_ROWS + r;                                                \
        float g[MV_COLS], up[MV_COLS];                                                             \
        if (row < p.n_rows) {           /* gate and up of the row in one pass over the tokens */   \
            const u8 * w[2] = {wg + row * p.row_bytes, wu + row * p.row_bytes};                    \
            float gu[2 * MV_COLS];                                                                 \
            cols_dot_rows<K, 2, MV_COLS>(w, xr, xs, n_cols, n_items, gu);                          \
            _Pragma("unroll")                                                                      \
            for (int c = 0; c < MV_COLS; ++c) { g[c] = gu[c]; up[c] = gu[MV_COLS + c]; }           \
        } else {                                                                                   \
            _Pragma("unroll")                                                                      \
            for (int c = 0; c < MV_COLS; ++c) g[c] = up[c] = 0.0f;                                 \
        }                                                                                          \
        if (lane == 0) {                                                                           \
            _Pragma("unroll")                                                                      \
            for (int c = 0; c < MV_COLS; ++c)                                                      \
                if (c < n_cols) hs[c][warp * GLU_ROWS + r] = glu_value(p.gelu, g[c], up[c]);       \
        }                                                                                          \
    }                                                                                              \
    __syncthreads();                                                                               \
    for (int c = warp; c < n_cols; c += GLU_WARPS) {                                               \
        const float v = hs[c][lane];                                                               \
        const i64 t = t0 + c;                                                                      \
        if (row0 + lane < p.n_rows) h[t * p.n_rows + row0 + lane] = v;                             \
        if (p.write_q8) quantize_warp_q8_1(v, hq + t * (p.n_rows / QK8_1) + blockIdx.y);           \
    }                                                                                              \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(DOWN_WARPS * WARP_SIZE)                               \
matvec_moe_down_##name(const u8 * __restrict__ w, const K::act * __restrict__ x,                   \
                       const int * __restrict__ ids, const float * __restrict__ wts,               \
                       const float * __restrict__ scales, float * __restrict__ out,                \
                       const MoeDownParams p) {                                                    \
    PDL_ENTRY();                                                                                   \
    /* A block takes DOWN_ROWS output rows for every chosen expert: warp w the experts        */  \
    /* j = w, w + DOWN_WARPS, ... (all their loads in flight together, instead of one expert  */  \
    /* after another), then the weighted products are added in j order, as before.            */  \
    __shared__ float part[MOE_MAX_USED][DOWN_ROWS];                                                \
    const int t = blockIdx.y, warp = threadIdx.x / WARP_SIZE;                                      \
    const int row = blockIdx.x * DOWN_ROWS;                                                        \
    const int n_items = p.k / K::values_per_item;                                                  \
    extern __shared__ int4 staged_x[];                                                             \
    /* the token's n_used rows of x are contiguous: staged together */                            \
    const void * xs = stage_act<K>(x + (i64) t * p.n_used * n_items, p.n_used, n_items, staged_x); \
    for (int j = warp; j < p.n_used; j += DOWN_WARPS) {                                            \
        const int slot = t * p.n_used + j, e = ids[slot];                                          \
        const bool valid = e >= 0 && e < p.n_experts;                                              \
        float acc[DOWN_ROWS];                                                                      \
        rows_dot<K, DOWN_ROWS>(w + (i64) (valid ? e : 0) * p.expert_bytes + row * p.row_bytes,     \
                               p.row_bytes, p.n_rows - row, x + (i64) slot * n_items,              \
                               staged_row<K>(xs, j, n_items), n_items, acc);                       \
        /* with has_scale, y * s[e] before the routing weight (mul_expert_scale, then the sum) */  \
        const float wj = wts[slot], sj = p.has_scale && valid ? scales[e] : 1.0f;                  \
        if (threadIdx.x % WARP_SIZE == 0) {                                                        \
            _Pragma("unroll")                                                                      \
            for (int r = 0; r < DOWN_ROWS; ++r)                                                    \
                part[j][r] = valid ? __fmul_rn(p.has_scale ? __fmul_rn(acc[r], sj) : acc[r], wj) : NAN_F32; \
        }                                                                                          \
    }                                                                                              \
    __syncthreads();                                                                               \
    if (threadIdx.x < DOWN_ROWS && row + threadIdx.x < p.n_rows) {                                 \
        float sum = part[0][threadIdx.x];                                                          \
        for (int j = 1; j < p.n_used; ++j) sum = __fadd_rn(sum, part[j][threadIdx.x]);             \
        out[(i64) t * p.n_rows + row + threadIdx.x] = sum;                                         \
    }                                                                                              \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                       \
matmul_##name(const u8 * __restrict__ w, const K::act * __restrict__ x, float * __restrict__ y,    \
              const MatVecParams p) {                                                              \
    PDL_ENTRY();                                                                                   \
    const int row = blockIdx.x, t0 = blockIdx.y * MATMUL_TILE, n_items = p.k / K::values_per_item; \
    matvec_rows<K, MATMUL_TILE>(w + row * p.row_bytes, x + (i64) t0 * n_items,                     \
                                y + (i64) t0 * p.n_rows + row, n_items,                            \
                                min(MATMUL_TILE, p.n_tokens - t0), n_items, p.n_rows);             \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                       \
matvec_id_##name(const u8 * __restrict__ w, const K::act * __restrict__ x,                         \
                 const int * __restrict__ ids, float * __restrict__ y, const MatVecParams p) {     \
    PDL_ENTRY();                                                                                   \
    const int row = blockIdx.x, slot = blockIdx.y, n_items = p.k / K::values_per_item;             \
    const int x_row = p.x_per_slot ? slot : slot / p.n_used;                                       \
    const int expert = ids[slot];                                                                  \
    if (expert < 0 || expert >= p.n_experts) {                                                     \
        if (threadIdx.x == 0) y[(i64) slot * p.n_rows + row] = NAN_F32;                            \
        return;                                                                                    \
    }                                                                                              \
    matvec_rows<K, 1>(w + expert * p.expert_bytes + row * p.row_bytes,                             \
                      x + (i64) x_row * n_items, y + (i64) slot * p.n_rows + row,                  \
                      n_items, 1, 0, 0);                                                           \
}
