"""Checking a model before running it: the hyper-parameters are in range, and every tensor the
architecture reads exists with the shape the metadata implies and a type the backends support.

Without this a damaged or inconsistent file fails deep inside the forward pass (a KeyError for
a missing tensor, a ValueError from a mat-mul whose shapes disagree, an IndexError from a top-k
of zero experts) or asks for the memory of 2^31 layers. Each check raises one GGUFError (or
UnsupportedError, for a valid file Brass cannot run) naming the key or tensor, what was
expected and what the file has, as llama.cpp's loader does ("tensor 'x' has wrong shape").

Shapes are written in ggml order, as GGUF stores them and gguf-dump prints them: ne[0] is the
row length (a weight's input size), so a linear weight is [inputs, outputs].
"""

from __future__ import annotations

import math

from .errors import GGUFError, UnsupportedError
from .quants import SUPPORTED_TYPES

# What the architectures' forward passes read beyond the llama-family blocks (engine/arch/).
QK_NORM = {"qwen3", "qwen3moe", "gemma3", "qwen35", "qwen35moe"}   # attn_q_norm / attn_k_norm
POST_NORMS = {"gemma3"}                          # post_attention_norm, post_ffw_norm
DENSE_ONLY = {"gemma3", "qwen35"}                # their forward has no mixture-of-experts branch
NEEDS_EXPERTS = {"qwen3moe", "qwen35moe"}        # llama.cpp asserts n_expert > 0 for these
# Hybrids of gated delta-net and attention layers (qwen35.py): no ffn_norm, a
# post_attention_norm before the FFN, gated queries in attn_q, a shared expert when MoE.
HYBRID = {"qwen35", "qwen35moe"}
# Architectures whose layers differ in shape (gemma4: per-layer head_count_kv and
# feed_forward_length arrays, sliding-window layers with their own head size and rope width,
# values that are the raw keys, MoE layers that keep a dense FFN beside the experts).
PER_LAYER_SHAPES = {"gemma4"}


