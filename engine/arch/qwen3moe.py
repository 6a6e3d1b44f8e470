"""`qwen3moe`: qwen3 attention with a top-k mixture-of-experts FFN: softmax router, the
chosen experts' weights renormalised to sum to one. llama.cpp: src/models/qwen3moe.cpp."""

from . import common


# Decodes several sequences in one step (every layer goes through common.attention).
BATCHED_DECODE = True
# Its caches are reached only through common.rope_store and common.attend:
# bucket graphs apply.
BUCKET_GRAPHS = True


def configure(cfg, gf):
    cfg.rope_neox = True
    cfg.expert_weights_norm = True      # llama.cpp passes norm_w = true for qwen3moe
    return cfg


def forward(f: common.Forward, ids, out_rows=None):
    return common.pre_norm_decoder(f, ids, out_rows, qk_norm=True)
