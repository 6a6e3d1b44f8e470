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

    @property
    def nbytes(self) -> int:
        """Bytes the backend holds for the weights prepared so far (each Weight's nbytes)."""
        return sum(getattr(w, "nbytes", 0) for w in list(self._cache.values()))

    def output(self):
        """The LM head; tied to the token embedding when the file has no output.weight."""
        return self.opt("output.weight") or self("token_embd.weight")


class Forward:
    """Everything one forward pass needs. `trace(name, array)` receives activations under
    llama.cpp's node names (`attn_norm-3`, `l_out-3`, `result_norm`, ...)."""

    # A layer split (engine/distributed/tp.py Stage): this rank runs only the layers of its
    # stage, takes the residual stream from the stage before and hands it to the next; None:
    # every layer here.
    stage = None

    def __init__(self, backend, cfg: ModelConfig, weights: Weights, cache, pos,
                 trace: Callable | None = None, n_real=None):
        self.b, self.cfg, self.w, self.cache, self.pos = backend, cfg, weights, cache, pos
        self.trace = trace
        # A prompt padded to its length class (engine/model.py ClassStep): a one-element int32
        # backend array, how many of the rows are the prompt's; the rest follow them at later
        # positions, so attention's causal mask keeps them from every real row, and the
        # recurrent layers must not let them into their states (qwen35 delta_net). None: all.
        self.n_real = n_real

    def cb(self, x, name: str, il: int = -1):
        if self.trace is not None:
            self.trace(f"{name}-{il}" if il >= 0 else name, x)
        return x


def layers(f: Forward) -> range:
    """The layers this forward runs: all, or its stage's under a layer split."""
    return range(f.cfg.n_layer) if f.stage is None else range(*f.stage.layers)


def embeds(f: Forward) -> bool:
    """Whether this forward starts from the token embedding (not a later stage's)."""
    return f.stage is None or f.stage.first


def stage_in(f: Forward, carry: tuple) -> tuple:
    """The residual stream entering this forward's first layer: `carry` (the embedding's), or
    under a layer split past the first stage the arrays the stage before handed on."""
    return carry if embeds(f) else f.stage.recv()


def stage_out(f: Forward, carry: tuple) -> bool:
    """Hand the residual stream to the next stage; False on the last (it goes on to the
    output)."""
    if f.stage is None or f.stage.last:
        return False
    f.stage.send(carry)
    return True


def kv_layers(f: Forward, il: int):
    """Layer il's (k_cache, v_cache) of the forward's sequence, or the list of each row's in a
    batched decode step (the cache is then a SequenceBatch: a row per sequence)."""
    batch = getattr(f.cache, "sequences", None)
    return f.cache.layer(il) if batch is None else [c.layer(il) for c in batch]


def rope_store(f: Forward, il: int, q, k, v, rope: dict):
    """q/k norms, rope and the K/V cache writes of layer il (one kernel on the GPU), into the
    sequence's cache or, in a batched step, each row's own. Returns the roped (q, k)."""
    layers = kv_layers(f, il)
    if isinstance(layers, list):
        return f.b.rope_store_rows(q, k, v, f.pos, layers, **rope)
    return f.b.rope_store(q, k, v, f.pos, *layers, **rope)


def attend(f: Forward, il: int, q, scale: float, window: int = 0):
    """Attention of layer il's queries over its cache (each row over its own in a batch)."""
    layers = kv_layers(f, il)
    if isinstance(layers, list):
        return f.b.attention_rows(q, layers, f.pos, scale, window)
    return f.b.attention(q, *layers, f.pos, scale, window)


