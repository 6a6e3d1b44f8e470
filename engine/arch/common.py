"""Pieces shared by the transformer architectures: weights by GGUF name, the forward-pass
context with llama.cpp-named activation taps, and the attention / FFN / MoE / output blocks
written against backend ops.

Each block mirrors the order of operations in llama.cpp's graph (src/llama-graph.cpp), because
the numpy backend reproduces llama.cpp's rounding and a different order would move numbers.
"""

from __future__ import annotations

import math
from typing import Callable

from ..config import ModelConfig


class Weights:
    """Backend weight handles by GGUF tensor name, prepared on first use."""

    def __init__(self, backend, gf):
        self.backend, self.gf = backend, gf
        self._cache: dict = {}

    def __call__(self, name: str):
        w = self._cache.get(name)
        if w is None:
            if name not in self.gf.tensors:
                raise KeyError(name)
            w = self._cache[name] = self.backend.weight(self.gf, name)
        return w

    def opt(self, name: str):
        return self(name) if name in self.gf.tensors else None

    def __contains__(self, name: str) -> bool:
        return name in self.gf.tensors

    def output(self):
        """The LM head; tied to the token embedding when the file has no output.weight."""
        return self.opt("output.weight") or self("token_embd.weight")


class Forward:
    """Everything one forward pass needs. `trace(name, array)` receives activations under
    llama.cpp's node names (`attn_norm-3`, `l_out-3`, `result_norm`, ...)."""

    def __init__(self, backend, cfg: ModelConfig, weights: Weights, cache, pos,
                 trace: Callable | None = None):
        self.b, self.cfg, self.w, self.cache, self.pos = backend, cfg, weights, cache, pos
        self.trace = trace

    def cb(self, x, name: str, il: int = -1):
        if self.trace is not None:
            self.trace(f"{name}-{il}" if il >= 0 else name, x)
        return x


