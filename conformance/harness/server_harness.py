"""What the server tests share: a model whose forward pass is a stub (thousands of requests a
minute through everything else the server does), `brass serve`'s own uvicorn set-up run on a
thread of the test process, on loopback, around any App; and the live server that
test_server*.py drive (one `brass serve` process for the whole session, the fixture `server`),
with what a reply must be, computed from the engine itself.

A test module takes the fixtures by importing them: `from conformance.server_harness import
model, server  # noqa: F401`."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from brass.errors import BrassError
from brass.chat_template import ChatTemplate
from brass.sampling import Sampler, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
N_CTX = 256
API_KEY = "brass-test-key"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# A short system prompt keeps SmolLM2's 20-token default one out of every test prompt.
SYSTEM = {"role": "system", "content": "Be brief."}
WORDS = ("sea ship storm harbor light wind stone river bread garden winter morning candle "
         "mountain letter window silver forest music bridge lantern orchard meadow copper").split()


class StubForward:
    """A real model (tokenizer, chat template, vocabulary, the engine's own generation checks)
    without its forward pass: logits are random over 64 of the vocabulary's tokens, one of them
    an end-of-generation token, and each token is drawn by the real Sampler with the request's
    sampling parameters and history. Serves both ways a scheduler may drive a model:
    `generate()`, and sessions (`new_session()`: prefill / decode / pick, one sequence a step;
    `arch.BATCHED_DECODE` is false, so no batched step). `n_ctx` may be smaller than the
    model's and `eog_bias` raises the end-of-generation logit, to bound replies; `delay`
    seconds a token make requests last; `gate`, a threading.Event, holds every decode step
    until it is set (a request stays running, after its first token, for as long as a test
    needs: queue tests that must not depend on the machine's speed)."""

    arch = type("StubArch", (), {"BATCHED_DECODE": False})

    def __init__(self, model, n_ctx: int = 64, delay: float = 0.0, eog_bias: float = 0.0,
                 gate: threading.Event | None = None):
        self._model, self.n_ctx, self.delay, self.eog_bias = model, n_ctx, delay, eog_bias
        self.gate = gate
        eog = min(model.tokenizer.vocab.eog)
        self.ids = np.array([eog] + [i for i in range(200, 300) if i != eog][:63])
        self.n_vocab = model.config.n_vocab

    def __getattr__(self, name):
        return getattr(self._model, name)

    def new_session(self, n_ctx=None):
        return StubSession(self, n_ctx or self.n_ctx)

    def generate(self, prompt_ids, max_tokens, sampling, session=None):
        self._model.check_generation(prompt_ids, max_tokens, self.n_ctx)
        return self._tokens(list(prompt_ids), max_tokens, sampling)

    def _tokens(self, history, max_tokens, sampling):
        s, sampler = self.new_session(), Sampler(sampling)
        logits = s.prefill(history)
        for _ in range(max_tokens):
            tok = s.pick(logits, sampler, history)
            history.append(tok)
            yield tok
            if self._model.tokenizer.is_eog(tok):
                return
            logits = s.decode(tok)


class StubSession:
    def __init__(self, stub: StubForward, n_ctx: int):
        self.stub, self.n_ctx, self.n_past = stub, n_ctx, 0
        self.rng = np.random.default_rng(n_ctx)

    def _logits(self, n: int):
        if self.n_past + n > self.n_ctx:
            raise BrassError(f"{self.n_past + n} tokens exceed the context of {self.n_ctx}")
        self.n_past += n
        if self.stub.delay:
            time.sleep(self.stub.delay)
        logits = self.rng.standard_normal(len(self.stub.ids)).astype(np.float32) * 2
        logits[0] += self.stub.eog_bias
        return logits

    def reset(self):
        self.n_past = 0

    def prefill(self, ids, device_logits=False, **kw):
        return self._logits(len(ids))

    def decode(self, token):
        if self.stub.gate is not None:
            self.stub.gate.wait()
        return self._logits(1)

    def pick(self, logits, sampler, history) -> int:
        return int(self.stub.ids[sampler(logits, history)])

    def host_row(self, logits) -> np.ndarray:
        """The logits as a row of the vocabulary (for logprobs): the stub's 64 tokens have
        theirs, every other token -inf."""
        row = np.full(self.stub.n_vocab, -np.inf, np.float32)
        row[self.stub.ids] = logits
        return row


class ThreadedServer:
    """`brass serve`'s uvicorn (engine/http_api.uvicorn_server) on a thread, on a free loopback
    port, serving `app`; `stop()` ends it as Ctrl-C does."""

    def __init__(self, app, log_config=None):
        from brass import http_api
        self.app = app
        self.sock = http_api.listen("127.0.0.1", 0)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = http_api.uvicorn_server(app, log_config=log_config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        self.app.scheduler.close()


class ASGIClient:
    """Requests straight into an ASGI application, on an event loop of the calling thread: what
    a test client does, without the HTTP client library around it (the fuzz sends thousands)."""

    def __init__(self, app):
        self.app = app
        self.loop = asyncio.new_event_loop()

    def close(self):
        self.loop.close()

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """(status, headers as a dict of lower-case names, body bytes)."""
        return self.loop.run_until_complete(self._request(method, path, body, headers or {}))

    async def _request(self, method, path, body, headers):
        path, _, query = path.partition("?")
        raw = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query.encode(), "root_path": "", "headers": raw, "client": ("127.0.0.1", 1),
                 "server": ("testserver", 80)}
        answered = asyncio.Event()
        sent, status, out_headers, parts = False, None, {}, []

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                out_headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    answered.set()

        await self.app(scope, receive, send)
        answered.set()
        return status, out_headers, b"".join(parts)


# --------------------------------------------------------------------------------------------
# The live server: `brass serve` in a process of its own, and what its replies must be


def words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


class LiveServer:
    def __init__(self, proc, host: str, port: int, log: Path):
        self.proc, self.host, self.port, self.log = proc, host, port, log
        self.url = f"http://{host}:{port}"

    def request(self, method: str, path: str, body=None, key: str | None = API_KEY,
                headers: dict | None = None, timeout: float = 300):
        """(status, headers, parsed JSON or raw bytes) of one request on a fresh connection."""
        h = {"Authorization": f"Bearer {key}"} if key else {}
        h.update(headers or {})
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read()
            ctype = r.getheader("Content-Type", "")
            # r.headers: header names compare without case, as HTTP has them
            return r.status, r.headers, json.loads(data) if ctype.startswith("application/json") else data
        finally:
            conn.close()

    def health(self) -> dict:
        status, _, body = self.request("GET", "/health")
        assert status == 200, body
        return body

    def metrics(self) -> dict:
        status, headers, text = self.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4"), text
        return parse_prometheus(text.decode())

    def raw(self, data: bytes, timeout: float = 30) -> bytes:
        """Send bytes as they are; return the server's answer: up to the end of one response
        with a Content-Length, else everything until the server closes."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(data)
            got = b""
            while not response_complete(got):
                try:
                    b = s.recv(65536)
                except ConnectionResetError:
                    break
                if not b:
                    break
                got += b
            return got


PROM_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*",?)*\})? '
                         r'(-?[0-9.]+(?:e[+-]?[0-9]+)?|[+-]Inf|NaN)')


def parse_prometheus(text: str) -> dict:
    """Prometheus' text format (0.0.4), strictly: every metric has HELP and TYPE before its
    samples, each sample line parses, counters end in _total. {name or name{labels}: value}."""
    assert text.endswith("\n")
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert doc and name not in types, line
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge") and name not in types, line
            types[name] = kind
        else:
            m = PROM_SAMPLE.fullmatch(line)
            assert m, f"not a sample line: {line!r}"
            name = m.group(1)
            assert name in types and name.startswith("brass_"), line
            assert (types[name] == "counter") == name.endswith("_total"), line
            samples[name + (m.group(2) or "")] = float(m.group(3))
    return samples


def response_complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length: *([0-9]+)\r?$", head)
    return bool(sep) and m is not None and len(body) >= int(m.group(1))


@pytest.fixture(scope="session")
def server(real_model_path, tmp_path_factory):
    real_model_path(MODEL)  # fetched into the cache the server reads, or skipped visibly
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # No --host: the default bind address is under test.
    cmd = [sys.executable, "-m", "brass", "serve", MODEL, "--backend", "numpy", "--port", "0",
           "--ctx", str(N_CTX), "--api-key", API_KEY]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        text = log.read_text(errors="replace")
        m = re.search(r"at http://([0-9.]+):([0-9]+)/", text)
        if m:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"brass serve did not start:\n{text}")
        time.sleep(0.1)
    yield LiveServer(proc, m.group(1), int(m.group(2)), log)
    proc.terminate()
    proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    # Bad input must be answered with a 4xx, never by an internal error.
    assert "Traceback" not in text and not re.search(r'HTTP/1\.[01]" 5[0-9][0-9]', text), \
        f"the server logged an internal error:\n{text}"


@pytest.fixture(scope="session")
def model(shared_model):
    return shared_model(MODEL, "numpy", n_ctx=N_CTX)     # one for the session (conftest.py)


@pytest.fixture(scope="session")
def openai_client(server):
    # a test dependency (the `test` extra; CI installs it). The offline GPU runner lacks it.
    openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat_ids(model, messages) -> list[int]:
    prompt = ChatTemplate.from_gguf(model.gguf, model.tokenizer).render(messages)
    return model.tokenizer.encode(prompt, add_special=True, parse_special=True)


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """`text` up to the stop string that is complete first (the earliest end; of two ending
    together, the earlier start) and whether there was one."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def expected(model, ids, max_tokens, sampling=None, stop=()):
    """What the server must answer, from the engine directly: (text, completion tokens,
    finish_reason). Text is decoded in one piece here, not streamed as the server does."""
    sampling = sampling or SamplingParams(temperature=0.0)
    tok = model.tokenizer
    tokens = list(model.generate(ids, max_tokens=max_tokens, sampling=sampling))
    ends_eog = bool(tokens) and tok.is_eog(tokens[-1])
    content = tokens[:-1] if ends_eog else tokens
    for n in range(1, len(content) + 1):
        text, hit = cut_at_stop(tok.decode(content[:n]), stop)
        if hit:
            return text, n, "stop"
    return tok.decode(content), len(tokens), "stop" if ends_eog else "length"


def read_sse(body: bytes) -> list:
    events = []
    for block in body.decode("utf-8").split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def big_prompt(n_words=400) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def serve_synth(*args, **popen) -> subprocess.Popen:
    synth = ROOT / "golden" / "models" / "synth-llama.gguf"
    return subprocess.Popen([sys.executable, "-m", "brass", "serve", str(synth), "--backend", "numpy",
                             *args], cwd=ROOT, stderr=subprocess.PIPE, text=True, **popen)
