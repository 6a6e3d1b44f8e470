"""Test doubles shared by the conformance tests."""

from __future__ import annotations

import numpy as np

from brass.backends.numpy_backend import NumpyBackend


class ReplayingNumpy(NumpyBackend):
    """The numpy backend with the CUDA backend's graph interface, a replay re-running the
    captured function: enough to drive Session.greedy's device-side loop (steps issued ahead
    of the consumer, tokens read back in chunks) on the CPU."""

    supports_graphs = True
    graph_bytes = 0

    def capture(self, fn, reuse_freed=False):
        return _Replay(self, fn)

    def decode_set(self, tok, pos, token, position):
        tok[0], pos[0] = token, position

    def decode_advance(self, next_ids, tok, pos, history):
        tok[0] = next_ids[0]
        pos[0] += 1
        history[pos[0]] = tok[0]

    def pinned_empty(self, n, dtype):
        return np.empty(n, dtype)

    def copy_to_host_async(self, src, dst):
        dst[...] = src
        return dst.copy

    def upload_async(self, dst, src):
        dst[...] = src
        return lambda: None


class _Replay:
    """A captured "graph": its replay re-runs the captured function. It keeps the function, as
    a backend may (a class made per capture would be a cycle of its own, freed only by the
    garbage collector with the function and all it reaches)."""

    def __init__(self, backend, fn):
        self.backend, self.fn, self.result = backend, fn, None
        self.nbytes = backend.graph_bytes       # what a CUDA graph would hold

    def replay(self):
        self.result = self.fn()


def rows_alone(backend):
    """`backend` (numpy) computing every row of a prompt as it would be alone: its mat-muls row
    by row (rows_independent: gemv per row) and its attention a query at a time over the keys
    up to that query's position. numpy's BLAS sums a row in an order that depends on how many
    rows (and keys) a product has; a prompt graph pads a prompt to its length class, so its
    real rows are products of more rows than an eager read's. The CPU tests of the padding
    compare through this on both sides (the CUDA kernels' own row independence is tested on
    the GPU)."""
    backend._rows_independent = True
    whole = backend.attention

    def attention(q, k_cache, v_cache, pos, scale, window=0):
        pos = np.asarray(pos)
        rows = [whole(q[t:t + 1], k_cache, v_cache, pos[t:t + 1], scale, window) for t in range(len(pos))]
        return np.concatenate(rows) if rows else whole(q, k_cache, v_cache, pos, scale, window)
    backend.attention = attention
    return backend