def check_hparams(cfg, gf) -> None:
    """Counts and sizes read from the metadata: positive where they size something, consistent
    with one another, and finite where they are real numbers. Runs before the architecture's
    `configure`, which builds per-layer lists from them."""
    a = cfg.arch

    def need(ok: bool, key: str, value, expected: str):
        if not ok:
            raise GGUFError(f"{gf.path}: metadata key {a}.{key} is {value!r}, expected {expected}")

    n_all = cfg.n_layer_all or cfg.n_layer
    need(n_all >= 1, "block_count", n_all, ">= 1")
    need(0 <= cfg.n_layer_nextn < n_all, "nextn_predict_layers", cfg.n_layer_nextn,
         f"in [0, block_count = {n_all}) (the trailing blocks the main pass skips)")
    # Every layer has tensors of its own, so a file cannot hold more layers than tensors; this
    # bounds the per-layer loops and the KV cache before the tensors are checked.
    need(cfg.n_layer <= len(gf.tensors), "block_count", cfg.n_layer,
         f"<= {len(gf.tensors)} (the file's tensor count)")
    need(cfg.n_embd >= 1, "embedding_length", cfg.n_embd, ">= 1")
    need(cfg.n_head >= 1, "attention.head_count", cfg.n_head, ">= 1")
    need(1 <= cfg.n_head_kv <= cfg.n_head and cfg.n_head % cfg.n_head_kv == 0,
         "attention.head_count_kv", cfg.n_head_kv,
         f"a divisor of attention.head_count ({cfg.n_head}): each KV head serves a group of "
         f"query heads")
    need(cfg.head_dim >= 1, "attention.key_length", cfg.head_dim, ">= 1")
    need(cfg.head_dim_v >= 1, "attention.value_length", cfg.head_dim_v, ">= 1")
    need(2 <= cfg.n_rot <= cfg.head_dim and cfg.n_rot % 2 == 0, "rope.dimension_count", cfg.n_rot,
         f"an even number in [2, attention.key_length = {cfg.head_dim}] (rope turns pairs)")
    need(cfg.n_vocab >= 1, "vocab_size", cfg.n_vocab, ">= 1")
    need(cfg.n_ctx_train >= 1, "context_length", cfg.n_ctx_train, ">= 1")
    need(cfg.n_ff >= 0, "feed_forward_length", cfg.n_ff, ">= 0")
    if a in PER_LAYER_SHAPES:
        for name, arr in (("attention.head_count_kv", cfg.n_head_kv_arr),
                          ("feed_forward_length", cfg.n_ff_arr)):
            need(not arr or len(arr) == n_all, name, f"an array of {len(arr)}",
                 f"one value per block ({n_all})")
        for il, h in enumerate(cfg.n_head_kv_arr):
            need(1 <= h <= cfg.n_head and cfg.n_head % h == 0, f"attention.head_count_kv[{il}]", h,
                 f"a divisor of attention.head_count ({cfg.n_head})")
        for il, n in enumerate(cfg.n_ff_arr):
            need(n >= 0, f"feed_forward_length[{il}]", n, ">= 0")
        need(cfg.head_dim_swa >= 1, "attention.key_length_swa", cfg.head_dim_swa, ">= 1")
        need(cfg.head_dim_v_swa >= 1, "attention.value_length_swa", cfg.head_dim_v_swa, ">= 1")
        need(2 <= cfg.n_rot_swa <= cfg.head_dim_swa and cfg.n_rot_swa % 2 == 0,
             "rope.dimension_count_swa", cfg.n_rot_swa,
             f"an even number in [2, attention.key_length_swa = {cfg.head_dim_swa}]")
        need(cfg.n_embd_per_layer >= 0, "embedding_length_per_layer_input", cfg.n_embd_per_layer, ">= 0")
        need(0 <= cfg.n_kv_shared_layers < n_all, "attention.shared_kv_layers",
             cfg.n_kv_shared_layers, f"in [0, block_count = {n_all})")
    need(cfg.n_expert >= 0, "expert_count", cfg.n_expert, ">= 0")
    if cfg.n_expert:
        need(1 <= cfg.n_expert_used <= cfg.n_expert, "expert_used_count", cfg.n_expert_used,
             f"in [1, expert_count = {cfg.n_expert}]")
        need(cfg.n_ff_exp >= 0, "expert_feed_forward_length", cfg.n_ff_exp, ">= 0")
    need(cfg.sliding_window >= 0, "attention.sliding_window", cfg.sliding_window, ">= 0")
    need(math.isfinite(cfg.norm_eps) and cfg.norm_eps >= 0, "attention.layer_norm_rms_epsilon",
         cfg.norm_eps, "a finite number >= 0")
    factor = 1.0 / cfg.rope_freq_scale if cfg.rope_freq_scale else math.inf
    for key, value in (("rope.freq_base", cfg.rope_base), ("rope.freq_base_swa", cfg.rope_base_swa),
                       ("rope.scaling.factor", factor)):
        need(math.isfinite(value) and value > 0, key, value, "a finite number > 0")
    need(math.isfinite(cfg.expert_weights_scale), "expert_weights_scale", cfg.expert_weights_scale,
         "a finite number")
    need(math.isfinite(cfg.final_logit_softcap) and cfg.final_logit_softcap >= 0,
         "final_logit_softcapping", cfg.final_logit_softcap, "a finite number >= 0")


