"""RMS norm of rows (kernels/norm.cu); the norms fused with a residual add or with each other
are fused.cu's (fused.py)."""

from __future__ import annotations

from ...errors import BrassError
from .common import f32
from .params import pack

NORM_THREADS = 256


def launched_kernels() -> list[tuple[str, str]]:
    return [("norm.cu", "rms_norm")]


def rms_norm(b, x, w, eps):
    x = f32(x, "rms_norm")
    D = x.shape[-1]
    if w is not None and tuple(w.shape) != (D,):
        raise BrassError(f"rms_norm: weight {w.name} has shape {w.shape}, rows have {D} values")
    y = b._out(x.shape)
    rows = x.size // D if D else 0
    if rows:
        b.launch("norm.cu", "rms_norm", rows, NORM_THREADS, x, x if w is None else w.dense, y,
                 params=pack("RmsNormParams", n_rows=rows, n_cols=D, eps=eps, has_weight=int(w is not None)))
    return y
