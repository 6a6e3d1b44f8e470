"""`qwen35` (Qwen3.5 dense): a hybrid of gated delta-net layers and full-attention layers.
llama.cpp: src/models/qwen35.cpp and delta-net-base.cpp (b11312).

- Which layers attend: every `full_attention_interval`-th (default 4: layers 3, 7, ...), or
  the per-layer flags of `attention.recurrent_layers`; the others are gated delta-nets, whose
  state (conv1d window and delta-rule matrix per value head) lives in the cache's
  RecurrentState instead of a KV cache.
- Every layer: x += mixer(rms(x)·attn_norm); x += FFN(rms(x)·post_attention_norm). The norm
  weights are used as stored (the converter already added Qwen's +1, except ssm_norm's).
- Attention layers: attn_q holds per head hd query rows then hd gate rows; q/k RMS norms;
  IMROPE, which for text (positions t = h = w = p) is NEOX rope over the first n_rot dims
  whenever rope.dimension_sections gives every rotated pair a t/h/w stream (Qwen3.5's
  [11,11,10,0] over 64 dims does); scale 1/sqrt(hd) whatever the metadata says; the attention
  output times sigmoid(gate) before attn_output.
- Delta-net layers: q|k|v = attn_qkv·h through a causal conv1d (K taps, carried state) and
  SiLU; q and k L2-normed; value head h reads key head h mod Hk (tiled: the converter
  reordered the value heads so, unlike qwen3next's grouped h // (Hv/Hk)); g = softplus(α +
  dt_bias)·ssm_a, β = sigmoid(b); the gated delta rule; rms(o)·ssm_norm·silu(z); ssm_out.

Activations are traced under llama.cpp's node names (engine/llamacpp.py, _QWEN35_ROLES), with
the output projection of either mixer as attn_out-N as in the other architectures.
"""

from __future__ import annotations

import numpy as np

from ..errors import GGUFError, UnsupportedError
from . import common


FULL_ATTENTION_INTERVAL = 4     # llama.cpp's default when the file has no interval key

# Decodes several sequences in one step: attention rows and delta-net recurrences per sequence.
BATCHED_DECODE = True


def configure(cfg, gf):
    a = cfg.arch
    cfg.rope_neox = True
    key = f"{a}.full_attention_interval"
    if not cfg.recurrent_layers:
        interval = cfg.full_attention_interval if key in gf.metadata else FULL_ATTENTION_INTERVAL
        if interval < 1:
            raise GGUFError(f"{gf.path}: metadata key {key} is {interval}, expected >= 1")
        cfg.recurrent_layers = [(il + 1) % interval != 0 for il in range(cfg.n_layer)]
    else:
        if len(cfg.recurrent_layers) < cfg.n_layer:
            raise GGUFError(f"{gf.path}: metadata key {a}.attention.recurrent_layers has "
                            f"{len(cfg.recurrent_layers)} flags, expected block_count = {cfg.n_layer_all}")
        cfg.recurrent_layers = cfg.recurrent_layers[:cfg.n_layer]   # the MTP blocks attend
    if cfg.head_dim_v != cfg.head_dim:       # llama.cpp asserts it (the gate has hd per head)
        raise GGUFError(f"{gf.path}: metadata key {a}.attention.value_length is {cfg.head_dim_v}, "
                        f"expected attention.key_length = {cfg.head_dim}")
    _check_rope_sections(cfg, gf)
    if any(cfg.recurrent_layers):
        _check_ssm(cfg, gf)
    # 1.0f / sqrtf(hd) in float32, as llama.cpp; attention.scale is not read
    cfg.attn_scale = float(np.float32(1) / np.sqrt(np.float32(cfg.head_dim)))
    return cfg