def check_model(gf, cfg, supported=SUPPORTED_TYPES) -> None:
    """Everything the forward pass of `cfg.arch` will read, checked against the file: raises
    GGUFError / UnsupportedError naming the first problem. `supported`: the GGML types the
    backend runs (both backends run quants.SUPPORTED_TYPES; a test keeps them equal)."""
    check_hparams(cfg, gf)
    a, path = cfg.arch, gf.path
    if cfg.sliding_window and len(cfg.swa_layers) != cfg.n_layer:
        raise GGUFError(f"{path}: metadata key {a}.attention.sliding_window_pattern gives "
                        f"{len(cfg.swa_layers)} layers, expected block_count = {cfg.n_layer}")
    if a in NEEDS_EXPERTS and cfg.n_expert == 0:
        raise GGUFError(f"{path}: metadata key {a}.expert_count is 0 (or missing), expected >= 1: "
                        f"{a} is a mixture-of-experts architecture")

    def tensor(name: str, *dims: tuple[int, str], optional: bool = False):
        """Check tensor `name` has ne == [d for d, _ in dims] (labels: where each comes from)."""
        info = gf.tensors.get(name)
        if info is None:
            if optional:
                return None
            want = ", ".join(f"{d} ({label})" for d, label in dims)
            raise GGUFError(f"{path}: tensor {name} is missing; {a} needs it with shape [{want}]")
        if info.type not in supported:
            raise UnsupportedError(f"{path}: tensor {name} has type {info.type.name}, which Brass "
                                   f"does not run (supported: {', '.join(t.name for t in supported)})")
        if tuple(info.shape) != tuple(d for d, _ in dims):
            want = ", ".join(f"{d} ({label})" for d, label in dims)
            raise GGUFError(f"{path}: tensor {name} has shape {list(info.shape)}, expected "
                            f"[{want}] from the metadata")
        return info

    def width(name: str, configured: int, key: str) -> tuple[int, str]:
        """An FFN width: from the metadata key, or (key absent) from the tensor itself, which
        the other tensors of the block must then agree with."""
        if configured:
            return configured, key
        info = gf.tensors.get(name)
        n = info.shape[1] if info is not None and len(info.shape) >= 2 else 0
        return n, f"{name} rows; {a}.{key} is missing"

    E = (cfg.n_embd, "embedding_length")
    tensor("token_embd.weight", E, (cfg.n_vocab, "vocabulary size"))
    tensor("output_norm.weight", E)
    tensor("output.weight", E, (cfg.n_vocab, "vocabulary size"), optional=True)   # else tied
    q = (cfg.n_head * cfg.head_dim, "head_count × key_length")
    k = (cfg.n_head_kv * cfg.head_dim, "head_count_kv × key_length")
    v = (cfg.n_head_kv * cfg.head_dim_v, "head_count_kv × value_length")
    o = (cfg.n_head * cfg.head_dim_v, "head_count × value_length")
    Dh = (cfg.head_dim, "key_length")
    moe = cfg.n_expert > 0 and a not in DENSE_ONLY
    hybrid = a in HYBRID
    if hybrid:
        q = (2 * cfg.n_head * cfg.head_dim, "2 × head_count × key_length: queries and gates")
        Hv, D = cfg.ssm_dt_rank, cfg.ssm_d_state
        C = (cfg.ssm_conv_channels, "(2 × ssm.group_count + ssm.time_step_rank) × ssm.state_size")
        V = (Hv * D, "ssm.time_step_rank × ssm.state_size")
        Hv = (Hv, "ssm.time_step_rank")
    if a in PER_LAYER_SHAPES:
        _gemma4_tensors(tensor, width, cfg, gf, E)
    for il in range(0 if a in PER_LAYER_SHAPES else cfg.n_layer):      # the uniform layers
        p = f"blk.{il}."
        tensor(p + "attn_norm.weight", E)
        if hybrid:
            tensor(p + "post_attention_norm.weight", E)
        if hybrid and cfg.is_recurrent(il):
            tensor(p + "attn_qkv.weight", E, C)
            tensor(p + "attn_gate.weight", E, V)
            tensor(p + "ssm_conv1d.weight", (cfg.ssm_d_conv, "ssm.conv_kernel"), C)
            tensor(p + "ssm_dt.bias", Hv)
            tensor(p + "ssm_a", Hv)
            tensor(p + "ssm_beta.weight", E, Hv)
            tensor(p + "ssm_alpha.weight", E, Hv)
            tensor(p + "ssm_norm.weight", (D, "ssm.state_size"))
            tensor(p + "ssm_out.weight", V, E)
        else:
            _attention_tensors(tensor, p, a, E, q, k, v, o, Dh)
        if a in POST_NORMS:
            tensor(p + "post_attention_norm.weight", E)
            tensor(p + "post_ffw_norm.weight", E)
        if not hybrid:
            tensor(p + "ffn_norm.weight", E)
        if moe:
            X = (cfg.n_expert, "expert_count")
            F = width(p + "ffn_up_exps.weight", cfg.n_ff_exp, "expert_feed_forward_length")
            tensor(p + "ffn_gate_inp.weight", E, X)
            tensor(p + "ffn_up_exps.weight", E, F, X)
            tensor(p + "ffn_gate_exps.weight", E, F, X)
            tensor(p + "ffn_down_exps.weight", F, E, X)
            if hybrid and p + "ffn_up_shexp.weight" in gf.tensors:     # the shared expert
                S = width(p + "ffn_up_shexp.weight", cfg.n_ff_shexp or cfg.n_ff,
                          "expert_shared_feed_forward_length")
                tensor(p + "ffn_gate_inp_shexp.weight", E)
                tensor(p + "ffn_up_shexp.weight", E, S)
                tensor(p + "ffn_gate_shexp.weight", E, S)
                tensor(p + "ffn_down_shexp.weight", S, E)
        else:
            F = width(p + "ffn_up.weight", cfg.n_ff, "feed_forward_length")
            tensor(p + "ffn_up.weight", E, F)
            tensor(p + "ffn_gate.weight", E, F)
            tensor(p + "ffn_down.weight", F, E)
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    if n_tokens > cfg.n_vocab:
        # Prompt ids index the embedding; an embedding padded beyond the vocabulary is fine.
        raise GGUFError(f"{path}: the tokenizer has {n_tokens} tokens, more than the "
                        f"{cfg.n_vocab} rows of token_embd.weight")


