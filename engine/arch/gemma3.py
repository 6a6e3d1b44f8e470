"""`gemma3`: embeddings scaled by sqrt(n_embd); q/k RMSNorm; queries scaled before attention;
norms after attention and after the FFN as well as before; GeGLU; five sliding-window layers
(own rope base, default 10000) for every global one; tied output. llama.cpp: src/models/gemma3.cpp.
The layer pattern and the local rope base are not in the metadata: llama.cpp hard-codes them."""

import math

import numpy as np

from ..errors import GGUFError
from . import common

SWA_PATTERN = 6     # every 6th layer is global (llama.cpp: load_swa_pattern(ml, 6))


# Decodes several sequences in one step (every layer goes through common.attention).
BATCHED_DECODE = True
# Its caches are reached only through common.rope_store and common.attend:
# bucket graphs apply.
BUCKET_GRAPHS = True


def configure(cfg, gf):
    cfg.rope_neox = True
    # The key is either a per-layer array of flags or a period n (the last layer of every n
    # is global), as in llama.cpp's load_swa_pattern.
    pattern = gf.get("gemma3.attention.sliding_window_pattern", SWA_PATTERN)
    if cfg.sliding_window > 0:
        if isinstance(pattern, np.ndarray) and pattern.ndim == 1:
            cfg.swa_layers = [bool(v) for v in pattern][:cfg.n_layer]
        elif isinstance(pattern, (int, np.integer)) and pattern >= 1:
            cfg.swa_layers = [il % int(pattern) < int(pattern) - 1 for il in range(cfg.n_layer)]
        else:
            raise GGUFError(f"{gf.path}: metadata key gemma3.attention.sliding_window_pattern is "
                            f"{pattern!r:.40}, expected a period >= 1 or an array of flags")
    # ref: gemma_pytorch config; the 27B (62 layers) scales by n_embd / n_head instead.
    denom = cfg.n_embd / cfg.n_head if cfg.n_layer == 62 else cfg.head_dim
    cfg.attn_scale = 1.0 / math.sqrt(denom)
    return cfg


def forward(f: common.Forward, ids, out_rows=None):
    b, cfg, w = f.b, f.cfg, f.w
    x = None
    if common.embeds(f):
        x = b.embed(w("token_embd.weight"), ids)
        x = f.cb(b.scale(x, math.sqrt(cfg.n_embd)), "inp_scaled")
    # pending: the previous layer's FFN output, added with the next norm
    x, pending = common.stage_in(f, (x, None))
    for il in common.layers(f):
        window = cfg.layer_window(il)
        rope_base = cfg.rope_base_swa if window else cfg.rope_base
        x, h = b.add_rms_norm(x, pending, w(f"blk.{il}.attn_norm.weight"), cfg.norm_eps)
        if il > 0:
            f.cb(x, "l_out", il - 1)
        f.cb(h, "attn_norm", il)
        h = common.attention(f, il, h, qk_norm=True, q_scale=cfg.attn_scale, kq_scale=1.0,
                             rope_base=rope_base, window=window)
        if il == cfg.n_layer - 1 and out_rows is not None:
            h, x = b.take_rows(h, out_rows), b.take_rows(x, out_rows)
        h = f.cb(b.rms_norm(h, w(f"blk.{il}.post_attention_norm.weight"), cfg.norm_eps),
                 "attn_post_norm", il)
        x, h = b.add_rms_norm(x, h, w(f"blk.{il}.ffn_norm.weight"), cfg.norm_eps)
        f.cb(x, "sa_out", il)
        f.cb(h, "ffn_norm", il)
        h = f.cb(common.ffn(f, il, h, gelu=True), "ffn_out", il)
        pending = f.cb(b.rms_norm(h, w(f"blk.{il}.post_ffw_norm.weight"), cfg.norm_eps),
                       "ffn_post_norm", il)
    if common.stage_out(f, (x, pending)):
        return None
    return common.output(f, x, pending)
