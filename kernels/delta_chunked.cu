// The gated delta rule over a prompt in chunks of GDN_CHUNK tokens (issue 12): the kernel twin
// of engine/delta_chunked.py, the same op as ssm.cu gated_delta_net_<D> (q, k [T, Hk, D];
// v [T, Hv, D]; g, beta [T, Hv]; state [Hv, D, D] holding S^T, updated in place; value head h
// reads key head h % Hk; output scaled by 1/sqrt(D)). Within a chunk of n tokens starting
// from state S (Dk x Dv), gamma the cumulative sum of g, Gamma = exp(gamma):
//
//   A[s, r] = beta_s exp(gamma_s - gamma_r) k_s.k_r  (r < s)      M[t, s] = exp(gamma_t - gamma_s) q_t.k_s  (s <= t)
//   B_s = beta_s (v_s - Gamma_s S^T k_s);   delta = (I + A)^-1 B   (forward substitution)
//   o_t = (Gamma_t S^T q_t + sum_{s<=t} M[t, s] delta_s) / sqrt(D)
//   S  <- Gamma_n S + sum_s exp(gamma_n - gamma_s) k_s delta_s^T
//
// The value columns of S evolve independently (A and M depend only on q, k, g, beta), so a
// block owns GDN_COLS columns of one value head: grid (Hv, D / GDN_COLS), GDN_CHUNK_THREADS
// threads. Each block walks the chunks in order (T / GDN_CHUNK steps of D x GDN_COLS state
// work, instead of T steps); within a chunk every term is spread over the block's threads:
// the C x C products A and M, S^T k and S^T q, the triangular solve (a row at a time, each
// row's dot products split over the threads), the outputs and the state update. A and M are
// recomputed by the D / GDN_COLS blocks of a head (C^2 D each, cheap next to a block's state
// work). Sums are float32 in another order than the sequential kernel (FMAs allowed): the
// tests hold it to DELTA_CHUNKED (kernels/cases.py), derived from the numpy twin in float32.
//
// Only the first *n_real of the n_tokens rows are the prompt's (a prompt graph of a length
// class pads the rest, engine/model.py ClassStep; an eager read passes INT_MAX): the chunks
// run over those rows exactly as over a prompt of that length, and the padding rows' outputs
// are zero.
//
// GDN_CHUNK = 64, as llama.cpp's chunked graph (delta-net-base.cpp) and the numpy twin: the
// solve is C sequential rows, the state steps T / C, and the C x C products grow as C^2; 64
// keeps the solve's serial part (64 rows) short beside the chunk's matrix work while cutting
// the state recurrence 64-fold, and the shared memory (two C x D tiles of k and q, two C x C
// tiles, the S columns) within the 227 KiB an H100/H200 block may opt in to at D = 128
// (125 KiB; the backend falls back to the sequential kernel where a GPU allows less).
#include "common.cuh"
#include "params.cuh"

#define GDN_CHUNK 64
#define GDN_CHUNK_THREADS 256
#define GDN_COLS 32

// Floats of dynamic shared memory for head dim D (engine/backends/cuda/backend.py mirrors it).
#define GDN_CHUNK_SMEM_FLOATS(D) (2 * GDN_CHUNK * ((D) + 1) + (D) * (GDN_COLS + 1) \
                                  + 2 * GDN_CHUNK * (GDN_CHUNK + 1) + GDN_CHUNK * GDN_COLS \
                                  + 3 * GDN_CHUNK + GDN_CHUNK_THREADS)

