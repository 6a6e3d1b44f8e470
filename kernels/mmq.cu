// A prompt's mat-mul on int8 tensor cores against Q8_1 activations (llama.cpp's MMQ,
// ggml-cuda/mmq.cuh): y [T, N] = x [T, K] . W^T, with x already quantized to Q8_1 blocks
// ([T, K/32] block_q8_1, the quantize_q8_1 kernel's output) and W in its ggml blocks.
//
// A thread block takes MMQ_ROWS weight rows x MMQ_COLS tokens. K is walked in chunks of 256
// values (8 blocks of 32: one K-quant super-block): every row's chunk is unpacked to int8
// quants in shared memory with its per-32-block scale factors, every token's chunk of Q8_1
// blocks copied beside it. Each warp then forms, per block of 32, the int32 dot products of
// its 32 rows x 32 tokens with `mma.sync.m16n8k32.s8.s8.s32` (Q6_K: two m16n8k16, one per
// 16-value half, which has its own scale) and scales them in float32 exactly as the mat-vec's
// dot_item<TYPE> does (kernels/matvec_q.cuh), adding block after block in K order. So against
// the decode mat-vec only the order of the float32 sum over the K/32 blocks differs (the
// mat-vec strides them over lanes and sums by shuffles); the integer products are the same.
//
// Quants are unpacked with the mat-vec's own bit arithmetic: Q4_0 / Q5_0 stay unsigned
// (0..15 / 0..31, the -8d / -16d constant taken against the activation block's half sum s),
// Q4_K / Q5_K keep their min against the integer sum of the activation quants, Q6_K is signed
// (q - 32), MXFP4 is the doubled E2M1 value.
//
// Launch: grid (ceil(N / MMQ_ROWS), ceil(T / MMQ_COLS)), MMQ_THREADS threads, static shared
// memory only (under 48 KiB). Rows past N and tokens past T read row N-1 / token T-1 (valid
// memory) and are not written. Needs sm_80 (int8 m16n8k32 mma).
#include "matvec_q.cuh"

// (each #ifndef: ci/gpu_tune_mmq.py compiles variants; the backend reads these defaults)
#ifndef MMQ_ROWS
#define MMQ_ROWS 64          // weight rows per block (2 warps x 32)
#endif
#ifndef MMQ_COLS
#define MMQ_COLS 64          // tokens per block (2 warps x 32)
#endif
#ifndef MMQ_THREADS
#define MMQ_THREADS 128      // 4 warps: 2 over rows x 2 over tokens
#endif
#define MMQ_WARPS_R (MMQ_ROWS / 32)     // warps over the tile's rows (each 32 rows x 32 tokens)
static_assert(MMQ_ROWS % 32 == 0 && MMQ_COLS % 32 == 0 && MMQ_THREADS == MMQ_ROWS * MMQ_COLS / 32,
              "mmq: a warp per 32 rows x 32 tokens of the tile");
