// A MoE prompt's expert mat-muls (mul_mat_id) on int8 tensor cores against Q8_1 activations
// (llama.cpp's MMQ, ggml-cuda/mmq.cuh): y [S, N] = x . W_e^T for each (token, slot) pair s and
// its expert e, with x already quantized to Q8_1 blocks (the quantize_q8_1 kernel's output) and
// the experts' W in their ggml blocks. moe_plan sorts the pairs by expert on the device;
// mmq_id_<type> multiplies each tile of one expert's pairs.
//
// A thread block takes MMQ_ROWS weight rows x MMQ_COLS pairs. K is walked in chunks of 256
// values (8 blocks of 32: one K-quant super-block): every row's chunk is unpacked to int8
// quants in shared memory with its per-32-block scale factors, every column's chunk of Q8_1
// blocks copied beside it. Each warp then forms, per block of 32, the int32 dot products of
// its 32 rows x 32 columns with `mma.sync.m16n8k32.s8.s8.s32` (Q6_K: two m16n8k16, one per
// 16-value half, which has its own scale) and scales them in float32 exactly as the mat-vec's
// dot does (kernels/matvec_q.cuh), adding block after block in K order. So against the decode
// mat-vec only the order of the float32 sum over the K/32 blocks differs (the mat-vec strides
// them over lanes and sums by shuffles); the integer products are the same.
//
// Quants are unpacked with the mat-vec's own bit arithmetic (kernels/quant_dot.cuh): Q4_0 /
// Q5_0 stay unsigned (0..15 / 0..31, the -8d / -16d constant taken against the activation
// block's half sum s), Q4_K / Q5_K keep their min against the integer sum of the activation
// quants, Q6_K is signed (q - 32), MXFP4 is the doubled E2M1 value.
//
// Launch: see mmq_id below; MMQ_THREADS threads, static shared memory only (under 48 KiB). Rows
// past N read row N-1 (valid memory) and are not written. Needs sm_80 (int8 m16n8k32 mma).
#include "common.cuh"
#include "params.cuh"
#include "quant_dot.cuh"

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
// resident blocks per SM asked of ptxas (__launch_bounds__): a register cap. The tile's shared
// memory (the padded layout below) leaves room for 5 blocks an SM, and the cap makes the
// registers fit them too (conformance/harness/kernel_resources.py reads both from the cubin).
#define MMQ_MIN_BLOCKS 5
#endif
#if MMQ_MIN_BLOCKS > 1
#define MMQ_BOUNDS __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS)
#else
#define MMQ_BOUNDS __launch_bounds__(MMQ_THREADS)   // (a minimum of 1 given changes ptxas's register choices)
#endif
// words per token row of the raw activation tile: 9 * MMQ_KB, rounded up to 4 mod 8 (16-byte
// rows; 8 rows' 4 consecutive words land on the 32 banks)
#define MMQ_XSTRIDE ((9 * MMQ_KB + 3) / 8 * 8 + 4)
#define MMQ_IPAD (32 / MMQ_KB)        // words after each block's row of 32-bit factors
#define MMQ_FPAD (16 / MMQ_KB)        // float2s after each block's row of (a, b)
#define MMQ_STRIDE (MMQ_KB * 8 + 4)   // ints per row of quants in shared memory: +4 so that the
                                      // 8 rows x 4 ints of a fragment load land on 32 banks

// The weight rows a tile reads (an expert's, in mmq_id): n_rows rows of k values, row_bytes apart.
struct MmqTile {
    int n_rows;
    int k;
    long long row_bytes;
};

// Per (row, block of 32): the unpacked quants as 8 ints (4 per int) such that the mat-vec's
// sum is sum_i __dp4a(q[i], yq[i]); a, b: the block's float factors; sc: Q6_K's two int8
// scales (low byte: values 0..15, next: 16..31).
struct MmqWeightBlock { int q[8]; float a; float b; int sc; };

// Which per-block factors mmq_block_value<TYPE> reads (the others are neither stored nor read):
// Q6_K's scales, the activation half sum s, the quants' sum.
template <int TYPE> constexpr bool mmq_reads_sc = TYPE == Q6_K;
template <int TYPE> constexpr bool mmq_reads_s8 = TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q4_1 || TYPE == Q5_1;
template <int TYPE> constexpr bool mmq_reads_isum = TYPE == Q4_K || TYPE == Q5_K;

// Q4_K and Q6_K items from wide loads, apart from their decoding. Q4_K: its 32 quant bytes as two
// 16-byte words, d, dmin and the 12 scale bytes as one, where k45_quants reads eight 32-bit
// words, two halves and four scale bytes one by one (the unpack's global loads used a fraction
// of each sector they touched, and L1 bound the tile). Rows of whole 144-byte blocks (16-byte
// aligned), so qs (at byte 16) and its pairs' 32 bytes are 16-byte aligned; h: d, dmin and the
// 12 scale bytes.
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

