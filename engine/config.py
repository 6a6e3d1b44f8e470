"""Typed model configuration read from GGUF metadata (`{arch}.*` keys).

The fields and defaults follow llama.cpp's hparams loading; architecture files adjust what
their architecture hard-codes (e.g. Gemma 3's sliding-window layer pattern) in `configure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import GGUFError
from .validate import check_hparams


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int               # key/query head size
    head_dim_v: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_neox: bool = False
    # mixture of experts
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0
    # sliding-window attention: window size and which layers use it
    sliding_window: int = 0
    swa_layers: list[bool] = field(default_factory=list)
    rope_base_swa: float = 10000.0
    # attention / logits scaling
    attn_scale: float = 0.0     # 0: 1/sqrt(head_dim)
    final_logit_softcap: float = 0.0

    def layer_window(self, il: int) -> int:
        return self.sliding_window if self.swa_layers and self.swa_layers[il] else 0


def _int(v, where: str) -> int:
    # Per-layer arrays (e.g. head counts) are allowed by GGUF; we support uniform ones.
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu" and len(v):
        vals = set(int(x) for x in v)
        if len(vals) != 1:
            raise GGUFError(f"{where}: per-layer values {sorted(vals)} are not supported")
        return vals.pop()
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    raise GGUFError(f"{where} is {_describe(v)}, expected an integer")


def _float(v, where: str) -> float:
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
        return float(v)
    raise GGUFError(f"{where} is {_describe(v)}, expected a number")


def _describe(v) -> str:
    if isinstance(v, (list, np.ndarray)):
        return f"an array of {len(v)}"
    return f"{type(v).__name__} {v!r:.40}"


def read_config(gf, arch: str) -> ModelConfig:
    md = gf.metadata

    def key(name):
        return f"{gf.path}: metadata key {arch}.{name}"

    def get(name, default=None, required=False):
        full = f"{arch}.{name}"
        if full in md:
            return md[full]
        if required:
            raise GGUFError(f"{gf.path}: metadata key {full} is missing")
        return default

    # Values of the wrong type (a string, an array where one number belongs) are named here;
    # their ranges are checked by validate.check_hparams.
    def get_int(name, default=None, required=False):
        v = get(name, default, required)
        return v if v is None else _int(v, key(name))

    def get_float(name, default=None):
        v = get(name, default)
        return v if v is None else _float(v, key(name))

    def get_bool(name, default=False):
        v = get(name, default)
        if not isinstance(v, (bool, int, np.integer)):
            raise GGUFError(f"{key(name)} is {_describe(v)}, expected a bool")
        return bool(v)

    n_embd = get_int("embedding_length", required=True)
    n_head = get_int("attention.head_count", required=True)
    n_head_kv = get_int("attention.head_count_kv", n_head)
    head_dim = get_int("attention.key_length", n_embd // n_head if n_head > 0 else 0)
    head_dim_v = get_int("attention.value_length", head_dim)
    n_vocab = get_int("vocab_size")
    if n_vocab is None:
        toks = md.get("tokenizer.ggml.tokens")
        emb = gf.tensors.get("token_embd.weight")
        n_vocab = len(toks) if isinstance(toks, list) else \
            emb.shape[1] if emb is not None and len(emb.shape) == 2 else 0
    eps = get_float("attention.layer_norm_rms_epsilon")
    if eps is None:
        raise GGUFError(f"{gf.path}: metadata key {arch}.attention.layer_norm_rms_epsilon is missing")
    scale = get_float("rope.scaling.factor") or get_float("rope.scale_linear") or 0.0
    cfg = ModelConfig(
        arch=arch,
        n_layer=get_int("block_count", required=True),
        n_embd=n_embd,
        n_ff=get_int("feed_forward_length", 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=get_int("rope.dimension_count", head_dim),
        n_vocab=n_vocab,
        n_ctx_train=get_int("context_length", 2048),
        norm_eps=eps,
        rope_base=get_float("rope.freq_base", 10000.0),
        rope_freq_scale=1.0 / scale if scale else 1.0,
        n_expert=get_int("expert_count", 0),
        n_expert_used=get_int("expert_used_count", 0),
        n_ff_exp=get_int("expert_feed_forward_length", 0),
        expert_weights_norm=get_bool("expert_weights_norm", False),
        expert_weights_scale=get_float("expert_weights_scale", 0.0),
        sliding_window=get_int("attention.sliding_window", 0),
        rope_base_swa=get_float("rope.freq_base_swa", 10000.0),
        final_logit_softcap=get_float("final_logit_softcapping", 0.0),
    )
    # The architecture's configure builds per-layer lists from these: check them first.
    check_hparams(cfg, gf)
    return cfg
