"""kernels/delta_chunked.cu run on the CPU, for machines without a GPU (CI, development).

As mmq_host.py does for mmq.cu: the kernel source itself (with its headers) is compiled by
g++ against the same shim of CUDA device code (every CUDA thread of a block a std::thread,
__shared__ variables function statics, one block at a time, __syncthreads a barrier of the
block's threads). The one line that is not plain C++, the dynamic shared memory declaration,
becomes a pointer to a host buffer poisoned with NaN before each block, so a read of shared
memory the block never wrote shows in the result. What this cannot check is timing, FMA
contraction, or the hardware's shared memory limits; it does check the indexing, the chunk
edges, the tiled head mapping, the solve and the barriers' placement (a missing barrier still
may pass by luck of the scheduling) against the numpy sequential rule.

    python3 conformance/harness/delta_host.py [seed]      # a few shapes; exit 1 on a failure
conformance/kernels/test_kernels_delta_chunked.py::test_chunked_kernel_on_the_cpu uses it (skips without g++).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import SHIM, compile_host, host_headers  # noqa: E402

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
HEADERS = ("common.cuh", "params.cuh")
HEAD_DIMS = (32, 64, 128)

HARNESS = r"""#include "shim.h"
float * host_smem;
#include "delta_host.cu"
#include <limits>
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
static std::barrier<> *block_bar;
void __syncthreads() { block_bar->arrive_and_wait(); }
float host_h2f(unsigned short) { abort(); }
unsigned short host_f2h(float) { abort(); }
float host_shfl_xor(float, int) { abort(); }
double host_shfl_xor_d(double, int) { abort(); }
typedef void (*kernel_t)(const float *, const float *, const float *, const float *, const float *,
                         float *, float *, const int *, const GatedDeltaNetParams);
extern "C" int run_gdn_chunked(int D, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, float * state, float * out, int T, int Hv, int Hk,
                               int n_real) {
    kernel_t fn = D == 32 ? gated_delta_net_chunked_32 : D == 64 ? gated_delta_net_chunked_64
                : D == 128 ? gated_delta_net_chunked_128 : nullptr;
    if (!fn) return 1;
    GatedDeltaNetParams p{}; p.n_tokens = T; p.n_v_heads = Hv; p.n_k_heads = Hk; p.head_dim = D;
    std::vector<float> sm(D == 32 ? GDN_CHUNK_SMEM_FLOATS(32) : D == 64 ? GDN_CHUNK_SMEM_FLOATS(64)
                                                                  : GDN_CHUNK_SMEM_FLOATS(128));
    host_smem = sm.data();
    std::barrier<> bb(GDN_CHUNK_THREADS); block_bar = &bb;
    gridDim = {(unsigned) Hv, (unsigned) (D / GDN_COLS), 1};
    blockDim = {GDN_CHUNK_THREADS, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            std::fill(sm.begin(), sm.end(), std::numeric_limits<float>::quiet_NaN());
            blockIdx = {bx, by, 0};
            std::vector<std::thread> th;
            for (unsigned i = 0; i < GDN_CHUNK_THREADS; ++i)
                th.emplace_back([=, &n_real] { threadIdx = {i, 0, 0}; fn(q, k, v, g, beta, state, out, &n_real, p); });
            for (auto & t : th) t.join();
        }
    return 0;
}
extern "C" int gdn_chunked_smem_floats(int D) {
    return D == 32 ? GDN_CHUNK_SMEM_FLOATS(32) : D == 64 ? GDN_CHUNK_SMEM_FLOATS(64) : GDN_CHUNK_SMEM_FLOATS(128);
}
"""


def _sources() -> dict[str, str]:
    out = host_headers(HEADERS)
    s = (KERNEL_DIR / "delta_chunked.cu").read_text()
    decl = "extern __shared__ float smem[];"
    if s.count(decl) != 1:
        raise RuntimeError(f"delta_chunked.cu: expected one {decl!r}")
    out["delta_host.cu"] = s.replace(decl, "float * const smem = host_smem;")
    out["shim.h"] = SHIM
    out["harness.cpp"] = HARNESS
    return out


def build() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of delta_chunked.cu; raises RuntimeError without g++."""
    so = compile_host(_sources(), "delta", "delta_chunked.cu")
    so.run_gdn_chunked.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4
    so.gdn_chunked_smem_floats.argtypes = [ctypes.c_int]
    return so


# the count of real rows when every row is (the backend's word of INT_MAX)
ALL_ROWS = 2**31 - 1


