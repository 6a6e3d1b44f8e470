// Causal GQA softmax attention of a prompt (T >= 2 queries of one sequence) in tiles, on
// tensor cores: the same function as `attention` in attention.cu, with the same roundings
// where they matter, but without its row of logits in shared memory (no limit from the context
// length) and with K.Q and P.V as f16 `mma.sync.m16n8k16` with float32 accumulation.
//
// The function (as attention.cu and the numpy reference): query t of head h sees positions
// s with s <= pos[t], pos[t] - s < window when window > 0, and s <= capacity - 1; head h reads
// KV head h / (H / H_kv). The caches are paged (common.cuh): position s is row kv_row(table, s)
// of the layer's pool, so a tile's rows come from as many blocks as it spans (a row's address
// is looked up in the block table as its copy is issued). Q is rounded to F16 before K.Q (the products of two halves are exact
// in float32; the tensor core adds them in float32 in its own order, as the old kernel adds in
// its own); logit = dot * scale in float32; the softmax is normalised BEFORE its rounding to
// F16: p = f16(exp(l - m) / sum); out = sum_s p_s v_s in float32.
//
// Tiles: a block of 4 warps takes BQ = 64 queries of one head (16 rows per warp: the m16 of
// the mma) and walks the cache slots the block can see in tiles of BK = 64 slots (32 when a
// head dim is 256, so that the warp's 16 x DV float32 output stays in registers: 128 of them
// at DV = 256). 64 x 64 gives each K/V tile staged in shared memory 4 warps to serve (each
// element of K feeds 64 query rows, so loads are 1/64 of the mma work), keeps the logits of a
// warp in 32 registers, and makes 8 x 16 = 128 blocks at 512 tokens of 16 heads: one block per
// SM of an H200. Tiles of K and V are copied with cp.async into two buffers, the next tile's
// copy in flight while the current one is multiplied; rows are XOR-swizzled by 16-byte chunk
// (chunk c of row r at c ^ (r % 8)) so that ldmatrix's eight rows fall on distinct banks
// without padding. Shared memory: 2 * (BQ * D + 2 * BK * (D + DV)) bytes (Q, two K and two V
// tiles), at least the 4 * BQ * (DV + 8) of the output staging that overlays it at the end;
// independent of the number of slots (96 KiB at most, D = DV = 256: within the 99 KiB of
// sm_86/89/120). A block walks the slots [min lo, max hi] over its rows (one sequence's prompt:
// contiguous); a warp skips a tile none of its rows sees and drops the mask on a tile all its
// rows see whole. A row that sees no slot gets zeros, as in attention.cu.
//
// The normalised probabilities are needed before V is read, so each block makes two passes
// over its slots. Pass 1 computes each row's max m and sum of exp(l - m) online: per tile the
// new max, each thread's 2 x BK/8 exponentials of a row (at most 16) summed in float32, that
// partial added to a running sum in double, which is rescaled by exp(m_old - m_new) when the
// max grows; at the end the four lanes of a row add their sums in lane order. Double, because
// the reference adds its float32 exponentials in float64 and the old kernel in double: a
// float32 running sum of thousands of tiles would drift by up to n * 2^-24 relative and move
// every probability of the row with it; the float32 partials of at most 16 terms (2^-24
// relative each) and one double add per tile cost little, where a double operation per
// element would be the slowest instruction of the loop on GPUs with 1/64-rate FP64. Pass 2
// recomputes the logits of each tile (the same instructions on the same data, so the same
// bits: m bounds them all), forms p = f16(exp(l - m) * (1 / sum)), the reciprocal of the
// double sum rounded to float32 once per row (the old kernel divides each term in double; the
// product differs from that quotient by at most ~1.5 float32 ulp, which flips an F16 rounding
// only within that distance of a rounding boundary, as the float32 order of the dot products
// already does: kernels/cases.py ATTENTION), and accumulates P.V with the probabilities taken
// straight from the logit registers as the A fragments (the C layout of two n8 tiles is the A
// layout of one k16 step). Where the rounding to F16 happens is invisible to ATTENTION (any
// placement errs by at most an F16 ulp); kernels/cases.py ATTENTION_UNIFORM's rows of equal
// logits see it. The output goes through shared memory so that whole warps hold 32
// consecutive values in lane order for quantize_warp_q8_1, as attention.cu writes its Q8_1
// blocks.
//
// Needs sm_80 (cp.async, f16 mma with float32 accumulation; ldmatrix is sm_75). Kernels
// attention_tiled_<D>_<DV>; head dims it lacks keep attention.cu (engine/backends/cuda/
// attention_tiled.py says which). conformance/harness/attn_host.py runs this source on the CPU.
#include "common.cuh"
#include "params.cuh"

