"""`llama`: pre-norm decoder, RMSNorm, rope (normal pairs), GQA attention, SwiGLU FFN
(or top-k MoE when the file has experts). llama.cpp: src/models/llama.cpp."""

from . import common

ROPE_NEOX = False


def configure(cfg, gf):
    cfg.rope_neox = ROPE_NEOX
    return cfg


def forward(f: common.Forward, ids, out_rows=None):
    b, cfg, w = f.b, f.cfg, f.w
    x = b.embed(w("token_embd.weight"), ids)
    for il in range(cfg.n_layer):
        h = f.cb(b.rms_norm(x, w(f"blk.{il}.attn_norm.weight"), cfg.norm_eps), "attn_norm", il)
        h = common.attention(f, il, h)
        if il == cfg.n_layer - 1 and out_rows is not None:
            h, x = b.take_rows(h, out_rows), b.take_rows(x, out_rows)
        x = f.cb(b.add(h, x), "ffn_inp", il)
        h = f.cb(b.rms_norm(x, w(f"blk.{il}.ffn_norm.weight"), cfg.norm_eps), "ffn_norm", il)
        h = common.moe(f, il, h) if cfg.n_expert else f.cb(common.ffn(f, il, h), "ffn_out", il)
        x = f.cb(b.add(h, x), "l_out", il)
    return common.output(f, x)