#ifndef MMQ_KB
#define MMQ_KB 8             // blocks of 32 per K chunk (256 values)
#endif
#ifndef MMQ_MIN_BLOCKS
#define MMQ_MIN_BLOCKS 5     // resident blocks per SM asked of ptxas (__launch_bounds__): a register cap
#endif
#if MMQ_MIN_BLOCKS > 1
#define MMQ_BOUNDS __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS)
#else
#define MMQ_BOUNDS __launch_bounds__(MMQ_THREADS)   // (a minimum of 1 given changes ptxas's choices: 103 -> 109 registers)
#endif
#ifndef MMQ_PREFETCH
#define MMQ_PREFETCH 0       // 1: while a chunk is multiplied, ask L2 for the next chunk's weight bytes
#endif
#ifndef MMQ_PACKED
#define MMQ_PACKED 0         // 1: mmq_tile_packed (fewer, wider shared-memory loads; below)
#endif
#ifndef MMQ_ROWS_FAST
// 1: the unpack gives a tile's rows (and tokens) to adjacent threads, one block of 32 of each,
// and stores a block's 8 words as two 128-bit stores. ncu on mmq_id_q4_k (H200, the 30B-A3B
// shape, 2026-12-03) found its shared stores 9-way bank conflicted (73 % of their wavefronts,
// 39 % of all shared wavefronts): with a row's blocks on adjacent threads the factor stores
// ([block][row]: 8 blocks 128 words apart) all hit one bank. Rows adjacent, a quarter warp's
// 8 rows x 4 words at the 68-word stride cover the 32 banks once, and so do the factors.
// Off: 1.43x slower on the H200 (ci/gpu_tune_mmq.py, 2026-12-03: a layer 2,632 us against
// 1,839, the dense 12288 x 4096 1,385 against 526; the same bits): with a row per thread the
// unpack's global loads of a warp touch 32 rows' sectors instead of 4 rows' consecutive blocks,
// which costs more than the conflicts it removes.
#define MMQ_ROWS_FAST 0
#endif
#ifndef MMQ_VEC_LOADS
// 1: a Q4_K (row, block) unpacked from wide loads: its 32 quant bytes as two 16-byte words, d,
// dmin and the 12 scale bytes as one (the mat-vec's q4k_pair_load), where
// k45_quants reads eight 32-bit words, two halves and four scale bytes one by one; a Q6_K one
// from eighteen aligned words (q6k_load) instead of 32 halves. ncu on
// mmq_id_q4_k (2026-12-03): L1/TEX throughput 79 % (the limit), its global loads using 4.1 of
// each sector's 32 bytes. The same values, so the same bits. On the H200 (ci/gpu_tune_mmq.py,
// 2026-12-03, the 30B-A3B shape): gate 594 -> 557 us, down 672 -> 646, a layer 1,861 -> 1,760
// (5.4 %), the dense 12288 x 4096 523 -> 486, every output the default's bits.
#define MMQ_VEC_LOADS 1
#endif
#ifndef MMQ_BANKS
// 1: mmq_tile's shared stores without bank conflicts, and only the factors TYPE reads stored.
// With a row's (or token's) blocks on adjacent threads (for the global loads' sake, see
// MMQ_ROWS_FAST), a quarter warp's 128-bit store of a block's quant words (nvcc merges the
// eight 32-bit stores into two) puts blocks kb and kb + 4 on the same banks (2-way), and the
// factors ([block][row]: the 8 blocks a multiple of 32 words apart) land 8 lanes to a bank
// (8-way): 40 wavefronts per 32 (row, block) items where 10 or 11 do (ci/mmq_banks.py's model:
// 32 banks of 4 bytes, a 64-bit access in two half-warp phases, 128-bit in four; it puts 72.5 %
// of the default's store wavefronts in conflicts, where ncu (2026-12-03, mmq_id_q4_k) counted
// 73 %, and 39 % of all its shared wavefronts, L1/TEX being the kernel's limit). Here: blocks
// 4..7 of a row write their high half first, so that each 128-bit store's quarter warp (one
// row's 8 blocks, 8 words apart) covers the 32 banks once; the factor rows are padded by
// 32 / MMQ_KB words (float2: 16 / MMQ_KB), so that block kb's rows start kb * 4 banks on.
// The layout the mma loop reads is the same, and so are the values: the same bits.
#define MMQ_BANKS 1
#endif
#ifndef MMQ_X_RAW
// 1: the activation tile staged as the Q8_1 blocks' own bytes, copied by consecutive threads
// from consecutive words (a token's chunk is 9 * MMQ_KB contiguous words; 16-byte loads when
// aligned). mmq_tile's default gives a thread one (token, block) item and reads its 8 quant
// words (32-bit loads) and two halves (16-bit) with lanes 36 bytes apart: each load of a warp
// touches ~11 lines of 128 bytes (4 tokens x 288 bytes) for the 128 bytes it uses, ten such
// loads per item: 1,792 lines a chunk of a 64-token tile where these copies touch 216
// (ci/mmq_banks.py), the most L1 wavefronts of any of the tile's accesses by that model (ncu
// found the unpack's global loads using 4.1 of each sector's 32 bytes, L1/TEX the tile's
// limit). The mma loop then takes the B fragments from the raw
// blocks (token rows of MMQ_XSTRIDE words: 8 tokens x 4 words a fragment load on 32 banks),
// d8 (and s) as the block's first word, and the K-quants' integer sum of a block's 32
// activation quants from one more mma against a fragment of ones (the same integer the
// default's __dp4a sum gives). The same values: the same bits.
#define MMQ_X_RAW 1
#endif
#ifndef MMQ_SKIP_PAD
// 1: a tile's columns past its last valid token (an expert's tile holds ~32 of 64 slots on
// the 30B-A3B prompt: 4096 slots over 128 experts) are neither staged nor multiplied: warps
// whose 32 columns are all past it skip the mma loop (their outputs are never written); the
// columns of a warp that holds a valid one are multiplied as before (stale values where
// nothing was staged; never written either). Columns are independent: the same bits.
#define MMQ_SKIP_PAD 1
#endif
#ifndef MMQ_UNPACK_UNROLL
// Items of the weight unpack (a thread's (row, block) pairs of a chunk: 4 of them at 64 rows x
// 8 blocks over 128 threads) whose loads are in flight together. The unpack loop runs item
// after item: its SASS (ptxas 13.0 on NVRTC's PTX, nvdisasm) issues an item's three 16-byte
// loads, waits for them, unpacks and stores, then loops, so each item waits out the latency of
// L2 or DRAM alone; ncu on the default of 2026-12-03 found mmq_id_q4_k no longer bound by L1
// (33.8 %) but issuing once in 8 cycles at 24 % occupancy. N > 1: N items' loads (Q4_K and
// Q6_K: mmq_load, into registers: 12 and 20 words an item) before their unpacks (ptxas does not
// hoist an item's loads above the previous item's branches and stores by itself; unrolling
// alone left them apart). The same values in the same places: the same bits.
#define MMQ_UNPACK_UNROLL 1
#endif
#ifndef MMQ_X_ASYNC
// 1 (with MMQ_X_RAW): the activation tile's 16-byte copies as cp.async (global to shared, no
// register held), issued before the weight unpack and waited for after it, so that their
// latency passes under the weights' instead of after it. Without it the SASS of the copy loop
// (unrolled by 4) still waits for each 16-byte load before its store and the next load: nine
// round trips a chunk for a 64-token tile. The same bytes: the same bits.
#define MMQ_X_ASYNC 0
#endif
// words per token row of the raw activation tile: 9 * MMQ_KB, rounded up to 4 mod 8 (16-byte
// rows; 8 rows' 4 consecutive words land on the 32 banks)
#define MMQ_XSTRIDE ((9 * MMQ_KB + 3) / 8 * 8 + 4)
#if MMQ_BANKS && !MMQ_ROWS_FAST
#define MMQ_IPAD (32 / MMQ_KB)        // words after each block's row of 32-bit factors
#define MMQ_FPAD (16 / MMQ_KB)        // float2s after each block's row of (a, b)
#else
#define MMQ_IPAD 0
#define MMQ_FPAD 0
#endif
#define MMQ_STRIDE (MMQ_KB * 8 + 4)   // ints per row of quants in shared memory: +4 so that the
                                      // 8 rows x 4 ints of a fragment load land on 32 banks
#define MMQ_PSTRIDE (MMQ_KB * 8 + 8)  // mmq_tile_packed's: +8, so that 4 rows x 8 ints of its
                                      // 64-bit fragment loads (a half warp) land on 32 banks

// Per (row, block of 32): the unpacked quants as 8 ints (4 per int) such that the mat-vec's
// sum is sum_i __dp4a(q[i], yq[i]); a, b: the block's float factors; sc: Q6_K's two int8
// scales (low byte: values 0..15, next: 16..31).
struct MmqWeightBlock { int q[8]; float a; float b; int sc; };

// Which per-block factors mmq_block_value<TYPE> reads (with MMQ_BANKS the others are neither
// stored nor given shared memory): Q6_K's scales, the activation half sum s, the quants' sum.
template <int TYPE> constexpr bool mmq_reads_sc = !MMQ_BANKS || TYPE == Q6_K;
template <int TYPE> constexpr bool mmq_reads_s8 = !MMQ_BANKS || TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q4_1 || TYPE == Q5_1;
template <int TYPE> constexpr bool mmq_reads_isum = !MMQ_BANKS || TYPE == Q4_K || TYPE == Q5_K;

// MMQ_VEC_LOADS's Q4_K and Q6_K items as loads and a decoding of what they loaded, apart, so
// that MMQ_UNPACK_UNROLL can issue several items' loads before decoding any.
// Q4_K: rows of whole 144-byte blocks (16-byte aligned), so qs (at byte 16) and its pairs' 32
// bytes are 16-byte aligned; h: d, dmin and the 12 scale bytes.
struct MmqRawQ4K { int4 lo, hi, h; };

__device__ __forceinline__ void mmq_load_q4k_quants(const u8 * __restrict__ row, const int ib, MmqRawQ4K & r) {
    const int4 * q4 = (const int4 *) (((const block_q4_K *) row + ib / 8)->qs + 32 * ((ib % 8) / 2));
    r.lo = q4[0];
    r.hi = q4[1];
}

__device__ __forceinline__ void mmq_load_q4k_header(const u8 * __restrict__ row, const int ib, MmqRawQ4K & r) {
    r.h = *(const int4 *) ((const block_q4_K *) row + ib / 8);
}

