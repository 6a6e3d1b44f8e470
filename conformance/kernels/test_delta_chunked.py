"""The chunked gated delta rule (engine/delta_chunked.py, the twin of a tensor-core prefill
kernel) against the sequential op the numpy backend runs as llama.cpp does: outputs and the
final state, over prompts shorter than, equal to and longer than a chunk, with strong and weak
decay, more value heads than key heads (the tiled mapping)."""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends.numpy_backend import NumpyBackend
from brass.delta_chunked import gated_delta_net_chunked
from conformance.harness.cases import RECURRENCE, nmse

F32 = np.float32


def unit(a):
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(F32)


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (150, 64), (37, 16)])
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_chunked_equals_sequential(rng, T, chunk, decay):
    Hk, Hv, D = 2, 6, 32
    q = unit(rng.standard_normal((T, Hk, D)))
    k = unit(rng.standard_normal((T, Hk, D)))
    v = rng.uniform(-1, 1, (T, Hv, D)).astype(F32)
    hi = 2.0 if decay == "strong" else 0.01
    g = -rng.uniform(0, hi, (T, Hv)).astype(F32)
    beta = rng.uniform(0, 1, (T, Hv)).astype(F32)
    state = rng.uniform(-0.5, 0.5, (Hv, D, D)).astype(F32)
    seq_state, chunk_state = state.copy(), state.copy()
    want = NumpyBackend().gated_delta_net(q, k, v, g, beta, seq_state)
    got = gated_delta_net_chunked(q, k, v, g, beta, chunk_state, chunk=chunk)
    # RECURRENCE: float32 sums in another order (matrix products against the sequential scan)
    assert nmse(got, want) <= RECURRENCE, f"output NMSE {nmse(got, want):.3g}"
    assert nmse(chunk_state, seq_state) <= RECURRENCE, f"state NMSE {nmse(chunk_state, seq_state):.3g}"
