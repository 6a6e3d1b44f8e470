"""The delta-net layer's elementwise chains fused into their neighbours, each the float32 ops
of the kernels it replaces in their order, so that one launch gives the bits of several:
norm.cu's rms_norm takes a scalar scale (l2_norm) and the gate silu(z) (rms_norm_gated);
ssm.cu's delta_net_gates gives sigmoid(beta) and softplus(alpha + dt_bias) * a; ssm_conv takes
its silu. On the CPU (conformance/harness/norm_host.py, delta_host.py: the sources under g++)
against the separate kernels' CPU builds, or for norm.cu's products and quotients numpy's
IEEE-rounded float32 ones (silu's expf the C library's, as the CPU build's); on the GPU,
CudaBackend's ops against base.Backend's compositions of the separate kernels, bit for bit.
A decode step of a delta-net layer takes 9 launches fewer."""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.backends.base import Backend
from conformance.harness.mmq_host import built, c_expf, q8_1_blocks

F32 = np.float32

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="no CUDA device here: the GPU runner runs these")


@pytest.fixture(scope="module")
def lib():
    from conformance.harness import norm_host
    return built(norm_host.build)


def _silu(z):
    """ssm.cu's unary silu, __fdiv_rn(z, 1 + expf(-z)), with the C library's expf."""
    return (z / (F32(1) + c_expf(-z))).astype(F32)


@pytest.mark.parametrize("D", [128, 200, 1000], ids=str)
def test_rms_norm_takes_the_scale_and_the_gate_on_the_cpu(lib, rng, D):
    from conformance.harness import norm_host
    x = (rng.standard_normal((5, D)) * rng.uniform(0.1, 10)).astype(F32)
    w, z = rng.uniform(0.5, 1.5, D).astype(F32), rng.uniform(-6, 6, (5, D)).astype(F32)
    eps, s = float(F32(1e-6) / F32(D)), float(F32(1) / np.sqrt(F32(D)))
    plain = norm_host.rms_norm(lib, x, None, eps)
    got = norm_host.rms_norm(lib, x, None, eps, scale=s)
    assert np.array_equal(got.view(np.uint32), (plain * F32(s)).view(np.uint32)), "the scale: other bits than scale's"
    normed = norm_host.rms_norm(lib, x, w, 1e-6)
    got = norm_host.rms_norm(lib, x, w, 1e-6, z=z)
    want = normed * _silu(z)
    assert not np.isnan(got).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "the gate: other bits than unary silu, then mul"
    if D % 32 == 0:             # the output norm's Q8_1 blocks, as the quantize kernel forms them
        again, blocks = norm_host.rms_norm(lib, x, w, 1e-6, z=z, blocks=True)
        assert np.array_equal(again.view(np.uint32), got.view(np.uint32))
        assert np.array_equal(blocks.reshape(-1), q8_1_blocks(got).reshape(-1)), \
            "the Q8_1 blocks are not the quantize kernel's of the gated rows"


@pytest.fixture(scope="module")
def seq():
    from conformance.harness import delta_host
    return built(delta_host.build_sequential)


@pytest.mark.parametrize("T, H", [(1, 32), (5, 48), (3, 7)], ids=str)
def test_delta_net_gates_on_the_cpu(seq, rng, T, H):
    from conformance.harness import delta_host as dh
    beta, alpha = (rng.uniform(-8, 8, (T, H)).astype(F32) for _ in range(2))
    alpha[0, 0] = 25.0                                  # softplus's x-above-20 branch
    bias, a = rng.uniform(-2, 2, H).astype(F32), -rng.uniform(0.1, 4, H).astype(F32)
    beta_out, g = dh.delta_net_gates(seq, beta, alpha, bias, a)
    want_beta = dh.unary(seq, beta, 0)
    want_g = dh.unary(seq, alpha + bias, 1) * a          # add and mul: IEEE float32, as the kernels
    assert not np.isnan(g).any() and not np.isnan(beta_out).any()
    assert np.array_equal(beta_out.view(np.uint32), want_beta.view(np.uint32)), "beta: other bits than unary sigmoid"
    assert np.array_equal(g.view(np.uint32), want_g.view(np.uint32)), "g: other bits than add, softplus, mul"