// Q6_K: nine aligned words under each of ql and qh (q6k_load), funnel-shifted into place
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
        if constexpr (TYPE == Q4_K) {
            MmqRawQ4K raw;
            mmq_load_q4k_quants(row, ib, raw);
            mmq_decode_q4k_quants(raw, ib, o.q);
            mmq_load_q4k_header(row, ib, raw);
            mmq_decode_q4k_scales(raw, ib, sc, m, d, dmin);
        } else {
            k45_quants<TYPE>(row, ib, o.q, sc, m, d, dmin);
        }
        // d * sc and dmin * m are exact in float32 (11-bit by 6-bit mantissas): the mat-vec's
        // d * sc * sumi - dmin * m * isum, with the products formed in the same order.
        o.a = d * sc;
        o.b = dmin * m;
    } else if constexpr (TYPE == Q6_K) {
        Q6KRaw r;
        q6k_load(row, ib, r);
        mmq_decode_q6k(r, ib, o);
    }
}

// One block of 32's float result from its int32 dot product(s), as the mat-vec's dot:
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

// A warp's 32 rows (from r0) x 32 tokens (from wc) of results into y: lane (g, t) holds rows
// r0 + 16m + 8h + g and tokens wc + 8n + 2t + j in acc[m][n][2h + j] (the mma's D layout);
// token c is row coly[c] of y (< 0: not written).
__device__ __forceinline__ void mmq_store(const float (&acc)[2][4][4], float * __restrict__ y, const MmqTile & p,
                                          const int r0, const int wc, const int g, const int t,
                                          const int * __restrict__ coly) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int r = r0 + 16 * m + 8 * (c / 2) + g;
                const int col = wc + 8 * n + 2 * t + c % 2;
                const int yr = coly[col];
                if (r < p.n_rows && yr >= 0) y[(i64) yr * p.n_rows + r] = acc[m][n][c];
            }
}

// The tile's shared stores without bank conflicts. A row's blocks sit on adjacent threads of the
// unpack (for the global loads: a warp's loads then touch 4 rows' consecutive blocks, where a
// row per thread touched 32 rows' sectors, which cost more than its conflict-free stores saved),
// and a quarter warp's 128-bit store of a block's quant words (nvcc merges the eight 32-bit
// stores into two) would put blocks kb and kb + 4 on the same banks, the factors ([block][row]:
// the 8 blocks a multiple of 32 words apart) 8 lanes to a bank (ci/mmq_banks.py counts it: most
// of the store wavefronts conflicts, L1 being the tile's limit). So a block's 8 quant words
// (16-byte aligned) go as two 128-bit stores, blocks 4..7 of a row (kb / 4 odd) their high half
// first: a quarter warp's 8 lanes (one row's blocks, 8 words apart) then write banks 0-3, 8-11,
// 16-19, 24-27, 4-7, ... : each bank once; and the factor rows are padded by 32 / MMQ_KB words
// (float2: 16 / MMQ_KB, MMQ_IPAD / MMQ_FPAD), so that block kb's rows start kb * 4 banks on.
__device__ __forceinline__ void mmq_store_block(int * __restrict__ dst, const int kb, const int (&q)[8]) {
    const int4 lo = make_int4(q[0], q[1], q[2], q[3]), hi = make_int4(q[4], q[5], q[6], q[7]);
    const bool swap = (kb >> 2) & 1;
    int4 * d = (int4 *) dst;
    d[swap] = swap ? hi : lo;
    d[!swap] = swap ? lo : hi;
}

// The activation tile is the Q8_1 blocks' own bytes, copied by consecutive threads from
// consecutive words (a column's chunk is 9 * MMQ_KB contiguous words): an item (column, block)
// per thread read its 8 quant words and two halves with lanes 36 bytes apart, each warp-wide
// load touching ~11 lines of 128 bytes for the 128 bytes it used (ci/mmq_banks.py: several
// times the lines of these copies). The mma loop takes the B fragments from the raw blocks
// (column rows of MMQ_XSTRIDE words: 8 columns x 4 words a fragment load on 32 banks), d8 (and
// s) as the block's first word, and the K-quants' integer sum of a block's 32 activation quants
// from one more mma against a fragment of ones. 16-byte copies when every column's chunk is
// 16-byte aligned (it starts at block (row * nb + kb0), a multiple of 4), else word by word.
#define MMQ_X_WIDE (MMQ_KB % 4 == 0 && n_kb == MMQ_KB && nb % 4 == 0 && ((u64) x & 15) == 0)