__device__ __forceinline__ void mmq_decode_q4k_quants(const MmqRawQ4K & r, const int ib, int (&q)[8]) {
    const int v[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
    const int shift = 4 * ((ib % 8) % 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (v[i] >> shift) & 0x0F0F0F0F;
}

__device__ __forceinline__ void mmq_decode_q4k_scales(const MmqRawQ4K & r, const int ib, int & sc, int & m,
                                                      float & d, float & dmin) {
    const int s = ib % 8;
    const u32 dm = (u32) r.h.x, w0 = (u32) r.h.y, w1 = (u32) r.h.z, w2 = (u32) r.h.w;
    q4k_scale_min(w0, w1, w2, s, sc, m);        // scale_min_k4's bytes, taken from the three words
    d = f16_to_f32((u16) (dm & 0xFFFF));
    dmin = f16_to_f32((u16) (dm >> 16));
}

// Q6_K: nine aligned words under each of ql and qh (the mat-vec's q6k_load), funnel-shifted
// into place, where q6k_quants reads sixteen 2-aligned words as 32 halves
__device__ __forceinline__ void mmq_decode_q6k(const Q6KRaw & r, const int ib, MmqWeightBlock & o) {
    const int lshift = 4 * ((ib % 4) / 2), hshift = 2 * (ib % 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int vl = ((int) __funnelshift_r(r.wl[i], r.wl[i + 1], r.shift) >> lshift) & 0x0F0F0F0F;
        const int vh = (((int) __funnelshift_r(r.wh[i], r.wh[i + 1], r.shift) >> hshift) & 0x03030303) << 4;
        o.q[i] = (int) __vsubss4(vl | vh, 0x20202020);
    }
    o.a = f16_to_f32((u16) (r.d_sc & 0xFFFF));
    o.sc = (int) (r.d_sc >> 16);
}

template <int TYPE>
__device__ __forceinline__ void mmq_unpack(const u8 * __restrict__ row, const int ib, MmqWeightBlock & o) {
    o.a = 0.0f; o.b = 0.0f; o.sc = 0;
    if constexpr (TYPE == Q4_0) {
        const block_q4_0 * b = (const block_q4_0 *) row + ib;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a2(b->qs + 4 * i);
            o.q[i] = v & 0x0F0F0F0F;
            o.q[i + 4] = (v >> 4) & 0x0F0F0F0F;
        }
        o.a = f16_to_f32(b->d);
    } else if constexpr (TYPE == Q4_1) {
        const block_q4_1 * b = (const block_q4_1 *) row + ib;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = ((const int *) b->qs)[i];
            o.q[i] = v & 0x0F0F0F0F;
            o.q[i + 4] = (v >> 4) & 0x0F0F0F0F;
        }
        o.a = f16_to_f32(b->d);
        o.b = f16_to_f32(b->m);
    } else if constexpr (TYPE == Q5_0) {
        const block_q5_0 * b = (const block_q5_0 *) row + ib;
        const u32 qh = (u32) load_i32_a2(b->qh);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a2(b->qs + 4 * i);
            o.q[i] = (v & 0x0F0F0F0F) | spread_bits4(qh >> (4 * i));
            o.q[i + 4] = ((v >> 4) & 0x0F0F0F0F) | spread_bits4(qh >> (16 + 4 * i));
        }
        o.a = f16_to_f32(b->d);
    } else if constexpr (TYPE == Q5_1) {
        const block_q5_1 * b = (const block_q5_1 *) row + ib;
        const u32 qh = *(const u32 *) b->qh;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = ((const int *) b->qs)[i];
            o.q[i] = (v & 0x0F0F0F0F) | spread_bits4(qh >> (4 * i));
            o.q[i + 4] = ((v >> 4) & 0x0F0F0F0F) | spread_bits4(qh >> (16 + 4 * i));
        }
        o.a = f16_to_f32(b->d);
        o.b = f16_to_f32(b->m);
    } else if constexpr (TYPE == Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) row + ib;
#pragma unroll
        for (int i = 0; i < 8; ++i) o.q[i] = load_i32_a2((const u8 *) b->qs + 4 * i);
        o.a = f16_to_f32(b->d);
    } else if constexpr (TYPE == MXFP4) {
        const block_mxfp4 * b = (const block_mxfp4 *) row + ib;
        const u32 table[4] = {0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = load_i32_a1(b->qs + 4 * i);
            o.q[i] = table16_lookup(v, table);
            o.q[i + 4] = table16_lookup(v >> 4, table);
        }
        o.a = e8m0_half_to_f32(b->e);
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        int sc, m;
        float d, dmin;
#if MMQ_VEC_LOADS
        if constexpr (TYPE == Q4_K) {
            MmqRawQ4K raw;
            mmq_load_q4k_quants(row, ib, raw);
            mmq_decode_q4k_quants(raw, ib, o.q);
            mmq_load_q4k_header(row, ib, raw);
            mmq_decode_q4k_scales(raw, ib, sc, m, d, dmin);
        } else {
            k45_quants<TYPE>(row, ib, o.q, sc, m, d, dmin);
        }
#else
        k45_quants<TYPE>(row, ib, o.q, sc, m, d, dmin);
#endif
        // d * sc and dmin * m are exact in float32 (11-bit by 6-bit mantissas): the mat-vec's
        // d * sc * sumi - dmin * m * isum, with the products formed in the same order.
        o.a = d * sc;
        o.b = dmin * m;
    } else if constexpr (TYPE == Q6_K) {
#if MMQ_VEC_LOADS
        // nine aligned words under each of ql and qh, funnel-shifted into place (the mat-vec's
        // q6k_load), where q6k_quants reads sixteen 2-aligned words as 32 halves
        Q6KRaw r;
        q6k_load(row, ib, r);
        mmq_decode_q6k(r, ib, o);
#else
        const block_q6_K * b = q6k_quants(row, ib, o.q);
        const i8 * sc = b->scales + 8 * ((ib % 8) / 4) + 2 * (ib % 4);
        o.a = f16_to_f32(b->d);
        o.sc = (int) (u8) sc[0] | ((int) (u8) sc[1] << 8);
#endif
    }
}

// One block of 32's float result from its int32 dot product(s), as dot_item<TYPE>:
// d8 = the activation block's scale, s8 = its half sum s, isum = the integer sum of its quants;
// sumi (Q6_K: sumi for values 0..15, sumi2 for 16..31).
template <int TYPE>
__device__ __forceinline__ float mmq_block_value(const float a, const float b, const int sc,
                                                 const float d8, const float s8, const int isum,
                                                 const int sumi, const int sumi2) {
    if constexpr (TYPE == Q4_0) {
        return a * (d8 * sumi - 8.0f * s8);
    } else if constexpr (TYPE == Q5_0) {
        return a * (d8 * sumi - 16.0f * s8);
    } else if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
        return a * d8 * sumi + b * s8;
    } else if constexpr (TYPE == Q8_0 || TYPE == MXFP4) {
        return a * d8 * sumi;
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        return d8 * (a * sumi - b * isum);
    } else {    // Q6_K
        const int sc0 = (int) (i8) (sc & 0xFF), sc1 = (int) (i8) ((sc >> 8) & 0xFF);
        return a * d8 * (sc0 * sumi + sc1 * sumi2);
    }
}