def _attention_tensors(tensor, p, a, E, q, k, v, o, Dh):
    tensor(p + "attn_q.weight", E, q)
    tensor(p + "attn_k.weight", E, k)
    tensor(p + "attn_v.weight", E, v)
    tensor(p + "attn_output.weight", o, E)
    for kind, dim in (("q", q), ("k", k), ("v", v), ("output", E)):   # qwen2's biases
        tensor(p + f"attn_{kind}.bias", dim, optional=True)
    if a in QK_NORM:
        tensor(p + "attn_q_norm.weight", Dh)
        tensor(p + "attn_k_norm.weight", Dh)


def _gemma4_tensors(tensor, width, cfg, gf, E):
    """gemma4's layers (llama_model_gemma4::load_arch_tensors): head size and KV heads per
    layer; attn_v optional (the values are then the raw keys); rope_freqs for the full layers;
    a dense FFN in every layer, and in a layer with a router also the experts (gate and up
    merged or apart), their norms and scales."""
    a, path = cfg.arch, gf.path
    full = [il for il in range(cfg.n_layer) if not cfg.is_swa(il)]
    if full:
        hd = cfg.layer_head_dim(full[0])
        tensor("rope_freqs.weight", (hd // 2, "key_length / 2"))
    X = (cfg.n_expert, "expert_count")
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        swa = "_swa" if cfg.is_swa(il) else ""
        hd, Hkv = cfg.layer_head_dim(il), cfg.layer_n_head_kv(il)
        q = (cfg.n_head * hd, f"head_count × key_length{swa}")
        kv = (Hkv * hd, f"head_count_kv[{il}] × key_length{swa}")
        Dh = (hd, f"key_length{swa}")
        if p + "attn_qkv.weight" in gf.tensors:
            raise UnsupportedError(f"{path}: tensor {p}attn_qkv.weight (fused q/k/v) is not "
                                   f"supported yet; Brass reads attn_q, attn_k and attn_v")
        for name, dims in (("attn_norm", (E,)), ("attn_q", (E, q)), ("attn_k", (E, kv)),
                           ("attn_output", (q, E)), ("attn_q_norm", (Dh,)),
                           ("attn_k_norm", (Dh,)), ("post_attention_norm", (E,)),
                           ("ffn_norm", (E,)), ("post_ffw_norm", (E,))):
            tensor(p + name + ".weight", *dims)
        tensor(p + "attn_v.weight", E, kv, optional=True)
        tensor(p + "layer_output_scale.weight", (1, "a scalar"), optional=True)
        F = width(p + "ffn_up.weight", cfg.layer_n_ff(il), f"feed_forward_length[{il}]")
        tensor(p + "ffn_up.weight", E, F)
        tensor(p + "ffn_gate.weight", E, F)
        tensor(p + "ffn_down.weight", F, E)
        if p + "ffn_gate_inp.weight" not in gf.tensors:
            continue
        if cfg.n_expert == 0:
            raise GGUFError(f"{path}: tensor {p}ffn_gate_inp.weight is present but metadata key "
                            f"{a}.expert_count is 0 (or missing)")
        tensor(p + "ffn_gate_inp.weight", E, X)
        tensor(p + "ffn_gate_inp.scale", E)
        for name in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
            tensor(p + name + ".weight", E)
        if p + "ffn_gate_up_exps.weight" in gf.tensors:
            info = gf.tensors[p + "ffn_gate_up_exps.weight"]
            Fx = cfg.n_ff_exp or (info.shape[1] // 2 if len(info.shape) == 3 else 0)
            tensor(p + "ffn_gate_up_exps.weight", E, (2 * Fx, "2 × expert_feed_forward_length"), X)
            Fx = (Fx, "expert_feed_forward_length")
        else:
            Fx = width(p + "ffn_up_exps.weight", cfg.n_ff_exp, "expert_feed_forward_length")
            tensor(p + "ffn_up_exps.weight", E, Fx, X)
            tensor(p + "ffn_gate_exps.weight", E, Fx, X)
        tensor(p + "ffn_down_exps.weight", Fx, E, X)
        tensor(p + "ffn_down_exps.scale", X, optional=True)
    # llama.cpp multiplies a matmul by an optional `<weight>.scale` (NVFP4's second scale);
    # Brass runs only the two gemma4 uses (the router input scale, the per-expert scale)
    other = sorted(n for n in gf.tensors if n.endswith(".scale")
                   and not n.endswith((".ffn_gate_inp.scale", ".ffn_down_exps.scale")))
    if other:
        raise UnsupportedError(f"{path}: tensor {other[0]} (a weight's scale factor) is not "
                               f"supported")
