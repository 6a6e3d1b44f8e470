"""`brass serve` and bad requests: every wrong body, header and connection gets a 4xx in
OpenAI's error body (snapshots: the messages are ours to define) and the server keeps serving;
fields Brass does not read are named in a header and a log line, and fields it does not
implement are refused where ignoring them would change the answer. Against the live server of
conformance/harness/server_harness.py, and (ignored and refused fields) in process over a stub forward.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="FastAPI is not installed, so brass serve cannot run (pip install -e .; "
                                      "on the GPU runner: the wheels in .whl/, listed in ci/gpu.sh)")
from conformance.harness.server_harness import (API_KEY, CHAT, COMPLETIONS, MODEL, big_prompt, expected,  # noqa: E402
                                        read_sse, words)


BAD_REQUESTS = {
    # name: (path, body: bytes | JSON object, status)
    "malformed_json": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}', 400),
    "trailing_garbage": (CHAT, b'{"messages": []} xyz', 400),
    "body_not_an_object": (CHAT, b'[1, 2, 3]', 400),
    "nan_literal": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400),
    "deeply_nested": (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    "non_utf8_bytes": (COMPLETIONS, b'{"prompt": "caf\xe9 \xff"}', 400),
    "unpaired_surrogate": (COMPLETIONS, b'{"prompt": "bad \\ud800 text", "max_tokens": 1}', 400),
    "messages_missing": (CHAT, {"max_tokens": 1}, 400),
    "messages_not_array": (CHAT, {"messages": "hello"}, 400),
    "messages_empty": (CHAT, {"messages": []}, 400),
    "message_not_object": (CHAT, {"messages": ["hello"]}, 400),
    "role_not_string": (CHAT, {"messages": [{"role": 1, "content": "hi"}]}, 400),
    "role_unknown": (CHAT, {"messages": [{"role": "tool", "content": "hi"}]}, 400),
    "content_number": (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400),
    "content_image_part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    "prompt_missing": (COMPLETIONS, {"max_tokens": 1}, 400),
    "prompt_object": (COMPLETIONS, {"prompt": {"text": "hi"}}, 400),
    "prompt_empty": (COMPLETIONS, {"prompt": ""}, 400),
    "prompt_token_out_of_range": (COMPLETIONS, {"prompt": [1, 2, 10**9]}, 400),
    "max_tokens_string": (COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, 400),
    "max_tokens_float": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, 400),
    "max_tokens_bool": (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, 400),
    "max_tokens_zero": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400),
    "max_tokens_negative": (COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, 400),
    "max_tokens_absurd": (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**12}, 400),
    "max_tokens_beyond_int64": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2**80}, 400),
    "prompt_longer_than_context": (COMPLETIONS, {"prompt": big_prompt(), "max_tokens": 1}, 400),
    "chat_longer_than_context": (CHAT, {"messages": [{"role": "user", "content": big_prompt()}]}, 400),
    "temperature_string": (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400),
    "temperature_negative": (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400),
    "top_p_zero": (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400),
    "top_p_above_one": (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400),
    "top_k_float": (COMPLETIONS, {"prompt": "hi", "top_k": 1.5}, 400),
    "top_k_negative": (COMPLETIONS, {"prompt": "hi", "top_k": -1}, 400),
    "min_p_above_one": (COMPLETIONS, {"prompt": "hi", "min_p": 2}, 400),
    "repetition_penalty_zero": (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400),
    "seed_string": (COMPLETIONS, {"prompt": "hi", "seed": "abc"}, 400),
    "seed_below_minus_one": (COMPLETIONS, {"prompt": "hi", "seed": -2}, 400),
    "stream_string": (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400),
    "stream_options_not_object": (COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "stream": True,
                                                "stream_options": 3}, 400),
    "stop_number": (COMPLETIONS, {"prompt": "hi", "stop": 5}, 400),
    "stop_too_many": (COMPLETIONS, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    "stop_empty_string": (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400),
    "n_two": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400),
    "logprobs": (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400),
    "tools": (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    "model_not_string": (CHAT, {"model": 7, "messages": [{"role": "user", "content": "hi"}]}, 400),
    "unknown_model": (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_gets_4xx(server, snapshot, name):
    path, body, status = BAD_REQUESTS[name]
    got, _, answer = server.request("POST", path, body)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer == snapshot
    assert server.health()["status"] == "ok"


def test_bad_requests_with_the_openai_client(openai_client):
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=10**9)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai_client.with_options(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)


HTTP_ERRORS = {
    # name: (raw request bytes, status)
    "body_over_size_limit": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                             b"Content-Length: 5000000\r\n\r\n{\"messages\": [" % API_KEY.encode(), 413),
    "no_content_length": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                          b"Connection: close\r\n\r\n" % API_KEY.encode(), 411),
    # A chunked body is read (and found to lack its messages).
    "chunked_body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" % API_KEY.encode(), 400),
    "bad_content_length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                           b"Content-Length: 1_0\r\n\r\n{}" % API_KEY.encode(), 400),
    "no_api_key": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 401),
    "wrong_api_key": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                      b"Content-Length: 2\r\n\r\n{}", 401),
    # The right key under another scheme than Bearer is refused.
    "basic_scheme_with_key": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic %s\r\n"
                              b"Connection: close\r\n\r\n" % API_KEY.encode(), 401),
    "key_without_scheme": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n"
                           b"Connection: close\r\n\r\n" % API_KEY.encode(), 401),
    "unknown_path": (b"GET /v2/everything HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    "wrong_method": (b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    "unknown_method": (b"BREW /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    "head_method": (b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    "garbage_request_line": (b"\x16\x03\x01 hello there\r\n\r\n", 400),
}


@pytest.mark.parametrize("name", HTTP_ERRORS)
def test_http_level_errors(server, snapshot, name):
    request, status = HTTP_ERRORS[name]
    answer = server.raw(request)
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n")[0].decode()
    assert status_line.split()[1] == str(status), answer[:500]
    if request.startswith(b"HEAD "):
        assert body == b"", "a response to HEAD has no body"
        error = {}
    else:
        error = json.loads(body)
        assert set(error["error"]) == {"message", "type", "param", "code"}
    assert {"status": status_line, **error} == snapshot
    assert server.health()["status"] == "ok"


def test_keep_alive_survives_errors(server):
    """On one connection: a good request, a 400 whose body was read, and a good one again."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    h = {"Authorization": f"Bearer {API_KEY}"}
    try:
        for body, status in ((None, 200), (b'{"prompt": 1}', 400), (None, 200)):
            if body is None:
                conn.request("GET", "/v1/models", headers=h)
            else:
                conn.request("POST", COMPLETIONS, body=body, headers=h)
            r = conn.getresponse()
            r.read()
            assert r.status == status
            assert r.getheader("Connection") != "close"
    finally:
        conn.close()