// D (16x8 s32) += A (16 rows x 32 int8, row-major) . B (32 x 8 tokens, column-major).
// Fragments (PTX ISA, mma.m16n8k32 .s8; g = lane / 4, t = lane % 4, in 32-bit words of 4
// quants): a0 = A[g][word t], a1 = A[g+8][word t], a2 = A[g][word t+4], a3 = A[g+8][word t+4];
// b0 = B[word t][token g], b1 = B[word t+4][token g]; d0, d1 = D[g][2t, 2t+1],
// d2, d3 = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mma_s8_k32(int (&d)[4], const int a0, const int a1, const int a2, const int a3,
                                           const int b0, const int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same over 16 quants: a0 = A[g][word t], a1 = A[g+8][word t], b0 = B[word t][token g].
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], const int a0, const int a1, const int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// MMQ_PREFETCH: the next chunk's weight bytes (a row's blocks kb0 + MMQ_KB ..: the span they
// fall in, to the row's end at most) are asked of L2 while this chunk is multiplied, so that
// its unpack finds them there instead of waiting on DRAM. Weights only (see PDL_ENTRY).
__device__ __forceinline__ void mmq_prefetch_next(const u8 * __restrict__ w, const MmqParams & p, const int row0,
                                                  const int kb0, const int nb) {
#if MMQ_PREFETCH
    if (kb0 + MMQ_KB < nb && threadIdx.x < MMQ_ROWS) {
        const u8 * row = w + (i64) min(row0 + (int) threadIdx.x, p.n_rows - 1) * p.row_bytes;
        const i64 lo = (i64) p.row_bytes * (kb0 + MMQ_KB) / nb;
        const i64 hi = min((i64) p.row_bytes, (i64) p.row_bytes * (kb0 + 2 * MMQ_KB) / nb + 1);
        prefetch_l2_bytes(row + lo, hi - lo);
    }
#endif
}

// A warp's 32 rows (from r0) x 32 tokens (from wc) of results into y: lane (g, t) holds rows
// r0 + 16m + 8h + g and tokens wc + 8n + 2t + j in acc[m][n][2h + j] (the mma's D layout);
// without IDS token c is row tok0 + c of y, with IDS row coly[c] (< 0: not written).
template <bool IDS>
__device__ __forceinline__ void mmq_store(const float (&acc)[2][4][4], float * __restrict__ y, const MmqParams & p,
                                          const int r0, const int wc, const int g, const int t, const int tok0,
                                          const int * __restrict__ coly) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int r = r0 + 16 * m + 8 * (c / 2) + g;
                const int col = wc + 8 * n + 2 * t + c % 2;
                const int yr = IDS ? coly[col] : tok0 + col;
                if (r < p.n_rows && (IDS ? yr >= 0 : yr < p.n_tokens)) y[(i64) yr * p.n_rows + r] = acc[m][n][c];
            }
}

// MMQ_UNPACK_UNROLL: an item's loads (mmq_load) apart from its unpack (mmq_unpack_loaded), for
// MMQ_VEC_LOADS's Q4_K and Q6_K; the other types load inside mmq_unpack, as without it.
template <int TYPE> struct MmqRaw { const u8 * row; };
#if MMQ_VEC_LOADS
template <> struct MmqRaw<Q4_K> { MmqRawQ4K r; };
template <> struct MmqRaw<Q6_K> { Q6KRaw r; };
#endif

template <int TYPE>
__device__ __forceinline__ void mmq_load(const u8 * __restrict__ row, const int ib, MmqRaw<TYPE> & raw) {
    if constexpr (MMQ_VEC_LOADS && TYPE == Q4_K) {
        mmq_load_q4k_quants(row, ib, raw.r);
        mmq_load_q4k_header(row, ib, raw.r);
    } else if constexpr (MMQ_VEC_LOADS && TYPE == Q6_K) {
        q6k_load(row, ib, raw.r);
    } else {
        raw.row = row;
    }
}

template <int TYPE>
__device__ __forceinline__ void mmq_unpack_loaded(const MmqRaw<TYPE> & raw, const int ib, MmqWeightBlock & o) {
    if constexpr (MMQ_VEC_LOADS && TYPE == Q4_K) {
        int sc, m;
        float d, dmin;
        mmq_decode_q4k_quants(raw.r, ib, o.q);
        mmq_decode_q4k_scales(raw.r, ib, sc, m, d, dmin);
        o.a = d * sc;           // as mmq_unpack forms them
        o.b = dmin * m;
        o.sc = 0;
    } else if constexpr (MMQ_VEC_LOADS && TYPE == Q6_K) {
        o.b = 0.0f;
        mmq_decode_q6k(raw.r, ib, o);
    } else {
        mmq_unpack<TYPE>(raw.row, ib, o);
    }
}

// MMQ_X_ASYNC: 16 bytes from global to shared memory without a register (sm_80's cp.async;
// .cg: through L2 only, as the tile's other global data); the CPU build (conformance/harness/mmq_host.py)
// copies at once, where the wait is then nothing.
__device__ __forceinline__ void mmq_cp_async16(void * smem, const void * gmem) {
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((unsigned) __cvta_generic_to_shared(smem)), "l"(gmem) : "memory");
#else
    *(int4 *) smem = *(const int4 *) gmem;
#endif
}

