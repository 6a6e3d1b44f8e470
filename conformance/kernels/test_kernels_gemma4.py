"""Per-kernel conformance of the CUDA ops Gemma 4 needs beyond the common ones, against the
numpy reference backend, as conformance/kernels/test_kernels.py does for those (fresh random inputs,
outputs poisoned with NaN, NMSE within the op's bound from kernels/cases.py OP_BOUNDS):

- rope_ff: rope with per-pair frequency factors (the full-attention layers' "proportional"
  rope: factors 1 for the rotated pairs, 1e30 for the rest), at the real models' head size
  512 and the synthetic model's 64;
- tanh and the final logit softcap (one kernel for scale, tanh, scale);
- mul_expert_scale (ffn_down_exps.scale), and mul by a one-value weight (layer_output_scale);
- attention and rope_store at Gemma 4's head sizes (256 on sliding-window layers, 512 on
  full ones), including a cache long enough that attention needs more than the 48 KiB of
  shared memory a kernel gets without opting in;
- bad shapes give BrassError.

Without a GPU these tests skip; CI still compiles the kernels (test_nvrtc_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.harness.kernel_checks import check, kv_store_and_attention, weights
from brass.backends import cuda_available
from brass.backends.base import Backend
from brass.errors import BrassError
from brass.gguf import GGMLType, GGUFFile
from conformance.harness.cases import EXACT, F16_ROUNDED, OP_BOUNDS, write_gguf

pytestmark = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the CUDA kernel tests run on the GPU runner (ci/gpu.sh suite); "
           "CI compiles every kernel in test_nvrtc_compile.py")

F16, F32 = np.float16, np.float32


def vectors(tmp_path, name: str, **values):
    """A GGUF of the given float32 vectors (exact values, unlike conformance.harness.cases' random ones)."""
    tensors = {k: (GGMLType.F32, (len(v),), np.asarray(v, F32).view(np.uint8)) for k, v in values.items()}
    return GGUFFile(write_gguf(tmp_path / f"{name}.gguf", tensors))


def proportional_factors(head_dim: int, rotated_pairs: int) -> np.ndarray:
    """Gemma 4's rope_freqs: 1 for the first pairs, 1e30 (no rotation) for the rest."""
    return np.concatenate([np.ones(rotated_pairs), np.full(head_dim // 2 - rotated_pairs, 1e30)]).astype(F32)


# ---- rope with frequency factors ---------------------------------------------------------------

# (head_dim, n_rot, base, freq_scale, factors: "proportional" (Gemma 4's, a quarter of the pairs
# rotated) or "random" (in [0.5, 8], more than n_rot / 2 of them: only the first are read))
ROPE_FF_CASES = [
    (512, 512, 1e6, 1.0, "proportional"),     # the real models' full layers
    (64, 64, 1e6, 1.0, "proportional"),       # synth-gemma4's full layers
    (128, 96, 1e4, 0.5, "random"),            # dims past n_rot pass through; freq_scale after the factor
]


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("case", ROPE_FF_CASES, ids=lambda c: "d%d-rot%d-%s" % (c[0], c[1], c[4]))
def test_rope_ff(cuda, ref, rng, tmp_path, case, neox, record_property):
    Dh, n_rot, base, freq_scale, kind = case
    T, H = 7, 4
    if kind == "proportional":
        ff = proportional_factors(Dh, n_rot // 8)
    else:
        ff = rng.uniform(0.5, 8, Dh // 2).astype(F32)
    gf = vectors(tmp_path, "ff", ff=ff)
    x = rng.uniform(-1, 1, (T, H, Dh)).astype(F32)
    pos = np.concatenate([[0], np.sort(rng.integers(1, 8192, T - 1))]).astype(np.int32)
    got = cuda.to_numpy(cuda.rope_ff(cuda.asarray(x), cuda.asarray(pos), n_rot, base, neox,
                                     cuda.weight(gf, "ff"), freq_scale))
    want = ref.rope_ff(x, pos, n_rot, base, neox, ref.weight(gf, "ff"), freq_scale)
    check(got, want, OP_BOUNDS["rope_ff"], record_property)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:]), "dims past n_rot must pass through"
    if kind == "proportional" and neox:
        # pairs with factor 1e30 turn by ~1e-27 rad: they keep their values
        kept = np.concatenate([np.arange(n_rot // 8, n_rot // 2), n_rot // 2 + np.arange(n_rot // 8, n_rot // 2)])
        np.testing.assert_allclose(got[..., kept], x[..., kept], rtol=1e-6, atol=1e-6)


def test_rope_ff_with_unit_factors_is_rope(cuda, rng, tmp_path):
    # angle / 1.0 is the angle: the same bits as rope itself.
    T, H, Dh = 5, 3, 256
    gf = vectors(tmp_path, "ones", ones=np.ones(Dh // 2, F32))
    X = cuda.asarray(rng.uniform(-1, 1, (T, H, Dh)).astype(F32))
    P = cuda.asarray(np.sort(rng.integers(0, 4096, T)).astype(np.int32))
    for neox in (True, False):
        a = cuda.to_numpy(cuda.rope_ff(X, P, Dh, 1e4, neox, cuda.weight(gf, "ones")))
        b = cuda.to_numpy(cuda.rope(X, P, Dh, 1e4, neox))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"neox={neox}: rope_ff(1) differs from rope"


# ---- tanh and the final logit softcap ------------------------------------------------------------

def test_tanh(cuda, ref, rng, record_property):
    cases = {
        "moderate": rng.uniform(-12, 12, (5, 3001)),
        "small": rng.uniform(-1e-3, 1e-3, (2, 999)),          # tanh(x) ~ x: relative accuracy
        "saturated": np.concatenate([rng.uniform(-1e4, -20, 100), rng.uniform(20, 1e4, 100),
                                     [0.0, -0.0, np.inf, -np.inf]]),
    }
    for what, x in cases.items():
        x = x.astype(F32)
        got = cuda.to_numpy(cuda.tanh(cuda.asarray(x)))
        check(got, ref.tanh(x), OP_BOUNDS["tanh"], record_property, what)


@pytest.mark.parametrize("cap", [30.0, 20.0, 7.5])
@pytest.mark.parametrize("T", [1, 9])
def test_softcap(cuda, ref, rng, T, cap, record_property):
    # Logits well inside, around and far beyond the cap.
    x = (rng.standard_normal((T, 5003)) * rng.choice([1.0, 30.0, 300.0], (T, 1))).astype(F32)
    X = cuda.asarray(x)
    got = cuda.to_numpy(cuda.softcap(X, cap))
    check(got, ref.softcap(x, cap), OP_BOUNDS["softcap"], record_property)
    assert np.abs(got).max() <= cap, "the softcap exceeds the cap"
    # The one kernel computes the numbers of the three ops it replaces (Backend.softcap on
    # this backend's scale and tanh kernels), bit for bit.
    composed = cuda.to_numpy(Backend.softcap(cuda, X, cap))
    assert np.array_equal(got.view(np.uint32), composed.view(np.uint32)), "softcap differs from scale-tanh-scale"


# ---- per-expert output scale ------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,N,E", [(1, 2, 256, 4), (5, 3, 777, 8), (40, 8, 2816, 128)])
def test_mul_expert_scale_bit_exact(cuda, ref, rng, tmp_path, T, k, N, E, record_property):
    gf = vectors(tmp_path, "scale", s=rng.uniform(0.1, 4, E))
    y = rng.uniform(-1, 1, (T, k, N)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    got = cuda.to_numpy(cuda.mul_expert_scale(cuda.asarray(y), cuda.weight(gf, "s"), cuda.asarray(ids)))
    want = ref.mul_expert_scale(y, ref.weight(gf, "s"), ids)
    check(got, want, OP_BOUNDS["mul_expert_scale"], record_property)
    assert OP_BOUNDS["mul_expert_scale"] == EXACT
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "not bit-identical"


def test_mul_expert_scale_bad_expert_gives_nan(cuda, rng, tmp_path):
    gf = vectors(tmp_path, "scale", s=np.arange(1, 5, dtype=F32))
    y = cuda.asarray(rng.uniform(-1, 1, (1, 3, 64)).astype(F32))
    ids = cuda.asarray(np.array([[1, 4, -1]], np.int32))      # 4 and -1 are out of range for 4 experts
    out = cuda.to_numpy(cuda.mul_expert_scale(y, cuda.weight(gf, "s"), ids))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1:]).all()


def test_mul_by_scalar_weight_bit_exact(cuda, ref, rng, tmp_path, record_property):
    # layer_output_scale: a weight of shape (1,) times the whole residual stream
    gf = vectors(tmp_path, "one", s=[0.734])
    x = rng.uniform(-1, 1, (5, 640)).astype(F32)
    got = cuda.to_numpy(cuda.mul(cuda.asarray(x), cuda.weight(gf, "s")))
    check(got, ref.mul(x, ref.weight(gf, "s")), OP_BOUNDS["mul"], record_property)
    assert np.array_equal(got.view(np.uint32), ref.mul(x, ref.weight(gf, "s")).view(np.uint32))


# ---- attention and rope_store at Gemma 4's head sizes -------------------------------------------------

# As test_kernels.ATTENTION_CASES: (T, past, H, H_kv, head_dim, window, scale); Gemma 4's scale is 1.
GEMMA4_ATTENTION_CASES = [
    (1, 200, 8, 1, 512, 0, 1.0),          # full layer, decode, GQA 8:1
    (9, 30, 8, 1, 512, 0, 1.0),           # full layer, prefill after a past
    (1, 700, 16, 8, 256, 512, 1.0),       # sliding-window layer, decode past the window
    (12, 40, 16, 8, 256, 16, 1.0),        # sliding-window layer, prefill
    # 10,000 slots of logits + 512 + 4 x 512 floats = 50 KiB of shared memory: past the 48 KiB
    # default, so the kernel must be opted in (compiler.Kernels.allow_smem)
    (1, 10000, 4, 1, 512, 0, 1.0),
]


@pytest.mark.parametrize("case", GEMMA4_ATTENTION_CASES, ids=lambda c: "T%d-past%d-H%d-kv%d-d%d-w%d" % c[:6])
def test_attention_gemma4_head_dims(cuda, ref, rng, case, record_property):
    kv_store_and_attention(cuda, ref, rng, case, record_property)


def test_attention_rows_head_dim_512(cuda, ref, rng, record_property):
    # A batched decode step: each row attends over its own sequence (its row of the block
    # tables, all rows in one pool pair).
    from conformance.harness.attn_host import device_rows
    H, Hkv, Dh = 8, 1, 512
    pasts = [37, 5, 120]
    layers_ref = []
    for past in pasts:
        kv = [rng.uniform(-1, 1, (past + 8, Hkv, Dh)).astype(F16) for _ in range(2)]
        layers_ref.append(kv)
    layers_dev = device_rows(cuda, rng, layers_ref)
    pos = np.array(pasts, np.int32)
    q = rng.uniform(-1, 1, (len(pasts), H, Dh)).astype(F32)
    got = cuda.to_numpy(cuda.attention_rows(cuda.asarray(q), layers_dev, cuda.asarray(pos), 1.0))
    want = np.concatenate([ref.attention(q[r:r + 1], *layers_ref[r], pos[r:r + 1], 1.0) for r in range(len(pasts))])
    check(got, want, OP_BOUNDS["attention"], record_property)


@pytest.mark.parametrize("Dh", [256, 512])
def test_rope_store_gemma4_head_dims(cuda, ref, rng, tmp_path, Dh, record_property):
    T, H, Hkv, past = 3, 8, 2, 4
    gf = weights(tmp_path, rng, {"qn": (GGMLType.F32, (Dh,)), "kn": (GGMLType.F32, (Dh,))})
    q, k, v = (rng.uniform(-1, 1, (T, n, Dh)).astype(F32) for n in (H, Hkv, Hkv))
    pos = np.arange(past, past + T, dtype=np.int32)
    cap = past + T + 2
    kw = dict(eps=1e-6, n_rot=Dh, base=1e4, neox=True, freq_scale=1.0)
    caches_ref = [np.full((cap, Hkv, Dh), np.nan, F16) for _ in range(2)]
    qr, kr = ref.rope_store(q, k, v, pos, *caches_ref, q_norm=ref.weight(gf, "qn"), k_norm=ref.weight(gf, "kn"), **kw)
    from conformance.harness.attn_host import device_sequence, read_back
    dev = device_sequence(cuda, rng, *(np.full((cap, Hkv, Dh), np.nan, F16) for _ in range(2)))
    qg, kg = cuda.rope_store(cuda.asarray(q), cuda.asarray(k), cuda.asarray(v), cuda.asarray(pos), *dev,
                             q_norm=cuda.weight(gf, "qn"), k_norm=cuda.weight(gf, "kn"), **kw)
    check(cuda.to_numpy(qg), qr, OP_BOUNDS["rope_store"], record_property, "q")
    check(cuda.to_numpy(kg), kr, OP_BOUNDS["rope_store"], record_property, "k")
    for got_c, want_c, what in zip(dev, caches_ref, ("k cache", "v cache")):
        got_c = read_back(cuda, got_c)
        assert np.isnan(got_c[:past]).all() and np.isnan(got_c[past + T:]).all(), f"{what}: written outside pos"
        check(got_c[past:past + T].astype(F32), want_c[past:past + T].astype(F32), F16_ROUNDED,
              record_property, what)


# ---- errors on bad input ------------------------------------------------------------------------------

def test_gemma4_ops_refuse_bad_input(cuda, rng, tmp_path):
    gf = vectors(tmp_path, "bad", ff=np.ones(8, F32), s=np.ones(4, F32))
    ff, s = cuda.weight(gf, "ff"), cuda.weight(gf, "s")
    x = cuda.asarray(rng.uniform(-1, 1, (2, 3, 32)).astype(F32))
    pos = cuda.asarray(np.arange(2, dtype=np.int32))
    with pytest.raises(BrassError, match="frequency factors"):
        cuda.rope_ff(x, pos, 32, 1e4, True, ff)                # 8 factors for 16 pairs
    with pytest.raises(BrassError, match="n_rot"):
        cuda.rope_ff(x, pos, 7, 1e4, True, ff)
    with pytest.raises(BrassError, match="pos"):
        cuda.rope_ff(x, cuda.asarray(np.arange(3, dtype=np.int32)), 16, 1e4, True, ff)
    with pytest.raises(BrassError, match="float32"):
        cuda.tanh(x.astype(F16))
    with pytest.raises(BrassError, match="float32"):
        cuda.softcap(x.astype(F16), 30.0)
    with pytest.raises(BrassError, match="cap"):
        cuda.softcap(x, 0.0)
    y = cuda.asarray(rng.uniform(-1, 1, (2, 3, 16)).astype(F32))
    with pytest.raises(BrassError, match="ids"):
        cuda.mul_expert_scale(y, s, cuda.asarray(np.zeros((2, 2), np.int32)))
    with pytest.raises(BrassError, match="y \\[T, k, N\\]"):
        cuda.mul_expert_scale(y[0], s, cuda.asarray(np.zeros((3, 16), np.int32)))
    gf2 = weights(tmp_path, rng, {"m": (GGMLType.F32, (4, 32))})
    with pytest.raises(BrassError, match="1-D weight"):
        cuda.mul_expert_scale(y, cuda.weight(gf2, "m"), cuda.asarray(np.zeros((2, 3), np.int32)))
