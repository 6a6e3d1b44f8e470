"""cuBLAS's two GEMMs the prompt path uses, called through ctypes on a handle of our own (or,
with the own_cublas option off, through CuPy's binding on CuPy's handle).

CuPy refuses any cuBLAS call while a stream is being captured ("calling cuBLAS API during stream
capture is currently unsupported"), so a prompt, whose mat-muls run on tensor cores through
cuBLAS, could not be captured as a graph (engine/model.py PromptStep). cuBLAS itself supports
capture once the handle has a workspace of the caller's (cublasSetWorkspace: no allocation
inside the capture). This module calls the same library CuPy loaded (found in the process's
memory map, so there is one cuBLAS in the process) with the same arguments CuPy's binding
takes; the scalars alpha and beta are host pointers, read when the call is made (a capture
bakes their values in, which is what a constant 1 and 0 want).
"""

from __future__ import annotations

import ctypes
import functools

from .errors import CudaError

# cuBLAS asks for at least 32 MiB of workspace on Hopper for its best kernels (cuBLAS docs,
# cublasSetWorkspace); one buffer per handle, kept for the handle's life.
WORKSPACE_BYTES = 32 << 20

_c = ctypes
_GEMM_EX = [_c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,
            _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p, _c.c_int, _c.c_int,
            _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int]
_GEMM_STRIDED = [_c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,
                 _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong,
                 _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong,
                 _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong,
                 _c.c_int, _c.c_int, _c.c_int]


def _loaded_path() -> str | None:
    """The libcublas.so CuPy has loaded into this process, if it has."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            name = path.rsplit("/", 1)[-1]
            if name.startswith("libcublas.so"):
                return path
    return None


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """libcublas, as loaded by CuPy (its handle made first, which loads it)."""
    import cupy
    cupy.cuda.device.get_cublas_handle()
    path = _loaded_path()
    if path is None:
        raise CudaError("cuBLAS is not loaded in this process (CuPy made a handle without it?)")
    lib = ctypes.CDLL(path)
    for name, args in (("cublasCreate_v2", [_c.POINTER(_c.c_void_p)]),
                       ("cublasSetStream_v2", [_c.c_void_p, _c.c_void_p]),
                       ("cublasSetWorkspace_v2", [_c.c_void_p, _c.c_void_p, _c.c_size_t]),
                       ("cublasGemmEx", _GEMM_EX), ("cublasGemmStridedBatchedEx", _GEMM_STRIDED)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _c.c_int, args
    return lib


def _check(status: int, what: str):
    if status != 0:
        raise CudaError(f"{what} failed: cuBLAS status {status}")


class Handle:
    """A cuBLAS handle bound to one stream, with its own workspace (so that the calls can be
    captured into a graph)."""

    def __init__(self, stream_ptr: int):
        import cupy
        self.lib = library()
        h = _c.c_void_p()
        _check(self.lib.cublasCreate_v2(_c.byref(h)), "cublasCreate")
        self.ptr = h.value
        self.workspace = cupy.empty(WORKSPACE_BYTES, cupy.uint8)
        _check(self.lib.cublasSetStream_v2(self.ptr, stream_ptr), "cublasSetStream")
        _check(self.lib.cublasSetWorkspace_v2(self.ptr, self.workspace.data.ptr, WORKSPACE_BYTES),
               "cublasSetWorkspace")

    def gemmEx(self, *args):
        _check(self.lib.cublasGemmEx(self.ptr, *args), "cublasGemmEx")

    def gemmStridedBatchedEx(self, *args):
        _check(self.lib.cublasGemmStridedBatchedEx(self.ptr, *args), "cublasGemmStridedBatchedEx")


@functools.lru_cache(maxsize=None)
def cupy_binding():
    """CuPy's cuBLAS binding, loaded on first use: its constants (CUBLAS_OP_T, ...) for every
    call, and its calls where the backend has no handle of its own."""
    try:
        from cupy_backends.cuda.libs import cublas
        cublas.CUBLAS_OP_T  # noqa: B018 (the library itself loads on first attribute access)
        return cublas
    except ImportError as e:
        raise CudaError(f"cuBLAS could not be loaded ({e}); install the cuda extra "
                        f"(pip install -e '.[cuda]', which brings nvidia-cublas) or a CUDA toolkit") from None


class CupyHandle:
    """CuPy's shared cuBLAS handle of the current device, set to a stream."""

    def __init__(self, stream_ptr: int):
        import cupy
        self.cublas = cupy_binding()
        self.handle = cupy.cuda.device.get_cublas_handle()
        self.cublas.setStream(self.handle, stream_ptr)

    def gemmEx(self, *args):
        self.cublas.gemmEx(self.handle, *args)

    def gemmStridedBatchedEx(self, *args):
        self.cublas.gemmStridedBatchedEx(self.handle, *args)
