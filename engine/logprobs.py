"""Log-probabilities as OpenAI reports them: the log-softmax, in float32, of the logits a
token was chosen from (before any sampling penalty: llama-server's post_sampling_probs=false).
One function for `brass score --logprobs` and the server, so the two cannot disagree."""

from __future__ import annotations

import numpy as np

# The most top_logprobs / logprobs alternatives a request may ask for (OpenAI allows 20 for
# chat, 5 for legacy completions; Brass allows 20 for both).
MAX_TOP_LOGPROBS = 20


def log_softmax(logits) -> np.ndarray:
    """Row-wise log-softmax of host logits, computed in float32."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float32))


def top(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one log-softmax row, best first (ties: the lower id)."""
    if k <= 0:
        return []
    ids = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in ids]
