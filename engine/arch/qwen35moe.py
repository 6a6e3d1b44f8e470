"""`qwen35moe` (Qwen3.5/3.6 MoE): qwen35's hybrid layers with a mixture-of-experts FFN — a
softmax router over all experts, the top-k renormalised (llama.cpp hard-codes norm_w and no
weight scale; the expert_weights_* keys are not read), plus a shared expert whose output is
scaled by sigmoid(ffn_gate_inp_shexp · x), one gate per token. llama.cpp: src/models/qwen35moe.cpp."""

from __future__ import annotations

from ..errors import UnsupportedError
from . import common, qwen35

BATCHED_DECODE = qwen35.BATCHED_DECODE


def configure(cfg, gf):
    cfg = qwen35.configure(cfg, gf)
    cfg.expert_weights_norm = True
    cfg.expert_weights_scale = 0.0
    if "blk.0.ffn_gate_up_exps.weight" in gf.tensors:
        raise UnsupportedError(f"{gf.path}: merged expert tensors (ffn_gate_up_exps) are not "
                               "supported yet; Brass reads ffn_gate_exps and ffn_up_exps")
    return cfg


def moe_ffn(f: common.Forward, il: int, x):
    """Routed experts plus the gated shared expert (qwen35moe.cpp build_layer_ffn)."""
    b, w = f.b, f.w
    p = f"blk.{il}."
    routed = common.moe(f, il, x)
    if p + "ffn_up_shexp.weight" not in w:
        return routed
    h = b.ffn_glu(x, w(p + "ffn_gate_shexp.weight"), w(p + "ffn_up_shexp.weight"))
    shexp = f.cb(b.matmul(h, w(p + "ffn_down_shexp.weight")), "ffn_shexp", il)
    # ffn_gate_inp_shexp is one row [n_embd]: one gate logit per token
    gate = b.matmul(x, w(p + "ffn_gate_inp_shexp.weight")).reshape(x.shape[0], 1)
    if f.trace is None:
        return b.gated_residual(routed, shexp, gate)
    gate = f.cb(b.sigmoid(gate), "shared_expert_gate_sigmoid", il)     # traced: each op's output
    return b.add(routed, b.mul(shexp, gate))


def forward(f: common.Forward, ids, out_rows=None):
    return qwen35.hybrid_decoder(f, ids, out_rows, ffn=moe_ffn)
