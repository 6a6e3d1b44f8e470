"""What the server tests share: a model whose forward pass is a stub (thousands of requests a
minute through everything else the server does), and `brass serve`'s own uvicorn set-up run on
a thread of the test process, on loopback, around any App."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from brass.errors import BrassError
from brass.sampling import Sampler


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
