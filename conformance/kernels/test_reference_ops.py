"""The numpy reference backend's ops against plain definitions written as loops, on fresh
random inputs: the semantics the CUDA kernels are then held to (docs/design.md)."""

import math

import numpy as np
import pytest

from brass.backends.numpy_backend import NumpyBackend, gelu_f16_table, rope_cos_sin

b = NumpyBackend()


@pytest.mark.parametrize("window", [0, 1, 3, 7])
@pytest.mark.parametrize("T, H, Hkv", [(1, 4, 4), (5, 8, 2), (9, 6, 1)])
def test_attention_matches_loop(rng, T, H, Hkv, window):
    Dh, n_ctx = 16, 32
    p0 = int(rng.integers(0, 12))
    pos = np.arange(p0, p0 + T, dtype=np.int32)
    k_cache = rng.normal(size=(n_ctx, Hkv, Dh)).astype(np.float16)
    v_cache = rng.normal(size=(n_ctx, Hkv, Dh)).astype(np.float16)
    q = rng.normal(size=(T, H, Dh)).astype(np.float32)
    scale = 1 / math.sqrt(Dh)
    out = b.attention(q, k_cache, v_cache, pos, scale, window)
    ref = np.empty((T, H, Dh))
    for t in range(T):
        for h in range(H):
            kv = h // (H // Hkv)                       # GQA: consecutive heads share a KV head
            slots = [s for s in range(pos[t] + 1) if not window or pos[t] - s < window]
            logits = np.array([np.dot(q[t, h].astype(np.float16).astype(np.float64),
                                      k_cache[s, kv].astype(np.float64)) * scale for s in slots])
            p = np.exp(logits - logits.max())
            p /= p.sum()
            ref[t, h] = sum(pi * v_cache[s, kv].astype(np.float64) for pi, s in zip(p, slots))
    # the reference rounds Q and the probabilities to F16 as llama.cpp does: ≤ 2^-11 relative
    # per probability, so the output moves by at most ~1e-3 of its scale
    np.testing.assert_allclose(out.reshape(T, H, Dh), ref, rtol=0, atol=2e-3)


def test_attention_window_excludes_exactly(rng):
    """A value planted in the slot just outside the window must not reach the output."""
    Dh, window = 8, 4
    k = np.zeros((16, 1, Dh), np.float16)
    v = np.zeros((16, 1, Dh), np.float16)
    v[10 - window] = 100.0          # position 10 sees slots 7..10 only
    v[10 - window + 1] = 1.0
    out = b.attention(rng.normal(size=(1, 1, Dh)).astype(np.float32), k, v,
                      np.array([10], np.int32), 1.0, window)
    assert out.max() < 1.0 + 1e-3


@pytest.mark.parametrize("neox", [False, True])
def test_rope_matches_formula(rng, neox):
    T, H, Dh, n_rot, base = 6, 3, 16, 8, 10000.0
    x = rng.normal(size=(T, H, Dh)).astype(np.float32)
    pos = rng.integers(0, 5000, size=T).astype(np.int32)
    y = b.rope(x, pos, n_rot, base, neox)
    ref = x.astype(np.float64).copy()
    for t in range(T):
        for i in range(n_rot // 2):
            theta = pos[t] * base ** (-2 * i / n_rot)
            a, c = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[t, :, a].astype(np.float64), x[t, :, c].astype(np.float64)
            ref[t, :, a] = x0 * math.cos(theta) - x1 * math.sin(theta)
            ref[t, :, c] = x0 * math.sin(theta) + x1 * math.cos(theta)
    # float32 angle recurrence as in ggml: |Δθ| ≤ pos·n_rot·2^-24 ≈ 2.4e-3 rad at pos 5000
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-2)
    assert np.array_equal(y[..., n_rot:], x[..., n_rot:])     # the tail is not rotated


def test_rope_angles_follow_ggml_recurrence():
    cos, _ = rope_cos_sin(np.array([3000], np.int32), 64, 1e6)
    theta = np.float32(3000)
    scale = np.float32(np.power(np.float32(1e6), np.float32(-2 / 64)))
    for _i in range(5):
        theta = np.float32(theta * scale)
    assert cos[0, 5] == np.cos(theta)


def test_topk_order_and_ties(rng):
    x = rng.normal(size=(5, 16)).astype(np.float32)
    x[:, 3] = x[:, 9] = x.max(axis=1) + 1       # a tie for first place
    idx, val = b.topk(x, 4)
    assert (idx[:, 0] == 3).all() and (idx[:, 1] == 9).all(), "ties must go to the lower id"
    assert np.array_equal(val, np.take_along_axis(x, idx, axis=1))
    assert (np.diff(val, axis=1) <= 0).all()


def test_rms_norm(rng):
    x = rng.normal(size=(4, 64)).astype(np.float32) * 3
    y = b.rms_norm(x, None, 1e-6)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, ref, rtol=1e-6)


def test_swiglu_geglu(rng):
    g = rng.normal(size=(3, 40)).astype(np.float32) * 4
    u = rng.normal(size=(3, 40)).astype(np.float32)
    np.testing.assert_allclose(b.swiglu(g, u), g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-6)
    gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g.astype(np.float64) ** 3)))
    # GELU through float16 as ggml's table: ≤ 2 half-ulps ≈ 1e-3 relative
    np.testing.assert_allclose(b.geglu(g, u), gelu * u, rtol=2e-3, atol=1e-4)
    assert np.array_equal(gelu_f16_table(np.array([12.0, -12.0], np.float32)), [12.0, 0.0])


def test_weighted_sum(rng):
    y = rng.normal(size=(3, 4, 8)).astype(np.float32)
    w = rng.random(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(b.weighted_sum(y, w), (y * w[..., None]).sum(axis=1), rtol=1e-5)
