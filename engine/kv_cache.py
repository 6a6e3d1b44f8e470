"""Per-sequence caches on the backend's device.

`KVCache`: per attention layer a float16 `[n_ctx, H_kv, Dh]` array for keys and one for values
(H_kv and Dh of that layer: gemma4's sliding-window and full layers differ); the slot of a
token is its position.

`RecurrentState`: per recurrent (gated delta-net) layer of a hybrid model, the state that
replaces a KV cache there: the conv1d's last K-1 inputs `[K-1, C]` and the delta rule's matrix
per value head `[Hv, D, D]`, both float32 as llama.cpp keeps them (its `cache_r_l*` /
`cache_s_l*`, same layouts). It does not grow with the context, and it cannot be rewound: going
back to position 0 (`reset`) zeroes it, and there is no going back to any other position.
Every array has a leading sequence axis, so a batched decode can hold one state per sequence in
the same arrays; a session uses sequence 0.
"""

import numpy as np


class RecurrentState:
    def __init__(self, backend, cfg, n_seq: int = 1):
        self.layers = [il for il in range(cfg.n_layer) if cfg.is_recurrent(il)]
        K1, C = cfg.ssm_d_conv - 1, cfg.ssm_conv_channels
        Hv, D = cfg.ssm_dt_rank, cfg.ssm_d_state
        self.conv = {il: backend.zeros((n_seq, K1, C), np.float32) for il in self.layers}
        self.ssm = {il: backend.zeros((n_seq, Hv, D, D), np.float32) for il in self.layers}

    def layer(self, il: int, seq: int = 0):
        """(conv state `[K-1, C]`, delta state `[Hv, D, D]`) of layer `il`: views the ops
        update in place."""
        return self.conv[il][seq], self.ssm[il][seq]

    def reset(self, seq: int | None = None):
        """Zero the state of one sequence (None: all), as llama.cpp starts a new sequence."""
        for a in list(self.conv.values()) + list(self.ssm.values()):
            if seq is None:
                a[...] = 0
            else:
                a[seq] = 0

    def copy_from(self, src: "RecurrentState"):
        """Every sequence's state from `src` (of the same model and sequence count)."""
        for il in self.layers:
            self.conv[il][...] = src.conv[il]
            self.ssm[il][...] = src.ssm[il]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in list(self.conv.values()) + list(self.ssm.values()))


class KVCache:
    """One sequence's cache. Hybrid models (`cfg.recurrent_layers`) hold keys and values only
    for their attention layers, and a RecurrentState (`recurrent`) for the others."""

    def __init__(self, backend, cfg, n_ctx: int):
        self.n_ctx = n_ctx
        kv = [not cfg.is_recurrent(il) for il in range(cfg.n_layer)]
        # KV heads and head sizes per layer (gemma4's differ between its layer kinds)
        self.k = [backend.zeros((n_ctx, cfg.layer_n_head_kv(il), cfg.layer_head_dim(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.v = [backend.zeros((n_ctx, cfg.layer_n_head_kv(il), cfg.layer_head_dim_v(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.recurrent = RecurrentState(backend, cfg) if not all(kv) else None

    def layer(self, il: int):
        return self.k[il], self.v[il]

    @staticmethod
    def nbytes_for(cfg, n_ctx: int) -> int:
        """The device bytes of the keys and values of a cache of n_ctx slots (its recurrent
        state aside), without allocating it."""
        return sum(2 * n_ctx * cfg.layer_n_head_kv(il) * (cfg.layer_head_dim(il) + cfg.layer_head_dim_v(il))
                   for il in range(cfg.n_layer) if not cfg.is_recurrent(il))

    def reset(self):
        """Back to an empty sequence: the KV slots are rewritten as positions are reached
        again, the recurrent state must start from zero."""
        if self.recurrent is not None:
            self.recurrent.reset()

    def copy_prefix(self, src: "KVCache", n: int):
        """Slots 0 .. n - 1 of every layer's keys and values, and the recurrent state, from
        `src` (a cache of the same model and size): a sequence's first n positions as read
        there (engine/model.py StartStep)."""
        for dst_l, src_l in zip(self.k + self.v, src.k + src.v):
            if dst_l is not None:
                dst_l[:n] = src_l[:n]
        if self.recurrent is not None:
            self.recurrent.copy_from(src.recurrent)

    @property
    def nbytes(self) -> int:
        kv = sum(a.nbytes for a in self.k + self.v if a is not None)
        return kv + (self.recurrent.nbytes if self.recurrent is not None else 0)
