"""`llama`: pre-norm decoder, RMSNorm, rope on adjacent pairs, GQA attention, SwiGLU FFN (or
top-k MoE when the file has experts). llama.cpp: src/models/llama.cpp."""

from . import common


# Decodes several sequences in one step (every layer goes through common.attention).
BATCHED_DECODE = True
# Its caches are reached only through common.rope_store and common.attend:
# bucket graphs apply.
BUCKET_GRAPHS = True


def configure(cfg, gf):
    cfg.rope_neox = False
    return cfg


def forward(f: common.Forward, ids, out_rows=None):
    return common.pre_norm_decoder(f, ids, out_rows)
