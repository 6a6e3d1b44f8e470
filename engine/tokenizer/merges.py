"""The two merge algorithms: SentencePiece by scores, byte-level BPE by merge ranks.

Both follow llama.cpp b11312 (`llm_tokenizer_spm_session`, `llm_tokenizer_bpe_session` in
src/llama-vocab.cpp) step by step, including their priority queues: symbols start as single
characters, the best adjacent pair is merged, stale queue entries are skipped. The order in
which pairs leave the queue (score or rank, then the leftmost) is what makes the output exact.
"""

from __future__ import annotations

import heapq


def spm_merge(text: str, token_to_id: dict[str, int], scores: list[float]) -> list[str]:
    """llm_tokenizer_spm_session::tokenize up to resegmentation: the final symbols of `text`.

    A pair is merged when the joined text is a token; the highest score goes first, then the
    leftmost pair. Every merged symbol is a token; a single character may not be (the caller
    falls back to bytes)."""
    symbols = list(text)
    n = len(symbols)
    if n < 2:
        return symbols
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    queue: list[tuple[float, int, int, int]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        joined = symbols[left] + symbols[right]
        tid = token_to_id.get(joined)
        if tid is not None:
            heapq.heappush(queue, (-scores[tid], left, right, len(joined)))

    for i in range(1, n):
        add(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        ls, rs = symbols[left], symbols[right]
        # symbols only grow or vanish, so an unchanged total size means an unchanged pair
        if not ls or not rs or len(ls) + len(rs) != size:
            continue
        symbols[left] = ls + rs
        symbols[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add(prv[left], left)
        add(left, nxt[left])
    return [s for s in symbols if s]


def bpe_merge(word: str, ranks: dict[str, int]) -> list[str]:
    """llm_tokenizer_bpe_session::tokenize for one word: its final symbols.

    `ranks` maps "left right" (the GGUF merge string) to its rank; the lowest rank goes first,
    then the leftmost pair."""
    symbols = list(word)
    n = len(symbols)
    if n < 2:
        return symbols
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    queue: list[tuple[int, int, int, str]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        rank = ranks.get(symbols[left] + " " + symbols[right])
        if rank is not None:
            heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

    for i in range(1, n):
        add(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        ls, rs = symbols[left], symbols[right]
        if not ls or not rs or ls + rs != joined:
            continue
        symbols[left] = joined
        symbols[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add(prv[left], left)
        add(left, nxt[left])
    return [s for s in symbols if s]
