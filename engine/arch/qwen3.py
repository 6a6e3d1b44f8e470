"""`qwen3`: qwen2 without biases, with an RMSNorm on each query and key head before rope.
llama.cpp: src/models/qwen3.cpp."""

from . import common


# Decodes several sequences in one step (every layer goes through common.attention).
BATCHED_DECODE = True
# Its caches are reached only through common.rope_store and common.attend:
# bucket graphs apply.
BUCKET_GRAPHS = True


def configure(cfg, gf):
    cfg.rope_neox = True
    return cfg


def forward(f: common.Forward, ids, out_rows=None):
    return common.pre_norm_decoder(f, ids, out_rows, qk_norm=True)