def gated_delta_net_chunked(lib, q, k, v, g, beta, state, n_real=ALL_ROWS):
    """The CPU build of gated_delta_net_chunked_<D>: the op's contract (state updated in place;
    only the first n_real rows update it), the output poisoned with NaN before the kernel runs."""
    q, k, v, g, beta = (np.ascontiguousarray(a, np.float32) for a in (q, k, v, g, beta))
    assert state.dtype == np.float32 and state.flags.c_contiguous
    T, Hv, D = v.shape
    out = np.full((T, Hv, D), np.nan, np.float32)
    if lib.run_gdn_chunked(D, q.ctypes.data, k.ctypes.data, v.ctypes.data, g.ctypes.data,
                           beta.ctypes.data, state.ctypes.data, out.ctypes.data, T, Hv, q.shape[1], n_real):
        raise ValueError(f"no chunked kernel for head dim {D}")
    return out


# The decode (sequential) kernel of kernels/ssm.cu the same way: shuffles between the threads
# of a row go through an exchange array and the block's barrier (every thread of a block
# reaches each shuffle, as on the GPU, where they are warp-uniform).
SEQ_HARNESS = r"""#include "shim.h"
#include "ssm_host.cu"
#include <limits>
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
static std::barrier<> *block_bar;
static float xch[1024];
void __syncthreads() { block_bar->arrive_and_wait(); }
float host_h2f(unsigned short) { abort(); }
unsigned short host_f2h(float) { abort(); }
double host_shfl_xor_d(double, int) { abort(); }
float host_shfl_xor(float v, int o) {
    const unsigned i = threadIdx.x;
    xch[i] = v;
    block_bar->arrive_and_wait();
    const float r = xch[(i ^ o) % blockDim.x];
    block_bar->arrive_and_wait();
    return r;
}
// the elementwise kernels, one block of one thread striding over everything
extern "C" void run_unary(const float * x, float * y, long long n, int op) {
    UnaryParams p{}; p.n = n; p.op = op;
    gridDim = {1, 1, 1}; blockDim = {EW_THREADS, 1, 1}; blockIdx = {0, 0, 0};
    for (unsigned i = 0; i < EW_THREADS; ++i) { threadIdx = {i, 0, 0}; unary(x, y, p); }
}
extern "C" void run_delta_net_gates(const float * beta, const float * alpha, const float * bias, const float * a,
                                    float * beta_out, float * g, long long n, int H) {
    DeltaGatesParams p{}; p.n = n; p.n_heads = H;
    gridDim = {1, 1, 1}; blockDim = {EW_THREADS, 1, 1}; blockIdx = {0, 0, 0};
    for (unsigned i = 0; i < EW_THREADS; ++i) { threadIdx = {i, 0, 0}; delta_net_gates(beta, alpha, bias, a, beta_out, g, p); }
}
typedef void (*kernel_t)(const float *, const float *, const float *, const float *, const float *,
                         float *, float *, const int *, const GatedDeltaNetParams);
extern "C" int run_gdn(int D, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, float * state, float * out, int T, int Hv, int Hk, int n_real) {
    kernel_t fn = D == 32 ? gated_delta_net_32 : D == 64 ? gated_delta_net_64
                : D == 128 ? gated_delta_net_128 : nullptr;
    if (!fn) return 1;
    GatedDeltaNetParams p{}; p.n_tokens = T; p.n_v_heads = Hv; p.n_k_heads = Hk; p.head_dim = D;
    const unsigned threads = GDN_ROWS * gdn_lanes(D);
    std::barrier<> bb(threads); block_bar = &bb;
    gridDim = {(unsigned) Hv, (unsigned) (D / GDN_ROWS), 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            blockIdx = {bx, by, 0};
            std::vector<std::thread> th;
            for (unsigned i = 0; i < threads; ++i)
                th.emplace_back([=, &n_real] { threadIdx = {i, 0, 0}; fn(q, k, v, g, beta, state, out, &n_real, p); });
            for (auto & t : th) t.join();
        }
    return 0;
}
extern "C" int gdn_threads(int D) { return GDN_ROWS * gdn_lanes(D); }
extern "C" void run_ssm_conv(const float * x, float * state, const float * w, float * y, int T, int C, int K,
                             int n_real, int silu) {
    SsmConvParams p{}; p.n_tokens = T; p.n_channels = C; p.kernel = K; p.silu = silu;
    // a thread per (channel, token block), no barrier: the threads of a block run one after
    // another. The first token block (the one that writes the new window) runs first, so that
    // a block that read the carried window after it would read the new one and fail the test.
    gridDim = {(unsigned) ((C + SSM_CONV_THREADS - 1) / SSM_CONV_THREADS),
               (unsigned) ((T + SSM_CONV_TOKENS - 1) / SSM_CONV_TOKENS), 1};
    blockDim = {SSM_CONV_THREADS, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx)
            for (unsigned i = 0; i < SSM_CONV_THREADS; ++i) {
                blockIdx = {bx, by, 0}; threadIdx = {i, 0, 0};
                ssm_conv(x, state, w, y, &n_real, p);
            }
}
"""