#define ATTN_TILED_THREADS 128
#define ATTN_TILED_BQ 64
#define ATTN_TILED_BK(D, DV) (((D) > 128 || (DV) > 128) ? 32 : 64)
#define ATTN_TILED_MAX(a, b) ((a) > (b) ? (a) : (b))
#define ATTN_TILED_SMEM(D, DV) ATTN_TILED_MAX(2 * (ATTN_TILED_BQ * (D) + 2 * ATTN_TILED_BK(D, DV) * ((D) + (DV))), \
                                              4 * ATTN_TILED_BQ * ((DV) + 8))

// ---- the only inline PTX of this file (conformance/harness/attn_host.py replaces each statement) --

// The shared-window address of a generic pointer into shared memory (what ldmatrix and
// cp.async take).
__device__ __forceinline__ u32 attn_smem_u32(const void * p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronously (L2 only: every tile is read once per block).
__device__ __forceinline__ void attn_cp_async16(const u32 dst, const void * src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void attn_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void attn_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Four 8x8 matrices of halves; lanes 8i..8i+7 give the row addresses of matrix i. Lane l gets
// in r[i] row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i (the lower column in the low half).
__device__ __forceinline__ void attn_ldmatrix_x4(u32 (&r)[4], const u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The same, transposed: lane l gets rows 2(l%4) and 2(l%4)+1 of column l/4 of matrix i.
__device__ __forceinline__ void attn_ldmatrix_x4_trans(u32 (&r)[4], const u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += A (16x16, row) B (16x8, col), halves in, float32 out. Fragments (PTX ISA, mma.m16n8k16
// .f16; g = lane / 4, t = lane % 4, each 32-bit register two halves, the lower index low):
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
// b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1].
__device__ __forceinline__ void attn_mma(float (&d)[4], const u32 (&a)[4], const u32 b0, const u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- tiles ----------------------------------------------------------------------------------

__device__ __forceinline__ u32 attn_pack_f16(const float lo, const float hi) {
    return (u32) f32_to_f16(lo) | ((u32) f32_to_f16(hi) << 16);
}

// Element offset of 16-byte chunk `ch` of row `r` in a swizzled tile of rows of W halves.
template <int W>
__device__ __forceinline__ int attn_swz(const int r, const int ch) {
    return r * W + ((ch ^ (r & 7)) << 3);
}

// The same for chunk c8 + c (c8 a multiple of 8, known at compile time in the unrolled loops;
// c < 8): the XOR touches only c, so the loops over c8 need no more offsets than values of c.
template <int W>
__device__ __forceinline__ int attn_swz8(const int r, const int c8, const int c) {
    return r * W + (c8 << 3) + ((c ^ (r & 7)) << 3);
}

// Positions s0 .. s0 + BK - 1 of one KV head (position s at src + kv_row(table, s) * stride,
// W halves) into a swizzled tile; rows past `hi` (the last slot the block can see) are zeros,
// never read from the pool (nor their block table entries). Thread i copies chunk i % C of
// rows i / C, i / C + NT / C, ...
template <int W, int BK>
__device__ __forceinline__ void attn_load_tile(u16 * dst, const u16 * src, const int * table, const i64 stride,
                                               const int s0, const int hi) {
    constexpr int C = W / 8, RP = ATTN_TILED_THREADS / C;
    static_assert(ATTN_TILED_THREADS % C == 0 && BK % RP == 0, "whole rows per pass");
    const int r0 = threadIdx.x / C, ch = threadIdx.x % C;
#pragma unroll
    for (int i = 0; i < BK / RP; ++i) {
        const int r = r0 + i * RP;
        u16 * d = dst + attn_swz<W>(r, ch);
        if (s0 + r <= hi) attn_cp_async16(attn_smem_u32(d), src + kv_row(table, s0 + r) * stride + ch * 8);
        else *(int4 *) d = make_int4(0, 0, 0, 0);
    }
}

// Logits of the warp's 16 query rows (qw: its rows of the Q tile) against a K tile:
// s[n] is the C fragment of slots 8n .. 8n + 7.
template <int D, int BK>
__device__ __forceinline__ void attn_qk(float (&s)[BK / 8][4], const u16 * qw, const u16 * kt, const int lane) {
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[4];      // matrices: rows 0-7 / 8-15 of dims 16kk..+7, then of dims 16kk+8..+15
        attn_ldmatrix_x4(a, attn_smem_u32(qw + attn_swz8<D>((lane / 8 % 2) * 8 + lane % 8, kk / 4 * 8,
                                                           2 * (kk % 4) + lane / 16)));
#pragma unroll
        for (int nn = 0; nn < BK / 16; ++nn) {
            u32 b[4];  // slots 16nn..+7: dims 16kk..+7, 16kk+8..+15; then slots 16nn+8..+15
            attn_ldmatrix_x4(b, attn_smem_u32(kt + attn_swz8<D>(nn * 16 + (lane / 16) * 8 + lane % 8, kk / 4 * 8,
                                                                 2 * (kk % 4) + lane / 8 % 2)));
            attn_mma(s[2 * nn], a, b[0], b[1]);
            attn_mma(s[2 * nn + 1], a, b[2], b[3]);
        }
    }
}

// o += P V for the warp's 16 rows: pk[j] the A fragment of slots 16j .. 16j + 15, vt a V tile.
template <int DV, int BK>
__device__ __forceinline__ void attn_pv(float (&o)[DV / 8][4], const u32 (&pk)[BK / 16][4], const u16 * vt,
                                        const int lane) {
#pragma unroll
    for (int dn = 0; dn < DV / 16; ++dn) {
#pragma unroll
        for (int j = 0; j < BK / 16; ++j) {
            u32 b[4];  // transposed: slots 16j..+7 / 16j+8..+15 of dims 16dn..+7, then of 16dn+8..+15
            attn_ldmatrix_x4_trans(b, attn_smem_u32(vt + attn_swz8<DV>(16 * j + (lane / 8 % 2) * 8 + lane % 8,
                                                                        dn / 4 * 8, 2 * (dn % 4) + lane / 16)));
            attn_mma(o[2 * dn], pk[j], b[0], b[1]);
            attn_mma(o[2 * dn + 1], pk[j], b[2], b[3]);
        }
    }
}

// Block (h, y): head h, queries t0 .. t0 + BQ - 1 with t0 = (gridDim.y - 1 - y) * BQ (the
// last query tiles, which see the most slots, are scheduled first). Dynamic shared memory:
// ATTN_TILED_SMEM(D, DV) bytes.
template <int D, int DV>
__device__ __forceinline__ void attention_tiled_body(const float * __restrict__ q, const u16 * __restrict__ k_cache,
                                                     const u16 * __restrict__ v_cache, const int * __restrict__ pos,
                                                     const int * __restrict__ table, float * __restrict__ out,
                                                     block_q8_1 * __restrict__ out_q, const AttentionTiledParams & p) {
    constexpr int BQ = ATTN_TILED_BQ, BK = ATTN_TILED_BK(D, DV), NT = ATTN_TILED_THREADS;
    constexpr int KC = D / 8;                  // 16-byte chunks of a Q / K row
    constexpr int SN = BK / 8, ON = DV / 8;    // n8 tiles of the logits, of the output
    constexpr int OS = DV + 8;                 // row stride of the output staging (floats): the
                                               // float2 stores of a half-warp on distinct banks
    static_assert(D % 64 == 0 && DV % 64 == 0, "rows of at least 8 chunks (the swizzle), whole k16 steps");
    static_assert(BQ == 16 * (NT / WARP_SIZE), "16 query rows per warp");
    static_assert(4 * BQ * OS <= ATTN_TILED_SMEM(D, DV), "the output staging fits");

    extern __shared__ __align__(16) u8 attn_smem[];
    u16 * const qs = (u16 *) attn_smem;        // [BQ][D] the queries, rounded to F16
    u16 * const ks = qs + BQ * D;              // [2][BK][D] K tiles
    u16 * const vs = ks + 2 * BK * D;          // [2][BK][DV] V tiles
    float * const os = (float *) attn_smem;    // [BQ][OS] the output, after both passes
    __shared__ int row_lo[BQ], row_hi[BQ];     // visible slots of each query row
    __shared__ double row_sum[2][NT];          // each thread's sums of its two rows

    const float NEG_INF = -__int_as_float(0x7f800000);
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int tq = lane % 4;
    const int r0 = warp * 16 + lane / 4, r1 = r0 + 8;   // this thread's two rows of the tile
    const int h = blockIdx.x;
    const int t0 = (int) (gridDim.y - 1 - blockIdx.y) * BQ;
    const int h_kv = h / (p.n_heads / p.n_kv_heads);
    const i64 k_stride = (i64) p.n_kv_heads * D, v_stride = (i64) p.n_kv_heads * DV;
    const u16 * const kb = k_cache + (i64) h_kv * D;
    const u16 * const vb = v_cache + (i64) h_kv * DV;

    if (tid < BQ) {
        const int t = t0 + tid;
        int lo = 0x7fffffff, hi = -1;           // rows past the prompt see nothing
        if (t < p.n_tokens) {
            const int ps = pos[t];
            hi = min(ps, p.capacity - 1);
            lo = p.window > 0 ? max(0, ps - p.window + 1) : 0;
        }
        row_lo[tid] = lo;
        row_hi[tid] = hi;
    }
#pragma unroll
    for (int i = 0; i < BQ * KC / NT; ++i) {
        const int c = tid + i * NT;
        const int r = c / KC, ch = c % KC, t = t0 + r;
        int4 w = make_int4(0, 0, 0, 0);
        if (t < p.n_tokens) {
            const float4 * src = (const float4 *) (q + ((i64) t * p.n_heads + h) * D) + 2 * ch;
            const float4 a = src[0], b = src[1];
            w = make_int4((int) attn_pack_f16(a.x, a.y), (int) attn_pack_f16(a.z, a.w),
                          (int) attn_pack_f16(b.x, b.y), (int) attn_pack_f16(b.z, b.w));
        }
        *(int4 *) (qs + attn_swz<D>(r, ch)) = w;
    }
    __syncthreads();

    // The slots the block sees, [lo_b, hi_b]; the warp's [lo_w, hi_w] (a tile outside it is
    // skipped) and [lo_all, hi_all], seen by all its rows (a tile inside it needs no mask).
    int lo_b = 0x7fffffff, hi_b = -1, lo_w = 0x7fffffff, hi_w = -1, lo_all = -1, hi_all = 0x7fffffff;
    for (int r = 0; r < BQ; ++r) {
        const int lo = row_lo[r], hi = row_hi[r];
        lo_b = min(lo_b, lo);
        hi_b = max(hi_b, hi);
        if (r / 16 == warp) {
            lo_w = min(lo_w, lo);
            hi_w = max(hi_w, hi);
            lo_all = max(lo_all, lo);
            hi_all = min(hi_all, hi);
        }
    }
    const int lo0 = row_lo[r0], hi0 = row_hi[r0], lo1 = row_lo[r1], hi1 = row_hi[r1];
    const int n_tiles = hi_b >= lo_b ? (hi_b - lo_b) / BK + 1 : 0;
    const u16 * const qw = qs + warp * 16 * D;

    // ---- pass 1: each row's max and sum of exp(l - max) ----------------------------------
    float m0 = NEG_INF, m1 = NEG_INF;
    double l0 = 0.0, l1 = 0.0;
    if (n_tiles > 0) attn_load_tile<D, BK>(ks, kb, table, k_stride, lo_b, hi_b);
    attn_cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        if (it + 1 < n_tiles)
            attn_load_tile<D, BK>(ks + ((it + 1) & 1) * BK * D, kb, table, k_stride, lo_b + (it + 1) * BK, hi_b);
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        const int s0 = lo_b + it * BK;
        if (s0 <= hi_w && s0 + BK - 1 >= lo_w) {
            const bool full = s0 >= lo_all && s0 + BK - 1 <= hi_all;
            float s[SN][4];
            attn_qk<D, BK>(s, qw, ks + (it & 1) * BK * D, lane);
            float tm0 = NEG_INF, tm1 = NEG_INF;
#pragma unroll
            for (int n = 0; n < SN; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int sl = s0 + 8 * n + 2 * tq + e;
                    const float x0 = __fmul_rn(s[n][e], p.scale), x1 = __fmul_rn(s[n][2 + e], p.scale);
                    s[n][e] = full || (sl >= lo0 && sl <= hi0) ? x0 : NEG_INF;
                    s[n][2 + e] = full || (sl >= lo1 && sl <= hi1) ? x1 : NEG_INF;
                    tm0 = fmaxf(tm0, s[n][e]);
                    tm1 = fmaxf(tm1, s[n][2 + e]);
                }
            }
            // the four lanes of a quad hold one row
            tm0 = fmaxf(tm0, __shfl_xor_sync(0xffffffffu, tm0, 1));
            tm0 = fmaxf(tm0, __shfl_xor_sync(0xffffffffu, tm0, 2));
            tm1 = fmaxf(tm1, __shfl_xor_sync(0xffffffffu, tm1, 1));
            tm1 = fmaxf(tm1, __shfl_xor_sync(0xffffffffu, tm1, 2));
            const float mn0 = fmaxf(m0, tm0), mn1 = fmaxf(m1, tm1);
            if (mn0 != NEG_INF) {               // masked logits are -inf: exp gives 0
                float part = 0.0f;
#pragma unroll
                for (int n = 0; n < SN; ++n) part += expf(__fsub_rn(s[n][0], mn0)) + expf(__fsub_rn(s[n][1], mn0));
                if (mn0 > m0) l0 *= (double) expf(__fsub_rn(m0, mn0));
                l0 += (double) part;
                m0 = mn0;
            }
            if (mn1 != NEG_INF) {
                float part = 0.0f;
#pragma unroll
                for (int n = 0; n < SN; ++n) part += expf(__fsub_rn(s[n][2], mn1)) + expf(__fsub_rn(s[n][3], mn1));
                if (mn1 > m1) l1 *= (double) expf(__fsub_rn(m1, mn1));
                l1 += (double) part;
                m1 = mn1;
            }
        }
        __syncthreads();
    }
    row_sum[0][tid] = l0;
    row_sum[1][tid] = l1;
    __syncthreads();
    // the row's sum over its quad, in lane order (the same bits in all four lanes)
    const int quad = tid & ~3;
    const double sum0 = ((row_sum[0][quad] + row_sum[0][quad + 1]) + row_sum[0][quad + 2]) + row_sum[0][quad + 3];
    const double sum1 = ((row_sum[1][quad] + row_sum[1][quad + 1]) + row_sum[1][quad + 2]) + row_sum[1][quad + 3];
    const float inv0 = (float) (1.0 / sum0), inv1 = (float) (1.0 / sum1);

    // ---- pass 2: p = f16(exp(l - m) / sum), o += P V --------------------------------------
    float o[ON][4];
#pragma unroll
    for (int n = 0; n < ON; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    if (n_tiles > 0) {
        attn_load_tile<D, BK>(ks, kb, table, k_stride, lo_b, hi_b);
        attn_load_tile<DV, BK>(vs, vb, table, v_stride, lo_b, hi_b);
    }
    attn_cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        if (it + 1 < n_tiles) {
            const int nb = (it + 1) & 1, ns = lo_b + (it + 1) * BK;
            attn_load_tile<D, BK>(ks + nb * BK * D, kb, table, k_stride, ns, hi_b);
            attn_load_tile<DV, BK>(vs + nb * BK * DV, vb, table, v_stride, ns, hi_b);
        }
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        const int s0 = lo_b + it * BK;
        if (s0 <= hi_w && s0 + BK - 1 >= lo_w) {
            const bool full = s0 >= lo_all && s0 + BK - 1 <= hi_all;
            float s[SN][4];
            attn_qk<D, BK>(s, qw, ks + (it & 1) * BK * D, lane);
            u32 pk[BK / 16][4];
#pragma unroll
            for (int n = 0; n < SN; ++n) {
                float pr[4];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int sl = s0 + 8 * n + 2 * tq + e;
                    const bool v0 = full || (sl >= lo0 && sl <= hi0), v1 = full || (sl >= lo1 && sl <= hi1);
                    pr[e] = v0 ? __fmul_rn(expf(__fsub_rn(__fmul_rn(s[n][e], p.scale), m0)), inv0) : 0.0f;
                    pr[2 + e] = v1 ? __fmul_rn(expf(__fsub_rn(__fmul_rn(s[n][2 + e], p.scale), m1)), inv1) : 0.0f;
                }
                pk[n / 2][2 * (n % 2)] = attn_pack_f16(pr[0], pr[1]);       // row g
                pk[n / 2][2 * (n % 2) + 1] = attn_pack_f16(pr[2], pr[3]);   // row g + 8
            }
            attn_pv<DV, BK>(o, pk, vs + (it & 1) * BK * DV, lane);
        }
        __syncthreads();
    }
    attn_cp_async_wait<0>();
    __syncthreads();

    // ---- the output through shared memory: rows of 32 consecutive values per warp ---------
    float * const ow = os + warp * 16 * OS;
#pragma unroll
    for (int n = 0; n < ON; ++n) {
        *(float2 *) (ow + (lane / 4) * OS + 8 * n + 2 * tq) = make_float2(o[n][0], o[n][1]);
        *(float2 *) (ow + (lane / 4 + 8) * OS + 8 * n + 2 * tq) = make_float2(o[n][2], o[n][3]);
    }
    __syncthreads();
    for (int r = 0; r < 16; ++r) {
        const int t = t0 + warp * 16 + r;
        if (t >= p.n_tokens) break;             // the same for the whole warp
        const i64 base = ((i64) t * p.n_heads + h) * DV;
#pragma unroll
        for (int c = 0; c < DV / 32; ++c) {
            const float v = ow[r * OS + 32 * c + lane];
            out[base + 32 * c + lane] = v;
            if (p.write_q8) quantize_warp_q8_1(v, out_q + (base + 32 * c) / QK8_1);
        }
    }
}

#define ATTN_TILED_KERNEL(NAME, D, DV)                                                                 \
extern "C" __global__ void __launch_bounds__(ATTN_TILED_THREADS, 1)                                     \
attention_tiled_##NAME(const float * __restrict__ q, const u16 * __restrict__ k_cache,                 \
                       const u16 * __restrict__ v_cache, const int * __restrict__ pos,                 \
                       const int * __restrict__ table, float * __restrict__ out,                       \
                       block_q8_1 * __restrict__ out_q, const AttentionTiledParams p) {                \
    PDL_ENTRY();                                                                                       \
    attention_tiled_body<D, DV>(q, k_cache, v_cache, pos, table, out, out_q, p);                       \
}

ATTN_TILED_KERNEL(64_64, 64, 64)
ATTN_TILED_KERNEL(128_128, 128, 128)
ATTN_TILED_KERNEL(256_256, 256, 256)
ATTN_TILED_KERNEL(64_128, 64, 128)
ATTN_TILED_KERNEL(128_64, 128, 64)
ATTN_TILED_KERNEL(128_256, 128, 256)
ATTN_TILED_KERNEL(256_128, 256, 128)
