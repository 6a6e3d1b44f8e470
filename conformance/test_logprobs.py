"""Logprobs as OpenAI defines them (issue 46): `brass score --logprobs`, the reference; and
`brass serve`'s echo, generated tokens' logprobs, batched prompts and /tokenize.

The served model is the synthetic synth-llama (golden/models/) on the numpy backend, served
in this process by `brass serve`'s own uvicorn (conformance/server_harness.ThreadedServer):
fast, and the engine's own code path from the HTTP request to the logits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conformance import goldens

SYNTH = "synth-llama"
# float32 log-softmax against a float64 one of the same logits: a few ulps of values of
# magnitude ~10 (float32's eps is 1.2e-7; exp/log/sum of a vocabulary add a few more).
F32_LOGSOFTMAX_TOL = 1e-5


def brass(*args):
    return subprocess.run([sys.executable, "-m", "brass", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def synth_path() -> str:
    return str(goldens.model(SYNTH).path())


def score_logprobs(ids, top_k=5) -> dict:
    r = brass("score", synth_path(), "--tokens", json.dumps(ids), "--top-k", top_k,
              "--backend", "numpy", "--logprobs", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def synth_model():
    from brass.model import Model
    return Model(synth_path(), backend="numpy", n_ctx=256, quiet=True)


IDS = [1, 15, 300, 42, 7, 99, 512, 3, 64]


def test_score_logprobs_is_the_log_softmax_of_score(synth_model):
    """--logprobs: per position the log-softmax of the teacher-forced logits (float32), the
    given next token's logprob aligned as OpenAI's echo has it (first null), and the top-k."""
    out = score_logprobs(IDS, top_k=5)
    logits = synth_model.score(IDS).astype(np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    assert out["tokens"] == IDS
    assert out["token_logprobs"][0] is None and len(out["token_logprobs"]) == len(IDS)
    got = np.array(out["token_logprobs"][1:])
    want = np.array([ref[t, IDS[t + 1]] for t in range(len(IDS) - 1)])
    np.testing.assert_allclose(got, want, rtol=0, atol=F32_LOGSOFTMAX_TOL)
    assert len(out["top_logprobs"]) == len(IDS)
    for t, row in enumerate(out["top_logprobs"]):
        ids = [i for i, _ in row]
        assert ids == list(np.argsort(-ref[t], kind="stable")[:5])
        np.testing.assert_allclose([v for _, v in row], ref[t, ids], rtol=0, atol=F32_LOGSOFTMAX_TOL)
        assert all(v <= 0 for _, v in row)


def test_score_logprobs_text():
    """The table: per position, the next token's logprob (the JSON's, to 6 places), "-" last."""
    ids = [1, 15, 42]       # tokens whose text has no space, so the columns split on spaces
    r = brass("score", synth_path(), "--tokens", json.dumps(ids), "--top-k", 2,
              "--backend", "numpy", "--logprobs")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("# position, token (id, text), logprob of the next token")
    want = score_logprobs(ids, top_k=2)["token_logprobs"][1:] + [None]
    assert len(lines) == 1 + len(ids)
    for line, lp in zip(lines[1:], want):
        col = line.split()[3]
        assert col == ("-" if lp is None else f"{lp:.6f}"), line
