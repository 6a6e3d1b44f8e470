"""`gemma4` (Gemma 4, dense and MoE): sliding-window and full-attention layers of different
shapes, normalised q/k/v with no attention scale, proportional rope on the full layers, a
dense GeGLU FFN in every layer plus routed experts in the MoE ones, a per-layer output scale,
a final logit softcap. llama.cpp: src/models/gemma4.cpp (b11312).

- Layers: `attention.sliding_window_pattern` says which are sliding-window (SWA) layers. SWA
  and full layers have their own head size (key_length_swa / key_length), KV head count
  (head_count_kv is one value per layer), rope width (rope.dimension_count_swa /
  dimension_count) and rope base (rope.freq_base_swa, default 10000 / rope.freq_base).
- Embeddings times sqrtf(n_embd) (float32). Norm weights are used as stored (no +1).
- Attention: q = rms(W_q·h)·q_norm, k = rms(W_k·h)·k_norm, v = rms(W_v·h) with NO weight;
  without attn_v (k_eq_v, the full layers of the large models) v = rms(W_k·h), the raw key
  projection before its norm. NEOX rope on q and k; on full layers through rope_freqs (1 for
  the rotated pairs, 1e30 for the rest: angles / 1e30 ≈ 0, i.e. "proportional" rope whose
  exponent uses the full head size). Scale 1.0 (q and k are normalised), grouped-query heads
  in contiguous groups, SWA layers keep keys with pos_q − pos_k < sliding_window.
- x = x + rms(attn)·post_attention_norm; f = FFN(x); x = x + rms(f)·post_ffw_norm;
  x = x · layer_output_scale (when the layer has one: the whole residual stream).
- FFN: down(gelu(gate(h))·up(h)) with h = rms(x)·ffn_norm (GELU through ggml's float16 table).
  A layer with a router (ffn_gate_inp) adds experts: the dense branch normed by
  post_ffw_norm_1, the experts on rms(x)·pre_ffw_norm_2 routed by
  W_router·(rms(x)·(1/sqrtf(n_embd))·ffn_gate_inp.scale) (softmax over all experts, top-k
  renormalised), gate and up merged (ffn_gate_up_exps: gate rows first) or apart, each
  chosen expert's down output times ffn_down_exps.scale[e] before its routing weight, the sum
  normed by post_ffw_norm_2; f = dense + experts.
- Logits: c·tanh(output·(rms(x)·output_norm) / c), c = final_logit_softcapping (30 when the
  key is absent); output is token_embd when the file has no output.weight.

Not supported (refused in one line at load): per-layer embeddings (E2B/E4B,
embedding_length_per_layer_input > 0), KV sharing (attention.shared_kv_layers > 0), a fused
attn_qkv. Activations are traced under llama.cpp's node names (engine/llamacpp.py,
_GEMMA4_ROLES); the residual after attention, llama.cpp's attn_out-N, is attn_residual-N here
(attn_out-N is the output projection in every Brass architecture).
"""

from __future__ import annotations

import numpy as np

from ..errors import GGUFError, UnsupportedError
from . import common

# Decodes several sequences in one step (attention rows in their own caches).
BATCHED_DECODE = True

FINAL_LOGIT_SOFTCAP = 30.0      # llama.cpp's default when the key is absent (llama-hparams.h)
# Two options of a Gemma 4 model, on its config (configure sets them on; a test or a program
# sets `model.config.fused_ops = False` before the forwards it should change). Neither moves a
# number on the numpy backend, whose fused ops are the compositions they replace.
# - fused_experts: the routed experts through the fused moe_ffn op (gate and up of
#   ffn_gate_up_exps, GELU, the per-expert down scale; two kernels on the GPU for a decode
#   step) instead of their composition of mat-muls by id. The composition's intermediate nodes
#   (ffn_moe_geglu, ffn_moe_down_scaled) are then not traced.
# - fused_ops: the fused ops the other architectures use, where Gemma 4's composition allows
#   them: a sliding-window layer's q/k norms, rope and cache writes as one rope_store (one
#   kernel on the GPU instead of six), the residual add after attention with the FFN's input
#   norm as one add_rms_norm (which also writes the Q8_1 blocks the FFN's mat-vecs read), a
#   MoE layer's sum of its dense and routed branches with post_ffw_norm as another, the
#   layer's last residual add and layer_output_scale with the next layer's input norm (or the
#   output norm) as add_rms_norm with a scale, and a MoE layer's two norms of its residual, the
#   experts' and the router's, as moe_norms. Full layers keep rope_ff (their frequency
#   factors); the q/k norms' own nodes (Qcur_normed, Kcur_normed: no llama.cpp node matches
#   them) are then not traced on SWA layers.


