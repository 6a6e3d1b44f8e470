"""kernels/fused.cu's norm kernels on the CPU (conformance/harness/fused_host.py: the kernel source compiled by g++
against a shim of the CUDA device code), against the numpy reference's compositions: the
residual add (then gemma4's layer_output_scale) and RMS norm of add_rms_norm, and gemma4's
moe_norms (the experts' norm and the router's input from one sum of squares), with the Q8_1
blocks both write beside their normed rows. Skips without g++; the GPU runs the same kernels
in test_kernels.py (test_add_rms_norm, test_moe_norms)."""

from __future__ import annotations

import numpy as np
import pytest

from brass import quants
from brass.gguf import GGMLType, GGUFFile
from conformance.harness.cases import RMS_NORM, TRANSCENDENTAL, cuda_reference, nmse, random_weight_file
from conformance.harness.kernel_checks import check
from conformance.harness.mmq_host import built  # noqa: E402

F32 = np.float32


@pytest.fixture(scope="module")
def lib():
    from conformance.harness import fused_host
    return built(fused_host.build)


def _weights(tmp_path, rng, D):
    return GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"norm": (GGMLType.F32, (D,)),
                                                                  "router": (GGMLType.F32, (D,)),
                                                                  "scale": (GGMLType.F32, (1,))}))


def _q8_equal(blocks: np.ndarray, y: np.ndarray) -> bool:
    want = quants.quantize_q8_1_cuda(y)
    R = y.shape[0]
    b = blocks.reshape(R, -1, 36)
    d = b[..., 0:2].copy().view("<f2").reshape(want.d.shape)
    s = b[..., 2:4].copy().view("<f2").reshape(want.s.shape)
    qs = b[..., 4:].copy().view(np.int8).reshape(want.qs.shape)
    return np.array_equal(d, want.d) and np.array_equal(s, want.s) and np.array_equal(qs, want.qs)


@pytest.mark.parametrize("D,residual,scaled", [(256, True, True), (200, True, True), (2816, False, True),
                                               (576, True, False)], ids=str)
def test_add_rms_norm_on_the_cpu(lib, rng, tmp_path, D, residual, scaled):
    from conformance.harness import fused_host
    gf = _weights(tmp_path, rng, D)
    ref = cuda_reference()
    a, b = (rng.uniform(-1, 1, (3, D)).astype(F32) * F32(rng.uniform(0.1, 10)) for _ in range(2))
    sc = ref.weight(gf, "scale")
    s, y, yq = fused_host.add_rms_norm(lib, a, b if residual else None, ref.weight(gf, "norm").dense(), 1e-6,
                                       sc.dense() if scaled else None)
    s_want, y_want = ref.add_rms_norm(a, b if residual else None, ref.weight(gf, "norm"), 1e-6,
                                      scale=sc if scaled else None)
    assert np.array_equal(s, s_want), "the sum (and its scale) as the add and mul ops"
    assert not np.isnan(y).any() and nmse(y, y_want) <= RMS_NORM, nmse(y, y_want)
    if D % 32 == 0:
        assert _q8_equal(yq, y), "the Q8_1 blocks are the quantize kernel's of the normed rows"


@pytest.mark.parametrize("D", [256, 2816, 200], ids=str)
def test_moe_norms_on_the_cpu(lib, rng, tmp_path, D):
    from conformance.harness import fused_host
    gf = _weights(tmp_path, rng, D)
    ref = cuda_reference()
    x = rng.uniform(-1, 1, (4, D)).astype(F32) * F32(rng.uniform(0.1, 50))
    factor = float(np.float32(1) / np.sqrt(np.float32(D)))
    h, hq, r = fused_host.moe_norms(lib, x, ref.weight(gf, "norm").dense(), ref.weight(gf, "router").dense(),
                                    factor, 1e-6)
    h_want, r_want = ref.moe_norms(x, ref.weight(gf, "norm"), ref.weight(gf, "router"), factor, 1e-6)
    for got, want, what in ((h, h_want, "experts' norm"), (r, r_want, "router input")):
        assert not np.isnan(got).any() and nmse(got, want) <= RMS_NORM, (what, nmse(got, want))
    if D % 32 == 0:
        assert _q8_equal(hq, h), "the Q8_1 blocks are the quantize kernel's of the experts' input"


@pytest.mark.parametrize("per_row", [False, True], ids=["one-sequence", "per-row"])
def test_rope_store_writes_through_block_tables_on_the_cpu(lib, rng, per_row, record_property):
    # rope_store's roped q, k and its cache writes against the reference's rope and kv_store:
    # position p of a sequence lands at slot p % 16 of block table[p / 16] of the pools
    # (per_row: token t's sequence is table row t), every other slot of the pools keeps its
    # bits.
    from brass.backends.cuda.params import pack
    from brass.kv_cache import BLOCK_TOKENS as B
    from conformance.harness import fused_host
    T, H, Hkv, D, DV, n_rot, n_blocks = 3, 4, 2, 64, 32, 48, 11
    ref = cuda_reference()
    q, k = (rng.uniform(-1, 1, (T, h, D)).astype(F32) for h in (H, Hkv))
    v = rng.uniform(-1, 1, (T, Hkv, DV)).astype(F32)
    pos = np.array([37, 2, 16], np.int32) if per_row else np.array([30, 31, 32], np.int32)
    rows = T if per_row else 1
    tables = rng.permutation(n_blocks)[:3 * rows].astype(np.int32).reshape(rows, 3)
    kp = rng.uniform(-1, 1, (n_blocks, B, Hkv, D)).astype(np.float16)
    vp = rng.uniform(-1, 1, (n_blocks, B, Hkv, DV)).astype(np.float16)
    k_want, v_want = kp.copy(), vp.copy()
    theta_scale = np.float32(np.power(np.float32(10000.0), np.float32(-2.0) / np.float32(n_rot)))
    params = pack("RopeStoreParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=D, head_dim_v=DV,
                  n_rot=n_rot, theta_scale=theta_scale, freq_scale=1.0, neox=1, q_norm=0, k_norm=0, eps=1e-6,
                  capacity=3 * B, write_k=1, per_row=int(per_row), table_stride=3)
    q_out, k_out = fused_host.rope_store_raw(lib, q, k, v, pos, kp, vp, tables, params)
    for got, x, what in ((q_out, q, "q"), (k_out, k, "k")):
        check(got, ref.rope(x, pos, n_rot, 10000.0, True), TRANSCENDENTAL, record_property, what)
    for t, p in enumerate(pos):             # the cache holds the kernel's own roped k, as F16
        tab = tables[t if per_row else 0]
        k_want[tab[p // B], p % B] = k_out[t].astype(np.float16)
        v_want[tab[p // B], p % B] = v[t].astype(np.float16)
    assert np.array_equal(kp.view(np.uint16), k_want.view(np.uint16)), "keys: the slots the table names, only"
    assert np.array_equal(vp.view(np.uint16), v_want.view(np.uint16)), "values: the slots the table names, only"
