"""lm-eval (EleutherAI's harness, `local-completions`) against `brass serve` and against llama.cpp's
own `llama-server` (ci/build_llama_server.py builds it; BRASS_TEST_LLAMA_SERVER names another
binary) on the same GGUF, SmolLM2-135M, with a small local task file (conformance/data/lm_eval/:
brass_mc, multiple choice by loglikelihood; brass_gen, generate until; no hub download).

llama-server has no `echo`, which lm-eval's loglikelihood requests ask for: a proxy in front of
it (conformance/harness/echo_adapter.py) answers them from llama-server's own logprobs, one prompt
position at a time. Both servers take text prompts (`tokenized_requests=False`); lm-eval's remote
tokenizer (which counts the context's tokens) reads /tokenize, /detokenize and /tokenizer_info in
vLLM's form, which llama-server's differ from: the proxy lends it brass serve's (the same GGUF's
tokenizer, which brass conform's tokenize check holds to llama.cpp's ids).

The reference for each loglikelihood is llama.cpp itself (brass.llamacpp: the library the goldens
were recorded with), teacher-forced over lm-eval's own tokenization of the pair. Bound per
continuation token: ARGMAX_EPS (0.75), the suite's bound on the numpy backend's logit gaps against
llama.cpp's CPU (twice the largest gap error at which its argmax differed, 0.345;
engine/conform.py): a token's logprob is its logit's gap to the log-sum-exp.

Runs only where lm-eval is installed (pip install -e '.[eval]'); slow (two servers, two lm-eval
runs), so CI runs it in its grading step (ci/grade_engines.sh), not in the README's command."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("lm_eval") is None:
    pytest.skip("lm-eval is not installed (pip install -e '.[eval]')", allow_module_level=True)
# Minutes of CPU (two servers, two lm_eval runs): CI's grading step (ci/grade_engines.sh) runs it,
# the README's test command does not, so that its time does not depend on what is installed.
if os.environ.get("BRASS_TEST_LM_EVAL") != "1":
    pytest.skip("lm-eval's run is the CI grading step's (ci/grade_engines.sh); BRASS_TEST_LM_EVAL=1 "
                "runs it here", allow_module_level=True)

from brass.conform import ARGMAX_EPS, STREAM_EPS  # noqa: E402
from conformance.harness.echo_adapter import EchoAdapter  # noqa: E402
from conformance.harness.engines import (  # noqa: E402
    ROOT, ServerFailed, brass_serve, built_llama_server, llama_cpp_server, llama_cpp_server_missing)

MODEL = "smollm2-135m"
TASKS = ROOT / "conformance" / "data" / "lm_eval"


def lm_eval(url: str, out: Path) -> dict:
    """Run lm-eval on both tasks; {task: [sample, ...]} by doc_id, plus "results"."""
    args = (f"base_url={url}/v1/completions,model={MODEL},tokenizer_backend=remote,"
            "tokenized_requests=False,num_concurrent=1,max_retries=1,timeout=1800")
    env = {**__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets")}
    r = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                        "--model_args", args, "--tasks", "brass_mc,brass_gen", "--include_path", str(TASKS),
                        "--log_samples", "--output_path", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {}
    for task in ("brass_mc", "brass_gen"):
        (f,) = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        got[task] = sorted(rows, key=lambda s: s["doc_id"])
    (f,) = sorted(out.rglob("results_*.json"))
    got["results"] = json.loads(f.read_text())["results"]
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    binary = Path(os.environ.get("BRASS_TEST_LLAMA_SERVER") or built_llama_server())
    why = llama_cpp_server_missing(binary)
    if why:
        pytest.skip(why)
    logs = tmp_path_factory.mktemp("lm_eval")
    try:
        brass = brass_serve(MODEL, logs, n_ctx=512)
    except ServerFailed as e:
        pytest.fail(str(e))
    try:
        llama = llama_cpp_server(MODEL, logs, binary, n_ctx=512)
    except ServerFailed as e:
        brass.stop()
        pytest.fail(str(e))
    lent = {p: brass.url for p in ("/tokenize", "/detokenize", "/tokenizer_info")}
    proxy = EchoAdapter(llama.url, routes=lent)
    try:
        yield {"brass": lm_eval(brass.url, logs / "brass"), "llama": lm_eval(proxy.url, logs / "llama")}
    finally:
        proxy.close()
        llama.stop()
        brass.stop()


def pair_ids(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a pair into tokens (its _encode_pair: the context's trailing spaces
    move to the continuation, the whole is encoded and cut at the context's length), with the
    remote tokenizer's encoding (no special tokens added, special text parsed)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    enc = lambda s: tok.encode(s, add_special=False, parse_special=True)  # noqa: E731
    whole, ctx = enc(context + continuation), enc(context)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def llama_cpp(real_model_path):
    """(llama.cpp's model, Brass's tokenizer of the same file: lm-eval's remote tokenizer)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python, the reference's library, is not installed "
                        "(pip install -e '.[record]')")
    from brass import llamacpp
    from brass.model import Model
    path = real_model_path(MODEL)
    return llamacpp.Model(path), Model(path, backend="numpy", n_ctx=64, quiet=True).tokenizer