def attention(f: Forward, il: int, x, *, qk_norm: bool = False, q_scale: float | None = None,
              kq_scale: float | None = None, rope_base: float | None = None, window: int = 0):
    """Self-attention of the normed input `x [T, D]` → `[T, D]` (before the residual add).
    Optional biases (qwen2) are used when the file has them."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    T = x.shape[0]

    def with_bias(kind, y):
        bias = w.opt(p + f"attn_{kind}.bias")
        return y if bias is None else b.add(y, bias)

    # One op for the three projections: on the GPU one launch per weight type, one
    # quantization of x.
    ys = b.matmul_many(x, [w(p + f"attn_{kind}.weight") for kind in "qkv"])
    q, k, v = (with_bias(kind, y) for kind, y in zip("qkv", ys))
    q = q.reshape(T, cfg.n_head, cfg.head_dim)
    k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
    v = v.reshape(T, cfg.n_head_kv, cfg.head_dim_v)
    base = cfg.rope_base if rope_base is None else rope_base
    rope = dict(q_norm=w(p + "attn_q_norm.weight") if qk_norm else None,
                k_norm=w(p + "attn_k_norm.weight") if qk_norm else None,
                eps=cfg.norm_eps, n_rot=cfg.n_rot, base=base, neox=cfg.rope_neox,
                freq_scale=cfg.rope_freq_scale)
    if kq_scale is None:
        kq_scale = 1.0 / math.sqrt(cfg.head_dim)
    q, k = rope_store(f, il, q, k, v, rope)
    out = attend(f, il, q if q_scale is None else b.scale(q, q_scale), kq_scale, window)
    f.cb(q, "Qcur", il)
    f.cb(k, "Kcur", il)
    f.cb(v, "Vcur", il)
    out = f.cb(out, "kqv_out", il)
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
    h = b.ffn_glu(x, w(p + "ffn_gate.weight"), w(p + "ffn_up.weight"), gelu)
    f.cb(h, "ffn_geglu" if gelu else "ffn_swiglu", il)
    return b.matmul(h, w(p + "ffn_down.weight"))


def moe(f: Forward, il: int, x):
    """Top-k mixture of experts with a softmax router (build_moe_ffn, SILU, gating SOFTMAX)."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    logits, probs, ids, weights = b.moe_gate(x, w(p + "ffn_gate_inp.weight"), cfg.n_expert_used,
                                             cfg.expert_weights_norm, cfg.expert_weights_scale)
    f.cb(logits, "ffn_moe_logits", il)
    f.cb(probs, "ffn_moe_probs", il)
    f.cb(ids, "ffn_moe_topk", il)
    f.cb(weights, "ffn_moe_weights_norm" if cfg.expert_weights_norm else "ffn_moe_weights", il)
    out = b.moe_ffn(x, w(p + "ffn_gate_exps.weight"), w(p + "ffn_up_exps.weight"),
                    w(p + "ffn_down_exps.weight"), ids, weights)
    return f.cb(out, "ffn_moe_out", il)


def output(f: Forward, x, residual=None):
    """Final norm (after adding the last sublayer's `residual`, when given) and LM head."""
    b, cfg, w = f.b, f.cfg, f.w
    x, h = b.add_rms_norm(x, residual, w("output_norm.weight"), cfg.norm_eps)
    if residual is not None:
        f.cb(x, "l_out", cfg.n_layer - 1)
    h = f.cb(h, "result_norm")
    return f.cb(b.matmul(h, w.output()), "result_output")


def pre_norm_decoder(f: Forward, ids, out_rows, *, qk_norm: bool = False):
    """The llama-family stack: x += attn(norm(x)); x += ffn(norm(x)); then output.
    The FFN is a top-k MoE when the config has experts. `out_rows` keeps only the rows
    whose logits are wanted from the last layer's residual on (as llama.cpp's inp_out_ids).
    Each residual add is done together with the norm that follows it (add_rms_norm), so a
    sublayer's output is carried to the next norm as `pending`."""
    b, cfg, w = f.b, f.cfg, f.w
    x = b.embed(w("token_embd.weight"), ids) if embeds(f) else None
    x, pending = stage_in(f, (x, None))
    for il in layers(f):
        x, h = b.add_rms_norm(x, pending, w(f"blk.{il}.attn_norm.weight"), cfg.norm_eps)
        if il > 0:
            f.cb(x, "l_out", il - 1)
        f.cb(h, "attn_norm", il)
        h = attention(f, il, h, qk_norm=qk_norm)
        if il == cfg.n_layer - 1 and out_rows is not None:
            h, x = b.take_rows(h, out_rows), b.take_rows(x, out_rows)
        x, h = b.add_rms_norm(x, h, w(f"blk.{il}.ffn_norm.weight"), cfg.norm_eps)
        f.cb(x, "ffn_inp", il)
        f.cb(h, "ffn_norm", il)
        pending = moe(f, il, h) if cfg.n_expert else f.cb(ffn(f, il, h), "ffn_out", il)
    if stage_out(f, (x, pending)):
        return None
    return output(f, x, pending)
