"""Batched decode: one forward step over the next token of each of several sequences.

Every sequence keeps its own Session (KV cache, position). A step stacks their next tokens as
the rows of one batch and runs the model once: each weight matrix is read once for all rows
(decode is bound by reading weights, so B sequences cost about what one does), while attention
reads each row's own cache up to its own position. Rows are computed exactly as they would be
alone (`Backend.rows_independent`): a sequence's tokens do not depend on which others share its
steps, nor on when they join or leave, so serving many requests together changes no answer.

Sequences join and leave between steps by being passed or not; prefill stays per sequence
(`Session.prefill`), so a scheduler interleaves a new request's prompt, in chunks, between the
batched steps of the running ones.
"""

from __future__ import annotations

import numpy as np

from .errors import BrassError, UnsupportedError


class SequenceBatch:
    """What a batched step's forward pass sees as its cache: the sequences' caches in row
    order (the attention block writes and reads row r in `sequences[r]`)."""

    def __init__(self, caches: list):
        self.sequences = caches


def supports_batched_decode(model) -> bool:
    """Whether the model's architecture decodes several sequences in one step (its layers go
    through the shared attention block, which knows a SequenceBatch)."""
    return bool(getattr(model.arch, "BATCHED_DECODE", False))


class BatchDecoder:
    """`step(sessions, tokens)`: logits `[B, n_vocab]` (a backend array) after `tokens[r]` at
    the next position of `sessions[r]`, each session advanced by one."""

    def __init__(self, model):
        if not supports_batched_decode(model):
            raise UnsupportedError(f"{model.gguf.architecture} does not decode sequences in "
                                   f"batches yet")
        self.model = model

    def step(self, sessions: list, tokens: list[int]):
        m = self.model
        b = m.backend
        if not sessions or len(sessions) != len(tokens):
            raise BrassError(f"a batched step needs one token per session "
                             f"({len(sessions)} sessions, {len(tokens)} tokens)")
        if len({id(s) for s in sessions}) != len(sessions):
            raise BrassError("a session appears twice in one batched step")
        for s, tok in zip(sessions, tokens):
            if s.model is not m:
                raise BrassError("a batched step's sessions must belong to its model")
            if not 0 <= int(tok) < m.config.n_vocab:
                raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
            if s.n_past + 1 > s.n_ctx:
                raise BrassError(f"{s.n_past + 1} tokens exceed the context of {s.n_ctx}")
        ids = np.asarray([int(t) for t in tokens], np.int32)
        pos = np.asarray([s.n_past for s in sessions], np.int32)
        with b.activate(), b.rows_independent():
            logits = m.forward(b.asarray(ids), b.asarray(pos),
                               SequenceBatch([s.cache for s in sessions]))
        for s in sessions:
            s.n_past += 1
        return logits