def configure(cfg, gf):
    a, path = cfg.arch, gf.path
    for name in ("attention.sliding_window_pattern", "attention.sliding_window",
                 "attention.key_length_swa", "attention.value_length_swa",
                 "embedding_length_per_layer_input"):
        if f"{a}.{name}" not in gf.metadata:      # llama.cpp requires them
            raise GGUFError(f"{path}: metadata key {a}.{name} is missing")
    pattern = gf.metadata[f"{a}.attention.sliding_window_pattern"]
    if not (isinstance(pattern, np.ndarray) and pattern.ndim == 1 and pattern.dtype.kind in "biu"):
        raise GGUFError(f"{path}: metadata key {a}.attention.sliding_window_pattern is "
                        f"{pattern!r:.40}, expected an array of flags (one per layer)")
    if len(pattern) < cfg.n_layer:
        raise GGUFError(f"{path}: metadata key {a}.attention.sliding_window_pattern gives "
                        f"{len(pattern)} layers, expected block_count = {cfg.n_layer}")
    cfg.swa_layers = [bool(v) for v in pattern][:cfg.n_layer]
    if cfg.n_embd_per_layer:
        raise UnsupportedError(f"{path}: per-layer embeddings ({a}.embedding_length_per_layer_input "
                               f"= {cfg.n_embd_per_layer}, Gemma 4 E2B/E4B) are not supported yet")
    if cfg.n_kv_shared_layers:
        raise UnsupportedError(f"{path}: KV sharing ({a}.attention.shared_kv_layers = "
                               f"{cfg.n_kv_shared_layers}) is not supported yet")
    for k, v, key in ((cfg.head_dim, cfg.head_dim_v, "key_length"),
                      (cfg.head_dim_swa, cfg.head_dim_v_swa, "key_length_swa")):
        if k != v:      # llama.cpp throws too
            vkey = key.replace("key", "value")
            raise GGUFError(f"{path}: metadata key {a}.attention.{vkey} is {v}, expected "
                            f"attention.{key} = {k}")
    if any(cfg.swa_layers) and cfg.sliding_window < 1:
        raise GGUFError(f"{path}: metadata key {a}.attention.sliding_window is "
                        f"{cfg.sliding_window}, expected >= 1 (a window of 0 masks every key)")
    cfg.rope_neox = True
    cfg.attn_scale = 1.0            # llama.cpp: f_attention_scale = 1.0 (q and k are normed)
    cfg.expert_weights_norm = True  # build_moe_ffn(norm_w = true, w_scale = 1.0)
    cfg.expert_weights_scale = 1.0
    if f"{a}.final_logit_softcapping" not in gf.metadata:
        cfg.final_logit_softcap = FINAL_LOGIT_SOFTCAP
    cfg.fused_ops = True
    cfg.fused_experts = True
    return cfg


