"""kernels/elementwise.cu's sigmoid_gate run on the CPU, for machines without a GPU: the kernel
source compiled by g++ against mmq_host.py's shim of CUDA device code, one block of EW_THREADS
threads striding over every element (the kernel's grid-stride loop covers them all).
conformance/kernels/test_kernels_sigmoid_gate.py holds it to the ops it replaces.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import build_kernel_file  # noqa: E402


RUNNERS = r"""extern "C" int run_sigmoid_gate(const float * x, const float * g, const float * a, float * y, const void * params) {
    SigmoidGateParams p; memcpy(&p, params, sizeof p);
    gridDim = {1, 1, 1}; blockDim = {EW_THREADS, 1, 1}; blockIdx = {0, 0, 0};
    for (unsigned i = 0; i < EW_THREADS; ++i) { threadIdx = {i, 0, 0}; sigmoid_gate(x, g, a, y, p); }
    return 0;
}
"""


def build() -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of elementwise.cu; raises NoHostCompiler without g++."""
    so = build_kernel_file("elementwise.cu", 256, RUNNERS)        # 256: EW_THREADS
    so.run_sigmoid_gate.argtypes = [ctypes.c_void_p] * 5
    return so


def sigmoid_gate(lib, x, g, a=None):
    """The kernel: (a +) x * sigmoid(g), g shaped as x or [T, 1]."""
    from brass.backends.cuda.params import pack
    x, g = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(g, np.float32)
    a_ = x if a is None else np.ascontiguousarray(a, np.float32)
    y = np.full(x.shape, np.nan, np.float32)
    params = pack("SigmoidGateParams", n=x.size, row=x.shape[1], row_gate=int(g.shape != x.shape),
                  has_a=int(a is not None))
    lib.run_sigmoid_gate(x.ctypes.data, g.ctypes.data, a_.ctypes.data, y.ctypes.data, params.ctypes.data)
    return y
