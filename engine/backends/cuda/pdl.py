"""Kernel launches with programmatic dependent launch (PDL), through the driver's cuLaunchKernelEx.

CuPy launches through cuLaunchKernel, which takes no launch attributes. Inside a captured decode
graph every kernel boundary costs about a microsecond of launch and block scheduling on the
H200, hundreds of times per token; with the programmatic-stream-serialization attribute a kernel
may be launched while the one before it still runs (it waits at PDL_ENTRY, kernels/common.cuh,
for that one to complete), so those costs overlap the previous kernel's tail, and the weights it
prefetches before PDL_ENTRY stream in meanwhile. Stream capture turns the attribute into a
programmatic edge of the graph.

The arguments are laid out as CuPy lays them out (buffers as device pointers, the parameter
struct by value): kernelParams holds one pointer per argument to its bytes.
"""

from __future__ import annotations

import ctypes
import functools

import cupy
import numpy as np

# cuda.h: CUlaunchAttributeID
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
MIN_CC = 90             # griddepcontrol needs sm_90


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_uint64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_Config) == 56, "CUlaunchConfig layout"


@functools.lru_cache(maxsize=None)
def _driver():
    """cuLaunchKernelEx of the driver CuPy uses, or None where there is none (CUDA < 12)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def available(cc: int) -> bool:
    return cc >= MIN_CC and _driver() is not None


_ATTR = _Attr(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
_ATTR.value.i = 1


def launch(fn: cupy.cuda.function.Function, grid: tuple, block: int, args: tuple, smem: int, stream) -> int:
    """Launch `fn` with the PDL attribute; returns the driver's CUresult (0: launched).
    args: device arrays (passed as their pointers) and numpy arrays (passed by value, their
    bytes: the parameter struct)."""
    holders = []
    for a in args:
        if isinstance(a, cupy.ndarray):
            holders.append(ctypes.c_void_p(a.data.ptr))
        elif isinstance(a, cupy.cuda.MemoryPointer):
            holders.append(ctypes.c_void_p(a.ptr))
        elif isinstance(a, np.ndarray):
            holders.append(a)               # its buffer is the argument's bytes
        else:
            raise TypeError(f"cannot pass a {type(a).__name__} to a kernel launched with PDL")
    ptrs = (ctypes.c_void_p * len(holders))(
        *[ctypes.addressof(h) if isinstance(h, ctypes.c_void_p) else h.ctypes.data for h in holders])
    g = grid + (1,) * (3 - len(grid))
    cfg = _Config(g[0], g[1], g[2], block, 1, 1, smem, stream.ptr, ctypes.pointer(_ATTR), 1)
    return _driver()(ctypes.byref(cfg), fn.ptr, ptrs, None)
