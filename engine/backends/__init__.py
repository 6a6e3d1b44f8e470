"""Backend selection: `numpy` (the reference, anywhere) or `cuda` (CuPy + NVRTC kernels)."""

from __future__ import annotations

from .. import flags
from ..errors import BrassError

BACKENDS = ("numpy", "cuda")


def cuda_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:     # no CuPy, no driver, no device: all mean "not available"
        return False


def default_backend() -> str:
    return flags.get("BRASS_BACKEND") or ("cuda" if cuda_available() else "numpy")


def get_backend(name: str | None = None, **options):
    """The backend `name` (default_backend() when None) with its options (keyword arguments of
    NumpyBackend or CudaBackend). The settings of the environment are checked once as it is
    built: a bad value raises, an unknown BRASS_* variable is warned about (engine/flags.py;
    CudaBackend checks them itself)."""
    name = name or default_backend()
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        flags.check()
        return NumpyBackend(**options)
    if name == "cuda":
        if not cuda_available():
            raise BrassError("the cuda backend needs CuPy and an NVIDIA GPU; none was found "
                             "(use --backend numpy)")
        from .cuda import CudaBackend
        return CudaBackend(**options)
    raise BrassError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
