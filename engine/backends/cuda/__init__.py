"""The CUDA backend (CuPy + NVRTC kernels from kernels/); see backend.py."""

from .backend import CudaBackend, CudaWeight

__all__ = ["CudaBackend", "CudaWeight"]
