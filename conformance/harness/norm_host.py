"""kernels/norm.cu's rms_norm run on the CPU, for machines without a GPU: the kernel source
compiled by g++ against mmq_host.py's shim of CUDA device code (every thread of a block a
std::thread, one block at a time, __syncthreads a barrier), launched as CudaBackend launches it
(one block of NORM_THREADS per row). conformance/kernels/test_kernels_delta_net_fused.py holds it to
the compositions it replaces.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import build_kernel_file  # noqa: E402


RUNNERS = r"""extern "C" int run_rms_norm(const float * x, const float * w, const float * z, float * y, void * yq,
                            const void * params, unsigned rows) {
    RmsNormParams p; memcpy(&p, params, sizeof p);
    run_grid(rows, 1, NORM_THREADS, 0, [=] { rms_norm(x, w, z, y, (block_q8_1 *) yq, p); });
    return 0;
}
"""


def build() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of norm.cu; raises NoHostCompiler without g++."""
    so = build_kernel_file("norm.cu", 256, RUNNERS)       # 256: NORM_THREADS
    so.run_rms_norm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_uint]
    return so


def rms_norm(lib, x, w, eps, scale=None, z=None, blocks=False):
    """The kernel over rows x [R, D]: rms_norm(x) (* w) (* scale) (* silu(z)); with blocks,
    (y, its Q8_1 blocks as the kernel wrote them)."""
    from brass.backends.cuda.params import pack
    x = np.ascontiguousarray(x, np.float32)
    R, D = x.shape
    y = np.full((R, D), np.nan, np.float32)
    w_ = x if w is None else np.ascontiguousarray(w, np.float32)
    z_ = x if z is None else np.ascontiguousarray(z, np.float32)
    yq = np.full((R, D // 32 * 36), 0xEE, np.uint8)
    params = pack("RmsNormParams", n_rows=R, n_cols=D, eps=eps, has_weight=int(w is not None),
                  has_scale=int(scale is not None), scale=0.0 if scale is None else scale, has_gate=int(z is not None),
                  write_q8=int(blocks))
    lib.run_rms_norm(x.ctypes.data, w_.ctypes.data, z_.ctypes.data, y.ctypes.data, yq.ctypes.data, params.ctypes.data,
                     R)
    return (y, yq) if blocks else y
