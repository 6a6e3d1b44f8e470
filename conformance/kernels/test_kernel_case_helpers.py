"""The helpers of kernels/cases.py that GPU-only checks lean on, checked where CI runs."""
from __future__ import annotations

import numpy as np

from conformance.harness.cases import ROPE_PAIR_ERROR, f16_steps, rope_cache_excess


def test_f16_steps_counts_float16_values_between():
    """The rope_store cache check's distance (conformance/kernels/test_kernels_model.py, on the GPU;
    checked here): neighbours are 1 apart across zero and across a binade, +0 and -0 are 0 apart."""
    f = np.float16
    a = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -6e-8, 1.0], f)
    b = np.array([-0.0, 0.0, np.nextafter(f(1.0), f(np.inf)), np.nextafter(f(-1.0), f(-np.inf)), np.nextafter(f(2.0), f(0)), 6e-8, 1.0], f)
    assert f16_steps(a, b).tolist() == [0, 0, 1, 1, 1, 2, 0]
    # a sign error or an F16 read as F32 would be far more than one step off
    assert f16_steps(np.array([1.0], f), np.array([-1.0], f))[0] > 1000


def _rope(x, angle, ulps, rng):
    """NEOX rope of x [T, H, D] in float32 with cos and sin each moved by up to `ulps` float32
    ulps (an implementation's sin/cos error), as F16: a rope_store cache."""
    half = x.shape[-1] // 2
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    if ulps:
        for v in (c, s):
            v += rng.integers(-ulps, ulps + 1, v.shape) * np.spacing(v)
    a, b = x[..., :half], x[..., half:]
    out = np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    return out.astype(np.float32).astype(np.float16)


def test_rope_cache_bound_takes_sin_cos_error_and_catches_wrong_rotation():
    """The rope_store cache check (test_kernels_model.py, on the GPU). An implementation whose
    sin and cos are 2 ulp off passes it, though an element whose pair cancels can be several of
    its own F16 steps off; a wrong angle or a swapped pair fails it."""
    rng = np.random.default_rng()
    T, H, D = 64, 8, 128
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.arange(T, dtype=np.float32)[:, None, None]
    angle = (pos * np.float32(10000.0) ** (-np.arange(D // 2, dtype=np.float32) * 2 / D)).astype(np.float32)
    want = _rope(x, angle, 0, rng)
    got = _rope(x, angle, 2, rng)
    assert rope_cache_excess(got, want) <= 1
    assert rope_cache_excess(_rope(x, angle + np.float32(1e-3), 0, rng), want) > 1
    assert rope_cache_excess(np.concatenate([want[..., D // 2:], want[..., :D // 2]], -1), want) > 1


def test_rope_cache_bound_is_absolute_in_the_heads_size():
    """A cancelled element (1e-4 in a head whose largest is 1) may be off by the rope's float32
    error, 4 of its own F16 steps; the head's largest element may not be 2 steps off."""
    f = np.float16
    want = np.zeros((1, 1, 4), f)
    want[0, 0, :2] = [1.0, 1e-4]
    got = want.copy()
    got[0, 0, 1] = f(float(want[0, 0, 1]) + 2.0 ** -22)        # the rope's error at this head
    assert f16_steps(got, want).max() >= 3
    assert rope_cache_excess(got, want) <= 1
    big = want.copy()
    big[0, 0, 0] = f(1.0 + 2 * 2.0 ** -10)                       # 2 steps at the head's largest
    assert rope_cache_excess(big, want) > 1
    assert 2.0 ** -22 < ROPE_PAIR_ERROR                          # the case above is inside the bound
    # a NaN where the reference holds a value is a fault; equal NaN (a poisoned, unwritten slot) is not
    nan = got.copy()
    nan[0, 0, 2] = np.nan
    assert rope_cache_excess(nan, want) == np.inf
    assert rope_cache_excess(nan, nan) <= 1