def test_chunked_request_bodies_on_a_kept_alive_connection(server, model, rng):
    """HTTP/1.1 as clients send it: a chunked body (no Content-Length), then a Content-Length
    one, then a chunked streaming request, all on one connection, each answered in full."""
    prompt = words(rng, 4)
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    text, n, reason = expected(model, ids, 3)
    body = json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]     # many small chunks
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    try:
        conn.request("POST", COMPLETIONS, body=iter(pieces), headers=h, encode_chunked=True)
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200, out
        assert (out["choices"][0]["text"], out["usage"]["completion_tokens"]) == (text, n)
        sock = conn.sock
        conn.request("POST", COMPLETIONS, body=body, headers=h)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == text
        stream = json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}).encode()
        conn.request("POST", COMPLETIONS, body=iter([stream[:5], stream[5:]]), headers=h, encode_chunked=True)
        r = conn.getresponse()
        events = read_sse(r.read())
        assert r.status == 200 and events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
        assert conn.sock is sock, "the connection was not kept alive"
    finally:
        conn.close()


def test_chunked_body_over_the_size_limit_gets_413(server):
    """A chunked body is counted as it arrives: past 1 MiB it is refused and the connection
    closed, without reading the rest."""
    big = b"x" * 65536
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" % API_KEY.encode())
    request += b"".join(b"%x\r\n%s\r\n" % (len(big), big) for _ in range(17))
    answer = server.raw(request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large", answer[:300]
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_fastapi_validation_errors_are_openai_400s(model):
    """FastAPI's own 422 (for a parameter it checks itself) is answered as ours are: a 400 in
    OpenAI's error body."""
    from conformance.harness.server_harness import ASGIClient, StubForward
    from brass.http_api import create_app
    from brass.server import App
    app = App(StubForward(model), MODEL, None, parallel=1, max_waiting=1)
    asgi = create_app(app)

    @asgi.app.get("/probe")
    async def probe(n: int):
        return {"n": n}

    client = ASGIClient(asgi)
    try:
        status, _, body = client.request("GET", "/probe?n=seven")
        assert status == 400, body
        err = json.loads(body)["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", "n")
    finally:
        client.close()
        app.scheduler.close()


def test_full_queue_over_http_gets_503_with_retry_after(model):
    """--parallel 1 --max-waiting 1 through uvicorn: one stream running, one waiting, the
    third request refused with 503, Retry-After and OpenAI's body; the waiting client hangs up
    and a new request takes its place; once every client has gone nothing runs. The running
    request is held after its first token by a gate on the stub's decode step, so it is still
    running whenever the test looks, however slow the machine."""
    from conformance.harness.server_harness import StubForward, ThreadedServer
    from brass.server import App
    gate = threading.Event()
    server = ThreadedServer(App(StubForward(model, n_ctx=256, eog_bias=-1e9, gate=gate), MODEL, None,
                                parallel=1, max_waiting=1))
    body = json.dumps({"prompt": "The sea", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)

    def health():
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def until(cond, what):
        deadline = time.monotonic() + 30
        while not cond(h := health()):
            assert time.monotonic() < deadline, f"{what}: {h}"
            time.sleep(0.02)

    def stream():
        s = socket.create_connection((server.host, server.port), timeout=30)
        s.sendall(head + body)
        streams.append(s)

    streams = []
    try:
        stream()
        until(lambda h: (h["requests_running"], h["requests_waiting"]) == (1, 0), "one running")
        stream()
        until(lambda h: (h["requests_running"], h["requests_waiting"]) == (1, 1), "one running, one waiting")
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", COMPLETIONS, body=body)
        r = conn.getresponse()
        err = json.loads(r.read())
        conn.close()
        assert r.status == 503 and int(r.getheader("Retry-After")) > 0, err
        assert (err["error"]["code"], err["error"]["type"]) == ("server_busy", "server_error")
        assert err["error"]["message"], err
        streams.pop().close()       # the waiting client leaves: its place is free
        until(lambda h: (h["requests_running"], h["requests_waiting"]) == (1, 0), "the waiting request dropped")
        stream()
        until(lambda h: (h["requests_running"], h["requests_waiting"]) == (1, 1), "a new request waiting")
        for s in streams:
            s.close()
        streams = []
        gate.set()                  # the running request's next step notices its client left
        until(lambda h: (h["requests_running"], h["requests_waiting"]) == (0, 0), "nothing left running")
    finally:
        gate.set()
        for s in streams:
            s.close()
        server.stop()


def test_silent_connection_is_closed_after_the_keep_alive_time(model, monkeypatch):
    """A connection that never sends a request is closed after the kept-alive time
    (uvicorn's clock starts only after a response: such connections were held for ever, each a
    file descriptor, a slowloris); one that sends its request in time is served."""
    from conformance.harness.server_harness import StubForward, ThreadedServer
    from brass import http_api
    from brass.server import App
    monkeypatch.setattr(http_api, "SOCKET_TIMEOUT", 1)
    server = ThreadedServer(App(StubForward(model), MODEL, None, parallel=1, max_waiting=1))
    try:
        silent = socket.create_connection((server.host, server.port), timeout=30)
        talker = socket.create_connection((server.host, server.port), timeout=30)
        start = time.monotonic()
        talker.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert talker.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert silent.recv(1) == b"", "the server sent something to a connection that asked nothing"
        assert 0.5 < time.monotonic() - start < 20
        silent.close()
        talker.close()
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# Fields Brass does not read, and fields it does not implement (in process, over a stub forward)


@pytest.fixture
def asgi(model):
    """(client, App): the whole application in process, over SmolLM2's tokenizer and a stub
    forward pass."""
    from brass.http_api import create_app
    from brass.server import App
    from conformance.harness.server_harness import ASGIClient, StubForward
    app = App(StubForward(model), MODEL, None, parallel=1, max_waiting=4)
    client = ASGIClient(create_app(app))
    yield client, app
    client.close()
    app.scheduler.close()


def post(client, path, body: dict):
    status, headers, data = client.request("POST", path, json.dumps(body).encode(),
                                           {"Content-Type": "application/json"})
    return status, headers, data


IGNORED = "x-brass-ignored-fields"


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_unknown_fields_are_named_in_a_header_and_the_log(asgi, caplog, stream):
    """`max_token` for `max_tokens` would go unnoticed: the reply names every field Brass did
    not read (unknown, or known and harmless such as `user`), and the log says so once."""
    client, app = asgi
    body = {"prompt": "The sea", "max_token": 5, "max_tokens": 2, "user": "u-1", "cache_prompt": True,
            "temperature": 0, "stream": stream}
    with caplog.at_level(logging.WARNING, logger="brass.server"):
        status, headers, data = post(client, COMPLETIONS, body)
        assert status == 200, data
        assert headers[IGNORED] == "max_token, user, cache_prompt"
        warned = [r.getMessage() for r in caplog.records if r.name == "brass.server"]
        assert len(warned) == 1 and "max_token" in warned[0] and "cache_prompt" in warned[0], warned
        # once per field name: the same fields again are named in the header, not logged again
        status, headers, _ = post(client, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1, "user": "u-1"})
        assert status == 200 and headers[IGNORED] == "user"
        assert len([r for r in caplog.records if r.name == "brass.server"]) == 1


def test_a_request_reading_every_field_has_no_ignored_header(asgi):
    client, _ = asgi
    status, headers, data = post(client, COMPLETIONS, {"prompt": "The sea", "max_tokens": 1, "seed": 3})
    assert status == 200, data
    assert IGNORED not in headers


def test_an_error_names_the_ignored_fields_too(asgi):
    """A 400 for another reason still says which fields were not read: the typo may be why."""
    client, _ = asgi
    status, headers, data = post(client, COMPLETIONS, {"prompt": "", "max_token": 5})
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    assert headers[IGNORED] == "max_token"


def test_ignored_field_names_cannot_break_the_header(asgi):
    """A field name is any JSON string: newlines, non-Latin-1 text, lone surrogates and many
    names become a header of printable ASCII, percent-encoded, at most 16 names."""
    client, _ = asgi
    body = {"prompt": "The sea", "max_tokens": 1, "a\r\nX-Evil: 1": 1, "café": 2, "\ud800": 3, "": 4}
    body.update({f"f{i}": i for i in range(20)})
    data = json.dumps(body).encode()        # \ud800 travels as JSON's escape, as a client sends it
    status, headers, out = client.request("POST", COMPLETIONS, data, {"Content-Type": "application/json"})
    assert status == 200, out
    value = headers[IGNORED]
    assert value.isascii() and value.isprintable() and "x-evil" not in headers
    names = value.split(", ")
    assert names[:4] == ["a%0D%0AX-Evil%3A%201", "caf%C3%A9", "%5Cud800", '""']
    assert names[4:16] == [f"f{i}" for i in range(12)] and names[16] == "and 8 more"


REFUSED = {
    # field: (a value that changes the answer: 400, the value that disables it: accepted)
    "logit_bias": ({"1": 5}, {}),
    "n": (2, 1),
    "presence_penalty": (0.5, 0),
    "frequency_penalty": (0.5, 0),
    "typical_p": (0.5, 1),
    "mirostat": (2, 0),
    "ignore_eos": (True, False),
    "n_predict": (5, -1),
    "repeat_penalty": (1.3, 1),
    "min_keep": (3, 0),
    "grammar": ("root ::= \"a\"", ""),
    "t_max_predict_ms": (100, 0),
    "xtc_probability": (0.5, 0),
    "dry_multiplier": (0.8, 0),
}


@pytest.mark.parametrize("field", REFUSED)
def test_unimplemented_fields_that_change_the_answer_are_refused(asgi, field):
    """A sampling or stopping parameter Brass does not implement: a 400 naming it, since an
    answer that ignored it would be wrong; its "off" value is accepted."""
    client, _ = asgi
    changes, off = REFUSED[field]
    status, _, data = post(client, COMPLETIONS, {"prompt": "The sea", "max_tokens": 1, field: changes})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_parameter")
    assert err["message"].startswith(f"'{field}' is not supported by Brass")
    status, headers, data = post(client, COMPLETIONS, {"prompt": "The sea", "max_tokens": 1, field: off})
    assert status == 200, data
    assert IGNORED not in headers


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "seed": -2}, "seed"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"prompt": "hi", "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"prompt": [1] * 300}, "prompt"),
    ({"messages": []}, "messages"),
])
def test_every_validation_error_names_its_field(asgi, body, param):
    client, _ = asgi
    status, _, data = post(client, CHAT if "messages" in body else COMPLETIONS, body)
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["param"] == param, err
    if param != "prompt":       # "the prompt is 300 tokens, but the context holds 64 ..."
        assert f"'{param}'" in err["message"], err


def test_a_conversation_the_template_refuses_names_messages(asgi, monkeypatch):
    from brass.chat_template import ChatTemplateError
    client, app = asgi

    def refuse(messages):
        raise ChatTemplateError("the chat template refused the conversation: roles must alternate")
    monkeypatch.setattr(app.template, "render", refuse)
    status, _, data = post(client, CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert (err["param"], err["code"]) == ("messages", "invalid_value") and "alternate" in err["message"]
