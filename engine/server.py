"""`brass serve`: an OpenAI-compatible HTTP API and a web chat page over one loaded model.

    POST /v1/chat/completions   POST /v1/completions   (`"stream": true` → server-sent events)
    GET  /v1/models             GET  /v1/models/{id}   GET /health   GET / (the chat page)

Standard library only (`http.server`). Requests are handled on threads; generation runs on one
worker thread that owns the model (engine/serving.py, continuous batching). Requests wait in a
FIFO queue; up to `--parallel` of them run at once, each with its own KV cache sized to its
prompt plus `max_tokens`: every step decodes the next token of all of them together (one
forward over a batch, each row computed as it would be alone), and a new request's prompt is
read in chunks between steps, so a long prompt does not stall the others. A handler whose
client has gone (a failed write, or the socket found closed while it waits) cancels its
request, and the worker drops it before its next step.

Bad input gets a 4xx with OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.
With `--api-key` (or $BRASS_API_KEY) every API request must carry `Authorization: Bearer KEY`;
the page itself is public (a browser cannot send the header when it navigates; the page sends
the key it is given with each of its API calls).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import queue
import re
import select
import socket
import sys
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from . import __version__
from .errors import BrassError
from .serving import BatchScheduler, Request

# A JSON body this large already holds more text than any context we serve (~4 bytes a token);
# a larger one is refused before it is read.
MAX_BODY_BYTES = 1 << 20
# How often a handler waiting for tokens checks whether its client is still there.
POLL_SECONDS = 0.2
# Seconds a client may stall while sending a request or while the server writes to it.
SOCKET_TIMEOUT = 60
# OpenAI accepts at most 4 stop sequences.
MAX_STOP = 4
ROLES = ("system", "user", "assistant")
WEB_DIR = Path(__file__).parent / "web"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}

# OpenAI request fields Brass does not implement, with the values that mean "not used". Any
# other value gets a 400: an answer that silently ignored them would be wrong.
UNSUPPORTED = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False, 0),
    "top_logprobs": (0,), "logit_bias": ({},), "frequency_penalty": (0,), "presence_penalty": (0,),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},),
}


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        if self.status == 401:
            kind = "authentication_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection."""


# --------------------------------------------------------------------------------------------
# Generation: jobs and the worker that runs them


class StopScanner:
    """Cuts generated text before the first stop string to be complete (the one ending first;
    of two ending at the same place, the longer), wherever the text was split into pieces.
    Text that could be the start of a stop string is held back until the next piece shows
    whether it is one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [(i + len(s), i) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)[1]], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job(Request):
    """One request's generation, run by the batch scheduler, which hands it its tokens
    (`on_token`); the handler reads `events`: ("delta", text), then ("done", finish_reason,
    usage) or ("error", APIError)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling, stop: list[str]):
        super().__init__(prompt_ids, max_tokens, sampling)
        self.stops = StopScanner(stop)
        self.events: queue.Queue = queue.Queue()
        self.completion_tokens = 0
        self.tokenizer = self._decoder = None      # the scheduler's model's, given at submit

    def on_token(self, token: int) -> bool:
        """Take one generated token; True when the job is finished."""
        if self._decoder is None:
            self._decoder = self.tokenizer.stream_decoder()
        self.completion_tokens += 1
        if self.tokenizer.is_eog(token):
            return self._finish("stop", self._decoder.flush())
        text, hit = self.stops.feed(self._decoder.feed(token))
        if hit:
            self._emit(text)
            return self._finish("stop", None)
        self._emit(text)
        if self.completion_tokens == self.max_tokens:
            return self._finish("length", self._decoder.flush())
        return False

    def on_error(self, exc: BaseException):
        if isinstance(exc, BrassError):
            self.events.put(("error", APIError(400, str(exc))))
        else:       # a fault of ours (the scheduler printed its traceback): keep serving the others
            self.events.put(("error", APIError(500, f"internal error during generation: "
                                                    f"{type(exc).__name__}")))

    def _emit(self, text: str):
        if text:
            self.events.put(("delta", text))

    def _finish(self, reason: str, tail: str | None) -> bool:
        if tail is not None:
            text, hit = self.stops.feed(tail)
            self._emit(text if hit else text + self.stops.flush())
            reason = "stop" if hit else reason
        n_prompt = len(self.prompt_ids)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": n_prompt + self.completion_tokens}
        self.events.put(("done", reason, usage))
        return True


