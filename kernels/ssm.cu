// The gated delta-net layers of the hybrid models (qwen35, qwen35moe): the causal conv1d over
// time with its carried window, the gated delta rule, and the unary activations around them.
// Each mirrors its numpy twin (engine/backends/numpy_backend.py) operation by operation in
// float32; the _rn intrinsics keep multiplies and adds from fusing into FMAs.
//
//   unary            y = sigmoid / softplus / silu (x)
//   delta_net_gates  the delta rule's gates: sigmoid(beta), softplus(alpha + dt_bias) * a
//   ssm_conv         y[t, c] = sum_i X[t + i, c] w[c, i], X = [state (K-1 rows); x]; state <- last K-1 rows of X;
//                    with p.silu, silu(y) (ssm_conv_silu: the delta-net's q, k and v)
//   gated_delta_net_<D>  the delta rule over the tokens in order, a block per (value head, 32 rows)
//
// A prompt graph of a length class (engine/model.py ClassStep) reads n_tokens rows of which
// only the first *n_real are the prompt's (the rest pad it to its class): the carried state
// (conv window, delta-rule matrix) is the state after exactly those real rows, as an eager
// read of them leaves it. *n_real is device memory, rewritten before each replay; an eager
// read passes a word holding INT_MAX (every row real).
#include "common.cuh"
#include "params.cuh"

#define EW_THREADS 256
#define SSM_CONV_THREADS 128
#define SSM_CONV_TOKENS 16      // tokens a thread; at least the window's K-1 rows (checked by the host)

extern "C" __global__ void __launch_bounds__(EW_THREADS)
unary(const float * __restrict__ x, float * __restrict__ y, const UnaryParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        const float v = x[i];
        y[i] = p.op == 0 ? sigmoid_f(v) : p.op == 1 ? softplus_f(v) : silu_f(v);
    }
}

// The delta rule's gates in one pass, each the float32 op of the kernel it replaces in order
// (unary sigmoid; add, unary softplus, mul): beta_out = sigmoid(beta), g = softplus(alpha +
// dt_bias) * a, the per-head vectors repeating every n_heads elements.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
delta_net_gates(const float * __restrict__ beta, const float * __restrict__ alpha, const float * __restrict__ dt_bias,
                const float * __restrict__ a, float * __restrict__ beta_out, float * __restrict__ g,
                const DeltaGatesParams p) {
    PDL_ENTRY();
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        const int h = (int) (i % p.n_heads);
        beta_out[i] = sigmoid_f(beta[i]);
        g[i] = __fmul_rn(softplus_f(__fadd_rn(alpha[i], dt_bias[h])), a[h]);
    }
}

// A thread per (channel, SSM_CONV_TOKENS tokens): blockIdx.y picks the tokens. A thread per
// channel walking every token in turn left a prompt's 8,192 channels on 64 blocks, each
// thread 512 tokens deep (the 9B's prompt spent ~330 us a layer there). Row j of X is state
// row j (j < K-1) or x row j - (K-1). Only the first token block (blockIdx.y == 0) reads the
// old state, since the others start at row SSM_CONV_TOKENS >= K-1, and only it writes the
// new one, after its own reads: no other block can see the window change under it.
extern "C" __global__ void __launch_bounds__(SSM_CONV_THREADS)
ssm_conv(const float * __restrict__ x, float * __restrict__ state, const float * __restrict__ w,
         float * __restrict__ y, const int * __restrict__ n_real, const SsmConvParams p) {
    PDL_ENTRY();
    const int c = blockIdx.x * SSM_CONV_THREADS + threadIdx.x;
    if (c >= p.n_channels) return;
    const int C = p.n_channels, K = p.kernel, K1 = K - 1;
    const float * wc = w + (i64) c * K;
#define X_ROW(j) ((j) < K1 ? state[(i64) (j) * C + c] : x[(i64) ((j) - K1) * C + c])
    const int t0 = blockIdx.y * SSM_CONV_TOKENS, t1 = min(p.n_tokens, t0 + SSM_CONV_TOKENS);
    for (int t = t0; t < t1; ++t) {
        float acc = __fmul_rn(X_ROW(t), wc[0]);
        for (int i = 1; i < K; ++i) acc = __fadd_rn(acc, __fmul_rn(X_ROW(t + i), wc[i]));
        y[(i64) t * C + c] = p.silu ? silu_f(acc) : acc;
    }
    if (blockIdx.y != 0) return;
    // The new window: rows T .. T+K-2 of X (the last K-1 real rows), in increasing j: row
    // T + j >= j of the old state is read before it is overwritten.
    const int T = min(p.n_tokens, *n_real);     // the real rows; y is computed for every row
    for (int j = 0; j < K1; ++j) {
        const float v = X_ROW(T + j);
        state[(i64) j * C + c] = v;
    }
#undef X_ROW
}