def attention(f: common.Forward, il: int, x):
    """Self-attention of the normed input `x [T, D]` → `[T, D]` (the output projection,
    before the post-attention norm)."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    T, H, Hkv, hd = x.shape[0], cfg.n_head, cfg.layer_n_head_kv(il), cfg.layer_head_dim(il)
    w_v = w.opt(p + "attn_v.weight")
    q, k, *v = b.matmul_many(x, [w(p + "attn_q.weight"), w(p + "attn_k.weight")]
                             + ([w_v] if w_v is not None else []))
    v = v[0] if v else k                # k_eq_v: the values are the raw key projection
    v = f.cb(b.rms_norm(v.reshape(T, Hkv, hd), None, cfg.norm_eps), "Vcur_normed", il)
    q, k = q.reshape(T, H, hd), k.reshape(T, Hkv, hd)
    n_rot = cfg.layer_n_rot(il)
    window = cfg.layer_window(il)
    if cfg.is_swa(il) and cfg.fused_ops:
        # q/k norms, rope (llama.cpp: rope_freq_base_train_swa, freq_scale 1 on SWA layers) and
        # the cache writes as the one op the other architectures use (one kernel on the GPU
        # instead of six; the same composition on the numpy backend)
        rope = dict(q_norm=w(p + "attn_q_norm.weight"), k_norm=w(p + "attn_k_norm.weight"),
                    eps=cfg.norm_eps, n_rot=n_rot, base=cfg.rope_base_swa, neox=True)
        q, k = common.rope_store(f, il, q, k, v, rope)
        f.cb(q, "Qcur_pos", il)
        f.cb(k, "Kcur_pos", il)
    else:
        q = f.cb(b.rms_norm(q, w(p + "attn_q_norm.weight"), cfg.norm_eps), "Qcur_normed", il)
        k = f.cb(b.rms_norm(k, w(p + "attn_k_norm.weight"), cfg.norm_eps), "Kcur_normed", il)
        if cfg.is_swa(il):
            # llama.cpp: rope_freq_base_train_swa, and freq_scale 1 on SWA layers
            q, k = (b.rope(t, f.pos, n_rot, cfg.rope_base_swa, True) for t in (q, k))
        else:
            ff = w("rope_freqs.weight")
            q, k = (b.rope_ff(t, f.pos, n_rot, cfg.rope_base, True, ff, cfg.rope_freq_scale)
                    for t in (q, k))
        f.cb(q, "Qcur_pos", il)
        f.cb(k, "Kcur_pos", il)
        layers = common.kv_layers(f, il)
        if isinstance(layers, list):                # a batched decode step: a row per sequence
            for r, (k_cache, v_cache) in enumerate(layers):
                b.kv_store(k_cache, k[r:r + 1], f.pos[r:r + 1])
                b.kv_store(v_cache, v[r:r + 1], f.pos[r:r + 1])
        else:
            b.kv_store(layers[0], k, f.pos)
            b.kv_store(layers[1], v, f.pos)
    o = f.cb(common.attend(f, il, q, cfg.attn_scale, window), "kqv_out", il)
    return f.cb(b.matmul(o, w(p + "attn_output.weight")), "attn_out", il)


def experts(f: common.Forward, il: int, x):
    """The routed experts of a MoE layer on the residual `x` → `[T, D]`, normed by
    post_ffw_norm_2 (gemma4.cpp's "Expert FFN" with its own router input)."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    # router input: rms(x) (no weight) · 1/sqrtf(n_embd) · ffn_gate_inp.scale
    factor = float(np.float32(1) / np.sqrt(np.float32(cfg.n_embd)))
    if cfg.fused_ops:
        # the experts' norm and the router's as one op (one kernel on the GPU instead of four,
        # and the experts' Q8_1 blocks written beside it: the quantize kernel goes too)
        h, r = b.moe_norms(x, w(p + "pre_ffw_norm_2.weight"), w(p + "ffn_gate_inp.scale"), factor, cfg.norm_eps)
    else:
        h = b.rms_norm(x, w(p + "pre_ffw_norm_2.weight"), cfg.norm_eps)
        r = b.mul(b.scale(b.rms_norm(x, None, cfg.norm_eps), factor), w(p + "ffn_gate_inp.scale"))
    h = f.cb(h, "ffn_norm_2", il)
    # the router's mat-vec and its softmax / top-k as one op (moe_gate: matmul, then moe_route)
    logits, probs, ids, weights = b.moe_gate(r, w(p + "ffn_gate_inp.weight"), cfg.n_expert_used,
                                             cfg.expert_weights_norm, cfg.expert_weights_scale)
    f.cb(logits, "ffn_moe_logits", il)
    f.cb(probs, "ffn_moe_probs", il)
    f.cb(ids, "ffn_moe_topk", il)
    f.cb(weights, "ffn_moe_weights_norm", il)
    if cfg.fused_experts:
        # the same composition as one op (Backend.moe_ffn), which the CUDA backend runs for a
        # decode step as two kernels (the chosen experts' gate/up with GELU, their down with the
        # per-expert scale and the weighted sum) instead of six
        fused = p + "ffn_gate_up_exps.weight" in w
        out = b.moe_ffn(h, w(p + ("ffn_gate_up_exps.weight" if fused else "ffn_gate_exps.weight")),
                        None if fused else w(p + "ffn_up_exps.weight"), w(p + "ffn_down_exps.weight"),
                        ids, weights, gelu=True, down_scale=w.opt(p + "ffn_down_exps.scale"))
        out = f.cb(out, "ffn_moe_out", il)
        return f.cb(b.rms_norm(out, w(p + "post_ffw_norm_2.weight"), cfg.norm_eps), "ffn_moe", il)
    if p + "ffn_gate_up_exps.weight" in w:
        gate_up = b.matmul_id(h, w(p + "ffn_gate_up_exps.weight"), ids)    # [T, k, 2F]
        n_ff = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :n_ff], gate_up[..., n_ff:]           # gate rows first
    else:
        up = b.matmul_id(h, w(p + "ffn_up_exps.weight"), ids)
        gate = b.matmul_id(h, w(p + "ffn_gate_exps.weight"), ids)
    a = f.cb(b.geglu(gate, up), "ffn_moe_geglu", il)
    y = b.matmul_id(a, w(p + "ffn_down_exps.weight"), ids)                # [T, k, D]
    scale = w.opt(p + "ffn_down_exps.scale")
    if scale is not None:
        y = f.cb(b.mul_expert_scale(y, scale, ids), "ffn_moe_down_scaled", il)
    out = f.cb(b.weighted_sum(y, weights), "ffn_moe_out", il)
    return f.cb(b.rms_norm(out, w(p + "post_ffw_norm_2.weight"), cfg.norm_eps), "ffn_moe", il)