class Scheduler(BatchScheduler):
    """The worker: FIFO admission, up to `parallel` jobs decoded together (engine/serving.py);
    a full queue is refused with 503 and Retry-After."""

    def submit(self, job: Job):
        job.tokenizer = self.model.tokenizer
        try:
            super().submit(job)
        except BatchScheduler.QueueFull as e:
            raise APIError(503, str(e), code="server_busy", headers={"Retry-After": "5"}) from None


# --------------------------------------------------------------------------------------------
# Request validation

_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


def _json_type(v) -> str:
    return _JSON_TYPES.get(type(v), type(v).__name__)


def _field(body: dict, name: str, kind: str, default=None):
    """body[name] checked against a JSON type; null or absent gives `default` (as OpenAI does)."""
    v = body.get(name)
    if v is None:
        return default
    ok = {
        "integer": isinstance(v, int) and not isinstance(v, bool),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "boolean": isinstance(v, bool),
        "string": isinstance(v, str),
        "object": isinstance(v, dict),
    }[kind]
    if not ok:
        raise APIError(400, f"'{name}' must be {'an' if kind[0] in 'aeio' else 'a'} {kind}, "
                            f"got {_json_type(v)}", code="invalid_type", param=name)
    return v


def _text(s: str, param: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"'{param}' holds an unpaired UTF-16 surrogate ({s[e.start]!r} at "
                            f"character {e.start}), which is not text", code="invalid_value", param=param) from None
    return s


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON value")


def parse_json_body(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (byte 0x{body[e.start]:02x} at offset "
                            f"{e.start})", code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                            f"column {e.colno}", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_type(obj)}",
                       code="invalid_json")
    return obj


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required", code="missing_field", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, f"'messages' must be a non-empty array, got {_json_type(msgs)}"
                       + (" (empty)" if msgs == [] else ""), code="invalid_type", param="messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"'{where}' must be an object, got {_json_type(m)}",
                           code="invalid_type", param=where)
        role = m.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"'{where}.role' must be a string, got {_json_type(role)}",
                           code="invalid_type", param=f"{where}.role")
        if role not in ROLES:
            raise APIError(400, f"'{where}.role' is {role!r}; Brass takes {', '.join(ROLES)}",
                           code="invalid_value", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_parts(content, f"{where}.content")
        elif not isinstance(content, str):
            raise APIError(400, f"'{where}.content' must be a string or an array of text parts, "
                                f"got {_json_type(content)}", code="invalid_type", param=f"{where}.content")
        out.append({"role": role, "content": _text(content, f"{where}.content")})
    return out


def _text_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise APIError(400, f"'{where}[{j}]' must be {{\"type\": \"text\", \"text\": string}}; "
                                "Brass serves text only", code="invalid_value", param=f"{where}[{j}]")
        texts.append(part["text"])
    # llama.cpp's server joins a message's text parts with newlines.
    return "\n".join(texts)


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"'stop' must be a string or an array of strings, got {_json_type(stop)}",
                       code="invalid_type", param="stop")
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'stop' holds {len(stops)} strings; at most {MAX_STOP} are allowed",
                       code="invalid_value", param="stop")
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' strings must not be empty", code="invalid_value", param="stop")
    return [_text(s, "stop") for s in stops]


def parse_sampling(body: dict):
    from .sampling import SamplingParams
    d = SamplingParams()
    try:
        return SamplingParams(
            temperature=_field(body, "temperature", "number", d.temperature),
            top_p=_field(body, "top_p", "number", d.top_p),
            top_k=_field(body, "top_k", "integer", d.top_k),
            min_p=_field(body, "min_p", "number", d.min_p),
            repetition_penalty=_field(body, "repetition_penalty", "number", d.repetition_penalty),
            seed=_field(body, "seed", "integer", None))
    except BrassError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def check_unsupported(body: dict):
    for name, unused in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v not in unused:
            raise APIError(400, f"'{name}' is not supported by Brass", code="unsupported_parameter",
                           param=name)


# --------------------------------------------------------------------------------------------
# The application: what each endpoint does


