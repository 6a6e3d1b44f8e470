"""Sampling: each filter does what llama.cpp's sampler of the same name does, on random logits."""

import numpy as np
import pytest

from brass.errors import BrassError
from brass.sampling import Sampler, SamplingParams


def _draws(params, logits, n=400, history=()):
    s = Sampler(params)
    return [s(logits, list(history)) for _ in range(n)]


def test_greedy_is_argmax(rng):
    logits = rng.normal(size=1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits, []) == int(np.argmax(logits))


def test_seed_reproduces(rng):
    logits = rng.normal(size=500).astype(np.float32)
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = _draws(SamplingParams(seed=1234, **p), logits, 50)
    b = _draws(SamplingParams(seed=1234, **p), logits, 50)
    c = _draws(SamplingParams(seed=4321, **p), logits, 50)
    assert a == b and a != c


def test_top_k_keeps_only_k_best(rng):
    logits = rng.normal(size=300).astype(np.float32)
    best = set(np.argsort(-logits)[:5].tolist())
    got = set(_draws(SamplingParams(temperature=5.0, top_k=5, top_p=1.0, min_p=0.0, seed=1), logits))
    assert got <= best and len(got) == 5     # at temperature 5 all five appear in 400 draws


def test_top_p_keeps_smallest_nucleus(rng):
    logits = rng.normal(scale=3, size=200).astype(np.float32)
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    n_keep = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1
    got = set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=2), logits, 2000))
    assert got <= set(order[:n_keep].tolist())
    assert order[0] in got


def test_min_p_threshold(rng):
    logits = rng.normal(scale=2, size=200).astype(np.float32)
    probs = np.exp(logits - logits.max())
    allowed = set(np.nonzero(probs >= 0.2)[0].tolist())
    got = set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=3), logits, 1000))
    assert got <= allowed


def test_temperature_sharpens(rng):
    logits = rng.normal(size=50).astype(np.float32)
    top = int(np.argmax(logits))
    cold = _draws(SamplingParams(temperature=0.05, top_k=0, top_p=1.0, min_p=0.0, seed=4), logits, 200)
    hot = _draws(SamplingParams(temperature=3.0, top_k=0, top_p=1.0, min_p=0.0, seed=4), logits, 200)
    assert cold.count(top) > hot.count(top)


def test_repetition_penalty_demotes_recent_tokens():
    logits = np.array([5.0, 4.9, -1.0, -1.1], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    # token 0 was just generated: 5.0/1.5 < 4.9, so greedy now picks token 1
    assert Sampler(p)(logits, [0]) == 1
    # negative logits are multiplied (pushed further down), as llama.cpp does
    assert Sampler(p)(np.array([-1.0, -1.2], np.float32), [0]) == 1


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(top_k=-2), "top_k"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_parameters_are_user_errors(kw, msg):
    with pytest.raises(BrassError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1e300),
                                dict(temperature=1.0, repetition_penalty=5e-324),
                                dict(temperature=1.0, repetition_penalty=1e300),
                                dict(temperature=1e-30, repetition_penalty=1e-45, top_p=1.0, min_p=0.0)])
def test_extreme_parameters_still_draw_a_token(kw, rng):
    """Valid but extreme values (a server takes them from any client) must not make NaN
    probabilities: a vanishing temperature is the argmax, a vanishing penalty sends the
    repeated tokens with positive logits to +inf, which then share the draw."""
    logits = rng.normal(scale=5, size=500).astype(np.float32)
    history = [int(i) for i in rng.integers(0, 500, size=8)]
    draws = _draws(SamplingParams(seed=1, **kw), logits, 20, history)   # NaN probabilities raise here
    assert all(0 <= d < 500 for d in draws)
    if kw["temperature"] < 1e-20 and kw.get("repetition_penalty", 1.0) == 1.0:
        assert set(draws) == {int(np.argmax(logits))}
    if kw.get("repetition_penalty") == 5e-324:
        assert set(draws) <= {h for h in history if logits[h] > 0} or not any(logits[h] > 0 for h in history)
