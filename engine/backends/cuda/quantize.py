"""Activations as Q8_1 blocks (kernels/quantize.cu), what the quantized mat-vecs read, and the
memo of blocks their producers wrote.

A kernel that produces an activation (a norm, attention, the gated FFN) writes its Q8_1 blocks
beside it; remember() keeps them, {id(array): (array, blocks)} on the backend (`b._q8`), and a
mat-vec that finds its input there skips the quantize kernel. Activations are never written in
place once produced, and the entry holds the array, so its id cannot be reused while the entry
lives.
"""

from __future__ import annotations

import numpy as np

from .common import FLOAT_TYPES, Q8_1_BLOCK_BYTES, grid_1d
from .params import pack

QUANTIZE_THREADS = 256
Q8_MEMO = 16                    # activations whose Q8_1 blocks are remembered


def launched_kernels() -> list[tuple[str, str]]:
    return [("quantize.cu", "quantize_q8_1")]


def quantize_q8_1(b, x):
    """Rows of x [R, K] (K a multiple of 32) → Q8_1 blocks, [R, K/32 * 36] bytes."""
    R, K = x.shape
    y = b._out((R, K // 32 * Q8_1_BLOCK_BYTES), np.uint8)
    b.launch("quantize.cu", "quantize_q8_1", grid_1d(R * K, QUANTIZE_THREADS, 1 << 30),
             QUANTIZE_THREADS, x, y, params=pack("QuantizeParams", n_rows=R, k=K))
    return y


def remember(b, x, blocks):
    """Keep `blocks`, the Q8_1 blocks a kernel wrote of activation `x`, for its mat-vecs."""
    b._q8[id(x)] = (x, blocks)
    if len(b._q8) > Q8_MEMO:
        b._q8.popitem(last=False)


def blocks_of(b, x):
    """The Q8_1 blocks a producer kernel wrote beside `x`, or None. x may also be a contiguous
    reshape of the remembered array (the delta-net's output norm is read as [T, Hv * D]): the
    same values in the same order, and the blocks, formed along rows of a multiple of 32
    values, are the same along x's rows."""
    hit = b._q8.get(id(x))
    if hit is not None and hit[0] is x:
        return hit[1]
    if x.flags.c_contiguous:
        for a, blocks in b._q8.values():
            if a.data.ptr == x.data.ptr and a.size == x.size and a.dtype == x.dtype:
                return blocks
    return None


def activations(b, x, w, source=None):
    """What the mat-vec kernel of w's type reads: x itself, or x as Q8_1 blocks (those a
    producer kernel already wrote for `source`, the array x was taken from, if any)."""
    if w.type in FLOAT_TYPES:
        return x
    blocks = blocks_of(b, source if source is not None else x)
    return blocks if blocks is not None else b.quantize_q8_1(x)