__device__ __forceinline__ void mmq_cp_async_wait_all() {
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// MMQ_BANKS: a block's 8 quant words (16-byte aligned) as two 128-bit stores, blocks 4..7 of
// a row (kb / 4 odd) their high half first: a quarter warp's 8 lanes (one row's blocks, 8
// words apart) then write banks 0-3, 8-11, 16-19, 24-27, 4-7, ... : each bank once.
__device__ __forceinline__ void mmq_store_block(int * __restrict__ dst, const int kb, const int (&q)[8]) {
    const int4 lo = make_int4(q[0], q[1], q[2], q[3]), hi = make_int4(q[4], q[5], q[6], q[7]);
    const bool swap = (kb >> 2) & 1;
    int4 * d = (int4 *) dst;
    d[swap] = swap ? hi : lo;
    d[!swap] = swap ? lo : hi;
}

// MMQ_X_RAW's 16-byte path: every token's chunk starts at block (row * nb + kb0), a multiple of
// 4, so 16-byte aligned
#define MMQ_X_WIDE (MMQ_KB % 4 == 0 && n_kb == MMQ_KB && nb % 4 == 0 && ((u64) x & 15) == 0)

// The tile of weight rows blockIdx.x * MMQ_ROWS.. against MMQ_COLS columns of x: without IDS
// the tokens tok0 .. tok0 + MMQ_COLS - 1 (past n_tokens: token n_tokens - 1 read, nothing
// written); with IDS column c reads x row colx[c] and writes y row coly[c] (< 0: not written),
// both given in shared memory by mmq_id below.
template <int TYPE, bool IDS>
__device__ __forceinline__ void mmq_tile(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x,
                                         float * __restrict__ y, const MmqParams & p, const int tok0,
                                         const int * __restrict__ colx, const int * __restrict__ coly,
                                         const int n_cols) {
    __align__(16) __shared__ int wq[MMQ_ROWS * MMQ_STRIDE];   // weight quants, a row of 256 per tile row
    // Per-block factors indexed [block][row or token], so that the lanes of a warp, which
    // read 8 consecutive rows (or 4 tokens 2 apart) of one block, hit distinct banks.
    __shared__ float2 wab[MMQ_KB][MMQ_ROWS + MMQ_FPAD];           // (a, b) per block and row
    __shared__ int wsc[MMQ_KB][MMQ_ROWS + MMQ_IPAD];              // Q6_K's scales
#if MMQ_X_RAW
    __align__(16) __shared__ int xraw[MMQ_COLS * MMQ_XSTRIDE];    // a token's chunk of block_q8_1
#else
    __align__(16) __shared__ int xq[MMQ_COLS * MMQ_STRIDE];   // activation quants, per token
    __shared__ float xd[MMQ_KB][MMQ_COLS + MMQ_IPAD];             // d8
    __shared__ float xs[MMQ_KB][MMQ_COLS + MMQ_IPAD];             // s (the half sum)
    __shared__ int xsum[MMQ_KB][MMQ_COLS + MMQ_IPAD];             // integer sum of the quants
#endif
    // columns staged and multiplied: all, or (MMQ_SKIP_PAD) those up to the last valid one
    const int cols = MMQ_SKIP_PAD ? n_cols : MMQ_COLS;

    const int row0 = blockIdx.x * MMQ_ROWS;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int wr = (warp % MMQ_WARPS_R) * 32, wc = (warp / MMQ_WARPS_R) * 32;   // this warp's rows and tokens
    const int nb = p.k / QK8_1;                               // blocks of 32 per row

    float acc[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][n][c] = 0.0f;

    for (int kb0 = 0; kb0 < nb; kb0 += MMQ_KB) {
        const int n_kb = min(MMQ_KB, nb - kb0);
#if MMQ_X_RAW && MMQ_X_ASYNC
        if (MMQ_X_WIDE) {
            constexpr int V = 9 * MMQ_KB / 4;       // 16-byte words per token's chunk
            for (int it = threadIdx.x; it < cols * V; it += MMQ_THREADS) {
                const int c = it / V, v = it % V;
                const int xr = IDS ? colx[c] : min(tok0 + c, p.n_tokens - 1);
                mmq_cp_async16(xraw + c * MMQ_XSTRIDE + 4 * v, (const int4 *) (x + (i64) xr * nb + kb0) + v);
            }
        }
#endif
        // Unpack: (row, block) pairs over the threads, a row's blocks on adjacent threads.
#if MMQ_UNPACK_UNROLL > 1
        // (the default path below keeps these stores written out: through this lambda ptxas
        // gave the default's mmq_id kernels other machine code than the one timed)
        auto stage = [&](const int r, const int kb, const MmqWeightBlock & o) {
#if MMQ_ROWS_FAST
            int4 * dst = (int4 *) (wq + r * MMQ_STRIDE + kb * 8);
            dst[0] = make_int4(o.q[0], o.q[1], o.q[2], o.q[3]);
            dst[1] = make_int4(o.q[4], o.q[5], o.q[6], o.q[7]);
#elif MMQ_BANKS
            mmq_store_block(wq + r * MMQ_STRIDE + kb * 8, kb, o.q);
#else
#pragma unroll
            for (int i = 0; i < 8; ++i) wq[r * MMQ_STRIDE + kb * 8 + i] = o.q[i];
#endif
            wab[kb][r] = make_float2(o.a, o.b);
            if constexpr (mmq_reads_sc<TYPE>) wsc[kb][r] = o.sc;
        };
        // MMQ_UNPACK_UNROLL items' loads first, then their unpacks and stores: ptxas does not
        // move an item's loads above the previous item's branches and stores by itself. A
        // block past the chunk's end is read as the row's last (valid memory), not stored.
        static_assert(MMQ_ROWS * MMQ_KB % (MMQ_THREADS * MMQ_UNPACK_UNROLL) == 0,
                      "mmq: MMQ_UNPACK_UNROLL must divide a thread's unpack items");
        for (int i0 = 0; i0 < MMQ_ROWS * MMQ_KB / MMQ_THREADS; i0 += MMQ_UNPACK_UNROLL) {
            MmqRaw<TYPE> raw[MMQ_UNPACK_UNROLL];
#pragma unroll
            for (int u = 0; u < MMQ_UNPACK_UNROLL; ++u) {
                const int it = threadIdx.x + (i0 + u) * MMQ_THREADS;
                const int r = MMQ_ROWS_FAST ? it % MMQ_ROWS : it / MMQ_KB, kb = MMQ_ROWS_FAST ? it / MMQ_ROWS : it % MMQ_KB;
                mmq_load<TYPE>(w + (i64) min(row0 + r, p.n_rows - 1) * p.row_bytes, min(kb0 + kb, nb - 1), raw[u]);
            }
#pragma unroll
            for (int u = 0; u < MMQ_UNPACK_UNROLL; ++u) {
                const int it = threadIdx.x + (i0 + u) * MMQ_THREADS;
                const int r = MMQ_ROWS_FAST ? it % MMQ_ROWS : it / MMQ_KB, kb = MMQ_ROWS_FAST ? it / MMQ_ROWS : it % MMQ_KB;
                if (kb < n_kb) {
                    MmqWeightBlock o;
                    mmq_unpack_loaded<TYPE>(raw[u], kb0 + kb, o);
                    stage(r, kb, o);
                }
            }
        }
#else
        for (int it = threadIdx.x; it < MMQ_ROWS * MMQ_KB; it += MMQ_THREADS) {
            const int r = MMQ_ROWS_FAST ? it % MMQ_ROWS : it / MMQ_KB, kb = MMQ_ROWS_FAST ? it / MMQ_ROWS : it % MMQ_KB;
            if (kb < n_kb) {
                const u8 * row = w + (i64) min(row0 + r, p.n_rows - 1) * p.row_bytes;
                MmqWeightBlock o;
                mmq_unpack<TYPE>(row, kb0 + kb, o);
#if MMQ_ROWS_FAST
                int4 * dst = (int4 *) (wq + r * MMQ_STRIDE + kb * 8);
                dst[0] = make_int4(o.q[0], o.q[1], o.q[2], o.q[3]);
                dst[1] = make_int4(o.q[4], o.q[5], o.q[6], o.q[7]);
#elif MMQ_BANKS
                mmq_store_block(wq + r * MMQ_STRIDE + kb * 8, kb, o.q);
#else
#pragma unroll
                for (int i = 0; i < 8; ++i) wq[r * MMQ_STRIDE + kb * 8 + i] = o.q[i];
#endif
                wab[kb][r] = make_float2(o.a, o.b);
                if constexpr (mmq_reads_sc<TYPE>) wsc[kb][r] = o.sc;
            }
        }
#endif
#if MMQ_X_RAW
        if (MMQ_X_WIDE) {
#if MMQ_X_ASYNC
            mmq_cp_async_wait_all();                // (issued before the unpack)
#else
            constexpr int V = 9 * MMQ_KB / 4;       // 16-byte words per token's chunk
            for (int it = threadIdx.x; it < cols * V; it += MMQ_THREADS) {
                const int c = it / V, v = it % V;
                const int xr = IDS ? colx[c] : min(tok0 + c, p.n_tokens - 1);
                *(int4 *) (xraw + c * MMQ_XSTRIDE + 4 * v) = ((const int4 *) (x + (i64) xr * nb + kb0))[v];
            }
#endif
        } else {
            const int words = 9 * n_kb;
            for (int it = threadIdx.x; it < cols * words; it += MMQ_THREADS) {
                const int c = it / words, v = it % words;
                const int xr = IDS ? colx[c] : min(tok0 + c, p.n_tokens - 1);
                xraw[c * MMQ_XSTRIDE + v] = ((const int *) (x + (i64) xr * nb + kb0))[v];
            }
        }
#else
        for (int it = threadIdx.x; it < cols * MMQ_KB; it += MMQ_THREADS) {
            const int c = MMQ_ROWS_FAST ? it % cols : it / MMQ_KB, kb = MMQ_ROWS_FAST ? it / cols : it % MMQ_KB;
            if (kb < n_kb) {
                const int xr = IDS ? colx[c] : min(tok0 + c, p.n_tokens - 1);
                const block_q8_1 * yb = x + (i64) xr * nb + kb0 + kb;
                int s = 0, v[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    v[i] = yb->qs[i];
                    s = __dp4a(0x01010101, v[i], s);
                }
#if MMQ_ROWS_FAST
                int4 * dst = (int4 *) (xq + c * MMQ_STRIDE + kb * 8);
                dst[0] = make_int4(v[0], v[1], v[2], v[3]);
                dst[1] = make_int4(v[4], v[5], v[6], v[7]);
#elif MMQ_BANKS
                mmq_store_block(xq + c * MMQ_STRIDE + kb * 8, kb, v);
#else
#pragma unroll
                for (int i = 0; i < 8; ++i) xq[c * MMQ_STRIDE + kb * 8 + i] = v[i];
#endif
                xd[kb][c] = f16_to_f32(yb->d);
                if constexpr (mmq_reads_s8<TYPE>) xs[kb][c] = f16_to_f32(yb->s);
                if constexpr (mmq_reads_isum<TYPE>) xsum[kb][c] = s;
            }
        }
#endif
        __syncthreads();
        mmq_prefetch_next(w, p, row0, kb0, nb);

        const int kb_end = MMQ_SKIP_PAD && wc >= cols ? 0 : n_kb;     // (a warp of padding only: none)
        for (int kb = 0; kb < kb_end; ++kb) {
            int a[2][4], b[4][2];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int * r_lo = wq + (wr + 16 * m + g) * MMQ_STRIDE + kb * 8;
                const int * r_hi = r_lo + 8 * MMQ_STRIDE;
                a[m][0] = r_lo[t]; a[m][1] = r_hi[t]; a[m][2] = r_lo[t + 4]; a[m][3] = r_hi[t + 4];
            }
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#if MMQ_X_RAW
                const int * c = xraw + (wc + 8 * n + g) * MMQ_XSTRIDE + 9 * kb + 1;   // the block's qs
#else
                const int * c = xq + (wc + 8 * n + g) * MMQ_STRIDE + kb * 8;
#endif
                b[n][0] = c[t]; b[n][1] = c[t + 4];
            }
            // This lane's rows (wr + 16m + g, + 8) and tokens (wc + 8n + 2t, + 1).
            float2 ab[2][2];
            int sc[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    ab[m][h] = wab[kb][wr + 16 * m + 8 * h + g];
                    sc[m][h] = 0;
                    if constexpr (mmq_reads_sc<TYPE>) sc[m][h] = wsc[kb][wr + 16 * m + 8 * h + g];
                }
            float d8[4][2], s8[4][2];
            int is[4][2];
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int c = wc + 8 * n + 2 * t + j;
#if MMQ_X_RAW
                    const u32 ds = (u32) xraw[c * MMQ_XSTRIDE + 9 * kb];      // d, s (halves)
                    d8[n][j] = f16_to_f32((u16) (ds & 0xFFFF)); s8[n][j] = 0.0f; is[n][j] = 0;
                    if constexpr (mmq_reads_s8<TYPE>) s8[n][j] = f16_to_f32((u16) (ds >> 16));
#else
                    d8[n][j] = xd[kb][c]; s8[n][j] = 0.0f; is[n][j] = 0;
                    if constexpr (mmq_reads_s8<TYPE>) s8[n][j] = xs[kb][c];
                    if constexpr (mmq_reads_isum<TYPE>) is[n][j] = xsum[kb][c];
#endif
                }
#if MMQ_X_RAW
            if constexpr (mmq_reads_isum<TYPE>) {
                // each token's sum of its block's 32 quants: A all ones, so every row g of D holds
                // the sums of tokens 2t and 2t + 1 (D[g][2t + j] = sum_k B[k][2t + j])
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    int q[4] = {0, 0, 0, 0};
                    mma_s8_k32(q, 0x01010101, 0x01010101, 0x01010101, 0x01010101, b[n][0], b[n][1]);
                    is[n][0] = q[0]; is[n][1] = q[1];
                }
            }
