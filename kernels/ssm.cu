// The gated delta-net layers of the hybrid models (qwen35, qwen35moe): the causal conv1d over
// time with its carried window, the gated delta rule, and the unary activations around them.
// Each mirrors its numpy twin (engine/backends/numpy_backend.py) operation by operation in
// float32; the _rn intrinsics keep multiplies and adds from fusing into FMAs.
//
//   unary            y = sigmoid / softplus / silu (x)
//   ssm_conv         y[t, c] = sum_i X[t + i, c] w[c, i], X = [state (K-1 rows); x]; state <- last K-1 rows of X
//   gated_delta_net_<D>  the delta rule over the tokens in order, a block per value head
#include "common.cuh"
#include "params.cuh"

#define EW_THREADS 256
#define SSM_CONV_THREADS 128

extern "C" __global__ void __launch_bounds__(EW_THREADS)
unary(const float * __restrict__ x, float * __restrict__ y, const UnaryParams p) {
    for (i64 i = (i64) blockIdx.x * EW_THREADS + threadIdx.x; i < p.n; i += (i64) gridDim.x * EW_THREADS) {
        const float v = x[i];
        float r;
        if (p.op == 0) {                    // sigmoid: 1 / (1 + exp(-x))
            r = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
        } else if (p.op == 1) {             // softplus: x above 20, else log(1 + exp(x))
            r = v > 20.0f ? v : logf(__fadd_rn(1.0f, expf(v)));
        } else {                            // silu: x / (1 + exp(-x))
            r = __fdiv_rn(v, __fadd_rn(1.0f, expf(-v)));
        }
        y[i] = r;
    }
}

// A thread per channel. Row j of X is state row j (j < K-1) or x row j - (K-1).
extern "C" __global__ void __launch_bounds__(SSM_CONV_THREADS)
ssm_conv(const float * __restrict__ x, float * __restrict__ state, const float * __restrict__ w,
         float * __restrict__ y, const SsmConvParams p) {
    const int c = blockIdx.x * SSM_CONV_THREADS + threadIdx.x;
    if (c >= p.n_channels) return;
    const int C = p.n_channels, K = p.kernel, K1 = K - 1;
    const float * wc = w + (i64) c * K;
#define X_ROW(j) ((j) < K1 ? state[(i64) (j) * C + c] : x[(i64) ((j) - K1) * C + c])
    for (int t = 0; t < p.n_tokens; ++t) {
        float acc = __fmul_rn(X_ROW(t), wc[0]);
        for (int i = 1; i < K; ++i) acc = __fadd_rn(acc, __fmul_rn(X_ROW(t + i), wc[i]));
        y[(i64) t * C + c] = acc;
    }
    // The new window: rows T .. T+K-2 of X, in increasing j: row T + j > j of the old state
    // is read before it is overwritten.
    for (int j = 0; j < K1; ++j) {
        const float v = X_ROW(p.n_tokens + j);
        state[(i64) j * C + c] = v;
    }
#undef X_ROW
}

// One block per value head h, thread j = value index. Thread j keeps row j of the head's state
// (state[h, j, :], column j of S_h) in registers over all the tokens; the key and query of key
// head h % Hk (tiled) come through shared memory. Per token, as the numpy twin:
//   m *= exp(g);  u = m . k;  delta = (v_j - u) * beta;  m += delta * k;  o_j = (m . q) / sqrt(D)
template <int D>
__device__ __forceinline__ void gated_delta_net(const float * __restrict__ q, const float * __restrict__ k,
                                                const float * __restrict__ v, const float * __restrict__ g,
                                                const float * __restrict__ beta, float * __restrict__ state,
                                                float * __restrict__ out, const GatedDeltaNetParams p) {
    __shared__ float ks[D], qs[D];
    const int h = blockIdx.x, j = threadIdx.x, Hv = p.n_v_heads, Hk = p.n_k_heads, hk = h % Hk;
    float * row = state + ((i64) h * D + j) * D;
    float m[D];
#pragma unroll
    for (int i = 0; i < D; ++i) m[i] = row[i];
    const float scale = __fdiv_rn(1.0f, sqrtf((float) D));
    for (int t = 0; t < p.n_tokens; ++t) {
        __syncthreads();                    // the previous token's ks / qs are read
        ks[j] = k[((i64) t * Hk + hk) * D + j];
        qs[j] = q[((i64) t * Hk + hk) * D + j];
        __syncthreads();
        const float decay = expf(g[(i64) t * Hv + h]), b = beta[(i64) t * Hv + h];
        float u = 0.0f;
#pragma unroll
        for (int i = 0; i < D; ++i) {
            m[i] = __fmul_rn(m[i], decay);
            u = __fadd_rn(u, __fmul_rn(m[i], ks[i]));
        }
        const float delta = __fmul_rn(__fsub_rn(v[((i64) t * Hv + h) * D + j], u), b);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < D; ++i) {
            m[i] = __fadd_rn(m[i], __fmul_rn(delta, ks[i]));
            o = __fadd_rn(o, __fmul_rn(m[i], qs[i]));
        }
        out[((i64) t * Hv + h) * D + j] = __fmul_rn(o, scale);
    }
#pragma unroll
    for (int i = 0; i < D; ++i) row[i] = m[i];
}

#define DEFINE_GDN(D)                                                                                  \
extern "C" __global__ void __launch_bounds__(D)                                                        \
gated_delta_net_##D(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v, \
                    const float * __restrict__ g, const float * __restrict__ beta, float * __restrict__ state, \
                    float * __restrict__ out, const GatedDeltaNetParams p) {                           \
    gated_delta_net<D>(q, k, v, g, beta, state, out, p);                                               \
}
DEFINE_GDN(32)
DEFINE_GDN(64)
DEFINE_GDN(128)