// A block per (value head h, GDN_ROWS of its value indices j): row j of the head's state
// (state[h, j, :], column j of S_h) stays in registers over all the tokens, split over
// gdn_lanes(D) adjacent threads of GDN_PART values each (D = 128: two, so that no thread holds
// more than 64 floats of state and nothing spills). The rows are independent of one another:
// spreading a head's D rows over D / GDN_ROWS blocks puts the state's loads on many SMs (one
// block per head, with a thread per row, left most SMs idle on a decode step of Qwen3.6's 32
// heads of 128). A block's rows are one contiguous slab of the state, read and written
// through shared memory in coalesced 16-byte words. The key and query of key head h % Hk
// (tiled) come through shared memory. Per token, as the numpy twin:
//   m *= exp(g);  u = m . k;  delta = (v_j - u) * beta;  m += delta * k;  o_j = (m . q) / sqrt(D)
// Each dot product is summed in GDN_SPLIT interleaved partial sums per thread (a chain of
// dependent adds was most of the step's arithmetic time), then over the row's threads.
#define GDN_ROWS 32
#define GDN_PART 64
#define GDN_SPLIT 4
__host__ __device__ constexpr int gdn_lanes(int D) { return D > GDN_PART ? D / GDN_PART : 1; }

template <int N>
__device__ __forceinline__ float gdn_dot(const float (&m)[N], const float * __restrict__ x) {
    float part[GDN_SPLIT];
#pragma unroll
    for (int s = 0; s < GDN_SPLIT; ++s) part[s] = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) part[i % GDN_SPLIT] = __fadd_rn(part[i % GDN_SPLIT], __fmul_rn(m[i], x[i]));
    float acc = part[0];
#pragma unroll
    for (int s = 1; s < GDN_SPLIT; ++s) acc = __fadd_rn(acc, part[s]);
    return acc;
}

