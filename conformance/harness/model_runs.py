"""Running a synthetic model's forward pass step by step on any backend, as the whole-model
kernel checks (conformance/kernels/test_kernels_model.py) and ci/free_running_spread.py, which
sets their bounds, both do: a prefill of random tokens then single-token decode steps, each
step's logits, the MoE router's nodes of a step, and where two runs first chose different
experts."""

from __future__ import annotations

import numpy as np


def steps(rng, n_vocab, n_prompt=12, n_decode=3):
    """A prefill of random tokens, then single-token decode steps."""
    out = [(rng.integers(0, n_vocab, n_prompt).astype(np.int32), np.arange(n_prompt, dtype=np.int32))]
    out += [(rng.integers(0, n_vocab, 1).astype(np.int32), np.array([n_prompt + i], np.int32))
            for i in range(n_decode)]
    return out


def forward(backend, weights, cfg, arch, cache, ids, pos, trace=None):
    from brass.arch.common import Forward

    # On the backend's own stream, as Model.forward runs it: the architecture's own array
    # operations (slices, copies) would otherwise queue on whichever stream is current (the
    # last CudaBackend made), unordered with this backend's kernels. On the H200 that made
    # one of two identical qwen35 runs read unwritten (NaN-poisoned) memory.
    with backend.activate():
        f = Forward(backend, cfg, weights, cache, backend.asarray(pos), trace)
        return backend.to_numpy(arch.forward(f, backend.asarray(ids)))


def forward_traced(backend, weights, cfg, arch, cache, ids, pos):
    """Logits and the MoE router's nodes (logits and chosen experts per layer) of one step."""
    nodes: dict = {}

    def keep(key, x):
        if key.startswith(("ffn_moe_logits-", "ffn_moe_topk-")):
            nodes[key] = backend.to_numpy(x)
    return forward(backend, weights, cfg, arch, cache, ids, pos, keep), nodes


def first_parting(cfg, got_nodes, want_nodes):
    """(token, layer) of a step where experts were first chosen differently (the lowest token,
    then the lowest layer at that token), or None."""
    found = []
    for il in range(cfg.n_layer):
        key = f"ffn_moe_topk-{il}"
        if key in want_nodes:
            rows = np.nonzero((np.sort(got_nodes[key], axis=-1) != np.sort(want_nodes[key], axis=-1)).any(axis=-1))[0]
            if len(rows):
                found.append((int(rows[0]), il))
    return min(found) if found else None
