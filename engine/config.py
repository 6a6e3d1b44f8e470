"""Typed model configuration read from GGUF metadata (`{arch}.*` keys).

The fields and defaults follow llama.cpp's hparams loading; architecture files adjust what
their architecture hard-codes (e.g. Gemma 3's sliding-window layer pattern) in `configure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import GGUFError


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


def _int(v):
    # Per-layer arrays (e.g. head counts) are allowed by GGUF; we support uniform ones.
    if hasattr(v, "__len__") and not isinstance(v, str):
        vals = set(int(x) for x in v)
        if len(vals) != 1:
            raise GGUFError(f"per-layer values {sorted(vals)} are not supported")
        return vals.pop()
    return int(v)


def read_config(gf, arch: str) -> ModelConfig:
    md = gf.metadata

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required:
            raise GGUFError(f"{gf.path}: metadata key {full} is missing")
        return default

    n_embd = _int(get("embedding_length", required=True))
    n_head = _int(get("attention.head_count", required=True))
    n_head_kv = _int(get("attention.head_count_kv", n_head))
    head_dim = _int(get("attention.key_length", n_embd // n_head))
    head_dim_v = _int(get("attention.value_length", head_dim))
    n_vocab = get("vocab_size")
    if n_vocab is None:
        toks = md.get("tokenizer.ggml.tokens")
        n_vocab = len(toks) if toks is not None else gf.tensors["token_embd.weight"].shape[1]
    eps = get("attention.layer_norm_rms_epsilon")
    if eps is None:
        raise GGUFError(f"{gf.path}: metadata key {arch}.attention.layer_norm_rms_epsilon is missing")
    scale = get("rope.scaling.factor") or get("rope.scale_linear") or 0.0
    return ModelConfig(
        arch=arch,
        n_layer=_int(get("block_count", required=True)),
        n_embd=n_embd,
        n_ff=_int(get("feed_forward_length", 0)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=_int(get("rope.dimension_count", head_dim)),
        n_vocab=int(n_vocab),
        n_ctx_train=_int(get("context_length", 2048)),
        norm_eps=float(eps),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_freq_scale=1.0 / float(scale) if scale else 1.0,
        n_expert=_int(get("expert_count", 0)),
        n_expert_used=_int(get("expert_used_count", 0)),
        n_ff_exp=_int(get("expert_feed_forward_length", 0)),
        expert_weights_norm=bool(get("expert_weights_norm", False)),
        expert_weights_scale=float(get("expert_weights_scale", 0.0)),
        sliding_window=_int(get("attention.sliding_window", 0)),
        rope_base_swa=float(get("rope.freq_base_swa", 10000.0)),
        final_logit_softcap=float(get("final_logit_softcapping", 0.0)),
    )