class App:
    def __init__(self, model, model_id: str, api_key: str | None, parallel: int, max_waiting: int):
        from .chat_template import ChatTemplate
        self.model, self.model_id, self.api_key = model, model_id, api_key
        self.template = ChatTemplate.from_gguf(model.gguf, model.tokenizer)
        self.scheduler = Scheduler(model, parallel, max_waiting)
        self.created = int(time.time())
        self.web_files = {"/": WEB_DIR / "index.html"}
        self.web_files.update({f"/web/{p.name}": p for p in WEB_DIR.iterdir() if p.suffix in CONTENT_TYPES})

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "brass"}

    def check_model(self, body: dict):
        name = _field(body, "model", "string")
        if name is not None and name != self.model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}",
                           code="model_not_found", param="model")

    def budget(self, n_prompt: int, max_tokens: int | None) -> int:
        """max_tokens for a prompt of `n_prompt` tokens: as asked, or what fits in the context."""
        n_ctx = self.model.n_ctx
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", code="invalid_value", param="prompt")
        if n_prompt >= n_ctx:
            raise APIError(400, f"the prompt is {_tokens(n_prompt)}, but the context holds {n_ctx} "
                                "for the prompt and the reply together", code="context_length_exceeded")
        room = n_ctx - n_prompt
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}",
                           code="invalid_value", param="max_tokens")
        if max_tokens > room:
            raise APIError(400, f"the prompt ({_tokens(n_prompt)}) plus max_tokens ({max_tokens}) exceed "
                                f"the context of {n_ctx} tokens; at most {room} new tokens fit",
                           code="context_length_exceeded", param="max_tokens")
        return max_tokens

    def prepare(self, body: dict, chat: bool) -> Job:
        """Validate a completion request and turn it into a job (nothing runs yet)."""
        self.check_model(body)
        check_unsupported(body)
        _field(body, "stream", "boolean")
        max_tokens = _field(body, "max_completion_tokens", "integer")
        if max_tokens is None:
            max_tokens = _field(body, "max_tokens", "integer")
        sampling = parse_sampling(body)
        stop = parse_stop(body)
        tok = self.model.tokenizer
        try:
            if chat:
                prompt = self.template.render(parse_messages(body))
                ids = tok.encode(prompt, add_special=True, parse_special=True)
                stop += self.template.stop_strings
            else:
                ids = self._prompt_ids(body)
        except BrassError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return Job(ids, self.budget(len(ids), max_tokens), sampling, stop)

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(_text(prompt, "prompt"), add_special=True, parse_special=True)
        n_vocab = self.model.config.n_vocab
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in prompt):
            if not all(0 <= i < n_vocab for i in prompt):
                raise APIError(400, f"'prompt' token ids must be in [0, {n_vocab})", code="invalid_value",
                               param="prompt")
            return list(prompt)
        if prompt is None:
            raise APIError(400, "'prompt' is required", code="missing_field", param="prompt")
        raise APIError(400, f"'prompt' must be a string or a non-empty array of token ids, got "
                            f"{_json_type(prompt)}", code="invalid_type", param="prompt")