#endif
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    if constexpr (TYPE == Q6_K) {
                        mma_s8_k16(lo, a[m][0], a[m][1], b[n][0]);
                        mma_s8_k16(hi, a[m][2], a[m][3], b[n][1]);
                    } else {
                        mma_s8_k32(lo, a[m][0], a[m][1], a[m][2], a[m][3], b[n][0], b[n][1]);
                    }
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int h = c / 2, j = c % 2;       // row g + 8h, token 2t + j
                        acc[m][n][c] += mmq_block_value<TYPE>(ab[m][h].x, ab[m][h].y, sc[m][h],
                                                              d8[n][j], s8[n][j], is[n][j], lo[c], hi[c]);
                    }
                }
        }
        __syncthreads();
    }

    mmq_store<IDS>(acc, y, p, row0 + wr, wc, g, t, tok0, coly);
}

// ---- The same tile with its shared memory read in fewer, wider loads (MMQ_PACKED) -----------
//
// ncu on mmq_id_q4_k (H200, the Qwen3-30B-A3B shape): L1/TEX throughput 78 %, DRAM 3.5 %, SM 20 %:
// mmq_tile is bound by its shared-memory wavefronts, 48 per block of 32 and warp for 8 mma
// (8 32-bit loads of A fragments, 8 of B, 8 + 24 of the blocks' factors). Here:
//  - a block's 8 words of quants are stored in the order 0 4 1 5 2 6 3 7, so that the two words
//    a lane takes for a fragment (t and t + 4) are adjacent: one 64-bit load each (and the
//    unpack writes them as two 128-bit stores);
//  - the factors a block's value needs are two floats per (row, block) and per (token, block)
//    (mmq_weight_pair / mmq_token_pair): one 64-bit load per row pair, one 128-bit load per
//    two tokens;
// 24 wavefronts per block and warp. The float arithmetic is mmq_block_value's on the same
// values in the same order: the results equal mmq_tile's bit for bit (the CPU test of every
// variant, conformance/kernels/test_kernels_mmq.py, and ci/gpu_tune_mmq.py on the GPU check it).
// One of the two goes once the GPU has timed them.

