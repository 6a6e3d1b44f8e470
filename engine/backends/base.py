"""The op surface every backend provides. Architecture files call only these methods.

Conventions (see docs/design.md):
- activations are float32 arrays `[T, D]` in the backend's own array type; heads are `[T, H, Dh]`;
- a linear weight `W` has numpy shape `(N, K)` and `matmul(x, W)` is `x @ W.T`;
- `pos` is an int32 array `[T]` on the device; attention masks, rope angles and KV slots are
  derived from it, so no op needs the host to know the sequence length (graph capture);
- the KV cache is float16 `[n_ctx, H_kv, Dh]` per layer; a token's slot is its position.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np


class Weight(ABC):
    """A model tensor prepared by a backend. `type` is the GGML type, `shape` numpy-ordered."""

    name: str
    type: Any
    shape: tuple[int, ...]


class Backend(ABC):
    name: str = "abstract"

    def activate(self):
        """Context in which this backend's work runs: on a device backend, its device and
        stream become current for the calling thread, so array operations made outside the
        backend's own kernels (the architecture's reshape/sum, host copies) queue on the same
        stream in order, whichever thread runs them and however many backends exist."""
        return contextlib.nullcontext()

    # -- memory -----------------------------------------------------------------------------
    @abstractmethod
    def weight(self, gf, name: str) -> Weight:
        """Prepare GGUF tensor `name` of file `gf` for use by this backend."""

    @abstractmethod
    def asarray(self, a: np.ndarray, dtype=None):
        """Host array → backend array."""

    @abstractmethod
    def to_numpy(self, a) -> np.ndarray:
        """Backend array → host array (a synchronisation point on devices)."""

    @abstractmethod
    def empty(self, shape, dtype=np.float32):
        """Uninitialised backend array (callers overwrite every element)."""

    @abstractmethod
    def zeros(self, shape, dtype=np.float32):
        ...

    # -- ops --------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, table: Weight, ids):
        """Rows `ids` of a (possibly quantized) table as float32 `[T, D]`."""

    @abstractmethod
    def matmul(self, x, w: Weight):
        """`x [T, K] @ W.T → [T, N]` (ggml_mul_mat(W, x))."""

    @abstractmethod
    def matmul_id(self, x, w: Weight, ids):
        """Expert mat-vec (ggml_mul_mat_id). `w` is `(E, N, K)`, `ids` int32 `[T, k]`.
        `x` is `[T, K]` (the same row for every chosen expert) or `[T, k, K]` (one row per
        choice). Returns `[T, k, N]`."""

    @abstractmethod
    def rms_norm(self, x, w: Weight | None, eps: float):
        """RMS-normalise over the last axis, then multiply by `w` (broadcast) if given."""

    @abstractmethod
    def add(self, a, b):
        """Elementwise `a + b`; `b` may be a Weight (a bias) broadcast over rows."""

    @abstractmethod
    def mul(self, a, b):
        """Elementwise `a * b` with numpy broadcasting."""

    @abstractmethod
    def scale(self, x, s: float):
        ...

    @abstractmethod
    def rope(self, x, pos, n_rot: int, base: float, neox: bool, freq_scale: float = 1.0):
        """Rotary embedding on `[T, H, Dh]` (first `n_rot` dims of each head), ggml_rope_ext
        with ext_factor 0 and attn_factor 1. `neox` rotates pairs (i, i + n_rot/2) instead of
        (2i, 2i + 1)."""

    @abstractmethod
    def kv_store(self, cache, x, pos):
        """Write `x [T, H_kv, Dh]` into `cache [n_ctx, H_kv, Dh]` at slots `pos` (as F16)."""

    @abstractmethod
    def attention(self, q, k_cache, v_cache, pos, scale: float, window: int = 0):
        """Causal GQA softmax attention of queries `q [T, H, Dh]` at positions `pos` over
        cache slots `s <= pos[t]` (and `pos[t] - s < window` when window > 0). Head h reads
        KV head `h // (H / H_kv)`. Returns `[T, H * Dv]`."""

    @abstractmethod
    def swiglu(self, gate, up):
        """`silu(gate) * up`."""

    @abstractmethod
    def geglu(self, gate, up):
        """`gelu_tanh(gate) * up`."""

    @abstractmethod
    def softmax(self, x):
        """Softmax over the last axis."""

    @abstractmethod
    def topk(self, x, k: int):
        """Indices (int32 `[T, k]`, descending by value) and values of the k largest per row."""

    @abstractmethod
    def weighted_sum(self, y, w):
        """`y [T, k, D]`, `w [T, k]` → `sum_j w[:, j, None] * y[:, j]` → `[T, D]`."""

    @abstractmethod
    def take_rows(self, x, rows):
        """`x[rows]` (rows: int32 backend array)."""

    @abstractmethod
    def argmax(self, x):
        """Row-wise argmax, int32 `[T]` on the device (first maximum on ties)."""

    def synchronize(self):
        """Wait for queued work (no-op on synchronous backends)."""
