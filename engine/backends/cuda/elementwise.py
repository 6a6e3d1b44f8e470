"""Elementwise ops (kernels/elementwise.cu): the residual adds and products (a weight broadcast
over rows), the scalar ops, the gated activations, and the experts' per-expert scale and
weighted sum."""

from __future__ import annotations

import cupy

from ...errors import BrassError
from ..base import Weight
from .common import F32, CudaWeight, f32, grid_1d, i32
from .params import pack

EW_THREADS = 256
KERNELS = ("add", "mul", "scale", "sigmoid_gate", "swiglu", "geglu", "weighted_sum", "tanh_f32", "softcap",
           "mul_expert_scale")


def launched_kernels() -> list[tuple[str, str]]:
    return [("elementwise.cu", k) for k in KERNELS]


def binary(b, kernel: str, x, other):
    """add or mul of x and `other` (an array or a Weight: the same shape, x's trailing shape,
    or one value)."""
    x = f32(x, kernel)
    other = f32(other.dense if isinstance(other, Weight) else other, kernel)
    if other.shape == x.shape:
        n_b = x.size
    elif other.ndim <= x.ndim and x.shape[x.ndim - other.ndim:] == other.shape:
        n_b = other.size
    elif other.ndim <= x.ndim and other.size == 1:
        n_b = 1         # a scalar weight (gemma4's layer_output_scale, shape (1,))
    else:
        # Other broadcasts do not occur in the architectures; CuPy's own kernel does them.
        return (cupy.add if kernel == "add" else cupy.multiply)(x, other, dtype=F32)
    y = b._out(x.shape)
    if x.size:
        b.launch("elementwise.cu", kernel, grid_1d(x.size, EW_THREADS), EW_THREADS, x, other, y,
                 params=pack("BinaryParams", n=x.size, n_b=n_b))
    return y


def sigmoid_gate(b, x, gate, a=None):
    """(a +) x * sigmoid(gate) in one launch, gate shaped as x or one value a row ([T, 1]);
    None where the shapes are other (the caller composes)."""
    x, gate = f32(x, "sigmoid_gate"), f32(gate, "sigmoid_gate gate")
    a = None if a is None else f32(a, "sigmoid_gate a")
    if x.ndim != 2 or (a is not None and a.shape != x.shape):
        return None
    if gate.shape == x.shape:
        row_gate = 0
    elif gate.shape == (x.shape[0], 1):
        row_gate = 1
    else:
        return None
    y = b._out(x.shape)
    if x.size:
        b.launch("elementwise.cu", "sigmoid_gate", grid_1d(x.size, EW_THREADS), EW_THREADS, x, gate,
                 x if a is None else a, y,
                 params=pack("SigmoidGateParams", n=x.size, row=x.shape[1], row_gate=row_gate, has_a=int(a is not None)))
    return y


def with_scalar(b, kernel: str, x, s: float):
    """A kernel taking x and one float (ScaleParams): scale, softcap."""
    x = f32(x, kernel)
    y = b._out(x.shape)
    if x.size:
        b.launch("elementwise.cu", kernel, grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                 params=pack("ScaleParams", n=x.size, s=s))
    return y


def glu(b, kernel: str, gate, up):
    """swiglu or geglu: act(gate) * up."""
    gate, up = f32(gate, kernel), f32(up, kernel)
    if gate.shape != up.shape:
        raise BrassError(f"{kernel}: gate {gate.shape} and up {up.shape} differ in shape")
    y = b._out(gate.shape)
    if gate.size:
        b.launch("elementwise.cu", kernel, grid_1d(gate.size, EW_THREADS), EW_THREADS,
                 gate, up, y, params=pack("GluParams", n=gate.size))
    return y


def tanh(b, x):
    x = f32(x, "tanh")
    y = b._out(x.shape)
    if x.size:
        b.launch("elementwise.cu", "tanh_f32", grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                 params=pack("GluParams", n=x.size))
    return y


def mul_expert_scale(b, y, s, ids):
    y = f32(y, "mul_expert_scale")
    ids = i32(ids, "mul_expert_scale ids")
    if not isinstance(s, CudaWeight) or s.dense is None or s.dense.ndim != 1:
        raise BrassError(f"mul_expert_scale: the scale must be a 1-D weight (one value per expert), "
                         f"got {getattr(s, 'shape', type(s).__name__)}")
    if y.ndim != 3 or ids.shape != y.shape[:2]:
        raise BrassError(f"mul_expert_scale: expected y [T, k, N] and ids [T, k], got {y.shape} "
                         f"and {ids.shape}")
    T, k, N = y.shape
    out = b._out(y.shape)
    if T * k and N:
        b.launch("elementwise.cu", "mul_expert_scale", (T * k, -(-N // EW_THREADS)), EW_THREADS,
                 y, s.dense, ids, out,
                 params=pack("ExpertScaleParams", n_slots=T * k, n_cols=N, n_experts=s.dense.shape[0]))
    return out


def weighted_sum(b, y, w):
    y, w = f32(y, "weighted_sum"), f32(w, "weighted_sum")
    if y.ndim != 3 or w.shape != y.shape[:2]:
        raise BrassError(f"weighted_sum: expected y [T, k, D] and w [T, k], got {y.shape} and {w.shape}")
    T, k, D = y.shape
    out = b._out((T, D), F32)
    if T and D:
        b.launch("elementwise.cu", "weighted_sum", (-(-D // EW_THREADS), T), EW_THREADS, y, w, out,
                 params=pack("WeightedSumParams", n_tokens=T, k=k, n_cols=D))
    return out
