"""kernels/fused.cu's norm kernels (add_rms_norm, moe_norms) and rope_store run on the CPU, for machines without
a GPU: the kernel source compiled by g++ against mmq_host.py's shim of CUDA device code
(every thread of a block a std::thread, one block at a time, __syncthreads a barrier, warp
shuffles through per-warp barriers), launched as CudaBackend launches them (one block of
FUSED_NORM_THREADS per row). conformance/kernels/test_kernels_fused_cpu.py holds them to the numpy
reference's compositions.

    python3 conformance/harness/fused_host.py [seed]      # a few shapes; exit 1 on a failure
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import SHIM, compile_host, host_headers, kernel_harness  # noqa: E402

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
HEADERS = ("common.cuh", "params.cuh", "route.cuh")
THREADS = 1024                      # FUSED_NORM_THREADS

RUNNERS = r"""extern "C" int run_add_rms_norm(const float * a, const float * b, const float * w, const float * sc, float * sum,
                                float * y, void * yq, const void * params, unsigned rows) {
    AddNormParams p; memcpy(&p, params, sizeof p);
    run_grid(rows, 1, NTHREADS, 0, [=] { add_rms_norm(a, b, w, sc, sum, y, (block_q8_1 *) yq, p); });
    return 0;
}

extern "C" int run_rope_store(const float * q, const float * k, const float * v, const float * qn, const float * kn,
                              const int * pos, float * q_out, float * k_out, u16 * kc, u16 * vc,
                              const int * table, const void * params) {
    RopeStoreParams p; memcpy(&p, params, sizeof p);
    run_grid(p.n_heads + 2 * p.n_kv_heads, p.n_tokens, ROPE_STORE_THREADS, 4 * p.head_dim,
             [=] { rope_store(q, k, v, qn, kn, pos, q_out, k_out, kc, vc, table, p); });
    return 0;
}

extern "C" int run_moe_norms(const float * x, const float * w, const float * wr, float * h, void * hq, float * r,
                             const void * params, unsigned rows) {
    MoeNormsParams p; memcpy(&p, params, sizeof p);
    run_grid(rows, 1, NTHREADS, 0, [=] { moe_norms(x, w, wr, h, (block_q8_1 *) hq, r, p); });
    return 0;
}
"""


def _sources() -> dict[str, str]:
    out = host_headers(HEADERS)
    src = (KERNEL_DIR / "fused.cu").read_text()
    src = src.replace("extern __shared__ float row[];", "float * const row = (float *) host_smem;")
    out["fused_host.cu"] = src
    out["shim.h"] = SHIM
    out["harness.cpp"] = kernel_harness("fused_host.cu", THREADS, RUNNERS,
                                        prelude="inline float __ldcg(const float * p) { return *p; }\n")
    return out


def build() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of fused.cu; raises RuntimeError without g++."""
    so = compile_host(_sources(), "fused", "fused.cu")
    p = ctypes.c_void_p
    so.run_add_rms_norm.argtypes = [p] * 8 + [ctypes.c_uint]
    so.run_moe_norms.argtypes = [p] * 7 + [ctypes.c_uint]
    so.run_rope_store.argtypes = [p] * 12
    return so


def rope_store_raw(lib, q, k, v, pos, k_pool, v_pool, tables, params, q_norm=None, k_norm=None):
    """(q_out, k_out) of the kernel over q/k/v [T, H(_kv), D] with the RopeStoreParams
    `params` as given; the float16 pools ([n_blocks, KV_BLOCK, H_kv, D]) are updated in place
    through the block tables (int32; per_row: a row per token), as the kernel writes them."""
    f32 = lambda a: np.ascontiguousarray(a, np.float32)     # noqa: E731
    q, k, v = f32(q), f32(k), f32(v)
    qn = f32(q_norm) if q_norm is not None else q
    kn = f32(k_norm) if k_norm is not None else k
    pos = np.ascontiguousarray(pos, np.int32)
    tables = np.ascontiguousarray(tables, np.int32)
    assert k_pool.flags.c_contiguous and v_pool.flags.c_contiguous
    q_out, k_out = np.full(q.shape, np.nan, np.float32), np.full(k.shape, np.nan, np.float32)
    lib.run_rope_store(_f(q), _f(k), _f(v), _f(qn), _f(kn), _f(pos), _f(q_out), _f(k_out),
                       _f(k_pool.view(np.uint16)), _f(v_pool.view(np.uint16)), _f(tables), _f(params))
    return q_out, k_out


def _f(a: np.ndarray) -> int:
    return a.ctypes.data


def add_rms_norm(lib, a, b, w, eps, scale=None):
    """(sum, y, y's Q8_1 blocks) of the kernel over rows a [R, D] (+ b, then * scale[0])."""
    from brass.backends.cuda.params import pack
    a = np.ascontiguousarray(a, np.float32)
    R, D = a.shape
    s, y = np.full((R, D), np.nan, np.float32), np.full((R, D), np.nan, np.float32)
    yq = np.full((R, D // 32 * 36), 0xEE, np.uint8)
    b = a if b is None else np.ascontiguousarray(b, np.float32)
    sc = a if scale is None else np.ascontiguousarray(scale, np.float32)
    params = pack("AddNormParams", n_rows=R, n_cols=D, eps=eps, has_residual=int(b is not a),
                  write_q8=int(D % 32 == 0), has_scale=int(scale is not None))
    lib.run_add_rms_norm(_f(a), _f(b), _f(np.ascontiguousarray(w, np.float32)), _f(sc), _f(s), _f(y), _f(yq),
                         _f(params), R)
    return s, y, yq


def moe_norms(lib, x, w, w_router, factor, eps):
    """(h, h's Q8_1 blocks, r) of the kernel over rows x [R, D]."""
    from brass.backends.cuda.params import pack
    x = np.ascontiguousarray(x, np.float32)
    R, D = x.shape
    h, r = np.full((R, D), np.nan, np.float32), np.full((R, D), np.nan, np.float32)
    hq = np.full((R, D // 32 * 36), 0xEE, np.uint8)
    params = pack("MoeNormsParams", n_rows=R, n_cols=D, eps=eps, factor=factor, write_q8=int(D % 32 == 0))
    lib.run_moe_norms(_f(x), _f(np.ascontiguousarray(w, np.float32)), _f(np.ascontiguousarray(w_router, np.float32)),
                      _f(h), _f(hq), _f(r), _f(params), R)
    return h, hq, r


if __name__ == "__main__":
    lib = build()
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    print(add_rms_norm(lib, x, x, np.ones(256, np.float32), 1e-6, np.array([0.5], np.float32))[1][0, :4])
    print(moe_norms(lib, x, np.ones(256, np.float32), np.ones(256, np.float32), 0.0625, 1e-6)[2][0, :4])