template <int D>
__device__ __forceinline__ void gated_delta_net(const float * __restrict__ q, const float * __restrict__ k,
                                                const float * __restrict__ v, const float * __restrict__ g,
                                                const float * __restrict__ beta, float * __restrict__ state,
                                                float * __restrict__ out, const int * __restrict__ n_real,
                                                const GatedDeltaNetParams p) {
    constexpr int P = gdn_lanes(D), N = D / P;      // threads per row, state values per thread
    // Slab layout: row r at r * LD, its part c at c * (N + 4): 16-byte aligned, and the eight
    // lanes of a 128-bit shared-memory wavefront fall on distinct banks both when a warp
    // stages consecutive words of a row and when each thread reads its own part.
    constexpr int LD = P * (N + 4);
    static_assert(D % GDN_ROWS == 0 && N % 4 == 0 && (P & (P - 1)) == 0, "head size");
    __shared__ float4 slab4[GDN_ROWS * LD / 4];
    float * slab = (float *) slab4;
    __shared__ float ks[D], qs[D];
    const int tid = threadIdx.x, r = tid / P, c = tid % P;
    const int h = blockIdx.x, j = blockIdx.y * GDN_ROWS + r;
    const int Hv = p.n_v_heads, Hk = p.n_k_heads, hk = h % Hk;
    float4 * rows = (float4 *) (state + ((i64) h * D + blockIdx.y * GDN_ROWS) * D);   // the slab in HBM
#pragma unroll 8
    for (int e = tid; e < GDN_ROWS * D / 4; e += GDN_ROWS * P) {
        const int row = e / (D / 4), col = e % (D / 4) * 4;
        *(float4 *) (slab + row * LD + col / N * (N + 4) + col % N) = rows[e];
    }
    __syncthreads();
    float * mine = slab + r * LD + c * (N + 4);
    float m[N];
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        const float4 w = *(const float4 *) (mine + i);
        m[i] = w.x; m[i + 1] = w.y; m[i + 2] = w.z; m[i + 3] = w.w;
    }
    const float scale = __fdiv_rn(1.0f, sqrtf((float) D));
    const int T = min(p.n_tokens, *n_real);     // the rows that update the state
    for (int t = 0; t < T; ++t) {
        __syncthreads();                    // the previous token's ks / qs are read
        for (int d = tid; d < D; d += GDN_ROWS * P) {
            ks[d] = k[((i64) t * Hk + hk) * D + d];
            qs[d] = q[((i64) t * Hk + hk) * D + d];
        }
        __syncthreads();
        const float decay = expf(g[(i64) t * Hv + h]), b = beta[(i64) t * Hv + h];
#pragma unroll
        for (int i = 0; i < N; ++i) m[i] = __fmul_rn(m[i], decay);
        float u = gdn_dot<N>(m, ks + c * N);
#pragma unroll
        for (int o = 1; o < P; o <<= 1) u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, o));
        const float delta = __fmul_rn(__fsub_rn(v[((i64) t * Hv + h) * D + j], u), b);
#pragma unroll
        for (int i = 0; i < N; ++i) m[i] = __fadd_rn(m[i], __fmul_rn(delta, ks[c * N + i]));
        float o = gdn_dot<N>(m, qs + c * N);
#pragma unroll
        for (int s = 1; s < P; s <<= 1) o = __fadd_rn(o, __shfl_xor_sync(0xffffffffu, o, s));
        if (c == 0) out[((i64) t * Hv + h) * D + j] = __fmul_rn(o, scale);
    }
    // The padding rows' outputs: zero (finite: they flow on through the padding rows' layers)
    for (int t = T; t < p.n_tokens; ++t)
        if (c == 0) out[((i64) t * Hv + h) * D + j] = 0.0f;
    // Each thread writes back only the part it read: no barrier needed before.
#pragma unroll
    for (int i = 0; i < N; i += 4) *(float4 *) (mine + i) = make_float4(m[i], m[i + 1], m[i + 2], m[i + 3]);
    __syncthreads();
#pragma unroll 8
    for (int e = tid; e < GDN_ROWS * D / 4; e += GDN_ROWS * P) {
        const int row = e / (D / 4), col = e % (D / 4) * 4;
        rows[e] = *(const float4 *) (slab + row * LD + col / N * (N + 4) + col % N);
    }
}

#define DEFINE_GDN(D)                                                                                  \
extern "C" __global__ void __launch_bounds__(GDN_ROWS * gdn_lanes(D))                                   \
gated_delta_net_##D(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v, \
                    const float * __restrict__ g, const float * __restrict__ beta, float * __restrict__ state, \
                    float * __restrict__ out, const int * __restrict__ n_real, const GatedDeltaNetParams p) { \
    PDL_ENTRY();                                                                                       \
    gated_delta_net<D>(q, k, v, g, beta, state, out, n_real, p);                                       \
}
DEFINE_GDN(32)
DEFINE_GDN(64)
DEFINE_GDN(128)