@pytest.mark.parametrize("T", [1, 6, 40], ids=str)
def test_ssm_conv_takes_its_silu_on_the_cpu(seq, rng, T):
    # T = 40: three of the conv's 16-token blocks
    from conformance.harness import delta_host as dh
    C, K = 300, 4
    x, w = rng.standard_normal((T, C)).astype(F32), rng.standard_normal((C, K)).astype(F32)
    state = rng.standard_normal((K - 1, C)).astype(F32)
    s1, s2 = state.copy(), state.copy()
    got = dh.ssm_conv(seq, x, s1, w, silu=True)
    want = dh.unary(seq, dh.ssm_conv(seq, x, s2, w), 2)
    assert not np.isnan(got).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "other bits than ssm_conv, then unary silu"
    assert np.array_equal(s1, s2), "the conv window"


@needs_cuda
@pytest.mark.parametrize("T, H, D", [(1, 32, 128), (7, 16, 128), (3, 4, 96)], ids=str)
def test_fused_delta_net_norms_equal_their_compositions_on_cuda(cuda, rng, tmp_path, T, H, D):
    # the delta-net's l2_norm of q and k and its gated output norm, each in one launch, against
    # base.Backend's compositions of rms_norm, scale, unary and mul on the same backend
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"norm": (GGMLType.F32, (D,))}))
    x = cuda.asarray((rng.standard_normal((T, H, D)) * rng.uniform(0.1, 10)).astype(F32))
    z = cuda.asarray(rng.uniform(-6, 6, (T, H, D)).astype(F32))
    w = cuda.weight(gf, "norm")
    for name, fused, composed in (
            ("l2_norm", cuda.l2_norm(x, 1e-6), Backend.l2_norm(cuda, x, 1e-6)),
            ("rms_norm_gated", cuda.rms_norm_gated(x, w, z, 1e-6), Backend.rms_norm_gated(cuda, x, w, z, 1e-6))):
        got, want = cuda.to_numpy(fused), cuda.to_numpy(composed)
        assert not np.isnan(got).any(), name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name}: other bits than its composition"
    # the output norm's Q8_1 blocks, found for its [T, H * D] reshape as the output projection
    # reads it, are the quantize kernel's
    from brass.backends.cuda import quantize
    y = cuda.rms_norm_gated(x, w, z, 1e-6).reshape(T, H * D)
    blocks = quantize.blocks_of(cuda, y)
    assert blocks is not None, "rms_norm_gated's blocks are not found for the reshaped output"
    # blocks_of gives the producer's [T * H, D / 32 blocks] array, quantize_q8_1 a [T, H * D / 32
    # blocks] one: the same bytes in the same order
    assert np.array_equal(cuda.to_numpy(blocks).reshape(-1), cuda.to_numpy(cuda.quantize_q8_1(y)).reshape(-1))


@needs_cuda
@pytest.mark.parametrize("T", [1, 9], ids=str)
def test_fused_delta_net_gates_equal_their_composition_on_cuda(cuda, rng, tmp_path, T):
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    H = 48
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"dt": (GGMLType.F32, (H,)), "a": (GGMLType.F32, (H,))}))
    dt, a = cuda.weight(gf, "dt"), cuda.weight(gf, "a")
    beta, alpha = (cuda.asarray(rng.uniform(-8, 8, (T, H)).astype(F32)) for _ in range(2))
    fused, composed = cuda.delta_net_gates(beta, alpha, dt, a), Backend.delta_net_gates(cuda, beta, alpha, dt, a)
    for name, got, want in zip(("beta", "g"), fused, composed):
        got, want = cuda.to_numpy(got), cuda.to_numpy(want)
        assert not np.isnan(got).any(), name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name}: other bits than its composition"


@needs_cuda
@pytest.mark.parametrize("T", [1, 9, 40], ids=str)
def test_ssm_conv_silu_equals_its_composition_on_cuda(cuda, rng, tmp_path, T):
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    C, K = 640, 4
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"conv": (GGMLType.F32, (C, K))}))
    conv = cuda.weight(gf, "conv")
    x = cuda.asarray(rng.standard_normal((T, C)).astype(F32))
    state = rng.standard_normal((K - 1, C)).astype(F32)
    s1, s2 = cuda.asarray(state), cuda.asarray(state)
    got = cuda.to_numpy(cuda.ssm_conv_silu(x, s1, conv))
    want = cuda.to_numpy(Backend.ssm_conv_silu(cuda, x, s2, conv))
    assert not np.isnan(got).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "ssm_conv_silu: other bits than its composition"
    assert np.array_equal(cuda.to_numpy(s1), cuda.to_numpy(s2)), "the conv window"
