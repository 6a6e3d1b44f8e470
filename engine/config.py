"""Typed model configuration read from GGUF metadata (`{arch}.*` keys).

The fields and defaults follow llama.cpp's hparams loading; architecture files adjust what
their architecture hard-codes (e.g. Gemma 3's sliding-window layer pattern) in `configure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import GGUFError
from .validate import PER_LAYER_SHAPES, check_hparams


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
    # multi-token-prediction blocks stored after the main ones (block_count counts them; the
    # main pass does not run them): n_layer is block_count minus these
    n_layer_nextn: int = 0
    n_layer_all: int = 0        # block_count: n_layer + n_layer_nextn
    # rope.dimension_sections (multi-section rope: qwen35's IMROPE), empty when absent
    rope_sections: list[int] = field(default_factory=list)
    # shared expert beside the routed ones (qwen35moe): its FFN width, 0 = none / n_ff
    n_ff_shexp: int = 0
    # hybrid recurrent models (qwen35): which layers are gated delta-nets rather than
    # attention. `recurrent_layers` comes from attention.recurrent_layers when the file has it
    # (else the architecture builds it from full_attention_interval, 0 when absent).
    recurrent_layers: list[bool] = field(default_factory=list)
    full_attention_interval: int = 0
    ssm_d_conv: int = 0         # ssm.conv_kernel: K, the causal conv1d's width
    ssm_d_inner: int = 0        # ssm.inner_size: value heads x head size
    ssm_d_state: int = 0        # ssm.state_size: D, the head size of q, k and v
    ssm_dt_rank: int = 0        # ssm.time_step_rank: Hv, the number of value heads
    ssm_n_group: int = 0        # ssm.group_count: Hk, the number of key heads
    # Per-layer shapes (gemma4). head_count_kv and feed_forward_length may hold one value per
    # block (the *_arr lists, empty when the key is a scalar; n_head_kv / n_ff are then layer
    # 0's, as llama.cpp's hparams.n_head_kv()); sliding-window layers have their own head size
    # and rope width (attention.key_length_swa / value_length_swa, rope.dimension_count_swa,
    # defaulting to the full layers' values as in llama.cpp's generic loader).
    n_head_kv_arr: list[int] = field(default_factory=list)
    n_ff_arr: list[int] = field(default_factory=list)
    head_dim_swa: int = 0
    head_dim_v_swa: int = 0
    n_rot_swa: int = 0
    n_embd_per_layer: int = 0   # embedding_length_per_layer_input (gemma4's PLE width)
    n_kv_shared_layers: int = 0     # attention.shared_kv_layers (gemma4: last layers reuse KV)

    def is_swa(self, il: int) -> bool:
        """Whether layer `il` is a sliding-window layer."""
        return bool(self.swa_layers) and bool(self.swa_layers[il])

    def layer_window(self, il: int) -> int:
        return self.sliding_window if self.is_swa(il) else 0

    def layer_n_head_kv(self, il: int) -> int:
        return self.n_head_kv_arr[il] if self.n_head_kv_arr else self.n_head_kv

    def layer_head_dim(self, il: int) -> int:
        """Key/query head size of layer `il` (sliding-window layers may differ)."""
        return self.head_dim_swa if self.is_swa(il) and self.head_dim_swa else self.head_dim

    def layer_head_dim_v(self, il: int) -> int:
        return self.head_dim_v_swa if self.is_swa(il) and self.head_dim_v_swa else self.head_dim_v

    def layer_n_rot(self, il: int) -> int:
        return self.n_rot_swa if self.is_swa(il) and self.n_rot_swa else self.n_rot

    def layer_n_ff(self, il: int) -> int:
        return self.n_ff_arr[il] if self.n_ff_arr else self.n_ff

    def is_recurrent(self, il: int) -> bool:
        """Whether layer `il` is a recurrent (gated delta-net) layer, with no KV cache."""
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    @property
    def ssm_conv_channels(self) -> int:
        """C: the channels of the delta-net's conv1d, q and k (Hk x D each) then v (Hv x D)."""
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_dt_rank * self.ssm_d_state


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


def _int_list(v, where: str) -> list[int]:
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu":
        return [int(x) for x in v]
    raise GGUFError(f"{where} is {_describe(v)}, expected an array of integers")


def _bool_list(v, where: str) -> list[bool]:
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "biu":
        return [bool(x) for x in v]
    raise GGUFError(f"{where} is {_describe(v)}, expected an array of bools")


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

    def get_int_layers(name, default):
        """A count that architectures with per-layer shapes may give per block: (layer 0's
        value, the list, or [] for a scalar). Elsewhere only uniform arrays are accepted."""
        v = get(name, default)
        if arch in PER_LAYER_SHAPES and isinstance(v, np.ndarray) and v.ndim == 1 \
                and v.dtype.kind in "iu" and len(v):
            per = [int(x) for x in v]
            return per[0], per
        return _int(v, key(name)), []

    def get_bool(name, default=False):
        v = get(name, default)
        if not isinstance(v, (bool, int, np.integer)):
            raise GGUFError(f"{key(name)} is {_describe(v)}, expected a bool")
        return bool(v)

    n_embd = get_int("embedding_length", required=True)
    n_head = get_int("attention.head_count", required=True)
    n_head_kv, n_head_kv_arr = get_int_layers("attention.head_count_kv", n_head)
    n_ff, n_ff_arr = get_int_layers("feed_forward_length", 0)
    head_dim = get_int("attention.key_length", n_embd // n_head if n_head > 0 else 0)
    head_dim_v = get_int("attention.value_length", head_dim)
    n_rot = get_int("rope.dimension_count", head_dim)
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
    sections = get("rope.dimension_sections")
    recurrent = get("attention.recurrent_layers")
    cfg = ModelConfig(
        arch=arch,
        n_layer=get_int("block_count", required=True),
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
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
        n_layer_nextn=get_int("nextn_predict_layers", 0),
        rope_sections=[] if sections is None else _int_list(sections, key("rope.dimension_sections")),
        n_ff_shexp=get_int("expert_shared_feed_forward_length", 0),
        recurrent_layers=[] if recurrent is None else
        _bool_list(recurrent, key("attention.recurrent_layers")),
        full_attention_interval=get_int("full_attention_interval", 0),
        ssm_d_conv=get_int("ssm.conv_kernel", 0),
        ssm_d_inner=get_int("ssm.inner_size", 0),
        ssm_d_state=get_int("ssm.state_size", 0),
        ssm_dt_rank=get_int("ssm.time_step_rank", 0),
        ssm_n_group=get_int("ssm.group_count", 0),
        n_head_kv_arr=n_head_kv_arr,
        n_ff_arr=n_ff_arr,
        head_dim_swa=get_int("attention.key_length_swa", head_dim),
        head_dim_v_swa=get_int("attention.value_length_swa", head_dim_v),
        n_rot_swa=get_int("rope.dimension_count_swa", n_rot),
        n_embd_per_layer=get_int("embedding_length_per_layer_input", 0),
        n_kv_shared_layers=get_int("attention.shared_kv_layers", 0),
    )
    # block_count includes the multi-token-prediction blocks, which the main pass skips
    # (llama.cpp: n_layer() = n_layer_all - n_layer_nextn).
    cfg.n_layer_all = cfg.n_layer
    if 0 < cfg.n_layer_nextn < cfg.n_layer_all:
        cfg.n_layer -= cfg.n_layer_nextn
    # The architecture's configure builds per-layer lists from these: check them first.
    check_hparams(cfg, gf)
    return cfg
