// Shared device code: ggml block layouts, half/bf16 conversions, warp reductions.
//
// No CUDA headers are included (not even cuda_fp16.h): NVRTC compiles these sources on a
// machine that has only the NVRTC library, as CI does. Conversions use PTX `cvt` directly.
#pragma once

typedef unsigned char  u8;
typedef signed char    i8;
typedef unsigned short u16;
typedef unsigned int   u32;
typedef long long      i64;
typedef unsigned long long u64;

#define WARP_SIZE 32
#define QK8_1 32

// The paged KV cache (engine/kv_cache.py BLOCK_TOKENS): a layer's keys (or values) live in a
// pool of blocks of KV_BLOCK slots, [n_blocks][KV_BLOCK][H_kv][D] halves, and a sequence's
// position s is slot s % KV_BLOCK of block table[s / KV_BLOCK] (its block table, int32).
// Every kernel that writes or reads a cache goes through kv_row; a sequence with a pool of
// its own (a session's private cache) is addressed the same way.
#define KV_BLOCK 16

// The pool row (in units of H_kv * D halves) of position s (s >= 0) of the sequence whose
// block table is `table`.
__device__ __forceinline__ i64 kv_row(const int * table, const int s) {
    return (i64) table[(unsigned) s / KV_BLOCK] * KV_BLOCK + (unsigned) s % KV_BLOCK;
}

// Whether position s (>= 0) has a block: a table's entries past the sequence's blocks are -1
// (a server's sequence holds the blocks of its request, not of its whole context). The cache
// writes skip a position without one instead of writing outside the pool.
__device__ __forceinline__ bool kv_held(const int * table, const int s) {
    return table[(unsigned) s / KV_BLOCK] >= 0;
}

// Programmatic dependent launch (Hopper and later). Inside a decode graph the backend launches
// kernels with the programmatic-serialization attribute: a kernel may then start while the one
// before it is still running, so the launch and the block scheduling of kernel n+1 hide behind
// the tail of kernel n. PDL_ENTRY is therefore the first statement of every kernel: it waits
// until the previous grid has completed and its writes are visible (griddepcontrol.wait), then
// lets the next kernel be launched (griddepcontrol.launch_dependents; it still waits for this
// one to complete before it touches memory). Nothing before PDL_ENTRY may read or write memory
// another kernel writes: only the weights, which no kernel writes, may be prefetched there
// (prefetch_l2_span). Without the launch attribute (eager launches, other GPUs) the wait
// returns at once. conformance/kernels/test_kernels_plumbing.py checks every kernel begins this way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY() do { asm volatile("griddepcontrol.wait;" ::: "memory");                  \
                         asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); } while (0)
#else
#define PDL_ENTRY() do { } while (0)
#endif

// Ask L2 for the bytes [p, p + n) ahead of their loads, one 128-byte line per lane of the warp
// in turn (no registers held, no result). Weights only (see PDL_ENTRY); a kernel calls it
// before PDL_ENTRY so that its weights stream in while the previous kernel finishes.
__device__ __forceinline__ void prefetch_l2_span(const void * p, const long long n) {
#if defined(__CUDA_ARCH__)
    const char * c = (const char *) p;
    for (long long o = (long long) (threadIdx.x % 32) * 128; o < n; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(c + o));
#endif
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32) h) << 16);
}

// What a kernel writes for an output it has no value for (an expert id out of range).
#define NAN_F32 __int_as_float(0x7fc00000)

// Half the E8M0 scale of an MXFP4 block, 2^(e-128) (e < 2: the subnormals), computed
// directly so that e = 255 gives 2^127 rather than half of an infinity.
__device__ __forceinline__ float e8m0_half_to_f32(u8 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : ((u32) e - 1) << 23);
}

// 32-bit loads from packed blocks whose alignment is only 2 bytes (Q4_0, Q5_0, Q8_0, Q6_K)
// or 1 byte (MXFP4): a plain int load there would be a misaligned access.
__device__ __forceinline__ int load_i32_a2(const u8 * p) {
    const u16 * p16 = (const u16 *) p;
    return (int) (p16[0] | ((u32) p16[1] << 16));
}

