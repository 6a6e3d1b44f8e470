"""The MoE router kernel of a decode step (moe_router_f32: the router's mat-vec and the
routing in one launch, BRASS_FUSED_ROUTER) on the CPU, through ci/router_host.py's g++ build of
kernels/matvec_f.cu: its logits bit for bit those of matmul_f32 (the unfused launch, the same
file), its experts exactly those the reference routes those logits to, its probabilities and
weights within TRANSCENDENTAL of the reference's (expf against numpy's exp), and the ticket
back at 0 after every launch (the next launch, a graph's replay, starts from it)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cases import TRANSCENDENTAL, cuda_reference, nmse

CASES = [  # T, E, K, k, norm, scale: qwen3moe's and qwen35moe's routers, a batched step, a tile
    (1, 128, 512, 8, True, 1.0), (1, 256, 256, 8, True, 1.0), (3, 128, 256, 8, False, 1.0),
    (8, 64, 128, 4, True, 2.5), (1, 32, 64, 32, True, 1.0),
]


def _lib():
    from ci import router_host
    try:
        return router_host.build()
    except RuntimeError as e:
        pytest.skip(f"no CPU build of matvec_f.cu: {e}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T%d-E%d-K%d-k%d-norm%d-scale%g" % c)
def test_router_on_the_cpu(rng, case, record_property):
    from ci.router_host import matmul, router
    T, E, K, k, norm, scale = case
    lib = _lib()
    w = rng.uniform(-1, 1, (E, K)).astype(np.float32)
    ticket = np.zeros(1, np.uint32)
    for launch in range(2):
        x = rng.uniform(-1, 1, (T, K)).astype(np.float32)
        logits, probs, ids, weights, ticket = router(lib, w, x, k, norm, scale, ticket)
        assert np.array_equal(logits, matmul(lib, w, x)), f"launch {launch}: logits differ from matmul_f32's"
        want_p, want_i, want_w = cuda_reference().moe_route(logits, k, norm, scale)
        assert np.array_equal(ids, want_i), f"launch {launch}: other experts chosen"
        err = max(nmse(probs, want_p), nmse(weights, want_w))
        record_property("nmse", f"{err:.3e}")
        assert err <= TRANSCENDENTAL, f"launch {launch}: NMSE {err:.3e}"
        assert ticket[0] == 0, f"launch {launch}: the ticket was left at {ticket[0]}"
