"""KV cache for one sequence: per layer a float16 `[n_ctx, H_kv, Dh]` array for keys and one
for values, on the backend's device. The slot of a token is its position."""

import numpy as np


class KVCache:
    def __init__(self, backend, cfg, n_ctx: int):
        self.n_ctx = n_ctx
        self.k = [backend.zeros((n_ctx, cfg.n_head_kv, cfg.head_dim), np.float16)
                  for _ in range(cfg.n_layer)]
        self.v = [backend.zeros((n_ctx, cfg.n_head_kv, cfg.head_dim_v), np.float16)
                  for _ in range(cfg.n_layer)]

    def layer(self, il: int):
        return self.k[il], self.v[il]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)
