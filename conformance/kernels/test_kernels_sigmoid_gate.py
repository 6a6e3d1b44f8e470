"""elementwise.cu's sigmoid_gate: qwen35's attention output gate, x * sigmoid(g), and qwen35moe's
shared expert added under its per-token gate, a + x * sigmoid(g[t]), each in one launch with
the float32 ops of the kernels it replaces in their order (ssm.cu's unary sigmoid, then mul,
then add). On the CPU (conformance/harness/elementwise_host.py: the source under g++) against
numpy's IEEE-rounded float32 ops with the C library's expf, as the CPU build's; on the GPU,
CudaBackend's sigmoid_gate and gated_residual against base.Backend's compositions of the
separate kernels, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.backends.base import Backend
from conformance.harness.mmq_host import built, c_expf

F32 = np.float32

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="no CUDA device here: the GPU runner runs these")


@pytest.fixture(scope="module")
def lib():
    from conformance.harness import elementwise_host
    return built(elementwise_host.build)


def _sigmoid(g):
    """ssm.cu's unary sigmoid, __fdiv_rn(1, 1 + expf(-g)), with the C library's expf."""
    return (F32(1) / (F32(1) + c_expf(-g))).astype(F32)


@pytest.mark.parametrize("T, D, per_row, residual", [(1, 512, False, False), (5, 300, False, False),
                                                     (1, 512, True, True), (7, 200, True, True)], ids=str)
def test_sigmoid_gate_on_the_cpu(lib, rng, T, D, per_row, residual):
    from conformance.harness import elementwise_host
    x = rng.standard_normal((T, D)).astype(F32)
    g = rng.uniform(-9, 9, (T, 1) if per_row else (T, D)).astype(F32)
    a = rng.standard_normal((T, D)).astype(F32) if residual else None
    got = elementwise_host.sigmoid_gate(lib, x, g, a)
    want = x * _sigmoid(g)                          # [T, 1] broadcasts over the row
    if residual:
        want = a + want
    assert not np.isnan(got).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "other bits than sigmoid, mul (and add)"


@needs_cuda
@pytest.mark.parametrize("T", [1, 9], ids=str)
def test_sigmoid_gates_equal_their_compositions_on_cuda(cuda, rng, T):
    D = 2048
    x, a = (cuda.asarray(rng.standard_normal((T, D)).astype(F32)) for _ in range(2))
    g = cuda.asarray(rng.uniform(-9, 9, (T, D)).astype(F32))
    g_row = cuda.asarray(rng.uniform(-9, 9, (T, 1)).astype(F32))
    for name, fused, composed in (
            ("sigmoid_gate", cuda.sigmoid_gate(x, g), Backend.sigmoid_gate(cuda, x, g)),
            ("gated_residual", cuda.gated_residual(a, x, g_row), Backend.gated_residual(cuda, a, x, g_row))):
        got, want = cuda.to_numpy(fused), cuda.to_numpy(composed)
        assert not np.isnan(got).any(), name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name}: other bits than its composition"