// The tile of weight rows blockIdx.x * MMQ_ROWS.. against MMQ_COLS columns of x: column c
// reads x row colx[c] and writes y row coly[c] (< 0: not written), both given in shared memory
// by mmq_id below; columns from n_cols on are neither staged nor multiplied.
template <int TYPE>
__device__ __forceinline__ void mmq_tile(const u8 * __restrict__ w, const block_q8_1 * __restrict__ x,
                                         float * __restrict__ y, const MmqTile & p,
                                         const int * __restrict__ colx, const int * __restrict__ coly,
                                         const int n_cols) {
    __align__(16) __shared__ int wq[MMQ_ROWS * MMQ_STRIDE];   // weight quants, a row of 256 per tile row
    // Per-block factors indexed [block][row or token], so that the lanes of a warp, which
    // read 8 consecutive rows (or 4 tokens 2 apart) of one block, hit distinct banks.
    __shared__ float2 wab[MMQ_KB][MMQ_ROWS + MMQ_FPAD];           // (a, b) per block and row
    __shared__ int wsc[MMQ_KB][MMQ_ROWS + MMQ_IPAD];              // Q6_K's scales
    __align__(16) __shared__ int xraw[MMQ_COLS * MMQ_XSTRIDE];    // a token's chunk of block_q8_1
    // columns staged and multiplied: those up to the last valid one (an expert's tile holds
    // about half its columns on a MoE prompt): warps whose 32 columns are all past it skip the
    // mma loop; a warp that holds a valid one multiplies all its 32 (stale values past it, never
    // written). Columns are independent: the same bits.
    const int cols = n_cols;

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
        // Unpack: (row, block) pairs over the threads, a row's blocks on adjacent threads.
        for (int it = threadIdx.x; it < MMQ_ROWS * MMQ_KB; it += MMQ_THREADS) {
            const int r = it / MMQ_KB, kb = it % MMQ_KB;
            if (kb < n_kb) {
                const u8 * row = w + (i64) min(row0 + r, p.n_rows - 1) * p.row_bytes;
                MmqWeightBlock o;
                mmq_unpack<TYPE>(row, kb0 + kb, o);
                mmq_store_block(wq + r * MMQ_STRIDE + kb * 8, kb, o.q);
                wab[kb][r] = make_float2(o.a, o.b);
                if constexpr (mmq_reads_sc<TYPE>) wsc[kb][r] = o.sc;
            }
        }
        if (MMQ_X_WIDE) {
            constexpr int V = 9 * MMQ_KB / 4;       // 16-byte words per token's chunk
            for (int it = threadIdx.x; it < cols * V; it += MMQ_THREADS) {
                const int c = it / V, v = it % V;
                const int xr = colx[c];
                *(int4 *) (xraw + c * MMQ_XSTRIDE + 4 * v) = ((const int4 *) (x + (i64) xr * nb + kb0))[v];
            }
        } else {
            const int words = 9 * n_kb;
            for (int it = threadIdx.x; it < cols * words; it += MMQ_THREADS) {
                const int c = it / words, v = it % words;
                const int xr = colx[c];
                xraw[c * MMQ_XSTRIDE + v] = ((const int *) (x + (i64) xr * nb + kb0))[v];
            }
        }
        __syncthreads();

        const int kb_end = wc >= cols ? 0 : n_kb;     // (a warp of padding only: none)
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
                const int * c = xraw + (wc + 8 * n + g) * MMQ_XSTRIDE + 9 * kb + 1;   // the block's qs
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
                    const u32 ds = (u32) xraw[c * MMQ_XSTRIDE + 9 * kb];      // d, s (halves)
                    d8[n][j] = f16_to_f32((u16) (ds & 0xFFFF)); s8[n][j] = 0.0f; is[n][j] = 0;
                    if constexpr (mmq_reads_s8<TYPE>) s8[n][j] = f16_to_f32((u16) (ds >> 16));
                }
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

    mmq_store(acc, y, p, row0 + wr, wc, g, t, coly);
}

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
        // S slots in turn (one dependent load each) its blocks ran on alone for a long tail,
        // the SMs idle most of the kernel's time. Out-of-range ids are rare, so a slot's rows
        // from one thread.
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
    MmqTile p;
    p.n_rows = q.n_rows; p.k = q.k; p.row_bytes = q.row_bytes;
    mmq_tile<TYPE>(w + (i64) e * q.expert_bytes, x, y, p, colx, coly, n);
}

#define DEFINE_MMQ(name, TYPE)                                                                     \
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
