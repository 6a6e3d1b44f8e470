"""Loading a model and running it: prefill, decode, teacher-forced scoring, generation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import arch as arch_registry
from .arch.common import Forward, Weights
from .backends import get_backend
from .catalog import resolve
from .config import read_config
from .errors import BrassError
from .gguf import GGUFFile
from .kv_cache import KVCache
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

DEFAULT_CTX = 4096


class Model:
    """A GGUF model on a backend. `Model(path_or_catalog_name, backend="numpy"|"cuda")`."""

    def __init__(self, model: str | os.PathLike | None = None, backend: str | None = None,
                 n_ctx: int | None = None, quiet: bool = False, **backend_options):
        self.path = resolve(model, quiet=quiet)
        self.gguf = GGUFFile(self.path)
        arch_name = self.gguf.architecture
        self.arch = arch_registry.get(arch_name)
        self.config = self.arch.configure(read_config(self.gguf, arch_name), self.gguf)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.backend = get_backend(backend, **backend_options)
        self.weights = Weights(self.backend, self.gguf)
        self.n_ctx = min(n_ctx or DEFAULT_CTX, self.config.n_ctx_train)
        if hasattr(self.backend, "load"):
            with self.backend.activate():
                self.backend.load(self.gguf, self.weights, quiet=quiet)

    @property
    def name(self) -> str:
        return self.gguf.get("general.name") or self.path.stem

    @property
    def chat_template(self) -> str | None:
        return self.gguf.get("tokenizer.chat_template")

    def new_session(self, n_ctx: int | None = None) -> "Session":
        return Session(self, n_ctx or self.n_ctx)

    def forward(self, ids, pos, cache: KVCache, out_rows=None, trace: Callable | None = None):
        """Logits (backend array) for tokens `ids` at positions `pos`; `out_rows` selects the
        rows whose logits are wanted (None: all)."""
        f = Forward(self.backend, self.config, self.weights, cache, pos, trace)
        with self.backend.activate():
            return self.arch.forward(f, ids, out_rows)

    def score(self, ids: list[int], trace: Callable | None = None) -> np.ndarray:
        """Teacher forcing: one prefill over `ids` (no BOS added), logits at every position."""
        s = self.new_session(max(len(ids), 1))
        return s.prefill(ids, all_logits=True, trace=trace)

    def generate(self, prompt_ids: list[int], max_tokens: int = 32,
                 sampling: SamplingParams | None = None, stop_at_eog: bool = True,
                 session: "Session | None" = None) -> Iterator[int]:
        """Yield generated token ids one by one (greedy when sampling.temperature == 0)."""
        sampling = sampling or SamplingParams(temperature=0.0)
        sampler = Sampler(sampling)
        s = session or self.new_session()
        if len(prompt_ids) + max_tokens > s.cache.n_ctx:
            raise BrassError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the context of {s.cache.n_ctx} tokens")
        if not prompt_ids:
            raise BrassError("the prompt is empty")
        history = list(prompt_ids)
        logits = s.prefill(prompt_ids, device_logits=True)
        for _ in range(max_tokens):
            tok = s.pick(logits, sampler, history)
            yield tok
            history.append(tok)
            if stop_at_eog and self.tokenizer.is_eog(tok):
                return
            logits = s.decode(tok)


@dataclass
class Session:
    """One sequence: its KV cache and how many positions are filled."""

    model: Model
    n_ctx: int

    def __post_init__(self):
        with self.model.backend.activate():
            self.cache = KVCache(self.model.backend, self.model.config, self.n_ctx)
        self.n_past = 0

    def prefill(self, ids: list[int], all_logits: bool = False, device_logits: bool = False,
                trace: Callable | None = None):
        m, b = self.model, self.model.backend
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size and (ids.min() < 0 or ids.max() >= m.config.n_vocab):
            raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
        if self.n_past + len(ids) > self.n_ctx:
            raise BrassError(f"{self.n_past + len(ids)} tokens exceed the context of {self.n_ctx}")
        pos = np.arange(self.n_past, self.n_past + len(ids), dtype=np.int32)
        with b.activate():
            out_rows = None if all_logits else b.asarray(np.array([len(ids) - 1], np.int32))
            logits = m.forward(b.asarray(ids), b.asarray(pos), self.cache, out_rows, trace)
            self.n_past += len(ids)
            return logits if device_logits else b.to_numpy(logits)

    def decode(self, token: int):
        return self.prefill([token], device_logits=True)

    def pick(self, logits, sampler: Sampler, history: list[int]) -> int:
        b = self.model.backend
        p = sampler.p
        with b.activate():
            if p.greedy and p.repetition_penalty == 1.0:
                return int(b.to_numpy(b.argmax(logits))[-1])
            return sampler(b.to_numpy(logits)[-1], history)


def load(model: str | os.PathLike | None = None, backend: str | None = None, **kw) -> Model:
    """Open a model: a GGUF path, a catalog name, or None for the default (SmolLM2-135M)."""
    return Model(model, backend=backend, **kw)
