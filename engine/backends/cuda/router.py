"""Row reductions (kernels/router.cu): softmax, top-k and argmax over the last axis (a MoE
router's probabilities and choices, an output head's greedy token)."""

from __future__ import annotations

import numpy as np

from ...errors import BrassError
from .common import F32, f32
from .params import pack

ROW_THREADS = 256
ARGMAX_THREADS = 1024


def launched_kernels() -> list[tuple[str, str]]:
    return [("router.cu", k) for k in ("softmax", "topk", "argmax", "argmax_partial", "argmax_final")]


def rows(x, what):
    """(x as float32, its columns, its rows)."""
    x = f32(x, what)
    return x, x.shape[-1], (x.size // x.shape[-1] if x.shape[-1] else 0)


def softmax(b, x):
    x, C, R = rows(x, "softmax")
    y = b._out(x.shape)
    if R:
        b.launch("router.cu", "softmax", R, ROW_THREADS, x, y, params=pack("RowParams", n_rows=R, n_cols=C, k=0))
    return y


def topk(b, x, k):
    x, C, R = rows(x, "topk")
    if not 0 < k <= C:
        raise BrassError(f"topk: k = {k} must be in [1, {C}]")
    ids = b._out((*x.shape[:-1], k), np.int32)
    vals = b._out((*x.shape[:-1], k), F32)
    if R:
        b.launch("router.cu", "topk", R, ROW_THREADS, x, ids, vals,
                 params=pack("RowParams", n_rows=R, n_cols=C, k=k))
    return ids, vals


def argmax(b, x):
    x, C, R = rows(x, "argmax")
    if not C:
        raise BrassError("argmax: rows are empty")
    ids = b._out(x.shape[:-1], np.int32)
    if R and C > 8 * ARGMAX_THREADS:
        # An output head's row: spread over many blocks (argmax_partial's best value and index
        # of each run of columns), then one warp picks the best.
        parts = min(-(-C // ARGMAX_THREADS), 256)
        pv, pi = b._out((R, parts), F32), b._out((R, parts), np.int32)
        b.launch("router.cu", "argmax_partial", (parts, R), ARGMAX_THREADS, x, pv, pi,
                 params=pack("RowParams", n_rows=R, n_cols=C, k=1))
        b.launch("router.cu", "argmax_final", R, 32, pv, pi, ids,
                 params=pack("RowParams", n_rows=R, n_cols=parts, k=1))
    elif R:
        b.launch("router.cu", "argmax", R, ARGMAX_THREADS, x, ids, params=pack("RowParams", n_rows=R, n_cols=C, k=1))
    return ids
