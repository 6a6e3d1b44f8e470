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


# --------------------------------------------------------------------------------------------
# The reply's forms. An entry (engine/scheduler.Job) is {"token": id, "logprob": float or None,
# "top": [(id, logprob), ...] or None}.


def token_text(tokenizer, i: int) -> str:
    return tokenizer.token_to_piece(i).decode("utf-8", errors="replace")


def chat_form(entries: list[dict], tokenizer) -> dict:
    """OpenAI's chat form: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def one(i, lp):
        return {"token": token_text(tokenizer, i), "logprob": lp, "bytes": list(tokenizer.token_to_piece(i))}
    return {"content": [{**one(e["token"], e["logprob"]),
                         "top_logprobs": [one(i, lp) for i, lp in e["top"]]} for e in entries],
            "refusal": None}


def completion_form(entries: list[dict], tokenizer, offset: int = 0) -> dict:
    """OpenAI's legacy completions form: tokens, token_logprobs, top_logprobs (a dict of token
    text to logprob per token; null for the first echoed token), text_offset (each token's
    character offset in the choice's text, from `offset`, the tokens' texts laid end to end)."""
    tokens = [token_text(tokenizer, e["token"]) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {token_text(tokenizer, i): lp for i, lp in e["top"]}
                             for e in entries],
            "text_offset": offsets}
