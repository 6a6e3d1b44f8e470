"""RMS norm of rows (kernels/norm.cu); the norms fused with a residual add or with each other
are fused.cu's (fused.py)."""

from __future__ import annotations

import numpy as np

from ...errors import BrassError
from ..base import Backend
from . import quantize
from .common import Q8_1_BLOCK_BYTES, f32
from .params import pack

NORM_THREADS = 256


def launched_kernels() -> list[tuple[str, str]]:
    return [("norm.cu", "rms_norm")]


def rms_norm(b, x, w, eps, *, scale=None, z=None, write_q8=False):
    """rms_norm(x) * w over the last axis; then * scale (a float), then * silu(z) (z shaped as
    x), in the one launch: the float32 ops of the scale, unary and mul kernels they replace.
    write_q8: the result's Q8_1 blocks too, remembered for the mat-vec that reads it (rows of a
    multiple of 32 values; others are quantized there as before)."""
    x = f32(x, "rms_norm")
    D = x.shape[-1]
    if w is not None and tuple(w.shape) != (D,):
        raise BrassError(f"rms_norm: weight {w.name} has shape {w.shape}, rows have {D} values")
    if z is not None:
        z = f32(z, "rms_norm gate")
        if z.shape != x.shape:
            raise BrassError(f"rms_norm: the gate has shape {z.shape}, x {x.shape}")
    y = b._out(x.shape)
    rows = x.size // D if D else 0
    write_q8 = write_q8 and D % 32 == 0
    yq = b._out((rows, D // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else y
    if rows:
        b.launch("norm.cu", "rms_norm", rows, NORM_THREADS, x, x if w is None else w.dense, x if z is None else z, y,
                 yq, params=pack("RmsNormParams", n_rows=rows, n_cols=D, eps=eps, has_weight=int(w is not None),
                                 has_scale=int(scale is not None), scale=0.0 if scale is None else scale,
                                 has_gate=int(z is not None), write_q8=int(write_q8)))
        if write_q8:
            quantize.remember(b, y, yq)
    return y


def l2_norm(b, x, eps):
    """base.l2_norm (rms_norm with eps / n, then * 1 / sqrt(n), float32) in one launch."""
    eps_n, scale = Backend.l2_norm_terms(x.shape[-1], eps)
    return rms_norm(b, x, None, eps_n, scale=scale)


def rms_norm_gated(b, x, w, z, eps):
    """base.rms_norm_gated (rms_norm(x, w) * silu(z)) in one launch."""
    return rms_norm(b, x, w, eps, z=z, write_q8=True)      # the output projection reads it
