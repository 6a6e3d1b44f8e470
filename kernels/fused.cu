// Fused kernels of a decoder layer: each does, in one launch, what several backend ops do one
// after another, with the same float32 operations in the same order as those ops' kernels
// (norm.cu, rope.cu, attention.cu's kv_store, router.cu), so fusion changes no number.
//
//   add_rms_norm   residual add (then a scalar factor) + RMS norm (+ the normed row as Q8_1
//                  blocks for the mat-vecs)
//   moe_norms      gemma4's two norms of a MoE layer's residual: the experts' input and the
//                  router's (weightless norm, a scalar factor, a weight), from one sum of squares
//   rope_store     q/k head norms + rope of q and k + K/V cache writes
//   moe_route      router softmax + top-k + renormalised, scaled expert weights
//   decode_advance greedy decoding on the device: argmax -> next token, position + 1
#include "common.cuh"
#include "params.cuh"
#include "route.cuh"

#define FUSED_NORM_THREADS 1024
#define ROPE_STORE_THREADS 128
// moe_route took the same time on 32 and on 256 threads (a decode step of the 30B-A3B shape).
#define ROUTE_THREADS 128

// One block per row. Element i is handled by thread i % 1024 in every pass, so a warp holds
// whole 32-value blocks in lane order and quantizes them as the quantize kernel would.
extern "C" __global__ void __launch_bounds__(FUSED_NORM_THREADS)
add_rms_norm(const float * __restrict__ a, const float * __restrict__ b, const float * __restrict__ w,
             const float * __restrict__ sc, float * __restrict__ sum, float * __restrict__ y,
             block_q8_1 * __restrict__ yq, const AddNormParams p) {
    PDL_ENTRY();
    __shared__ double partial[FUSED_NORM_THREADS / WARP_SIZE];
    const i64 base = (i64) blockIdx.x * p.n_cols;
    const bool own_sum = p.has_residual || p.has_scale;       // else sum is a itself
    double ss = 0.0;
    for (int i = threadIdx.x; i < p.n_cols; i += FUSED_NORM_THREADS) {
        float s = p.has_residual ? __fadd_rn(a[base + i], b[base + i]) : a[base + i];
        if (p.has_scale) s = __fmul_rn(s, sc[0]);          // as the mul op, after the add
        if (own_sum) sum[base + i] = s;
        const double v = s;
        ss += v * v;
    }
    ss = block_sum_f64<FUSED_NORM_THREADS>(ss, partial);
    const float mean = (float) (ss / p.n_cols);
    const float scale = 1.0f / sqrtf(__fadd_rn(mean, p.eps));
    const float * src = own_sum ? sum : a;
    for (int i = threadIdx.x; i < p.n_cols; i += FUSED_NORM_THREADS) {
        const float v = __fmul_rn(__fmul_rn(src[base + i], scale), w[i]);
        y[base + i] = v;
        // n_cols is a multiple of 32 when write_q8 is set: whole warps take this branch.
        if (p.write_q8) quantize_warp_q8_1(v, yq + (base + i) / QK8_1);
    }
}

// One block per row of x: h = rms_norm(x) * w (and its Q8_1 blocks), r = ((rms_norm(x) *
// factor) * w_router), the float32 operations of rms_norm, rms_norm without a weight, scale
// and mul in their order, the sum of squares (as add_rms_norm's) shared by both.
extern "C" __global__ void __launch_bounds__(FUSED_NORM_THREADS)
moe_norms(const float * __restrict__ x, const float * __restrict__ w, const float * __restrict__ w_router,
          float * __restrict__ h, block_q8_1 * __restrict__ hq, float * __restrict__ r, const MoeNormsParams p) {
    PDL_ENTRY();
    __shared__ double partial[FUSED_NORM_THREADS / WARP_SIZE];
    const i64 base = (i64) blockIdx.x * p.n_cols;
    double ss = 0.0;
    for (int i = threadIdx.x; i < p.n_cols; i += FUSED_NORM_THREADS) {
        const double v = x[base + i];
        ss += v * v;
    }
    ss = block_sum_f64<FUSED_NORM_THREADS>(ss, partial);
    const float mean = (float) (ss / p.n_cols);
    const float scale = 1.0f / sqrtf(__fadd_rn(mean, p.eps));
    for (int i = threadIdx.x; i < p.n_cols; i += FUSED_NORM_THREADS) {
        const float n = __fmul_rn(x[base + i], scale);
        const float v = __fmul_rn(n, w[i]);
        h[base + i] = v;
        r[base + i] = __fmul_rn(__fmul_rn(n, p.factor), w_router[i]);
        // n_cols is a multiple of 32 when write_q8 is set: whole warps take this branch.
        if (p.write_q8) quantize_warp_q8_1(v, hq + (base + i) / QK8_1);
    }
}

