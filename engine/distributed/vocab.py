"""The vocabulary-parallel LM head's collectives: each rank holds the logits of its contiguous
range of the vocabulary (rank order is vocabulary order), and what sampling needs of the whole
row comes from small per-rank pieces, never from a gather of the logits:

- `argmax`: each rank's (max, index) pair, all-gathered (2 numbers a rank and row): the first
  rank holding the largest value wins, which is the lowest id among equal maxima, as a
  numpy argmax of the whole row gives.
- `logsumexp`: each rank's (max, sum of exp(x - max)), all-gathered; combined as
  M + log(sum_r s_r exp(m_r - M)) with M the global max (the log-softmax of logprobs).
- `topk`: each rank's own top k (value, id), all-gathered (k pairs a rank), the top k of those.
- `gather`: the whole rows, for what needs them (teacher-forced scoring, sampling with top-k
  off).
"""

from __future__ import annotations

import numpy as np


def row_max(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(largest value float64 `[T]`, its column int64 `[T]`, the first among equals) of each
    row of this rank's logits."""
    x = np.asarray(logits, np.float32)
    i = np.argmax(x, axis=-1)
    return x[np.arange(len(i)), i].astype(np.float64), i.astype(np.int64)


def argmax(comm, logits: np.ndarray, offset: int) -> np.ndarray:
    """Global argmax (int64 `[T]`) of rows whose columns [offset, offset + n) this rank holds."""
    return argmax_of(comm, *row_max(logits), offset)


def argmax_of(comm, values: np.ndarray, index: np.ndarray, offset: int) -> np.ndarray:
    """Global argmax (int64 `[T]`) from each rank's row_max (host arrays; index local to the
    rank's columns, which start at `offset`)."""
    mine = np.stack([np.asarray(values, np.float64), (np.asarray(index) + offset).astype(np.float64)], -1)
    every = comm.all_gather(mine[:, None, :], axis=1)          # [T, ranks, 2], rank order
    best = np.argmax(every[..., 0], axis=1)                     # first max: the lowest id
    return every[np.arange(len(best)), best, 1].astype(np.int64)


def logsumexp(comm, logits: np.ndarray) -> np.ndarray:
    """log(sum exp(x)) over the whole vocabulary of each row (float64 `[T]`)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1)
    s = np.exp(x - m[:, None]).sum(axis=-1)
    every = comm.all_gather(np.stack([m, s], -1)[:, None, :], axis=1)
    M = every[..., 0].max(axis=1)
    return M + np.log((every[..., 1] * np.exp(every[..., 0] - M[:, None])).sum(axis=1))


def topk(comm, logits: np.ndarray, offset: int, k: int):
    """(ids int64 `[T, k]`, values float32 `[T, k]`) of the k largest per row, descending,
    ties to the lower id."""
    x = np.asarray(logits, np.float32)
    kk = min(k, x.shape[-1])
    idx = np.argsort(-x, axis=-1, kind="stable")[:, :kk]
    vals = np.take_along_axis(x, idx, -1).astype(np.float64)
    every = comm.all_gather(np.stack([vals, (idx + offset).astype(np.float64)], -1), axis=1)
    order = np.lexsort((every[..., 1], -every[..., 0]), axis=-1)[:, :k]
    top = np.take_along_axis(every, order[..., None], axis=1)
    return top[..., 1].astype(np.int64), top[..., 0].astype(np.float32)


def gather(comm, logits: np.ndarray) -> np.ndarray:
    """The whole rows (every rank's columns, in vocabulary order)."""
    return comm.all_gather(np.asarray(logits, np.float32), axis=-1)
