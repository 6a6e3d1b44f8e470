"""The committed load generator (ci/load_test.py) and soak script (ci/soak.py) against `brass
serve` on the CPU: smoke bounds, not speed bars. SmolLM2 on numpy with --parallel 4: 4
concurrent streaming clients all complete; a short soak with clients dropping their streams
mid-way and 100 idle connections held open fails no request and /health still answers within
a second. On the GPU runner the same scripts drive brass serve and llama-server side by side
for longer (issue 11)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
CLIENTS, MAX_TOKENS = 4, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(real_model_path, tmp_path_factory):
    pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")
    real_model_path(MODEL)
    port = _free_port()
    log = tmp_path_factory.mktemp("load") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "brass", "serve", MODEL, "--backend", "numpy",
                                 "--port", str(port), "--parallel", str(CLIENTS)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"brass serve did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/v1", proc.pid
    proc.terminate()
    proc.wait(timeout=30)


def test_load_generator_against_brass_serve(url, tmp_path):
    import json
    url, _ = url
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "ci/load_test.py", "--url", url, "--clients", str(CLIENTS),
                        "--requests", "2", "--max-tokens", str(MAX_TOKENS), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 2 * CLIENTS and res["failed"] == 0, res
    # each request ends at max_tokens or at the end-of-generation token
    assert 2 * CLIENTS <= res["generated_tokens"] <= 2 * CLIENTS * MAX_TOKENS, res
    assert res["tokens_per_s"] > 0 and 0 < res["ttft_p50_s"] <= res["ttft_p99_s"], res


def test_load_generator_names_a_missing_server():
    r = subprocess.run([sys.executable, "ci/load_test.py", "--url", f"http://127.0.0.1:{_free_port()}/v1",
                        "--timeout", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "load_test:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_soak_with_dropped_streams_and_idle_connections(url, tmp_path):
    import json
    url, pid = url
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "ci/soak.py", "--url", url[:-len("/v1")], "--clients", "4",
                        "--seconds", "6", "--disconnect", "0.5", "--idle", "100", "--pid", str(pid),
                        # short replies: the check is that dropped streams and idle connections
                        # break nothing, and every request still in flight at the end is waited for
                        "--max-tokens", "12",
                        "--sample", "1", "--warmup", "2", "--json", str(out),
                        # 6 s cannot judge flat memory: the first requests dequantize the weights
                        "--rss-growth-mb", "4096"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    res = json.loads(out.read_text()) if out.exists() else None
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert r.stdout.splitlines()[-1].startswith("soak: PASS: 4 streaming clients"), r.stdout[-2000:]
    assert res["failed"] == 0 and res["completed"] + res["dropped"] >= 4, res
    assert res["health_s_with_idle"] is not None and res["health_s_with_idle"] <= 1.0, res
    assert res["rss_mb_last"] and res["rss_mb_after_warmup"], res


def test_soak_says_when_ulimit_is_too_low_for_the_idle_connections(url):
    """1,000 idle connections need more open files than a limit of 256: the soak says so and
    how to raise it (exit 2), instead of failing half-way with EMFILE."""
    import resource
    url, pid = url

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    r = subprocess.run([sys.executable, "ci/soak.py", "--url", url[:-len("/v1")], "--idle", "1000",
                        "--seconds", "1", "--pid", str(pid)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, preexec_fn=low_limit)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "ulimit -n is 256" in r.stderr and "ulimit -n 1" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_soak_judges_gpu_memory_only_on_one_kind_of_reading():
    # ci/soak.py reads the server process's own GPU memory where nvidia-smi lists it, else the
    # whole device's: a growth from one kind to the other means nothing, so a run that mixed
    # them fails saying so, and one kind alone is judged against its limit
    import argparse
    from conformance.harness import soak_measures
    args = argparse.Namespace(health_limit=1.0, rss_growth_mb=16.0, gpu_growth_mb=64.0, pid=None, warmup=30.0)
    out = dict(failed=0, completed=5, dropped=1, clients=4, seconds=10, model="m", health_s_with_idle=0.01,
               idle_open_at_health=10, idle_connections=10, idle_open_at_end=10, health_after=True,
               health_s_during_median=0.01, health_s_during_max=0.02, rss_mb_first=None,
               rss_mb_after_warmup=None, rss_mb_max_after_warmup=None, rss_mb_last=None,
               gpu_mb_after_warmup=1000.0, gpu_mb_max_after_warmup=1010.0, gpu_mb_last=1010.0)
    for scope, grown, ok in ((["process"], 10.0, True), (["device"], 100.0, False),
                             (["device", "process"], 10.0, False)):
        ok_got, line = soak_measures.summary(dict(out, gpu_scope=scope, gpu_mb_last=1000.0 + grown), args)
        assert ok_got == ok, (scope, grown, line)
        assert ("cannot be judged" in line) == (len(scope) > 1), line


def test_soak_reads_the_servers_prompt_graph_bytes(url):
    """The graph_mb ci/soak.py samples (harness/soak_measures.py): brass serve's
    brass_prompt_graph_bytes summed (0 on the numpy backend, which captures no graphs); None
    from a server that reports none or is not there."""
    from conformance.harness.soak_measures import graph_mb
    base = url[0].removesuffix("/v1")
    assert graph_mb(base, 10) == 0.0
    assert graph_mb(f"http://127.0.0.1:{_free_port()}", 2) is None