// Blocks [0, H) of a token take its query heads, [H, H + H_kv) its key heads and
// [H + H_kv, H + 2 H_kv) its value heads. q (and k) heads: optional RMS norm over the head
// (double sum of squares, as rms_norm), then rope; q goes to q_out, k to the F16 pool at
// kv_row(table, pos[t]) (and to k_out when write_k); v heads go to theirs as they are.
// per_row: token t's sequence has block table row t (table + t * table_stride; a batched
// decode step, every row's sequence in the same pools).
extern "C" __global__ void __launch_bounds__(ROPE_STORE_THREADS)
rope_store(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v,
           const float * __restrict__ qn, const float * __restrict__ kn, const int * __restrict__ pos,
           float * __restrict__ q_out, float * __restrict__ k_out, u16 * __restrict__ k_cache,
           u16 * __restrict__ v_cache, const int * __restrict__ table, const RopeStoreParams p) {
    PDL_ENTRY();
    extern __shared__ float row[];          // [head_dim]: the head after its norm
    __shared__ double partial[ROPE_STORE_THREADS / WARP_SIZE];
    const int t = blockIdx.y, hb = blockIdx.x;
    if (p.per_row) table += (i64) t * p.table_stride;   // a batched decode step: token t's sequence
    const int slot = pos[t];
    const bool slot_ok = slot >= 0 && slot < p.capacity && kv_held(table, slot);
    const i64 pool_row = slot_ok ? kv_row(table, slot) : 0;
    if (hb >= p.n_heads + p.n_kv_heads) {
        const int h = hb - p.n_heads - p.n_kv_heads;
        const float * src = v + ((i64) t * p.n_kv_heads + h) * p.head_dim_v;
        if (slot_ok) {
            u16 * dst = v_cache + (pool_row * p.n_kv_heads + h) * p.head_dim_v;
            for (int d = threadIdx.x; d < p.head_dim_v; d += ROPE_STORE_THREADS) dst[d] = f32_to_f16(src[d]);
        }
        return;
    }
    const bool is_q = hb < p.n_heads;
    const int h = is_q ? hb : hb - p.n_heads;
    const int n_h = is_q ? p.n_heads : p.n_kv_heads;
    const float * src = (is_q ? q : k) + ((i64) t * n_h + h) * p.head_dim;
    float * out = is_q ? q_out + ((i64) t * n_h + h) * p.head_dim
                       : (p.write_k ? k_out + ((i64) t * n_h + h) * p.head_dim : nullptr);
    u16 * cache = (!is_q && slot_ok) ? k_cache + (pool_row * p.n_kv_heads + h) * p.head_dim : nullptr;
    norm_rope_head<ROPE_STORE_THREADS>(src, is_q ? qn : kn, is_q ? p.q_norm : p.k_norm, p.head_dim, p.n_rot,
                                       p.neox, p.theta_scale, p.freq_scale, p.eps, slot, row, partial, out, cache);
}

// One block per token: route_row (route.cuh) on its row of logits.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
moe_route(const float * __restrict__ logits, float * __restrict__ probs, int * __restrict__ ids,
          float * __restrict__ weights, const MoeRouteParams p) {
    PDL_ENTRY();
    const i64 t = blockIdx.x;
    route_row<ROUTE_THREADS>(logits + t * p.n_experts, probs + t * p.n_experts, ids + t * p.k,
                             weights + t * p.k, p.n_experts, p.k, p.norm, p.scale);
}

// One thread: the argmax of this step is the token of the next position.
extern "C" __global__ void decode_advance(const int * __restrict__ next, int * __restrict__ tok,
                                          int * __restrict__ pos, int * __restrict__ history,
                                          const AdvanceParams p) {
    PDL_ENTRY();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    /* the chosen token becomes the next step's input at the next position, and is kept in the
       history at that position (while it fits) */
    const int n = next[0], p1 = pos[0] + 1;
    tok[0] = n;
    pos[0] = p1;
    if (p1 >= 0 && p1 < p.capacity) history[p1] = n;
}

extern "C" __global__ void decode_set(int * __restrict__ tok, int * __restrict__ pos, const DecodeSetParams p) {
    PDL_ENTRY();
    if (threadIdx.x == 0 && blockIdx.x == 0) { tok[0] = p.tok; pos[0] = p.pos; }
}
