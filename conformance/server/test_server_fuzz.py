"""Property-based fuzz of `brass serve`'s request bodies (hypothesis): whatever a client sends to
/v1/chat/completions or /v1/completions, the answer is a 2xx or a 4xx (a 4xx in OpenAI's error
body), never a 5xx, and the server keeps serving.

Bodies are mostly well-formed requests with some fields wrong (a wrong JSON type, an edge
value: zero, negative, huge, infinite, empty, unpaired surrogates, unknown roles, stop strings
that match, ...), plus any JSON value, broken JSON and raw bytes; streaming and not, with and
without the API key. A 200 must be a well-formed completion (a stream: events ending in [DONE],
no error event).

Two runs, bounded and on loopback only:
- in process, 10,000 bodies: a minimal ASGI client (conformance/harness/server_harness.py; Starlette's
  TestClient costs twice as much a request) drives the whole application (body reading,
  JSON, the pydantic models, tokenizer and chat template, the scheduler thread, the real
  sampler with the request's parameters, the stop-string scanner, server-sent events) over
  SmolLM2's tokenizer and template with the forward pass replaced by a stub (a 64-token
  context bounds the replies): ~1 ms a request, hypothesis ~2 ms a body (~35 s on 2 busy cores);
- live: real sockets into uvicorn (h11, the server's own configuration, on a thread of this
  process): 1,000 bodies with the stub forward, and 12 with the real model's forward pass on
  numpy (`max_tokens` capped at 1: a prompt and a token cost ~0.5-2 s here).
"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")
pytest.importorskip("fastapi", reason="FastAPI is not installed (pip install -e .): brass serve cannot run")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conformance.harness.server_harness import ASGIClient, StubForward, ThreadedServer  # noqa: E402

MODEL = "smollm2-135m"
KEY = "fuzz-key"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
N_IN_PROCESS = int(os.environ.get("BRASS_TEST_FUZZ_BODIES", 10_000))
N_LIVE_STUB, N_LIVE_REAL = int(os.environ.get("BRASS_TEST_FUZZ_LIVE", 1000)), 12

# -- bodies ------------------------------------------------------------------------------------

# Text with what JSON can carry and UTF-8 cannot: lone surrogates (as \ud800 escapes).
plain = st.text(max_size=16)
text = plain | st.text(alphabet=st.characters(categories=["Cs", "Lu", "Zs"]), max_size=8)
json_scalar = (st.none() | st.booleans() | st.integers() | st.integers(-3, 300)
               | st.floats(allow_nan=True, allow_infinity=True) | text)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=4)

# Per field: values a careful client sends, and edge or wrong ones.
VALID = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 12), "max_completion_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "top_k": st.integers(0, 100),
    "seed": st.integers(-1, 2**40),
    "stop": st.lists(st.sampled_from(["\n", " ", "a", "e", "the", "."]) | st.text(min_size=1, max_size=4), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1), "logprobs": st.sampled_from([False, 0]), "tools": st.just([]),
    "response_format": st.just({"type": "text"}), "frequency_penalty": st.just(0), "user": plain,
}
number = st.floats(-1, 3) | st.sampled_from([0, 1, 1e-300, 1e300, 5e-324, 10**400, -0.0])
EDGE = {
    "model": st.sampled_from(["gpt-4o", "", MODEL.upper()]),
    "max_tokens": st.integers(-2, 70) | st.sampled_from([10**6, 2**80, 0]),
    "max_completion_tokens": st.integers(-1, 70),
    "temperature": number, "top_p": number, "min_p": number, "repetition_penalty": number,
    "top_k": st.integers(-2, 100) | st.sampled_from([10**30]),
    "seed": st.integers(-3, 2**70),
    "stop": text | st.lists(text, max_size=6),
    "stream": json_scalar, "stream_options": json_value,
    "n": st.sampled_from([2, 0]), "logprobs": st.sampled_from([True, 5]),
    "tools": st.just([{"type": "function"}]), "response_format": st.just({"type": "json_object"}),
    "frequency_penalty": st.sampled_from([0.5, -1]), "user": json_value,
}
good_part = st.fixed_dictionaries({"type": st.just("text"), "text": plain})
VALID_PROMPT = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": plain | st.lists(good_part, max_size=3)}),
                         min_size=1, max_size=3),
    "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
}
any_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]), "text": text})
EDGE_PROMPT = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool", "", "USER"]),
                                                "content": text | st.lists(any_part, max_size=3)}),
                         max_size=3) | st.lists(json_value, max_size=2),
    "prompt": text | st.lists(st.integers(-1, 49200), max_size=8) | st.lists(json_scalar, max_size=3),
}


@st.composite
def requests(draw, max_tokens_cap: int | None = None):
    """(path, headers, body bytes): mostly requests a careful client sends, some with a field or
    two wrong, some not requests at all."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    key = draw(st.sampled_from([KEY] * 30 + [None, "wrong"]))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return path, headers, draw(st.binary(max_size=64))
    if kind == 1:
        return path, headers, json.dumps(draw(json_value)).encode()
    careful = kind < 10             # half the bodies: no field wrong on purpose
    name = "messages" if path == CHAT else "prompt"
    how = draw(st.integers(0, 19))
    body = {}
    if careful or how < 17:
        body[name] = draw(VALID_PROMPT[name])
    elif how < 19:
        body[name] = draw(EDGE_PROMPT[name])
    for field in draw(st.lists(st.sampled_from(list(VALID)), max_size=6, unique=True)):
        how = draw(st.integers(0, 19))
        if careful or how < 15:
            body[field] = draw(VALID[field])
        elif how < 19:
            body[field] = draw(EDGE[field])
        else:
            body[field] = draw(json_value)
    if max_tokens_cap is not None:      # the live run: each token is a real forward pass
        body.pop("max_completion_tokens", None)
        mt = body.get("max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt > max_tokens_cap:
            body["max_tokens"] = max_tokens_cap
    data = json.dumps(body).encode()
    if draw(st.integers(0, 24)) == 0:   # broken: cut short
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    return path, headers, data


# -- what every answer must be -------------------------------------------------------------------


def check_answer(status: int, ctype: str, data: bytes, stream_asked: bool):
    assert 200 <= status < 300 or 400 <= status < 500, (status, data[:500])
    if status >= 400:
        err = json.loads(data)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["type"] in ("invalid_request_error", "authentication_error"), err
        return
    if ctype.startswith("text/event-stream"):
        blocks = [b for b in data.decode("utf-8").split("\n\n") if b]
        assert blocks and blocks[-1] == "data: [DONE]", blocks[-3:]
        events = [json.loads(b[len("data: "):]) for b in blocks[:-1]]
        assert not [e for e in events if "error" in e], events
        assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert not stream_asked
        out = json.loads(data)
        assert out["choices"][0]["finish_reason"] in ("stop", "length"), out
        assert out["usage"]["completion_tokens"] >= 1, out


def asked_stream(data: bytes) -> bool:
    try:
        return json.loads(data).get("stream") is True
    except Exception:
        return False


# -- in process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(shared_model):
    return shared_model(MODEL, "numpy", n_ctx=256)      # one for the session (conftest.py)


def test_fuzz_request_bodies_in_process(model, capfd):
    from brass.http_api import create_app
    from brass.server import App
    app = App(StubForward(model, n_ctx=64, eog_bias=3.0), MODEL, KEY, parallel=4, max_waiting=64)
    client = ASGIClient(create_app(app))
    auth = {"Authorization": f"Bearer {KEY}"}
    seen = {"n": 0, "2xx": 0, "4xx": 0}
    try:
        @settings(max_examples=N_IN_PROCESS, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def fuzz(req):
            path, headers, data = req
            status, answer_headers, answer = client.request("POST", path, data, headers)
            seen["n"] += 1
            seen[f"{status // 100}xx"] = seen.get(f"{status // 100}xx", 0) + 1
            check_answer(status, answer_headers.get("content-type", ""), answer, asked_stream(data))

        fuzz()
        # Still serving, nothing left running, and /metrics counted every answer.
        status, _, health = client.request("GET", "/health", headers=auth)
        health = json.loads(health)
        assert status == 200 and (health["requests_running"], health["requests_waiting"]) == (0, 0), health
        metrics = client.request("GET", "/metrics", headers=auth)[2].decode()
    finally:
        client.close()
        app.scheduler.close()
    log = capfd.readouterr().err
    five = re.search(r'brass_requests_total\{status="5xx"\} (\S+)', metrics)
    print(f"fuzz in process: {seen['n']} bodies: {seen['2xx']} answered 2xx, {seen['4xx']} 4xx, "
          f"{seen['n'] - seen['2xx'] - seen['4xx']} other; /metrics counts {five and five[1]} 5xx; "
          f"/health after: {health['requests_running']} running, {health['requests_waiting']} waiting")
    assert seen["n"] >= N_IN_PROCESS and seen["2xx"] > N_IN_PROCESS // 20 and seen["4xx"] > N_IN_PROCESS // 4, seen
    assert 'brass_requests_total{status="5xx"} 0' in metrics
    assert f'brass_requests_total{{status="2xx"}} {seen["2xx"] + 1}' in metrics     # + the /health
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


# -- live: real sockets, the real model ------------------------------------------------------------


def raw_post(host, port, path, headers, data, timeout=120) -> tuple[int, str, bytes]:
    head = f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Length: {len(data)}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    import http.client
    import io

    class _Sock:
        def makefile(self, *a, **k):
            return io.BytesIO(got)
    r = http.client.HTTPResponse(_Sock())
    r.begin()
    return r.status, r.getheader("Content-Type", ""), r.read()


@pytest.mark.parametrize("forward, n_bodies", [("stub", N_LIVE_STUB), ("real", N_LIVE_REAL)])
def test_fuzz_request_bodies_live(model, forward, n_bodies):
    """Real sockets into uvicorn: many bodies with the stub forward, a few with the real one."""
    from brass.server import App
    served = StubForward(model, n_ctx=64, eog_bias=3.0) if forward == "stub" else model
    server = ThreadedServer(App(served, MODEL, KEY, parallel=2, max_waiting=8))
    seen = []
    try:
        @settings(max_examples=n_bodies, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(requests(max_tokens_cap=1 if forward == "real" else None))
        def fuzz(req):
            path, headers, data = req
            status, ctype, body = raw_post(server.host, server.port, path, headers, data)
            seen.append(status)
            check_answer(status, ctype, body, asked_stream(data))

        fuzz()
        status, _, body = raw_post(server.host, server.port, COMPLETIONS, {"Authorization": f"Bearer {KEY}"},
                                   b'{"prompt": "The sea", "max_tokens": 1}')
        assert status == 200, body
    finally:
        server.stop()
    by_class = {f"{c}xx": sum(s // 100 == c for s in seen) for c in (2, 4, 5)}
    print(f"fuzz live ({forward} forward, uvicorn on loopback): {len(seen)} bodies: {by_class['2xx']} answered "
          f"2xx, {by_class['4xx']} 4xx, {by_class['5xx']} 5xx; a request after them: {status}")
    assert len(seen) >= n_bodies and seen.count(200) >= n_bodies // 10, sorted(set(seen))