def build_sequential() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of ssm.cu's gated_delta_net_<D>; RuntimeError without g++."""
    srcs = host_headers(HEADERS)
    srcs["ssm_host.cu"] = (KERNEL_DIR / "ssm.cu").read_text()
    srcs["shim.h"] = SHIM
    srcs["harness.cpp"] = SEQ_HARNESS
    so = compile_host(srcs, "gdn", "ssm.cu")
    so.run_gdn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4
    so.gdn_threads.argtypes = [ctypes.c_int]
    so.run_ssm_conv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    so.run_unary.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_longlong, ctypes.c_int]
    so.run_delta_net_gates.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_longlong, ctypes.c_int]
    return so


def gated_delta_net(lib, q, k, v, g, beta, state, n_real=ALL_ROWS):
    """The CPU build of gated_delta_net_<D> (the decode kernel): state updated in place (by the
    first n_real rows), the output poisoned with NaN before the kernel runs."""
    q, k, v, g, beta = (np.ascontiguousarray(a, np.float32) for a in (q, k, v, g, beta))
    assert state.dtype == np.float32 and state.flags.c_contiguous
    T, Hv, D = v.shape
    out = np.full((T, Hv, D), np.nan, np.float32)
    if lib.run_gdn(D, q.ctypes.data, k.ctypes.data, v.ctypes.data, g.ctypes.data,
                   beta.ctypes.data, state.ctypes.data, out.ctypes.data, T, Hv, q.shape[1], n_real):
        raise ValueError(f"no kernel for head dim {D}")
    return out


def ssm_conv(lib, x, state, w, n_real=ALL_ROWS, silu=False):
    """The CPU build of ssm.cu's ssm_conv (built by build_sequential): x [T, C], state [K-1, C]
    updated in place (the window after the first n_real rows), w [C, K] (silu: the output
    through silu); the output poisoned with NaN before the kernel runs."""
    x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
    assert state.dtype == np.float32 and state.flags.c_contiguous
    T, C = x.shape
    y = np.full((T, C), np.nan, np.float32)
    lib.run_ssm_conv(x.ctypes.data, state.ctypes.data, w.ctypes.data, y.ctypes.data, T, C, w.shape[1], n_real,
                     int(silu))
    return y


def unary(lib, x, op: int):
    """The CPU build of ssm.cu's unary (op: 0 sigmoid, 1 softplus, 2 silu)."""
    x = np.ascontiguousarray(x, np.float32)
    y = np.full(x.shape, np.nan, np.float32)
    lib.run_unary(x.ctypes.data, y.ctypes.data, x.size, op)
    return y


def delta_net_gates(lib, beta, alpha, dt_bias, a):
    """The CPU build of ssm.cu's delta_net_gates over [T, H] projections: (beta_out, g)."""
    beta, alpha, dt_bias, a = (np.ascontiguousarray(v, np.float32) for v in (beta, alpha, dt_bias, a))
    beta_out, g = np.full(beta.shape, np.nan, np.float32), np.full(alpha.shape, np.nan, np.float32)
    lib.run_delta_net_gates(beta.ctypes.data, alpha.ctypes.data, dt_bias.ctypes.data, a.ctypes.data,
                            beta_out.ctypes.data, g.ctypes.data, alpha.size, alpha.shape[-1])
    return beta_out, g


def random_case(rng, T, Hk, Hv, D, g_hi=2.0):
    """Inputs as the layer gives them: L2-normed q and k, g <= 0, beta in (0, 1)."""
    def unit(a):
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)
    q = unit(rng.standard_normal((T, Hk, D)))
    k = unit(rng.standard_normal((T, Hk, D)))
    v = rng.uniform(-1, 1, (T, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.01, g_hi, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    state = rng.uniform(-0.5, 0.5, (Hv, D, D)).astype(np.float32)
    return q, k, v, g, beta, state


def main(argv: list[str]) -> int:
    from brass.backends.numpy_backend import NumpyBackend
    from conformance.harness.cases import DELTA_CHUNKED, nmse
    rng = np.random.default_rng(int(argv[0]) if argv else 0)
    lib = build()
    failed = 0
    for T, Hk, Hv, D in ((1, 2, 4, 32), (7, 2, 6, 32), (64, 1, 2, 64), (65, 2, 4, 64),
                         (300, 2, 4, 32), (130, 1, 2, 128)):
        q, k, v, g, beta, state = random_case(rng, T, Hk, Hv, D)
        want_state, got_state = state.copy(), state.copy()
        want = NumpyBackend().gated_delta_net(q, k, v, g, beta, want_state)
        got = gated_delta_net_chunked(lib, q, k, v, g, beta, got_state)
        eo, es = nmse(got, want), nmse(got_state, want_state)
        ok = eo <= DELTA_CHUNKED and es <= DELTA_CHUNKED
        failed += not ok
        print(f"T={T:4d} Hk={Hk} Hv={Hv} D={D:3d}: output NMSE {eo:.2e}, state NMSE {es:.2e} "
              f"{'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