@pytest.fixture(scope="module")
def llama_cpp_loglikelihoods(runs, llama_cpp):
    """llama.cpp's own loglikelihood of each (context, continuation) of brass_mc, teacher-forced
    in one decode, float64 log-softmax of its float32 logits: {(doc_id, choice): (value, n tokens)}."""
    m, tok = llama_cpp
    out = {}
    for s in runs["brass"]["brass_mc"]:
        for k, a in enumerate(s["arguments"].values()):
            ctx, cont = pair_ids(tok, a["arg_0"], a["arg_1"])
            with m.context() as c:
                logits = np.asarray(c.decode(ctx + cont, all_logits=True), dtype=np.float64)
            lp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - logits.max(1, keepdims=True)
            ids = ctx + cont
            out[(s["doc_id"], k)] = (float(sum(lp[j - 1, ids[j]] for j in range(len(ctx), len(ids)))), len(cont))
    return out


def loglikelihoods(samples) -> dict:
    return {(s["doc_id"], k): float(r[0]) for s in samples for k, r in enumerate(s["filtered_resps"])}


def accuracy(lls: dict, samples) -> float:
    return float(np.mean([max(range(len(s["doc"]["choices"])), key=lambda k: lls[(s["doc_id"], k)])
                          == s["doc"]["answer"] for s in samples]))


def test_the_tasks_are_decided(runs, llama_cpp, llama_cpp_loglikelihoods):
    """The task file asks only what the bounds decide: each brass_mc item's best choice leads
    the next by more than the bound of both (else two engines within it may rank them either
    way), and each brass_gen answer is llama.cpp's greedy continuation with every step's margin
    at least STREAM_EPS up to the stop (the suite compares streams only that far)."""
    for s in runs["brass"]["brass_mc"]:
        vals = sorted((llama_cpp_loglikelihoods[(s["doc_id"], k)] for k in range(len(s["doc"]["choices"]))),
                      key=lambda vn: -vn[0])
        (a, na), (b, nb) = vals[:2]
        assert a - b > ARGMAX_EPS * (na + nb), (s["doc"], vals)
    m, tok = llama_cpp
    for s in runs["brass"]["brass_gen"]:
        ids, text = m.tokenize(s["doc"]["question"], True, True), ""
        with m.context() as c:
            logits = np.asarray(c.decode(ids, all_logits=False)[0])
            while not any(stop in text for stop in ("\n", ".", ",")):
                top2 = np.sort(logits)[-2:]
                assert top2[1] - top2[0] >= STREAM_EPS, (s["doc"], text)
                t = int(np.argmax(logits))
                text += tok.decode([t])
                logits = np.asarray(c.decode([t], all_logits=False)[0])
        assert text.strip(" .,\n") == s["doc"]["answer"], (s["doc"], text)


def test_generate_until_is_the_same_on_both(runs):
    """brass_gen: both servers generate the same text for every question (greedy, no repeat
    penalty), so the exact-match scores are equal."""
    gen = {name: [s["filtered_resps"] for s in r["brass_gen"]] for name, r in runs.items()}
    assert gen["brass"] == gen["llama"]
    scores = {name: r["results"]["brass_gen"]["exact_match,none"] for name, r in runs.items()}
    assert scores["brass"] == scores["llama"], scores


def held_to_llama_cpp(run, reference, engine: str) -> dict:
    """The run's brass_mc loglikelihoods, after checking each against llama.cpp's own within
    ARGMAX_EPS per token."""
    got = loglikelihoods(run["brass_mc"])
    assert set(got) == set(reference)
    worst = max(abs(got[k] - v) / n for k, (v, n) in reference.items())
    print(f"worst |{engine} - llama.cpp| per token: {worst:.4f}")
    for k, (v, n) in reference.items():
        assert abs(got[k] - v) <= ARGMAX_EPS * n, (k, got[k], v)
    return got


def test_brass_loglikelihoods_are_llama_cpps(runs, llama_cpp_loglikelihoods):
    """brass_mc through brass serve: each sample's loglikelihood within ARGMAX_EPS per token of
    llama.cpp's own, and lm-eval's accuracy the accuracy llama.cpp's values give."""
    got = held_to_llama_cpp(runs["brass"], llama_cpp_loglikelihoods, "brass")
    ref = {k: v for k, (v, _) in llama_cpp_loglikelihoods.items()}
    acc = runs["brass"]["results"]["brass_mc"]["acc,none"]
    assert acc == accuracy(ref, runs["brass"]["brass_mc"]) == accuracy(got, runs["brass"]["brass_mc"])


def test_llama_server_loglikelihoods_are_llama_cpps(runs, llama_cpp_loglikelihoods):
    """brass_mc through llama-server: held to llama.cpp's own values as Brass is (llama-server is
    a later llama.cpp build than the library's, on the same settings)."""
    held_to_llama_cpp(runs["llama"], llama_cpp_loglikelihoods, "llama-server")


def test_accuracies_are_equal(runs):
    """lm-eval's accuracy on brass_mc is the same against both servers, and so is each sample's
    pick (the task is decided: test_the_tasks_are_decided)."""
    picks = {name: [int(np.argmax([float(r[0]) for r in s["filtered_resps"]])) for s in r["brass_mc"]]
             for name, r in runs.items()}
    assert picks["brass"] == picks["llama"]
    acc = {name: r["results"]["brass_mc"]["acc,none"] for name, r in runs.items()}
    print(f"brass_mc accuracy: {acc}")
    assert acc["brass"] == acc["llama"], acc