__device__ __forceinline__ int load_i32_a1(const u8 * p) {
    return (int) (p[0] | ((u32) p[1] << 8) | ((u32) p[2] << 16) | ((u32) p[3] << 24));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of a double over the block (THREADS threads; every thread gets it), the order rms_norm,
// add_rms_norm, rope_store's head norms and the router's softmax sum in: per warp by shuffles,
// then the warps' partial sums one after another. `partial` holds one double per warp.
template <int THREADS>
__device__ __forceinline__ double block_sum_f64(double v, double * partial) {
    v = warp_sum_f64(v);
    __syncthreads();     // partial may still be read by a previous call
    if (threadIdx.x % WARP_SIZE == 0) partial[threadIdx.x / WARP_SIZE] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < THREADS / WARP_SIZE; ++i) s += partial[i];
    return s;
}

// Sum over a whole thread block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float * scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int n_warps = blockDim.x / WARP_SIZE;
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float * scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int n_warps = blockDim.x / WARP_SIZE;
    v = lane < n_warps ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

// ---- ggml block layouts (ggml-common.h); halves are stored as raw u16 -------------------

struct block_q4_0 { u16 d; u8 qs[16]; };
struct block_q4_1 { u16 d; u16 m; u8 qs[16]; };
struct block_q5_0 { u16 d; u8 qh[4]; u8 qs[16]; };
struct block_q5_1 { u16 d; u16 m; u8 qh[4]; u8 qs[16]; };
struct block_q8_0 { u16 d; i8 qs[32]; };
struct block_mxfp4 { u8 e; u8 qs[16]; };
struct block_q4_K { u16 d; u16 dmin; u8 scales[12]; u8 qs[128]; };
struct block_q5_K { u16 d; u16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; };
struct block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; u16 d; };

// Activation block for the int8 dot products: d = max|x|/127, s = sum(x) (both rounded to
// half, as llama.cpp's quantize_q8_1 stores them), qs = round(x/d).
struct block_q8_1 { u16 d; u16 s; int qs[8]; };

static_assert(sizeof(block_q4_0) == 18, "block_q4_0");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1");
static_assert(sizeof(block_q5_0) == 22, "block_q5_0");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0");
static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4");
static_assert(sizeof(block_q4_K) == 144, "block_q4_K");
static_assert(sizeof(block_q5_K) == 176, "block_q5_K");
static_assert(sizeof(block_q6_K) == 210, "block_q6_K");
static_assert(sizeof(block_q8_1) == 36, "block_q8_1");

// 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
__device__ __forceinline__ void scale_min_k4(int j, const u8 * q, int & sc, int & m) {
    if (j < 4) {
        sc = q[j] & 63;
        m  = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m  = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// MXFP4 (E2M1) values doubled so that they are integers {0,1,2,3,4,6,8,12} with a sign bit;
// the block scale is halved to match.
__device__ __forceinline__ int mxfp4_value_x2(int nibble) {
    const int m = nibble & 7;
    const int mag = m < 4 ? m : ((m & 1) ? 6 : 4) << ((m >> 1) & 1);
    return nibble & 8 ? -mag : mag;
}

// The better of two (value, index) candidates: larger value, then lower index (ties go to the
// lower index, as a stable sort orders them). An index of -1 is "no candidate". A total order,
// so any reduction tree picks the same winner.
__device__ __forceinline__ void better(float & v, int & i, const float v2, const int i2) {
    if (i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i))) { v = v2; i = i2; }
}

// Q8_1 quantization of 32 consecutive values held one per lane of a warp, in lane order:
// d = max|x| / 127, q = roundf(x / d) (half away from zero), s = sum(x), both rounded to half
// (llama.cpp's quantize_q8_1). Every kernel that hands a mat-vec its activations already
// quantized goes through this one function, so its blocks are bit-identical to those of the
// quantize_q8_1 kernel. The whole warp must be active.
struct WarpQ8 { int q; float d; float sum; };     // a lane's quant, the block's d and s (float)

__device__ __forceinline__ WarpQ8 warp_q8_1(const float xi) {
    const float amax = warp_max(fabsf(xi));
    const float sum = warp_sum(xi);
    const float d = amax / 127.0f;
    return {amax == 0.0f ? 0 : (int) roundf(xi / d), d, sum};
}

__device__ __forceinline__ void quantize_warp_q8_1(const float xi, block_q8_1 * __restrict__ b) {
    const WarpQ8 r = warp_q8_1(xi);
    const int lane = threadIdx.x % WARP_SIZE;
    ((i8 *) b->qs)[lane] = (i8) r.q;
    if (lane == 0) {
        b->d = f32_to_f16(r.d);
        b->s = f32_to_f16(r.sum);
    }
}

