"""Issue 47's bar scripts (ci/chat_ttft.py, ci/shared_prefix_load.py, ci/paged_memory.py),
without a real server: texts and prompts of an exact token length, the counts read from either
server's reply (OpenAI's usage, llama-server's timings), the chat's turns against a fake server
that answers as llama-server does, the --compare tables' ratios and verdicts, and one-line
errors for bad arguments. Against real servers they run on the GPU runner (ci/gpu.sh paged);
its shell side is checked here with stand-ins: ci/gpu_lib.sh's `served` (a server started, its
/health awaited, the client run, the server stopped) behind paged_serve and llama_serve, and
what ci/gpu_paged.sh's memory part says when a pass is skipped."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))

from chat_ttft import WORDS, Vocab, counts  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def vocab(rng: random.Random) -> Vocab:
    # words of one to four tokens, as a byte-level vocabulary makes them
    return Vocab({w: [rng.randrange(1000) for _ in range(1 + i % 4)] for i, w in enumerate(WORDS)}, measured=True)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 200, 2000])
def test_lengths_in_tokens(n):
    v = vocab(random.Random(n))
    words = v.words(random.Random(0), n)
    assert sum(len(v.ids[w]) for w in words) == n     # WORDS has one-token words: always exact
    assert v.text(random.Random(0), n) == " ".join(words)
    ids = v.token_ids(random.Random(1), n)
    assert len(ids) == n
    assert v.token_ids(random.Random(1), n) == ids          # a seed gives the same prompt again
    if n >= 17:
        assert v.token_ids(random.Random(2), n) != ids      # and another seed another prompt


def test_counts_from_either_server():
    openai = {"prompt_tokens": 120, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 96}}
    assert counts(openai, None) == {"prompt_tokens": 120, "cached_tokens": 96, "completion_tokens": 8}
    # llama-server's last chunk: prompt_n tokens read, cache_n reused from the slot
    timings = {"cache_n": 80, "prompt_n": 40, "predicted_n": 16}
    assert counts(None, timings) == {"prompt_tokens": 120, "cached_tokens": 80, "completion_tokens": 16}
    assert counts({"prompt_tokens": 120, "completion_tokens": 16}, timings)["cached_tokens"] == 80
    assert counts(None, None) == {"prompt_tokens": None, "cached_tokens": None, "completion_tokens": None}


def load_run(tmp_path, label, tps, p50, **more):
    p = tmp_path / f"{label}.json"
    p.write_text(json.dumps({"label": label, "clients": 16, "completed": 32, "failed": 0, "tokens_per_s": tps,
                             "ttft_p50_s": p50, "ttft_p99_s": 2 * p50, "prompt_tokens": 67000,
                             "cached_tokens": 60000, **more}))
    return str(p)


def table_rows(out: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in out.splitlines() if ln.startswith("|")]
    return {r[0]: r[1:] for r in rows[2:]}


def test_load_compare(tmp_path):
    llama = load_run(tmp_path, "llama-server", 1000.0, 0.400)
    met = load_run(tmp_path, "brass-cached", 1600.0, 0.160)
    r = run("ci/shared_prefix_load.py", "--compare", met, llama)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert rows["brass-cached"][-2:] == ["1.60 met", "0.40 met"], r.stdout
    assert rows["llama-server"][-2:] == ["(baseline)", "(baseline)"]
    # 1.4x the tokens, and a TTFT of 0.6x: both bars missed; the first run decides the status
    missed = load_run(tmp_path, "brass-slow", 1400.0, 0.240)
    r = run("ci/shared_prefix_load.py", "--compare", missed, met, llama)
    assert r.returncode == 1, r.stdout
    assert table_rows(r.stdout)["brass-slow"][-2:] == ["1.40 NOT met", "0.60 NOT met"], r.stdout
    r = run("ci/shared_prefix_load.py", "--compare", met)
    assert r.returncode == 2 and r.stderr.strip() == "--compare: no run labelled 'llama-server' among brass-cached"


def test_chat_compare(tmp_path):
    def write(label, ttfts, cached):
        turns = [{"turn": i + 1, "ttft_s": t, "prompt_tokens": 200 * (i + 1), "cached_tokens": c}
                 for i, (t, c) in enumerate(zip(ttfts, cached))]
        p = tmp_path / f"{label}.json"
        ratio = ttfts[-1] / ttfts[0]
        p.write_text(json.dumps({"label": label, "turns": turns, "ratio": ratio, "bar": 1.3, "pass": ratio <= 1.3}))
        return str(p)
    r = run("ci/chat_ttft.py", "--compare", write("brass-cached", [0.020, 0.022], [0, 190]),
            write("llama-server", [0.030, 0.045], [0, 180]))
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout)
    assert rows["2"] == ["22.0 (190/400)", "45.0 (180/400)"], r.stdout
    assert rows["last / first"] == ["1.10 (bar <= 1.3: PASS)", "1.50 (bar <= 1.3: FAIL)"], r.stdout


@pytest.mark.parametrize("args, message", [
    (["ci/chat_ttft.py"], "--url is required (or --compare JSON...)"),
    (["ci/chat_ttft.py", "--url", "http://127.0.0.1:9/v1", "--turns", "1"], "--turns must be at least 2"),
    (["ci/shared_prefix_load.py", "--url", "http://127.0.0.1:9/v1", "--clients", "0"], "every count must be"),
    (["ci/paged_memory.py", "--url", "http://127.0.0.1:9/v1", "--sequences", "0"], "--sequences, --prompt-tokens"),
    (["ci/paged_memory.py", "--url", "http://127.0.0.1:9/v1", "--model-file", "/nonexistent.gguf"],
     "--model-file /nonexistent.gguf: no such file"),
])
def test_argument_errors(args, message):
    r = run(*args)
    assert r.returncode == 2 and message in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_no_server_is_one_line(tmp_path):
    # port 9 (discard) has no server: the script says so and stops
    r = run("ci/shared_prefix_load.py", "--url", "http://127.0.0.1:9/v1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


class FakeServer:
    """Just enough of an OpenAI server for the scripts' loops, answering as llama-server does
    (counts in `timings` only, no usage): /tokenize with a word of n letters ceil(n / 2) tokens
    (a sum over whitespace-separated words, as a BPE pre-tokenizer makes it), /v1/completions
    streaming max_tokens chunks of "x" (or `generated`: a reply that ends sooner), cache_n the
    prompt's common prefix with the last one."""

    def __init__(self, generated: int | None = None):
        import http.server
        import threading
        fake = self
        self.last: list[int] = []
        self.generated = generated

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    return self.reply(json.dumps({"tokens": fake.tokens(body["content"])}).encode())
                ids = fake.tokens(body["prompt"])
                cache_n = next((i for i, (a, b) in enumerate(zip(ids, fake.last)) if a != b),
                               min(len(ids), len(fake.last)))
                fake.last = ids
                n = body["max_tokens"] if fake.generated is None else fake.generated
                chunks = [{"choices": [{"text": "x", "index": 0}]} for _ in range(n)]
                chunks.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                               "timings": {"cache_n": cache_n, "prompt_n": len(ids) - cache_n, "predicted_n": n}})
                self.reply(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n")

            def reply(self, data: bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def tokens(text: str) -> list[int]:
        return [hash(w) % 1000 for w in text.split() for _ in range(-(-len(w) // 2))]


@pytest.mark.parametrize("history", ["reply", "words"])
def test_chat_turns(tmp_path, history):
    import chat_ttft
    server = FakeServer()
    try:
        out = tmp_path / "chat.json"
        rc = chat_ttft.main(["--url", server.url, "--turns", "3", "--user-tokens", "30", "--max-tokens", "8",
                             "--warmup", "0", "--history", history, "--json", str(out)])
    finally:
        server.httpd.shutdown()
    turns = json.loads(out.read_text())["turns"]
    assert rc in (0, 1) and len(turns) == 3
    framing = len(FakeServer.tokens("User: Assistant:"))
    # each turn adds a user message of 30 tokens and the last reply: 8 tokens of words, or
    # its text "xxxxxxxx" (one word, 4 tokens here) read back
    reply = 8 if history == "words" else 4
    assert turns[0]["prompt_tokens"] == 30 + framing
    for a, b in zip(turns, turns[1:]):
        assert b["prompt_tokens"] - a["prompt_tokens"] == 30 + framing + reply, turns
    # cached and generated tokens as llama-server's timings give them (no usage)
    assert turns[0]["cached_tokens"] == 0 and all(0 < t["cached_tokens"] < t["prompt_tokens"] for t in turns[1:])
    assert all(t["completion_tokens"] == 8 for t in turns)


def test_chat_words_of_an_empty_reply(tmp_path):
    # A reply that ends at once (EOS first) reports 0 generated tokens: --history words adds
    # no words for it, not --max-tokens' worth
    import chat_ttft
    server = FakeServer(generated=0)
    try:
        out = tmp_path / "chat.json"
        chat_ttft.main(["--url", server.url, "--turns", "3", "--user-tokens", "30", "--max-tokens", "8",
                        "--warmup", "0", "--history", "words", "--json", str(out)])
    finally:
        server.httpd.shutdown()
    turns = json.loads(out.read_text())["turns"]
    framing = len(FakeServer.tokens("User: Assistant:"))
    assert [t["completion_tokens"] for t in turns] == [0, 0, 0]
    for a, b in zip(turns, turns[1:]):
        assert b["prompt_tokens"] - a["prompt_tokens"] == 30 + framing, turns


def test_memory_difference(tmp_path):
    def write(name, mib, src, blocks):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"pool_blocks": blocks, "device_mib": {"idle": [mib, src]},
                                 "model": {"kv_bytes_per_token": 147456}}))
        return str(p)
    # 16,128 blocks of 16 tokens at 147,456 B a token: 36,288 MiB apart
    big, small = write("big", 41288, "apps", 16384), write("small", 5000, "apps", 256)
    r = run("ci/paged_memory.py", "--difference", big, small)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("KV bytes a token, measured: (41,288 - 5,000 MiB) / ((16384 - 256) blocks x 16 tokens)"
                                " = 147,456 B (the layers' figure: 147,456 B; nvidia-smi counts whole MiB)")
    r = run("ci/paged_memory.py", "--difference", big, write("card", 5000, "card", 256))
    assert r.returncode == 2 and "not comparable" in r.stderr and "Traceback" not in r.stderr


# ci/gpu_lib.sh's `served` (paged_serve and llama_serve under ci/gpu.sh paged) against a
# stand-in server: a static HTTP server whose files are /health and /metrics, that writes the
# arguments it was started with
FAKE_SERVER = """
import http.server, pathlib, sys
args = sys.argv[1:]
pathlib.Path(sys.argv[0]).with_name("args").write_text(" ".join(args))
port = int(args[args.index("--port") + 1])
d = str(pathlib.Path(sys.argv[0]).with_name("site"))
handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=d)
http.server.ThreadingHTTPServer(("127.0.0.1", port), handler).serve_forever()
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lib(tmp_path, script: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """`script` after sourcing ci/gpu_lib.sh as ci/gpu.sh does (out=tmp_path, the clock at 0);
    python3 is the stand-in server, $server (llama-server) too; $port a free port."""
    import shutil
    import time
    if shutil.which("bash") is None or shutil.which("curl") is None:
        pytest.skip("no bash or curl here: ci/gpu_lib.sh needs both")
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "health").write_text("ok\n")
    (tmp_path / "site" / "metrics").write_text('brass_kv_blocks{state="used"} 3\nbrass_other 1\n')
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    (tmp_path / "llama-server").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$@"\n')
    (tmp_path / "llama-server").chmod(0o755)
    head = (f'set -uo pipefail; . ci/gpu_lib.sh; out="{tmp_path}"; t0=$SECONDS; port={free_port()}; '
            f'server="{tmp_path}/llama-server"; python3() {{ exec "{sys.executable}" "{fake}" "$@"; }}; ')
    start = time.monotonic()
    r = subprocess.run(["bash", "-c", head + script], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - start


def test_served_runs_the_client_once_the_server_answers(tmp_path):
    r, _ = lib(tmp_path, 'echo "$port"; after() { echo "after $1"; }; '
                         'served "fake" "$out/fake.log" "$port" 60 after python3 --port "$port" '
                         '-- bash -c "echo client ran; exit 3"; echo "rc=$?"; '
                         'curl -sf "http://127.0.0.1:$port/health" > /dev/null && echo "still up" || echo "stopped"')
    port, *lines = r.stdout.splitlines()
    assert lines[0].startswith("fake ready at t=") and lines[1] == "+ bash -c echo client ran; exit 3", r.stdout
    # the client's status, the hook after it with the port, the server stopped
    assert lines[2:] == ["client ran", f"after {port}", "rc=3", "stopped"], r.stdout + r.stderr


def test_served_gives_up_once_the_server_exits(tmp_path):
    # a server that dies at start (a bad option) is reported at once, not after the wait for
    # /health runs out (60 s here: the test's 30 s timeout would end it first)
    r, took = lib(tmp_path, 'served "fake" "$out/fake.log" "$port" 60 "" bash -c "echo bad option; exit 1" '
                            '-- echo client ran; echo "rc=$?"', timeout=30)
    assert "fake did not start by t=" in r.stdout and "bad option" in r.stdout, r.stdout + r.stderr
    assert "client ran" not in r.stdout and r.stdout.splitlines()[-1] == "rc=1"
    assert took < 20, took


def test_served_starts_nothing_without_time(tmp_path):
    r, _ = lib(tmp_path, 't0=$((SECONDS - 580)); served "fake" "$out/fake.log" "$port" 590 "" python3 --port "$port" '
                         '-- echo client ran; echo "rc=$?"')
    assert r.stdout.splitlines()[0].startswith("fake skipped at t=58"), r.stdout
    assert r.stdout.splitlines()[-1] == "rc=124" and not (tmp_path / "fake.log").exists()
    r, _ = lib(tmp_path, 'served "fake" "$out/fake.log" "$port" 60 "" python3 --port "$port"; echo "rc=$?"')
    assert r.stdout.splitlines() == ["served: no -- between the server's command and the client's", "rc=2"]


def test_paged_and_llama_serve_commands(tmp_path):
    r, _ = lib(tmp_path, 'serve_args="--kv-blocks 8"; paged_serve uncached m.gguf 4 "$port" stem 60 true; '
                         'echo "brass: $(cat "$out/args")"; '
                         'llama_serve m.gguf "$port" stem 60 "--parallel 2 -c 64" true; echo "llama: $(cat "$out/args")"')
    port = r.stdout.split("--port ")[1].split()[0]
    out = r.stdout.splitlines()
    assert out[0].startswith("brass serve (uncached, --parallel 4 --no-prefix-cache --kv-blocks 8) ready at t="), out
    # after the client, brass's block counts from /metrics
    assert out[1:4] == ["+ true", 'brass_kv_blocks{state="used"} 3',
                        f"brass: -m brass serve m.gguf --backend cuda --parallel 4 --port {port} --no-prefix-cache "
                        "--kv-blocks 8"], out
    assert out[4].startswith("llama-server (-ngl 99 -fa on --parallel 2 -c 64) ready at t="), out
    assert out[5:] == ["+ true", f"llama: -m m.gguf -ngl 99 -fa on --parallel 2 -c 64 --port {port}"], out
    assert (tmp_path / "stem-serve-uncached.log").exists() and (tmp_path / "stem-llama-server.log").exists()


@pytest.mark.parametrize("big, big_ends_at, lines", [
    # the big pass (until t = 450) wrote nothing: nothing to take the small pool's memory from
    (False, None, ["the 1/64-pool pass skipped: the big pass wrote no {out}/paged-memory.json",
                   "no --difference (the KV bytes a token, measured) at t=0 s: no {out}/paged-memory.json"]),
    # it ended late: under 60 s left, the small pass is skipped and says so
    (True, 545, ["the 1/64-pool pass skipped at t=545 s: under 60 s left of the call",
                 "no --difference (the KV bytes a token, measured) at t=545 s: no {out}/paged-memory-small.json"]),
    (True, 100, ["brass serve (small pass) until 590", "difference {out}/paged-memory.json {out}/paged-memory-small.json"]),
])
def test_paged_memory_says_what_it_skipped(tmp_path, big, big_ends_at, lines):
    # ci/gpu_paged.sh's memory part with paged_serve and python3 stood in for (the passes'
    # servers and clients run on the GPU runner): the big pass's deadline, then what follows
    # each of its outcomes
    (tmp_path / "m.gguf").write_bytes(b"")
    stand_in = f'''
        paged_serve() {{
            if [ "$5" = paged-memory ]; then
                echo "big pass until $6"
                {'echo {} > "$out/paged-memory.json"' if big else ':'}
                {f't0=$((SECONDS - {big_ends_at}))' if big_ends_at else ':'}
            else
                echo "brass serve (small pass) until $6" > "$out/paged-memory-small.txt"; echo {{}} > "$out/paged-memory-small.json"
            fi
        }}
        python3() {{ [ "$2" = --difference ] && echo "difference $3 $4"; }}
        nvidia-smi() {{ return 1; }}
    '''
    r, _ = lib(tmp_path, f'. ci/gpu_paged.sh; dir="{tmp_path}"; {stand_in}\nSHAPE_LOAD=m sub_paged memory')
    out = [ln for ln in r.stdout.splitlines() if not ln.startswith("==")]
    assert out and out[0] == "big pass until 450", r.stdout + r.stderr
    assert out[1:] == [ln.format(out=tmp_path) for ln in lines], r.stdout + r.stderr