// (a, b) or, for Q6_K, (a, its two int8 scales as an int's bits).
template <int TYPE>
__device__ __forceinline__ float2 mmq_weight_pair(const MmqWeightBlock & o) {
    if constexpr (TYPE == Q6_K) return make_float2(o.a, __int_as_float(o.sc));
    else return make_float2(o.a, o.b);
}

// (d8, the quants' integer sum as an int's bits) for the K-quants' min term, else (d8, s).
template <int TYPE>
__device__ __forceinline__ float2 mmq_token_pair(const float d8, const float s8, const int isum) {
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) return make_float2(d8, __int_as_float(isum));
    else return make_float2(d8, s8);
}

template <int TYPE>
__device__ __forceinline__ float mmq_pair_value(const float2 wv, const float2 xv, const int sumi, const int sumi2) {
    float b = 0.0f, s8 = 0.0f;
    int sc = 0, isum = 0;
    if constexpr (TYPE == Q6_K) sc = __float_as_int(wv.y); else b = wv.y;
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) isum = __float_as_int(xv.y); else s8 = xv.y;
    return mmq_block_value<TYPE>(wv.x, b, sc, xv.x, s8, isum, sumi, sumi2);
}

template <int TYPE, bool IDS>
__device__ __forceinline__ void mmq_tile_packed(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x,
                                                float * __restrict__ y, const MmqParams & p, const int tok0,
                                                const int * __restrict__ colx, const int * __restrict__ coly,
                                                const int /* n_cols: every column staged here */) {
    __align__(16) __shared__ int wq[MMQ_ROWS * MMQ_PSTRIDE];     // weight quants, words permuted
    __align__(16) __shared__ int xq[MMQ_COLS * MMQ_PSTRIDE];     // activation quants, the same
    __align__(16) __shared__ float2 wf[MMQ_KB][MMQ_ROWS];        // mmq_weight_pair per block, row
    __align__(16) __shared__ float2 xf[MMQ_KB][MMQ_COLS];        // mmq_token_pair per block, token

    const int row0 = blockIdx.x * MMQ_ROWS;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int wr = (warp % MMQ_WARPS_R) * 32, wc = (warp / MMQ_WARPS_R) * 32;
    const int nb = p.k / QK8_1;

    float acc[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][n][c] = 0.0f;

    for (int kb0 = 0; kb0 < nb; kb0 += MMQ_KB) {
        const int n_kb = min(MMQ_KB, nb - kb0);
        for (int it = threadIdx.x; it < MMQ_ROWS * MMQ_KB; it += MMQ_THREADS) {
            const int r = it / MMQ_KB, kb = it % MMQ_KB;
            if (kb < n_kb) {
                const u8 * row = w + (i64) min(row0 + r, p.n_rows - 1) * p.row_bytes;
                MmqWeightBlock o;
                mmq_unpack<TYPE>(row, kb0 + kb, o);
                int4 * dst = (int4 *) (wq + r * MMQ_PSTRIDE + kb * 8);
                dst[0] = make_int4(o.q[0], o.q[4], o.q[1], o.q[5]);
                dst[1] = make_int4(o.q[2], o.q[6], o.q[3], o.q[7]);
                wf[kb][r] = mmq_weight_pair<TYPE>(o);
            }
        }
        for (int it = threadIdx.x; it < MMQ_COLS * MMQ_KB; it += MMQ_THREADS) {
            const int c = it / MMQ_KB, kb = it % MMQ_KB;
            if (kb < n_kb) {
                const int xr = IDS ? colx[c] : min(tok0 + c, p.n_tokens - 1);
                const block_q8_1 * yb = x + (i64) xr * nb + kb0 + kb;
                int v[8], s = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    v[i] = yb->qs[i];
                    s = __dp4a(0x01010101, v[i], s);
                }
                int4 * dst = (int4 *) (xq + c * MMQ_PSTRIDE + kb * 8);
                dst[0] = make_int4(v[0], v[4], v[1], v[5]);
                dst[1] = make_int4(v[2], v[6], v[3], v[7]);
                xf[kb][c] = mmq_token_pair<TYPE>(f16_to_f32(yb->d), f16_to_f32(yb->s), s);
            }
        }
        __syncthreads();
        mmq_prefetch_next(w, p, row0, kb0, nb);

        for (int kb = 0; kb < n_kb; ++kb) {
            int2 a_lo[2], a_hi[2], b[4];       // (word t, word t + 4) of a row's or token's block
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int * r_lo = wq + (wr + 16 * m + g) * MMQ_PSTRIDE + kb * 8 + 2 * t;
                a_lo[m] = *(const int2 *) r_lo;
                a_hi[m] = *(const int2 *) (r_lo + 8 * MMQ_PSTRIDE);
            }
#pragma unroll
            for (int n = 0; n < 4; ++n) b[n] = *(const int2 *) (xq + (wc + 8 * n + g) * MMQ_PSTRIDE + kb * 8 + 2 * t);
            float2 wv[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) wv[m][h] = wf[kb][wr + 16 * m + 8 * h + g];
            float4 xv[4];                       // tokens wc + 8n + 2t and + 1
#pragma unroll
            for (int n = 0; n < 4; ++n) xv[n] = *(const float4 *) &xf[kb][wc + 8 * n + 2 * t];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    if constexpr (TYPE == Q6_K) {
                        mma_s8_k16(lo, a_lo[m].x, a_hi[m].x, b[n].x);
                        mma_s8_k16(hi, a_lo[m].y, a_hi[m].y, b[n].y);
                    } else {
                        mma_s8_k32(lo, a_lo[m].x, a_hi[m].x, a_lo[m].y, a_hi[m].y, b[n].x, b[n].y);
                    }
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int h = c / 2, j = c % 2;       // row g + 8h, token 2t + j
                        const float2 tv = j ? make_float2(xv[n].z, xv[n].w) : make_float2(xv[n].x, xv[n].y);
                        acc[m][n][c] += mmq_pair_value<TYPE>(wv[m][h], tv, lo[c], hi[c]);
                    }
                }
        }
        __syncthreads();
    }

    mmq_store<IDS>(acc, y, p, row0 + wr, wc, g, t, tok0, coly);
}

