"""Rotary embeddings of q or k alone (kernels/rope.cu): rope, and rope_ff with frequency factors
(Gemma 4's full-attention layers). The decode path's rope with the q/k norms and the cache
writes in one kernel is fused.cu's rope_store (fused.py)."""

from __future__ import annotations

import numpy as np

from ...errors import BrassError
from .common import CudaWeight, f32, i32
from .params import pack

ROPE_THREADS = 128


def launched_kernels() -> list[tuple[str, str]]:
    return [("rope.cu", "rope"), ("rope.cu", "rope_ff")]


def theta_scale(base, n_rot: int):
    """ggml's theta_scale, rounded to float32 the way the numpy reference rounds it."""
    return np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))


def rope(b, x, pos, n_rot, base, neox, freq_scale, freq_factors=None):
    """rope, or rope_ff when freq_factors (a 1-D weight of >= n_rot / 2 factors) is given."""
    what = "rope" if freq_factors is None else "rope_ff"
    x = f32(x, what)
    pos = i32(pos, f"{what} pos")
    if x.ndim != 3 or pos.shape != (x.shape[0],):
        raise BrassError(f"{what}: expected x [T, H, Dh] and pos [T], got {x.shape} and {pos.shape}")
    T, H, Dh = x.shape
    if n_rot % 2 or not 0 < n_rot <= Dh:
        raise BrassError(f"{what}: n_rot {n_rot} must be even and in (0, {Dh}]")
    if freq_factors is not None and (not isinstance(freq_factors, CudaWeight) or freq_factors.dense is None
                                     or freq_factors.dense.ndim != 1
                                     or freq_factors.dense.shape[0] < n_rot // 2):
        raise BrassError(f"rope_ff: the frequency factors must be a 1-D weight of at least "
                         f"n_rot / 2 = {n_rot // 2} values, got {getattr(freq_factors, 'shape', freq_factors)}")
    ts = theta_scale(base, n_rot)
    y = b._out(x.shape)
    n_threads = n_rot // 2 + (Dh - n_rot)
    ff = () if freq_factors is None else (freq_factors.dense,)
    if T:
        b.launch("rope.cu", what, (-(-n_threads // ROPE_THREADS), H, T), ROPE_THREADS, x, pos, *ff, y,
                 params=pack("RopeParams", n_tokens=T, n_heads=H, head_dim=Dh, n_rot=n_rot,
                             theta_scale=ts, freq_scale=freq_scale, neox=int(bool(neox))))
    return y
