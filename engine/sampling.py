"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The chain runs in llama.cpp's default order (common/sampling): penalties → top-k → top-p →
min-p → temperature → draw. Temperature 0 (or below) means greedy, which the generator does on
the device without copying the logits to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ParameterError


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature", "{name} must be >= 0"),
            (self.top_k >= 0, "top_k", "{name} must be >= 0 (0 disables it)"),
            (0.0 < self.top_p <= 1.0, "top_p", "{name} must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "{name} must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "{name} must be > 0"),
            (self.penalty_last_n >= 0, "penalty_last_n", "{name} must be >= 0"),
            (self.seed is None or self.seed >= -1, "seed", "{name} must be >= 0, or -1 for a random seed"),
        ]
        for ok, param, msg in checks:
            if not ok:
                raise ParameterError(param, msg)
        if self.seed == -1:         # llama.cpp's "random seed"
            self.seed = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def generation_length(max_tokens: int | None, n_prompt: int | None = None,
                      n_ctx: int | None = None) -> int | None:
    """The number of tokens to generate after a prompt of `n_prompt` tokens in a context of
    `n_ctx`: `max_tokens`, or (None) all that fits. The engine's one check of a generation's
    length: Model.generate, the batch scheduler, the server and the command line all rely on it
    and only translate its ParameterError (the prompt, or the context, may be unknown yet: a
    check before a model is loaded passes None for them)."""
    if max_tokens is not None and max_tokens < 1:
        raise ParameterError("max_tokens", f"{{name}} must be at least 1, got {max_tokens}")
    if n_prompt is None:
        return max_tokens
    if n_prompt == 0:
        raise ParameterError("prompt", "the prompt is empty")
    if n_ctx is None:
        return max_tokens
    if n_prompt >= n_ctx:
        raise ParameterError("prompt", f"the prompt is {_tokens(n_prompt)}, but the context holds "
                                       f"{n_ctx} for the prompt and the reply together",
                             code="context_length_exceeded")
    room = n_ctx - n_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ParameterError("max_tokens", f"the prompt ({_tokens(n_prompt)}) plus {{name}} ({max_tokens}) "
                                           f"exceed the context of {n_ctx} tokens; at most {room} new "
                                           f"tokens fit", code="context_length_exceeded")
    return max_tokens


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        p = self.p
        logits = np.asarray(logits, dtype=np.float32).copy()
        if p.repetition_penalty != 1.0 and p.penalty_last_n and history:
            recent = np.unique(np.asarray(history[-p.penalty_last_n:], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < logits.shape[0])]
            vals = logits[recent]
            # A penalty far from 1 may push logits to ±inf (one below float32's range divides by 0).
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                logits[recent] = np.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        if 0 < p.top_k < logits.shape[0]:
            # partial selection, then a stable sort of the k survivors (ties → lower id)
            cand = np.argpartition(-logits, p.top_k - 1)[:p.top_k]
            cand = np.sort(cand)
            ids = cand[np.argsort(-logits[cand], kind="stable")]
        else:
            ids = np.argsort(-logits, kind="stable")
        vals = logits[ids]
        if p.top_p < 1.0:
            probs = _softmax(vals)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            ids, vals = ids[:keep], vals[:keep]
        if p.min_p > 0.0:
            keep = vals >= vals[0] + np.log(p.min_p)
            ids, vals = ids[keep], vals[keep]
        probs = _softmax(vals, p.temperature)
        return int(ids[self.rng.choice(len(ids), p=probs)])


def _softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(x / temperature) for any temperature > 0 and logits that may be ±inf: the
    maximum is subtracted before dividing (a tiny temperature then gives -inf, not inf - inf),
    and infinite maxima share the probability among themselves."""
    x = x.astype(np.float64)
    top = x.max()
    if np.isinf(top):
        e = (x == top).astype(np.float64)
    else:
        with np.errstate(over="ignore"):
            e = np.exp((x - top) / temperature)
    return e / e.sum()