def _check_rope_sections(cfg, gf):
    """IMROPE pair i takes the stream of sector s = i mod Σsections: h if s%3 == 1 and
    s < 3·sec[1], w if s%3 == 2 and s < 3·sec[2], t if s%3 == 0 and s < 3·sec[0], else the
    fourth stream, which is position 0 for text (ggml_mrope_cache_init). Brass runs the case
    where every rotated pair has t, h or w (= the token's position): NEOX over n_rot dims."""
    key = f"{gf.path}: metadata key {cfg.arch}.rope.dimension_sections"
    sec = cfg.rope_sections
    if not sec:
        raise GGUFError(f"{key} is missing")
    if len(sec) > 4 or min(sec) < 0 or not any(sec[:3]):
        raise GGUFError(f"{key} is {sec}, expected up to 4 counts >= 0, one of the first three > 0")
    sec = list(sec) + [0] * (4 - len(sec))
    total = sum(sec)
    stray = [i for i in range(cfg.n_rot // 2)
             if not any(i % total % 3 == j and i % total < 3 * sec[j] for j in range(3))]
    if stray:
        raise UnsupportedError(f"{key} is {cfg.rope_sections}: rope pairs {stray[:4]} take the "
                               f"fourth position stream (left unrotated for text), which Brass "
                               f"does not run")


def _check_ssm(cfg, gf):
    def need(ok, name, value, expected):
        if not ok:
            raise GGUFError(f"{gf.path}: metadata key {cfg.arch}.{name} is {value!r}, expected {expected}")
    need(cfg.ssm_d_conv >= 2, "ssm.conv_kernel", cfg.ssm_d_conv, ">= 2")
    need(cfg.ssm_d_state >= 1, "ssm.state_size", cfg.ssm_d_state, ">= 1")
    need(cfg.ssm_n_group >= 1, "ssm.group_count", cfg.ssm_n_group, ">= 1")
    need(cfg.ssm_dt_rank >= 1 and cfg.ssm_dt_rank % cfg.ssm_n_group == 0, "ssm.time_step_rank",
         cfg.ssm_dt_rank, f"a multiple of ssm.group_count ({cfg.ssm_n_group}): each key head "
         f"serves value heads h with h mod {cfg.ssm_n_group} equal to it")
    need(cfg.ssm_d_inner == cfg.ssm_dt_rank * cfg.ssm_d_state, "ssm.inner_size", cfg.ssm_d_inner,
         f"ssm.time_step_rank × ssm.state_size = {cfg.ssm_dt_rank * cfg.ssm_d_state}")
    # the state is allocated per layer: keep a damaged file from asking for terabytes
    need(cfg.ssm_dt_rank * cfg.ssm_d_state ** 2 <= 1 << 28, "ssm.state_size", cfg.ssm_d_state,
         "a state of at most 2^28 floats per layer")
    need(cfg.ssm_d_conv <= 1 << 10, "ssm.conv_kernel", cfg.ssm_d_conv, "<= 1024")


def gated_attention(f: common.Forward, il: int, x):
    """Full attention with q/k norms, IMROPE (as NEOX, see _check_rope_sections) and the
    sigmoid output gate (qwen35.cpp build_layer_attn) → `[T, D]` before the residual."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    T, H, Hkv, hd = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
    qg, k, v = b.matmul_many(x, [w(p + "attn_q.weight"), w(p + "attn_k.weight"),
                                 w(p + "attn_v.weight")])
    qg = qg.reshape(T, H, 2 * hd)
    q, gate = qg[:, :, :hd], qg[:, :, hd:]
    rope = dict(q_norm=w(p + "attn_q_norm.weight"), k_norm=w(p + "attn_k_norm.weight"),
                eps=cfg.norm_eps, n_rot=cfg.n_rot, base=cfg.rope_base, neox=True,
                freq_scale=cfg.rope_freq_scale)
    k, v = k.reshape(T, Hkv, hd), v.reshape(T, Hkv, cfg.head_dim_v)
    q, k = common.rope_store(f, il, q, k, v, rope)
    f.cb(q, "Qcur", il)
    f.cb(k, "Kcur", il)
    o = f.cb(common.attend(f, il, q, cfg.attn_scale), "attn_pregate", il)
    o = f.cb(b.sigmoid_gate(o, gate.reshape(T, H * hd)), "attn_gated", il)
    return b.matmul(o, w(p + "attn_output.weight"))


def delta_net(f: common.Forward, il: int, x):
    """Gated delta-net (qwen35.cpp build_layer_attn_linear, delta-net-base.cpp) → `[T, D]`
    before the residual; the layer's conv and delta states are read and updated."""
    b, cfg, w = f.b, f.cfg, f.w
    p = f"blk.{il}."
    T, Hk, Hv, D = x.shape[0], cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state
    qkv, z, beta, alpha = b.matmul_many(x, [w(p + "attn_qkv.weight"), w(p + "attn_gate.weight"),
                                            w(p + "ssm_beta.weight"), w(p + "ssm_alpha.weight")])
    beta, g = b.delta_net_gates(beta, alpha, w(p + "ssm_dt.bias"), w(p + "ssm_a"))
    beta = f.cb(beta, "beta_sigmoid", il)
    f.cb(g, "gate", il)
    # The rows of each sequence with its own states: all rows of the one sequence, or in a
    # batched decode step one row per sequence (the recurrences run per sequence, as alone).
    batch = getattr(f.cache, "sequences", None)
    seqs = [] if batch is None else [(slice(r, r + 1), c) for r, c in enumerate(batch)]
    w_conv = w(p + "ssm_conv1d.weight")
    # a prompt graph of a length class: only the first n_real rows update the states
    real = {} if f.n_real is None else {"n_real": f.n_real}
    if batch is None:
        a = b.ssm_conv_silu(qkv, f.cache.recurrent.layer(il)[0], w_conv, **real)
    else:
        a = b.empty(qkv.shape)
        for rows, cache in seqs:
            a[rows] = b.ssm_conv_silu(qkv[rows], cache.recurrent.layer(il)[0], w_conv)
    a = f.cb(a, "conv_output_silu", il)
    kd = Hk * D
    q = f.cb(b.l2_norm(a[:, :kd].reshape(T, Hk, D), cfg.norm_eps), "q_conv_predelta", il)
    k = f.cb(b.l2_norm(a[:, kd:2 * kd].reshape(T, Hk, D), cfg.norm_eps), "k_conv_predelta", il)
    v = a[:, 2 * kd:].reshape(T, Hv, D)
    if batch is None:
        o = b.gated_delta_net(q, k, v, g, beta, f.cache.recurrent.layer(il)[1], **real)
    else:
        o = None
        for rows, cache in seqs:
            o_r = b.gated_delta_net(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                    cache.recurrent.layer(il)[1])
            if o is None:
                o = b.empty((T, *o_r.shape[1:]))
            o[rows] = o_r
    o = f.cb(o, "attn_output", il)
    y = b.rms_norm_gated(o, w(p + "ssm_norm.weight"), z.reshape(T, Hv, D), cfg.norm_eps)
    y = f.cb(y.reshape(T, Hv * D), "final_output", il)
    return b.matmul(y, w(p + "ssm_out.weight"))


def dense_ffn(f: common.Forward, il: int, x):
    return common.ffn(f, il, x)


def hybrid_decoder(f: common.Forward, ids, out_rows, ffn=dense_ffn):
    """The layer stack of qwen35 and qwen35moe (their `ffn` differs). Every layer runs on all
    tokens (a delta-net's state needs them); `out_rows` selects rows before the final norm,
    as llama.cpp's result_norm does. Residual adds are done with the norm that follows."""
    b, cfg, w = f.b, f.cfg, f.w
    x = b.embed(w("token_embd.weight"), ids) if common.embeds(f) else None
    x, pending = common.stage_in(f, (x, None))
    for il in common.layers(f):
        x, h = b.add_rms_norm(x, pending, w(f"blk.{il}.attn_norm.weight"), cfg.norm_eps)
        if il > 0:
            f.cb(x, "l_out", il - 1)
        f.cb(h, "attn_norm", il)
        h = delta_net(f, il, h) if cfg.is_recurrent(il) else gated_attention(f, il, h)
        f.cb(h, "attn_out", il)
        x, h = b.add_rms_norm(x, h, w(f"blk.{il}.post_attention_norm.weight"), cfg.norm_eps)
        f.cb(x, "attn_residual", il)
        f.cb(h, "attn_post_norm", il)
        pending = f.cb(ffn(f, il, h), "ffn_out", il)
    if common.stage_out(f, (x, pending)):
        return None
    if out_rows is not None:
        x, pending = b.take_rows(x, out_rows), b.take_rows(pending, out_rows)
    return common.output(f, x, pending)


def forward(f: common.Forward, ids, out_rows=None):
    return hybrid_decoder(f, ids, out_rows)