def attention(f: Forward, il: int, x, *, qk_norm: bool = False, q_scale: float | None = None,
              kq_scale: float | None = None, rope_base: float | None = None, window: int = 0):
    """Self-attention of the normed input `x [T, D]` → `[T, D]` (before the residual add).
    Optional biases (qwen2) are used when the file has them."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    T = x.shape[0]

    def proj(kind, n_head, head_dim):
        y = b.matmul(x, w(p + f"attn_{kind}.weight"))
        bias = w.opt(p + f"attn_{kind}.bias")
        if bias is not None:
            y = b.add(y, bias)
        return y.reshape(T, n_head, head_dim)

    q = proj("q", cfg.n_head, cfg.head_dim)
    k = proj("k", cfg.n_head_kv, cfg.head_dim)
    v = proj("v", cfg.n_head_kv, cfg.head_dim_v)
    if qk_norm:
        q = f.cb(b.rms_norm(q, w(p + "attn_q_norm.weight"), cfg.norm_eps), "Qcur_normed", il)
        k = f.cb(b.rms_norm(k, w(p + "attn_k_norm.weight"), cfg.norm_eps), "Kcur_normed", il)
    base = cfg.rope_base if rope_base is None else rope_base
    q = b.rope(q, f.pos, cfg.n_rot, base, cfg.rope_neox, cfg.rope_freq_scale)
    k = b.rope(k, f.pos, cfg.n_rot, base, cfg.rope_neox, cfg.rope_freq_scale)
    f.cb(q, "Qcur", il)
    f.cb(k, "Kcur", il)
    f.cb(v, "Vcur", il)
    if q_scale is not None:
        q = b.scale(q, q_scale)
    k_cache, v_cache = f.cache.layer(il)
    b.kv_store(k_cache, k, f.pos)
    b.kv_store(v_cache, v, f.pos)
    if kq_scale is None:
        kq_scale = 1.0 / math.sqrt(cfg.head_dim)
    out = f.cb(b.attention(q, k_cache, v_cache, f.pos, kq_scale, window), "kqv_out", il)
    out = b.matmul(out, w(p + "attn_output.weight"))
    bias = w.opt(p + "attn_output.bias")
    if bias is not None:
        out = b.add(out, bias)
    # llama.cpp names this node attn_out-N only in `llama`; we use the name everywhere.
    return f.cb(out, "attn_out", il)


def ffn(f: Forward, il: int, x, gelu: bool = False):
    """Gated FFN: down(act(gate(x)) * up(x))."""
    b, w = f.b, f.w
    p = f"blk.{il}."
    up = f.cb(b.matmul(x, w(p + "ffn_up.weight")), "ffn_up", il)
    gate = f.cb(b.matmul(x, w(p + "ffn_gate.weight")), "ffn_gate", il)
    if gelu:
        h = f.cb(b.geglu(gate, up), "ffn_geglu", il)
    else:
        h = f.cb(b.swiglu(gate, up), "ffn_swiglu", il)
    return b.matmul(h, w(p + "ffn_down.weight"))


def moe(f: Forward, il: int, x):
    """Top-k mixture of experts with a softmax router (build_moe_ffn, SILU, gating SOFTMAX)."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    logits = f.cb(b.matmul(x, w(p + "ffn_gate_inp.weight")), "ffn_moe_logits", il)
    probs = f.cb(b.softmax(logits), "ffn_moe_probs", il)
    ids, weights = b.topk(probs, cfg.n_expert_used)
    f.cb(ids, "ffn_moe_topk", il)
    if cfg.expert_weights_norm:
        # ggml clamps the sum to the smallest normal float16 before dividing
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / total.clip(6.103515625e-5, None)
    if cfg.expert_weights_scale not in (0.0, 1.0):
        weights = b.scale(weights, cfg.expert_weights_scale)
    f.cb(weights, "ffn_moe_weights_norm" if cfg.expert_weights_norm else "ffn_moe_weights", il)
    up = f.cb(b.matmul_id(x, w(p + "ffn_up_exps.weight"), ids), "ffn_moe_up", il)
    gate = f.cb(b.matmul_id(x, w(p + "ffn_gate_exps.weight"), ids), "ffn_moe_gate", il)
    h = f.cb(b.swiglu(gate, up), "ffn_moe_swiglu", il)
    down = f.cb(b.matmul_id(h, w(p + "ffn_down_exps.weight"), ids), "ffn_moe_down", il)
    return f.cb(b.weighted_sum(down, weights), "ffn_moe_out", il)


def output(f: Forward, x):
    """Final norm and LM head."""
    b, cfg, w = f.b, f.cfg, f.w
    x = f.cb(b.rms_norm(x, w("output_norm.weight"), cfg.norm_eps), "result_norm")
    return f.cb(b.matmul(x, w.output()), "result_output")


def pre_norm_decoder(f: Forward, ids, out_rows, *, qk_norm: bool = False):
    """The llama-family stack: x += attn(norm(x)); x += ffn(norm(x)); then output.
    The FFN is a top-k MoE when the config has experts. `out_rows` keeps only the rows
    whose logits are wanted from the last layer's residual on (as llama.cpp's inp_out_ids)."""
    b, cfg, w = f.b, f.cfg, f.w
    x = b.embed(w("token_embd.weight"), ids)
    for il in range(cfg.n_layer):
        h = f.cb(b.rms_norm(x, w(f"blk.{il}.attn_norm.weight"), cfg.norm_eps), "attn_norm", il)
        h = attention(f, il, h, qk_norm=qk_norm)
        if il == cfg.n_layer - 1 and out_rows is not None:
            h, x = b.take_rows(h, out_rows), b.take_rows(x, out_rows)
        x = f.cb(b.add(h, x), "ffn_inp", il)
        h = f.cb(b.rms_norm(x, w(f"blk.{il}.ffn_norm.weight"), cfg.norm_eps), "ffn_norm", il)
        h = moe(f, il, h) if cfg.n_expert else f.cb(ffn(f, il, h), "ffn_out", il)
        x = f.cb(b.add(h, x), "l_out", il)
    return output(f, x)
