"""The MoE router kernel of a decode step (kernels/matvec_f.cu moe_router_f32: the router's
mat-vec and moe_route in one launch) run on the CPU, for machines without a GPU.

As ci/matvec_host.py: the kernel source (matvec_f.cu with matvec.cuh, route.cuh, common.cuh)
compiled by g++ against the shim of CUDA device code (every thread of a block a std::thread,
one block at a time, __syncthreads a barrier). Blocks run one after another, so the last block
to take its ticket is the grid's last; __threadfence and __ldcg order nothing on the host.
matmul_f32 (the unfused mat-vec of the router) is built from the same file, so the fused
kernel's logits can be held to it bit for bit, and its ticket to 0 after each launch.

    python3 ci/router_host.py [seed]      # a few shapes; exit 1 on a failure
conformance/test_kernels_router_cpu.py uses it (skips without g++).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ci.mmq_host import HOST_HALF, HOST_RUN_GRID, HOST_WARP_SYNC, SHIM, compile_host, host_headers  # noqa: E402

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
HEADERS = ("common.cuh", "matvec.cuh", "params.cuh", "route.cuh")
THREADS = 128                       # MATVEC_THREADS

HARNESS = r"""#include "shim.h"
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned * p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline float __ldcg(const float * p) { return *p; }
unsigned char * host_smem;
#include "router_host.cu"
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
HOST_WARP_SYNC
HOST_HALF

HOST_RUN_GRID

extern "C" int run_router(const void * w, const void * x, float * logits, float * probs, int * ids,
                          float * weights, unsigned * ticket, const void * params, unsigned gx, unsigned threads) {
    MoeRouterParams p; memcpy(&p, params, sizeof p);
    run_grid(gx, 1, threads, 0, [=] { moe_router_f32((const u8 *) w, (const float4 *) x, logits, probs, ids,
                                                  weights, ticket, p); });
    return 0;
}

extern "C" int run_matmul(const void * w, const void * x, float * y, const void * params, unsigned gx,
                          unsigned gy, unsigned threads) {
    MatVecParams p; memcpy(&p, params, sizeof p);
    run_grid(gx, gy, threads, 0, [=] { matmul_f32((const u8 *) w, (const float4 *) x, y, p); });
    return 0;
}
"""


def _sources() -> dict[str, str]:
    out = host_headers(HEADERS)
    out["matvec.cuh"] = out["matvec.cuh"].replace("extern __shared__ int4 staged_x[];",
                                                  "int4 * const staged_x = (int4 *) host_smem;")
    out["router_host.cu"] = (KERNEL_DIR / "matvec_f.cu").read_text()
    out["shim.h"] = SHIM
    out["harness.cpp"] = (HARNESS.replace("HOST_WARP_SYNC", HOST_WARP_SYNC).replace("HOST_HALF", HOST_HALF)
                          .replace("HOST_RUN_GRID", HOST_RUN_GRID)
                          .replace("NTHREADS", str(THREADS)))
    return out


def build() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of matvec_f.cu; raises RuntimeError without g++."""
    so = compile_host(_sources(), "router", "matvec_f.cu")
    p = ctypes.c_void_p
    so.run_router.argtypes = [p, p, p, p, p, p, p, p, ctypes.c_uint, ctypes.c_uint]
    so.run_matmul.argtypes = [p, p, p, p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
    return so


def router(lib, w: np.ndarray, x: np.ndarray, k: int, norm: bool, scale: float, ticket=None):
    """(logits, probs, ids, weights, ticket) of moe_router_f32 over x [T, K] and the F32 router
    w [E, K], launched as CudaBackend.moe_gate launches it (outputs poisoned with NaN / -1)."""
    from kernels.params import pack
    T, K = x.shape
    E = w.shape[0]
    w = np.ascontiguousarray(w, np.float32)
    x = np.ascontiguousarray(x, np.float32)
    logits, probs = np.full((T, E), np.nan, np.float32), np.full((T, E), np.nan, np.float32)
    ids, weights = np.full((T, k), -1, np.int32), np.full((T, k), np.nan, np.float32)
    ticket = np.zeros(1, np.uint32) if ticket is None else ticket
    params = pack("MoeRouterParams", n_rows=E, k=K, n_tokens=T, n_used=k, row_bytes=4 * K,
                  norm=int(bool(norm)), scale=1.0 if scale in (0.0, 1.0) else scale)
    f = lambda a: a.ctypes.data  # noqa: E731
    lib.run_router(f(w), f(x), f(logits), f(probs), f(ids), f(weights), f(ticket), f(params), E, THREADS)
    return logits, probs, ids, weights, ticket


def matmul(lib, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x W^T through matmul_f32, as CudaBackend._matmul_tiles launches it for the router."""
    from engine.backends.cuda.backend import MATMUL_TILE
    from kernels.params import pack
    T, K = x.shape
    N = w.shape[0]
    w = np.ascontiguousarray(w, np.float32)
    x = np.ascontiguousarray(x, np.float32)
    y = np.full((T, N), np.nan, np.float32)
    params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=1, row_bytes=4 * K, expert_bytes=0,
                  x_per_slot=0, n_experts=1)
    lib.run_matmul(w.ctypes.data, x.ctypes.data, y.ctypes.data, params.ctypes.data, N, -(-T // MATMUL_TILE), THREADS)
    return y


def main(seed: int) -> int:
    from kernels.cases import cuda_reference
    rng = np.random.default_rng(seed)
    lib = build()
    ref = cuda_reference()
    bad = 0
    for T, E, K, k, norm, scale in ((1, 128, 512, 8, True, 1.0), (5, 256, 256, 8, False, 2.5), (8, 64, 128, 4, True, 1.0)):
        w = rng.uniform(-1, 1, (E, K)).astype(np.float32)
        x = rng.uniform(-1, 1, (T, K)).astype(np.float32)
        logits, probs, ids, weights, ticket = router(lib, w, x, k, norm, scale)
        want_p, want_i, want_w = ref.moe_route(logits, k, norm, scale)
        ok = (np.array_equal(logits, matmul(lib, w, x)) and np.array_equal(ids, want_i) and ticket[0] == 0
              and np.allclose(probs, want_p, rtol=1e-6, atol=0) and np.allclose(weights, want_w, rtol=1e-6, atol=0))
        print(f"T={T} E={E} K={K} k={k}: {'ok' if ok else 'FAILED'}")
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
