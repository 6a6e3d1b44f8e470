"""Errors of the CUDA backend; all are BrassErrors, so the CLI shows a message, not a traceback."""

from ...errors import BrassError


class CudaError(BrassError):
    """No usable device, a bad device choice, or a failed kernel launch."""


class KernelCompileError(CudaError):
    """A kernel source under kernels/ did not compile; the message names the kernel and line."""