template <int D>
__device__ __forceinline__ void gated_delta_net_chunked(const float * __restrict__ q, const float * __restrict__ k,
                                                        const float * __restrict__ v, const float * __restrict__ g,
                                                        const float * __restrict__ beta, float * __restrict__ state,
                                                        float * __restrict__ out, const int * __restrict__ n_real,
                                                        const GatedDeltaNetParams p) {
    constexpr int C = GDN_CHUNK, NT = GDN_CHUNK_THREADS, DC = GDN_COLS;
    constexpr int KP = D + 1, CP = C + 1, SP = DC + 1, PARTS = NT / DC;
    static_assert(C == 64 && DC == 32 && NT == 256 && D % 16 == 0, "the register tiles assume these");
    extern __shared__ float smem[];
    float * Ks = smem;                  // [C][KP]  k of the chunk (key head h % Hk), zero past n
    float * Qs = Ks + C * KP;           // [C][KP]  q
    float * Ss = Qs + C * KP;           // [D][SP]  S[i, c0 + c]
    float * As = Ss + D * SP;           // [C][CP]  A (strictly lower)
    float * Ms = As + C * CP;           // [C][CP]  M (lower, diagonal included)
    float * Bs = Ms + C * CP;           // [C][DC]  B, then delta in place
    float * Gs = Bs + C * DC;           // [C]      gamma
    float * bs = Gs + C;                // [C]      beta
    float * Ws = bs + C;                // [C]      exp(gamma_n - gamma_s)
    float * red = Ws + C;               // [NT]     partial sums of the solve

    const int tid = threadIdx.x, h = blockIdx.x, c0 = blockIdx.y * DC;
    const int T = min(p.n_tokens, *n_real), Hv = p.n_v_heads, Hk = p.n_k_heads, hk = h % Hk;
    const float scale = 1.0f / sqrtf((float) D);

    for (int e = tid; e < D * DC; e += NT) {            // row c0 + c of the state holds S[:, c0 + c]
        const int c = e / D, i = e % D;
        Ss[i * SP + c] = state[((i64) h * D + c0 + c) * D + i];
    }

    for (int t0 = 0; t0 < T; t0 += C) {
        const int n = T - t0 < C ? T - t0 : C;
        __syncthreads();                                // the previous chunk's readers are done
        for (int e = tid; e < C * D; e += NT) {
            const int s = e / D, i = e % D;
            const i64 src = ((i64) (t0 + s) * Hk + hk) * D + i;
            Ks[s * KP + i] = s < n ? k[src] : 0.0f;
            Qs[s * KP + i] = s < n ? q[src] : 0.0f;
        }
        if (tid == 0) {                                 // gamma: a float32 running sum, in order
            float acc = 0.0f;
            for (int s = 0; s < C; ++s) {
                if (s < n) {
                    acc += g[(i64) (t0 + s) * Hv + h];
                    bs[s] = beta[(i64) (t0 + s) * Hv + h];
                } else {
                    bs[s] = 0.0f;
                }
                Gs[s] = acc;
            }
        }
        __syncthreads();
        if (tid < C) Ws[tid] = tid < n ? expf(Gs[n - 1] - Gs[tid]) : 0.0f;

        // Register tiles: thread (ty, tx) = (tid / 16, tid % 16) takes rows ty + 16 a and
        // columns tx + 16 b of each product, so a value read from shared memory serves 2 to 4
        // products, and a warp's reads fall in distinct banks or broadcast.
        const int ty = tid / 16, tx = tid % 16;

        // A and M: C x C dot products over D (rows s, columns r); only differences
        // gamma_s - gamma_r with r <= s are exponentiated (g <= 0: every factor <= 1).
        {
            float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
            for (int i = 0; i < D; ++i) {
                float ks[4], qs[4], kr[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    ks[a] = Ks[(ty + 16 * a) * KP + i];
                    qs[a] = Qs[(ty + 16 * a) * KP + i];
                    kr[a] = Ks[(tx + 16 * a) * KP + i];
                }
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        kk[a][b] += ks[a] * kr[b];
                        qk[a][b] += qs[a] * kr[b];
                    }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int s = ty + 16 * a, r = tx + 16 * b;
                    float am = 0.0f, m = 0.0f;
                    if (r <= s && s < n) {
                        const float d = expf(Gs[s] - Gs[r]);
                        m = d * qk[a][b];
                        if (r < s) am = bs[s] * d * kk[a][b];
                    }
                    As[s * CP + r] = am;
                    Ms[s * CP + r] = m;
                }
        }

        // B_s = beta_s (v_s - Gamma_s S^T k_s) and the inter-chunk output Gamma_t S^T q_t:
        // rows s = ty + 16 a, columns c = tx + 16 b.
        float o[4][2];
        {
            float sk[4][2] = {}, sq[4][2] = {};
#pragma unroll 4
            for (int i = 0; i < D; ++i) {
                const float s0 = Ss[i * SP + tx], s1 = Ss[i * SP + tx + 16];
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const float kv = Ks[(ty + 16 * a) * KP + i], qv = Qs[(ty + 16 * a) * KP + i];
                    sk[a][0] += kv * s0;
                    sk[a][1] += kv * s1;
                    sq[a][0] += qv * s0;
                    sq[a][1] += qv * s1;
                }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const int s = ty + 16 * a;
                const float Gam = expf(Gs[s]);
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int c = tx + 16 * b;
                    o[a][b] = Gam * sq[a][b];
                    Bs[s * DC + c] = s < n ? bs[s] * (v[((i64) (t0 + s) * Hv + h) * D + c0 + c] - Gam * sk[a][b])
                                           : 0.0f;
                }
            }
        }
        __syncthreads();

        // (I + A) delta = B by forward substitution: row s after rows 0..s-1; thread (c, part)
        // sums the terms r = part, part + PARTS, ...; part 0 adds the PARTS partials in order.
        {
            const int c = tid % DC, part = tid / DC;
            for (int s = 1; s < n; ++s) {
                float acc = 0.0f;
                for (int r = part; r < s; r += PARTS) acc += As[s * CP + r] * Bs[r * DC + c];
                red[part * DC + c] = acc;
                __syncthreads();
                if (part == 0) {
                    float sum = red[c];
                    for (int pp = 1; pp < PARTS; ++pp) sum += red[pp * DC + c];
                    Bs[s * DC + c] -= sum;
                }
                __syncthreads();
            }
        }

        // o_t = (Gamma_t S^T q_t + sum_{s <= t} M[t, s] delta_s) / sqrt(D): M is zero above
        // its diagonal and delta past n, so the sum runs over s < n unmasked.
        for (int s = 0; s < n; ++s) {
            const float d0 = Bs[s * DC + tx], d1 = Bs[s * DC + tx + 16];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float m = Ms[(ty + 16 * a) * CP + s];
                o[a][0] += m * d0;
                o[a][1] += m * d1;
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int t = ty + 16 * a;
            if (t < n) {
                out[((i64) (t0 + t) * Hv + h) * D + c0 + tx] = o[a][0] * scale;
                out[((i64) (t0 + t) * Hv + h) * D + c0 + tx + 16] = o[a][1] * scale;
            }
        }

        // S <- Gamma_n S + sum_s exp(gamma_n - gamma_s) k_s delta_s^T, rows i = ty + 16 a,
        // columns c = tx + 16 b. Each thread owns its elements of S; every read of S in this
        // chunk happened before the solve's barriers.
        {
            constexpr int RI = D / 16;
            float acc[RI][2] = {};
            for (int s = 0; s < n; ++s) {
                const float w = Ws[s], d0 = w * Bs[s * DC + tx], d1 = w * Bs[s * DC + tx + 16];
#pragma unroll
                for (int a = 0; a < RI; ++a) {
                    const float kv = Ks[s * KP + ty + 16 * a];
                    acc[a][0] += kv * d0;
                    acc[a][1] += kv * d1;
                }
            }
            const float Gn = expf(Gs[n - 1]);
#pragma unroll
            for (int a = 0; a < RI; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    float & S = Ss[(ty + 16 * a) * SP + tx + 16 * b];
                    S = Gn * S + acc[a][b];
                }
        }
    }
    __syncthreads();
    for (int e = tid; e < D * DC; e += NT) {
        const int c = e / D, i = e % D;
        state[((i64) h * D + c0 + c) * D + i] = Ss[i * SP + c];
    }
    for (int e = tid; e < (p.n_tokens - T) * DC; e += NT)     // the padding rows' outputs
        out[((i64) (T + e / DC) * Hv + h) * D + c0 + e % DC] = 0.0f;
}

#define DEFINE_GDN_CHUNKED(D)                                                                          \
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)                                        \
gated_delta_net_chunked_##D(const float * __restrict__ q, const float * __restrict__ k,                \
                            const float * __restrict__ v, const float * __restrict__ g,                \
                            const float * __restrict__ beta, float * __restrict__ state,               \
                            float * __restrict__ out, const int * __restrict__ n_real,                 \
                            const GatedDeltaNetParams p) {                                             \
    PDL_ENTRY();                                                                                       \
    gated_delta_net_chunked<D>(q, k, v, g, beta, state, out, n_real, p);                               \
}
DEFINE_GDN_CHUNKED(32)
DEFINE_GDN_CHUNKED(64)
DEFINE_GDN_CHUNKED(128)
