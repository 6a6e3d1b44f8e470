"""Issue 47's bar scripts (ci/chat_ttft.py, ci/shared_prefix_load.py, ci/paged_memory.py),
without a real server: texts and prompts of an exact token length, the counts read from either
server's reply (OpenAI's usage, llama-server's timings), the chat's turns against a fake server
that answers as llama-server does, the --compare tables' ratios and verdicts, and one-line
errors for bad arguments. Against real servers they run on the GPU runner (ci/gpu.sh paged)."""

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