# --------------------------------------------------------------------------------------------
# HTTP


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"brass/{__version__}"
    timeout = SOCKET_TIMEOUT
    server: "BrassHTTPServer"

    def __getattr__(self, name):
        # http.server looks up do_<METHOD>: every method goes to the router, which answers an
        # unknown path with 404 and a method the path does not take with 405.
        if name.startswith("do_"):
            return lambda: self._dispatch(name[3:])
        raise AttributeError(name)

    # Routes: path → (method, handler name).
    ROUTES = {
        "/v1/chat/completions": ("POST", "chat_completions"),
        "/v1/completions": ("POST", "completions"),
        "/v1/models": ("GET", "models"),
        "/health": ("GET", "health"),
    }

    @property
    def app(self) -> App:
        return self.server.app

    def _dispatch(self, method: str):
        self._body_read = False
        self._started = False
        path = urlsplit(self.path).path
        try:
            if path in self.app.web_files:
                route, public = ("GET", "page"), True
            elif path.startswith("/v1/models/"):
                route, public = ("GET", "model"), False
            else:
                route, public = self.ROUTES.get(path), False
            if route is None:
                raise APIError(404, f"no such endpoint: {method} {path}", code="not_found")
            if method != route[0]:
                raise APIError(405, f"{path} takes {route[0]}, not {method}", code="method_not_allowed",
                               headers={"Allow": route[0]})
            if not public:
                self._check_auth()
            getattr(self, "_" + route[1])(path)
        except APIError as e:
            self._send_api_error(e)
        except ClientGone:
            self.close_connection = True
        except Exception as e:  # a fault of ours: answer 500 and keep serving
            traceback.print_exc(file=sys.stderr)
            self._send_api_error(APIError(500, f"internal error: {type(e).__name__}"))

    # -- plumbing --------------------------------------------------------------------------

    def _check_auth(self):
        key = self.app.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        # Header text arrives decoded as latin-1: encoding it back gives the bytes sent.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"),
                                                                 key.encode("utf-8")):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _read_body(self) -> dict:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError(411, "send the body with a Content-Length; chunked request bodies are not "
                                "accepted", code="length_required")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise APIError(411, "a Content-Length header is required", code="length_required")
        if len(set(lengths)) != 1 or not re.fullmatch(r"[0-9]{1,15}", lengths[0].strip()):
            raise APIError(400, f"bad Content-Length: {', '.join(lengths)!r}", code="invalid_request")
        n = int(lengths[0])
        if n > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {n} bytes; the limit is {MAX_BODY_BYTES}",
                           code="request_too_large")
        try:
            body = self.rfile.read(n)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {SOCKET_TIMEOUT} s",
                           code="request_timeout") from None
        if len(body) < n:
            raise ClientGone()
        self._body_read = True
        return parse_json_body(body)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj: dict, headers: dict | None = None):
        self._send(status, json.dumps(obj, ensure_ascii=False).encode("utf-8"), "application/json", headers)

    def _send_api_error(self, e: APIError):
        if self._started:  # mid-stream: the status line is gone; say it in the stream
            try:
                self._sse(e.body())
                self._end_stream()
            except OSError:
                pass
            self.close_connection = True
            return
        unread = self.command == "POST" and not self._body_read
        if unread:
            # The unread body would be taken for the next request on this connection.
            self.close_connection = True
        try:
            self._send_json(e.status, e.body(), e.headers)
            if unread:
                self._drain()
        except OSError:
            self.close_connection = True

    def _drain(self):
        """Closing a socket with unread bytes makes the kernel reset the connection, which can
        destroy the error response before the client reads it: end our side, then read and drop
        what still comes, for a moment, until the client closes."""
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(0.5)
        deadline = time.monotonic() + 2
        try:
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def send_error(self, code, message=None, explain=None):
        """Errors http.server finds itself (bad request line, headers too long, unknown method)."""
        self.close_connection = True
        self._started = False
        # A request line too broken to name its version is answered as HTTP/1.1, with headers.
        self.request_version = self.protocol_version
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "Error"
        self._send_json(code, APIError(code, message or phrase, code="invalid_request").body())

    def log_message(self, format, *args):
        sys.stderr.write(f"brass: {self.address_string()} {format % args}\n")

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _events(self, job: Job):
        """The job's events as they come; ClientGone (and the job cancelled) if the client leaves."""
        checked = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                event = None
            if time.monotonic() - checked >= POLL_SECONDS:
                if self._client_gone():
                    raise ClientGone()
                checked = time.monotonic()
            if event is None:
                continue
            yield event
            if event[0] != "delta":
                return

    def _write(self, data: bytes):
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        except (OSError, ValueError):
            raise ClientGone() from None

    def _sse(self, obj) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        self._write(f"data: {payload}\n\n".encode("utf-8"))

    def _end_stream(self):
        self._sse("[DONE]")
        if self._chunked:
            self._write(b"")

    # -- endpoints -------------------------------------------------------------------------

    def _page(self, path: str):
        f = self.app.web_files[path]
        self._send(200, f.read_bytes(), CONTENT_TYPES[f.suffix], {"Cache-Control": "no-cache"})

    def _models(self, path: str):
        self._send_json(200, {"object": "list", "data": [self.app.model_card()]})

    def _model(self, path: str):
        name = unquote(path[len("/v1/models/"):])
        if name != self.app.model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.app.model_id!r}", code="model_not_found")
        self._send_json(200, self.app.model_card())

    def _health(self, path: str):
        running, waiting = self.app.scheduler.counts()
        m = self.app.model
        self._send_json(200, {"status": "ok", "model": self.app.model_id, "backend": m.backend.name,
                              "n_ctx": m.n_ctx, "requests_running": running, "requests_waiting": waiting,
                              "tokens_generated": self.app.scheduler.tokens_generated})

    def _chat_completions(self, path: str):
        self._completion(chat=True)

    def _completions(self, path: str):
        self._completion(chat=False)

    def _completion(self, chat: bool):
        body = self._read_body()
        job = self.app.prepare(body, chat)
        stream = bool(body.get("stream"))
        options = _field(body, "stream_options", "object", {}) if stream else {}
        include_usage = bool(_field(options, "include_usage", "boolean", False))
        self.app.scheduler.submit(job)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.app.model_id}
        try:
            if stream:
                self._stream(job, head, chat, include_usage)
            else:
                self._complete(job, head, chat)
        finally:
            job.cancelled.set()  # a no-op for a finished job; stops one whose client went away

    def _complete(self, job: Job, head: dict, chat: bool):
        parts = []
        for event in self._events(job):
            if event[0] == "delta":
                parts.append(event[1])
            elif event[0] == "error":
                raise event[1]
            else:
                _, reason, usage = event
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=None, finish_reason=reason)
        self._send_json(200, {**head, "choices": [choice], "usage": usage})

    def _stream(self, job: Job, head: dict, chat: bool, include_usage: bool):
        if chat:
            head = {**head, "object": "chat.completion.chunk"}

        def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", **delta}
                c = {"index": 0, "delta": delta}
            else:
                c = {"index": 0, "text": text or ""}
            c.update(logprobs=None, finish_reason=reason)
            return {**head, "choices": [c]}

        # HTTP/1.0 clients know no chunked encoding: the stream ends when the connection does.
        self._chunked = self.request_version != "HTTP/1.0"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self._started = True
        if chat:
            self._sse(chunk("", None, role=True))
        for event in self._events(job):
            if event[0] == "delta":
                self._sse(chunk(event[1], None))
            elif event[0] == "error":
                raise event[1]
            else:
                _, reason, usage = event
                self._sse(chunk(None, reason))
                if include_usage:
                    self._sse({**head, "choices": [], "usage": usage})
        self._end_stream()


class BrassHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, app: App):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.app = app
        super().__init__((host, port), Handler)


# --------------------------------------------------------------------------------------------
# Command line


def model_id_for(name: str | None, path: Path) -> str:
    """The id clients name the model by: its catalog name, else its file name."""
    from . import catalog
    if name is None:
        return catalog.DEFAULT_MODEL
    return name if name in catalog.CATALOG else path.name


def cmd_serve(args):
    from .model import Model
    if args.parallel < 1:
        raise BrassError("--parallel must be >= 1")
    if args.max_waiting < 1:
        raise BrassError("--max-waiting must be >= 1")
    if not 0 <= args.port <= 65535:
        raise BrassError(f"--port {args.port} is not a port number (0-65535; 0 picks a free one)")
    model = Model(args.model, backend=args.backend, n_ctx=args.ctx)
    app = App(model, model_id_for(args.model, model.path), args.api_key, args.parallel, args.max_waiting)
    try:
        server = BrassHTTPServer(args.host, args.port, app)
    except (OSError, OverflowError) as e:
        raise BrassError(f"cannot listen on {args.host}:{args.port}: {getattr(e, 'strerror', None) or e}") from None
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    if app.template.is_fallback:
        print(f"brass: {app.model_id} has no chat template; chat requests use ChatML, as llama.cpp does",
              file=sys.stderr)
    print(f"brass: serving {app.model_id} on the {model.backend.name} backend at http://{shown}:{port}/ "
          f"(API: /v1, chat page: /){' — API key required' if args.api_key else ''}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("brass: stopped", file=sys.stderr)
    finally:
        server.server_close()


def add_cli(sub, add_model_args):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API and web chat page")
    add_model_args(p, model_optional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("BRASS_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every API request (default: $BRASS_API_KEY)")
    p.add_argument("--parallel", type=int, default=4,
                   help="requests decoded together in one batched step (each holds a KV cache)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests queued beyond --parallel before new ones get 503")
    p.set_defaults(func=cmd_serve)
