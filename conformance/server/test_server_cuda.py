"""`brass serve --backend cuda` on the GPU runner: generation runs on the server's worker
thread, several requests interleaved token by token, each with its own KV cache on the device.
16 clients at once must each get exactly the tokens the engine gives in-process on CUDA, and a
client that hangs up must stop its generation. The model is the committed synthetic llama
(golden/models/synth-llama.gguf), so the runner needs no model download. ~11 s on an H200.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from brass.backends import cuda_available
from brass.chat_template import ChatTemplate
from brass.sampling import SamplingParams

pytestmark = [
    pytest.mark.skipif(not cuda_available(), reason="no CUDA device here: brass serve on CUDA is tested on "
                                                    "the GPU runner (ci/gpu.sh suite)"),
    pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
                       reason="FastAPI / uvicorn are not installed, so brass serve cannot run: carry their "
                              "wheels in .whl/ (the list is in ci/gpu.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "golden" / "models" / "synth-llama.gguf"
N_CTX = 512
WORDS = "sea ship storm harbor light wind stone river bread garden winter morning".split()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-cuda") / "serve.log"
    with open(log, "wb") as out:
        # prefix caching off: these tests hold each request to the tokens of a read of its own
        # prompt, bit for bit; a request reusing another's cached blocks reads the rest of its
        # prompt in other pieces (fewer rows: the mat-vec kernels, not the f16 GEMMs), equal to
        # a whole read only within a bound (test_prefix_cache.py holds both)
        proc = subprocess.Popen([sys.executable, "-m", "brass", "serve", str(MODEL), "--backend", "cuda",
                                 "--port", "0", "--ctx", str(N_CTX), "--no-prefix-cache"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"at http://([0-9.]+):([0-9]+)/", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"brass serve --backend cuda did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    yield m.group(1), int(m.group(2))
    proc.terminate()
    proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and not re.search(r'HTTP/1\.[01]" 5[0-9][0-9]', text), \
        f"the server logged an internal error:\n{text}"


@pytest.fixture(scope="module")
def model():
    from brass.model import Model
    return Model(MODEL, backend="cuda", n_ctx=N_CTX, quiet=True)


def post(addr, path, body) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*addr, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def health(addr) -> dict:
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def greedy(model, ids, max_tokens) -> tuple[str, str]:
    tok = model.tokenizer
    tokens = list(model.generate(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)))
    eog = bool(tokens) and tok.is_eog(tokens[-1])
    return tok.decode(tokens[:-1] if eog else tokens), "stop" if eog else "length"


def test_sixteen_concurrent_clients_on_cuda(server, model, rng):
    prompts = [" ".join(rng.choice(WORDS, size=4)) for _ in range(4)]
    template = ChatTemplate.from_gguf(model.gguf, model.tokenizer)
    encode = model.tokenizer.encode
    refs = {
        False: [greedy(model, encode(p, add_special=True, parse_special=True), 24) for p in prompts],
        True: [greedy(model, encode(template.render([{"role": "user", "content": p}]), add_special=True,
                                    parse_special=True), 24) for p in prompts],
    }

    def client(i):
        p, chat, stream = i % 4, i % 2 == 0, i % 3 == 0
        body = {"max_tokens": 24, "temperature": 0, "stream": stream}
        body.update({"messages": [{"role": "user", "content": prompts[p]}]} if chat else {"prompt": prompts[p]})
        status, data = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
        assert status == 200, data
        if stream:
            events = [json.loads(b[6:]) for b in data.decode().split("\n\n") if b.startswith("data: {")]
            events = [e for e in events if e["choices"]]
            piece = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
            got = "".join(piece(e["choices"][0]) for e in events), events[-1]["choices"][0]["finish_reason"]
        else:
            c = json.loads(data)["choices"][0]
            got = c["message"]["content"] if chat else c["text"], c["finish_reason"]
        return got == refs[chat][p], (i, got, refs[chat][p])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(16)))
    assert all(ok for ok, _ in results), [r for ok, r in results if not ok]


def test_client_disconnect_stops_generation_on_cuda(server, rng):
    before = health(server)["tokens_generated"]
    body = json.dumps({"prompt": " ".join(rng.choice(WORDS, size=3)), "max_tokens": 400,
                       "temperature": 0.8, "seed": int(rng.integers(2**31)), "stream": True}).encode()
    with socket.create_connection(server, timeout=120) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while b'"text": "' not in seen:
            seen += s.recv(4096)
    deadline = time.monotonic() + 10
    while health(server)["requests_running"]:
        assert time.monotonic() < deadline, "generation still running after the client left"
        time.sleep(0.1)
    after = health(server)["tokens_generated"]
    time.sleep(1)
    assert health(server)["tokens_generated"] == after
    assert after - before < 200, "the abandoned request kept generating"
