"""`qwen2`: llama with biases on the q/k/v projections (picked up from the file by the
attention block) and NeoX rope. llama.cpp: src/models/qwen2.cpp."""

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
    return common.pre_norm_decoder(f, ids, out_rows)