def ffn_norm_name(f: common.Forward, il: int) -> str:
    """The trace name of the FFN's input norm (ffn_norm.weight): the dense FFN's own, or the
    dense branch's of a MoE layer."""
    return "ffn_norm_1" if f"blk.{il}.ffn_gate_inp.weight" in f.w else "ffn_norm"


def ffn(f: common.Forward, il: int, x, h=None):
    """The FFN of layer `il` on the residual `x` → `[T, D]`, normed by post_ffw_norm; `h`: x
    normed by ffn_norm.weight already (add_rms_norm), else normed here."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    post = w(p + "post_ffw_norm.weight")
    if h is None:
        h = b.rms_norm(x, w(p + "ffn_norm.weight"), cfg.norm_eps)
    h = f.cb(h, ffn_norm_name(f, il), il)
    if p + "ffn_gate_inp.weight" not in w:
        out = f.cb(common.ffn(f, il, h, gelu=True), "ffn_out", il)
        return f.cb(b.rms_norm(out, post, cfg.norm_eps), "ffn_post_norm", il)
    dense = common.ffn(f, il, h, gelu=True)
    dense = f.cb(b.rms_norm(dense, w(p + "post_ffw_norm_1.weight"), cfg.norm_eps), "ffn_mlp", il)
    routed = experts(f, il, x)
    if cfg.fused_ops:
        # the two branches' sum and post_ffw_norm in one op (add_rms_norm: dense + routed, as add)
        out, normed = b.add_rms_norm(dense, routed, post, cfg.norm_eps)
    else:
        out = b.add(dense, routed)
        normed = None
    out = f.cb(out, "ffn_moe_combined", il)
    return f.cb(b.rms_norm(out, post, cfg.norm_eps) if normed is None else normed, "ffn_post_norm", il)


def forward(f: common.Forward, ids, out_rows=None):
    b, cfg, w = f.b, f.cfg, f.w
    x = pending = None  # fused_ops: (FFN output, residual, layer_output_scale) of the layer before
    if common.embeds(f):
        x = b.embed(w("token_embd.weight"), ids)
        x = f.cb(b.scale(x, float(np.sqrt(np.float32(cfg.n_embd)))), "inp_scaled")   # sqrtf
    else:
        # a later stage of a layer split: the stage before handed on the residual stream (and,
        # fused, its last FFN output, scaled here by that layer's output scale)
        il = common.layers(f)[0] - 1
        carry = common.stage_in(f, ())
        x = carry[0]
        if len(carry) == 2:
            pending = (carry[1], x, w.opt(f"blk.{il}.layer_output_scale.weight"))
    for il in common.layers(f):
        p = f"blk.{il}."
        if pending is None:
            h = b.rms_norm(x, w(p + "attn_norm.weight"), cfg.norm_eps)
        else:
            # the layer before's residual add and output scale with this layer's input norm in
            # one op (add_rms_norm, which also writes the q/k/v mat-vecs' Q8_1 blocks)
            x, h = b.add_rms_norm(*pending[:2], w(p + "attn_norm.weight"), cfg.norm_eps, scale=pending[2])
            f.cb(x, "l_out", il - 1)
        h = f.cb(h, "attn_norm", il)
        h = attention(f, il, h)
        h = f.cb(b.rms_norm(h, w(p + "post_attention_norm.weight"), cfg.norm_eps),
                 "attn_post_norm", il)
        if cfg.fused_ops:
            # the residual add and the FFN's input norm in one op (add_rms_norm: h + x, as add)
            x, hn = b.add_rms_norm(h, x, w(p + "ffn_norm.weight"), cfg.norm_eps)
        else:
            x, hn = b.add(h, x), None
        x = f.cb(x, "attn_residual", il)
        out = ffn(f, il, x, hn)
        scale = w.opt(p + "layer_output_scale.weight")
        if cfg.fused_ops:
            pending = (out, x, scale)           # added (and scaled) by the next norm
            continue
        x = b.add(out, x)
        if scale is not None:
            x = b.mul(x, scale)
        f.cb(x, "l_out", il)
    if common.stage_out(f, (x,) if pending is None else (pending[1], pending[0])):
        return None
    if pending is None:
        if out_rows is not None:
            x = b.take_rows(x, out_rows)
        h = b.rms_norm(x, w("output_norm.weight"), cfg.norm_eps)
    else:
        out, x, scale = pending
        if out_rows is not None:
            out, x = b.take_rows(out, out_rows), b.take_rows(x, out_rows)
        x, h = b.add_rms_norm(out, x, w("output_norm.weight"), cfg.norm_eps, scale=scale)
        f.cb(x, "l_out", cfg.n_layer - 1)
    h = f.cb(h, "result_norm")
    logits = b.matmul(h, w.output())
    if cfg.final_logit_softcap:
        logits = b.softcap(logits, cfg.final_logit_softcap)
    return f.cb(logits, "result_output")