#if MMQ_PACKED
#define MMQ_TILE mmq_tile_packed
#else
#define MMQ_TILE mmq_tile
#endif

// ---- A prompt's expert mat-muls (mul_mat_id) on the same tiles, planned on the device -------
//
// moe_plan (one block) sorts the (token, slot) pairs by expert without the host: per expert
// its count, its start in the sorted list, each valid slot's rank within it, the sorted slots,
// and the tiles of up to MMQ_COLS slots of one expert (at most ceil(S / MMQ_COLS) + min(E, S)
// of them, the launch's max_tiles). Ranks come from atomics, so the order of an expert's slots
// varies from run to run; each output element is still one column's own sum (the columns of a
// tile never mix), so the results do not. The layout of the plan (ints):
//   counts[E] | starts[E] | rank[S] (-1: an id outside [0, E)) | sorted[S] | n_tiles | tile_expert[MT] | tile_start[MT]
#define MOE_PLAN_THREADS 256
#define MOE_PLAN_MAX_E 1024          // experts the plan counts in shared memory (backend: more go elsewhere)

extern "C" __global__ void __launch_bounds__(MOE_PLAN_THREADS)
moe_plan(const int * __restrict__ ids, int * __restrict__ plan, const MoePlanParams p) {
    PDL_ENTRY();
    __shared__ int cs[MOE_PLAN_MAX_E], ss[MOE_PLAN_MAX_E];    // counts, starts
    const int E = p.n_experts, S = p.n_slots;
    int * cnt = plan, * start = plan + E, * rank = plan + 2 * E, * sorted = rank + S;
    int * n_tiles = sorted + S, * tile_e = n_tiles + 1, * tile_s = tile_e + p.max_tiles;
    for (int e = threadIdx.x; e < E; e += MOE_PLAN_THREADS) cs[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < S; s += MOE_PLAN_THREADS) {
        const int e = ids[s];
        rank[s] = e >= 0 && e < E ? atomicAdd(cs + e, 1) : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {             // the scan, in shared memory; the tiles' stores need not wait
        int o = 0, t = 0;
        for (int e = 0; e < E; ++e) {
            ss[e] = o;
            for (int i = 0; i < cs[e]; i += MMQ_COLS) { tile_e[t] = e; tile_s[t] = o + i; ++t; }
            o += cs[e];
        }
        *n_tiles = t;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += MOE_PLAN_THREADS) { cnt[e] = cs[e]; start[e] = ss[e]; }
    for (int s = threadIdx.x; s < S; s += MOE_PLAN_THREADS)
        if (rank[s] >= 0) sorted[ss[ids[s]] + rank[s]] = s;
}

// Grid (ceil(N / MMQ_ROWS), max_tiles + 1): block row y < n_tiles multiplies tile y's slots by
// its expert's rows; the last block row writes NaN into the rows of slots whose expert id is
// out of range (as the mat-vec kernels do); the rest return.
template <int TYPE>
__device__ __forceinline__ void mmq_id(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x,
                                       const int * __restrict__ plan, float * __restrict__ y,
                                       const MmqIdParams & q) {
    const int E = q.n_experts, S = q.n_slots;
    const int * cnt = plan, * start = plan + E, * rank = plan + 2 * E, * sorted = rank + S;
    const int n_tiles = sorted[S], * tile_e = sorted + S + 1, * tile_s = tile_e + q.max_tiles;
    const int tile = blockIdx.y;
    if (tile == q.max_tiles) {
        // A thread per slot: this block row is scheduled last, and when every thread walked all
        // S slots in turn (one dependent load each) its blocks ran on alone for a long tail:
        // ncu on mmq_id_q4_k (H200, the 30B-A3B prompt, S = 4096) had the SMs active 39 % of
        // the kernel's cycles. Out-of-range ids are rare, so a slot's rows from one thread.
        const int r0 = blockIdx.x * MMQ_ROWS, r1 = min(q.n_rows, r0 + MMQ_ROWS);
        for (int s = threadIdx.x; s < S; s += MMQ_THREADS)
            if (rank[s] < 0)
                for (int r = r0; r < r1; ++r) y[(i64) s * q.n_rows + r] = NAN_F32;
        return;
    }
    if (tile >= n_tiles) return;
    const int e = tile_e[tile], s0 = tile_s[tile], n = min(MMQ_COLS, start[e] + cnt[e] - s0);
    __shared__ int colx[MMQ_COLS], coly[MMQ_COLS];
    if (threadIdx.x < MMQ_COLS) {
        const int s = sorted[s0 + min((int) threadIdx.x, n - 1)];
        colx[threadIdx.x] = q.x_per_slot ? s : s / q.n_used;
        coly[threadIdx.x] = (int) threadIdx.x < n ? s : -1;
    }
    __syncthreads();
    MmqParams p;
    p.n_rows = q.n_rows; p.k = q.k; p.n_tokens = 0; p.pad0 = 0; p.row_bytes = q.row_bytes;
    MMQ_TILE<TYPE, true>(w + (i64) e * q.expert_bytes, x, y, p, 0, colx, coly, n);
}

#define DEFINE_MMQ(name, TYPE)                                                                     \
extern "C" __global__ void MMQ_BOUNDS                                                             \
mmq_##name(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x, float * __restrict__ y,   \
           const MmqParams p) {                                                                    \
    PDL_ENTRY();                                                                                   \
    MMQ_TILE<TYPE, false>(w, x, y, p, blockIdx.y * MMQ_COLS, nullptr, nullptr,                      \
                          min(MMQ_COLS, p.n_tokens - (int) blockIdx.y * MMQ_COLS));                   \
}                                                                                                  \
extern "C" __global__ void MMQ_BOUNDS                                                             \
mmq_id_##name(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x,                        \
              const int * __restrict__ plan, float * __restrict__ y, const MmqIdParams p) {        \
    PDL_ENTRY();                                                                                   \
    mmq_id<TYPE>(w, x, plan, y, p);                                                                \
}

DEFINE_MMQ(q4_0, Q4_0)
DEFINE_MMQ(q4_1, Q4_1)
DEFINE_MMQ(q5_0, Q5_0)
DEFINE_MMQ(q5_1, Q5_1)
DEFINE_MMQ(q8_0, Q8_0)
DEFINE_MMQ(q4_k, Q4_K)
DEFINE_MMQ(q5_k, Q5_K)
DEFINE_MMQ(q6_k, Q6_K)
DEFINE_MMQ(mxfp4, MXFP4)