__device__ __forceinline__ int warp_sum_i32(int v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The activations, operation by operation as the numpy reference (ssm.cu's unary; the kernels
// that take an activation into their own pass call these, so that they give its bits).
__device__ __forceinline__ float sigmoid_f(const float v) {      // 1 / (1 + exp(-x))
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
}
__device__ __forceinline__ float softplus_f(const float v) {     // x above 20, else log(1 + exp(x))
    return v > 20.0f ? v : logf(__fadd_rn(1.0f, expf(v)));
}
__device__ __forceinline__ float silu_f(const float v) {         // x / (1 + exp(-x))
    return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v)));
}

// silu(g) * u = (g / (1 + exp(-g))) * u, operation by operation as the numpy reference.
__device__ __forceinline__ float swiglu_value(const float g, const float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// gelu_tanh as ggml's CPU computes it: looked up through F16 (the input rounded to F16, the
// tanh formula in float32, the result rounded to F16), identity at g >= 10, zero at g <= -10.
__device__ __forceinline__ float gelu_f16(float x) {
    if (x >= 10.0f) return x;
    if (x <= -10.0f) return 0.0f;
    const float h = f16_to_f32(f32_to_f16(x));
    const float inner = __fmul_rn(__fmul_rn(0.79788456080286535587989211986876f, h),
                                  __fadd_rn(1.0f, __fmul_rn(__fmul_rn(0.044715f, h), h)));
    const float g = __fmul_rn(__fmul_rn(0.5f, h), __fadd_rn(1.0f, tanhf(inner)));
    return f16_to_f32(f32_to_f16(g));
}

__device__ __forceinline__ float glu_value(const int gelu, const float g, const float u) {
    return gelu ? __fmul_rn(gelu_f16(g), u) : swiglu_value(g, u);
}

// Rope angle of pair i at position pos: pos * theta_scale^i built by i float32
// multiplications, as ggml_rope_cache_init does on the CPU, then times freq_scale.
__device__ __forceinline__ float rope_angle(const int pos, const int i, const float theta_scale,
                                            const float freq_scale) {
    float theta = (float) pos;
    for (int j = 0; j < i; ++j) theta = __fmul_rn(theta, theta_scale);
    return __fmul_rn(theta, freq_scale);
}

// The same angle divided by the pair's frequency factor before freq_scale (ggml_rope_ext with
// freq_factors: rope_yarn(theta / ff[i], ...)), in that order, as the numpy reference.
__device__ __forceinline__ float rope_angle_ff(const int pos, const int i, const float theta_scale,
                                               const float ff, const float freq_scale) {
    return __fmul_rn(__fdiv_rn(rope_angle(pos, i, theta_scale, 1.0f), ff), freq_scale);   // theta * 1 = theta
}

// One q or k head of a token: optional RMS norm over the head (double sum of squares, as
// rms_norm; weight nw), then rope at cache slot `slot`; the result goes to `out` (float32) and
// `cache` (F16), either may be null. `row` is head_dim floats of shared memory, `partial` one
// double per warp. fused.cu's rope_store calls it. Every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ void norm_rope_head(const float * src, const float * nw, const bool norm, const int D,
                                               const int n_rot, const bool neox, const float theta_scale,
                                               const float freq_scale, const float eps, const int slot,
                                               float * row, double * partial, float * out, u16 * cache) {
    float scale = 1.0f;
    if (norm) {
        double ss = 0.0;
        for (int d = threadIdx.x; d < D; d += THREADS) {
            const double x = src[d];
            ss += x * x;
        }
        ss = block_sum_f64<THREADS>(ss, partial);
        const float mean = (float) (ss / D);
        scale = 1.0f / sqrtf(__fadd_rn(mean, eps));
    }
    for (int d = threadIdx.x; d < D; d += THREADS)
        row[d] = norm ? __fmul_rn(__fmul_rn(src[d], scale), nw[d]) : src[d];
    __syncthreads();

    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half + (D - n_rot); i += THREADS) {
        if (i < half) {
            const float angle = rope_angle(slot, i, theta_scale, freq_scale);
            const float c = cosf(angle), s = sinf(angle);
            const int i0 = neox ? i : 2 * i;
            const int i1 = neox ? i + half : 2 * i + 1;
            const float x0 = row[i0], x1 = row[i1];
            const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
            const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
            if (out) { out[i0] = y0; out[i1] = y1; }
            if (cache) { cache[i0] = f32_to_f16(y0); cache[i1] = f32_to_f16(y1); }
        } else {
            const int d = n_rot + (i - half);
            if (out) out[d] = row[d];
            if (cache) cache[d] = f32_to_f16(row[d]);
        }
    }
}
