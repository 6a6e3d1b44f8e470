"""HTTP for `brass serve`: FastAPI routes over engine/server.py's App, run by uvicorn (h11).

Who needs the API key (with --api-key): every route but those a browser or a load balancer
reaches without one, the page and its files, /favicon.ico, /docs and /openapi.json, and
/health and /v1/models (open in llama-server too). conformance/server/test_server_auth.py holds the
table of every route and checks it against this app's own route list.

The event loop only moves bytes. Parsing, validation and tokenizing a request run on a worker
thread (`anyio.to_thread`); generation runs on the scheduler's thread, which hands each event
to the loop through `loop.call_soon_threadsafe`. A client that leaves is noticed by a task
waiting on the ASGI `http.disconnect` message (for a streamed reply, by Starlette's own
listener), and its job is cancelled at once: the scheduler drops it before its next token and
its place goes to the next request in the queue.

Every error is OpenAI's body (`{"error": {"message", "type", "param", "code"}}`), whoever finds
it: a route (APIError), the router (404 / 405), FastAPI's request validation (mapped to 400),
uvicorn's HTTP parser (a request it cannot read: 400, see BrassH11Protocol), or a fault of ours
(500, the traceback to the server's log and not to the client).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import re
import socket
import sys
import time
import traceback
import uuid

import anyio
import h11
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from . import __version__
from . import logprobs as logprob_forms
from .api import APIError
from .errors import BrassError
from .server import CONTENT_TYPES, App

# A JSON body this large already holds more text than any context we serve (~4 bytes a token);
# a larger one is refused before it is read (Content-Length) or once it has grown past it (chunked).
MAX_BODY_BYTES = 1 << 20
# Seconds a client may take to send its request body, and may leave a kept-alive connection idle.
SOCKET_TIMEOUT = 60
# Seconds the server waits for replies in progress when asked to stop, before it cuts them.
SHUTDOWN_GRACE_S = 3


class ClientGone(Exception):
    """The client closed its connection."""


class ServerStopping(Exception):
    """The server is shutting down: replies in progress end now, with a message saying so."""


STOPPING = APIError(503, "the server is stopping; retry later", code="server_stopping",
                    headers={"Retry-After": "5"})


class JSON(Response):
    """JSON as the server has always written it (json.dumps' separators, UTF-8 as is)."""
    media_type = "application/json"

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False).encode("utf-8")


def error_response(e: APIError) -> JSON:
    return JSON(e.body(), status_code=e.status, headers=e.headers)


# --------------------------------------------------------------------------------------------
# A job's events, on the event loop


class JobEvents:
    """Async iteration over a job's events, ending after its last ("done" or "error"). The
    scheduler's thread wakes the loop after each event; `client_gone()` ends the iteration with
    ClientGone and cancels the job."""

    def __init__(self, job):
        self.job = job
        self.gone = self.stopping = False
        self.completed = False      # set by a stream once its last line is out
        self._ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wakeup():
            try:
                loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:    # the loop has closed: the server is stopping
                pass
        job.wakeup = wakeup

    def client_gone(self):
        self.gone = True
        self.job.cancelled.set()
        self._ready.set()

    def server_stopping(self):
        self.stopping = True
        self.job.cancelled.set()
        self._ready.set()

    async def __aiter__(self):
        while True:
            if self.gone:
                raise ClientGone()
            if self.stopping:
                raise ServerStopping()
            self._ready.clear()
            try:
                event = self.job.events.get_nowait()
            except queue.Empty:
                await self._ready.wait()
                continue
            yield event
            if event[0] not in ("delta", "prompt"):
                return


async def _disconnected(receive):
    """Returns when the client has gone (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events; whatever ends the stream (its end, the client leaving, the server
    stopping) cancels the job, so it never runs on for nobody."""

    def __init__(self, events: JobEvents, content, on_left, on_end, headers: dict | None = None):
        super().__init__(content, media_type="text/event-stream; charset=utf-8",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.events, self.on_left, self.on_end = events, on_left, on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:    # ASGI 2.4 servers say so by a failed send
            pass
        finally:
            self.events.job.cancelled.set()
            self.on_end(self.events)
            if not self.events.completed:
                self.on_left()


def sse(obj) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


# --------------------------------------------------------------------------------------------
# The ASGI application


def create_app(brass: App):
    """The ASGI application serving `brass` (an App): FastAPI inside a guard that counts
    responses and answers a fault of ours with a 500 in OpenAI's body."""

    async def require_key(request: Request):
        key = brass.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Header text arrives decoded as latin-1: encoding it back gives the bytes sent.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"),
                                                                 key.encode("utf-8")):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    live: set[JobEvents] = set()     # the replies in progress, ended early if the server stops
    state = {"stopping": False}
    api = FastAPI(title="Brass", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", redirect_slashes=False,
                  description="An OpenAI-compatible API over one GGUF model. With --api-key, send "
                              "`Authorization: Bearer KEY` (GET /health and GET /v1/models are "
                              "open). Request fields Brass does not read are ignored and named in "
                              "the reply's X-Brass-Ignored-Fields header.")
    keyed = [Depends(require_key)]

    # -- errors --------------------------------------------------------------------------------

    @api.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @api.exception_handler(StarletteHTTPException)
    async def _router_error(request: Request, e: StarletteHTTPException):
        method, path = request.method, request.url.path
        if e.status_code == 404:
            return error_response(APIError(404, f"no such endpoint: {method} {path}", code="not_found"))
        if e.status_code == 405:
            allow = (e.headers or {}).get("Allow", "")
            return error_response(APIError(405, f"{path} takes {allow}, not {method}",
                                           code="method_not_allowed", headers={"Allow": allow}))
        return error_response(APIError(e.status_code, str(e.detail), code="invalid_request",
                                       headers=e.headers))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        # FastAPI's 422, for parameters it checks itself: a 400 in OpenAI's body, as ours are.
        err = (e.errors() or [{}])[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        return error_response(APIError(400, f"'{where}' {err.get('msg', 'is not valid')}".strip(),
                                       code="invalid_value", param=where or None))

    @api.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        # Starlette re-raises after answering: the guard below logs the traceback.
        return error_response(APIError(500, f"internal error: {type(e).__name__}"))

    # -- the page, health, models, metrics ------------------------------------------------------

    def page(file):
        async def get():
            return Response(file.read_bytes(), media_type=CONTENT_TYPES[file.suffix],
                            headers={"Cache-Control": "no-cache"})
        return get

    for route, file in brass.web_files.items():
        api.add_api_route(route, page(file), methods=["GET"], include_in_schema=False)

    # open, as llama-server's: load balancers probe it, clients list the model before anything
    @api.get("/health", summary="Liveness and load")
    async def health():
        return JSON(brass.health())

    @api.get("/metrics", dependencies=keyed, summary="Prometheus metrics")
    async def metrics():
        text = brass.metrics.prometheus(brass.scheduler, brass.parallel, brass.max_waiting,
                                        brass.model.graph_bytes())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models", summary="The served model")
    async def models():
        return JSON({"object": "list", "data": [brass.model_card()]})

    @api.get("/v1/models/{model_id:path}", dependencies=keyed, summary="A model by id")
    async def model(model_id: str):
        if model_id != brass.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{brass.model_id!r}", code="model_not_found")
        return JSON(brass.model_card())

    def body_schema(name: str) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{name}"}}}}}

    # -- tokenizer (llama-server's routes; vLLM's field names too) -----------------------------

    @api.post("/tokenize", dependencies=keyed, openapi_extra=body_schema("TokenizeRequest"),
              summary="Text to token ids")
    async def tokenize(request: Request):
        try:
            body = await read_body(request)
        except ClientGone:
            return Response(status_code=499)
        return JSON(await anyio.to_thread.run_sync(brass.tokenize, body))

    @api.get("/tokenizer_info", dependencies=keyed, summary="The tokenizer's special tokens (vLLM's route)")
    async def tokenizer_info():
        return JSON(brass.tokenizer_info())

    @api.post("/detokenize", dependencies=keyed, openapi_extra=body_schema("DetokenizeRequest"),
              summary="Token ids to text")
    async def detokenize(request: Request):
        try:
            body = await read_body(request)
        except ClientGone:
            return Response(status_code=499)
        return JSON(await anyio.to_thread.run_sync(brass.detokenize, body))

    # -- completions ----------------------------------------------------------------------------

    @api.post("/v1/chat/completions", dependencies=keyed, openapi_extra=body_schema("ChatCompletionRequest"),
              summary="Chat completion (stream: server-sent events)")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @api.post("/v1/completions", dependencies=keyed, openapi_extra=body_schema("CompletionRequest"),
              summary="Text completion (stream: server-sent events)")
    async def completions(request: Request):
        return await complete(request, chat=False)

    async def complete(request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request)
        except ClientGone:
            return Response(status_code=499)
        job, req = await anyio.to_thread.run_sync(brass.prepare, body, chat)
        headers = brass.reply_headers(req)
        if state["stopping"]:
            raise STOPPING
        if len(req._jobs) > 1:
            return await complete_batch(request, req, headers)
        events = JobEvents(job)             # before submit: no event is missed
        brass.submit(job)
        live.add(events)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": brass.model_id}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            echoed = echo_text(job, req, 0)
            return EventStream(events, stream(events, head, chat, usage, job, echoed),
                               on_left=brass.metrics.client_left,
                               on_end=live.discard, headers=headers)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        gone.add_done_callback(lambda t: t.cancelled() or events.client_gone())
        try:
            return await reply(events, head, chat, headers, job, req)
        except ClientGone:
            brass.metrics.client_left()
            return Response(status_code=499)    # nobody reads it; the guard does not count it
        except ServerStopping:
            return error_response(STOPPING)
        finally:
            gone.cancel()
            job.cancelled.set()
            live.discard(events)

    async def complete_batch(request: Request, req, headers: dict) -> Response:
        """A completion request of several prompts: one job each, submitted together (decoded
        together as the scheduler's places allow), one choice each, `index` its prompt's."""
        all_events = []
        try:
            for job in req._jobs:
                events = JobEvents(job)
                brass.submit(job)       # a full queue: the jobs already in are cancelled below
                all_events.append(events)
                live.add(events)
        except BaseException:
            for events in all_events:
                events.job.cancelled.set()
                live.discard(events)
            raise
        head = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion",
                "created": int(time.time()), "model": brass.model_id}
        gone = asyncio.ensure_future(_disconnected(request.receive))
        gone.add_done_callback(lambda t: t.cancelled() or [e.client_gone() for e in all_events])
        try:
            got = [await collect(events, False, events.job, req, i) for i, events in enumerate(all_events)]
        except ClientGone:
            brass.metrics.client_left()
            return Response(status_code=499)
        except ServerStopping:
            return error_response(STOPPING)
        finally:
            gone.cancel()
            for events in all_events:
                events.job.cancelled.set()
                live.discard(events)
        usage = {k: sum(u[k] for _, u in got) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        usage["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                               for _, u in got)}
        return JSON({**head, "choices": [c for c, _ in got], "usage": usage}, headers=headers)

    async def reply(events: JobEvents, head: dict, chat: bool, headers: dict, job, req) -> Response:
        choice, usage = await collect(events, chat, job, req, 0)
        return JSON({**head, "choices": [choice], "usage": usage}, headers=headers)

    async def collect(events: JobEvents, chat: bool, job, req, index: int) -> tuple[dict, dict]:
        """A job's whole reply: (its choice, its usage)."""
        parts, prompt, entries = [], [], []
        async for event in events:
            if event[0] == "delta":
                parts.append(event[1])
                entries += event[2] if len(event) > 2 else []
            elif event[0] == "prompt":
                prompt = event[1]
            elif event[0] == "error":
                raise event[1]
            else:
                _, reason, usage = event
        text = "".join(parts)
        tok = brass.model.tokenizer
        echoed = echo_text(job, req, index)
        choice = ({"index": index, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": index, "text": echoed + text})
        logprobs = None
        if job.logprobs is not None:
            if chat:
                logprobs = logprob_forms.chat_form(entries, tok)
            else:
                logprobs = logprob_forms.completion_form(prompt, tok)
                more = logprob_forms.completion_form(entries, tok, len(echoed))
                for k in logprobs:
                    logprobs[k] += more[k]
        choice.update(logprobs=logprobs, finish_reason=reason)
        return choice, usage

    def echo_text(job, req, index: int) -> str:
        """The prompt's text an echo begins with ('' without echo)."""
        if not job.echo:
            return ""
        p = req.prompts()[index]
        return p if isinstance(p, str) else brass.model.tokenizer.decode(p)

    async def stream(events: JobEvents, head: dict, chat: bool, include_usage: bool, job, echoed: str = ""):
        """Server-sent events; with echo, the prompt's text (and its logprobs, when asked, once
        the prompt has been read: the "prompt" event) is the first chunk."""
        if chat:
            head = {**head, "object": "chat.completion.chunk"}
        tok = brass.model.tokenizer
        offset = 0          # of the next token's text in the whole reply (legacy text_offset)

        def chunk(text: str | None, reason: str | None, role: bool = False, entries=None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", **delta}
                c = {"index": 0, "delta": delta}
            else:
                c = {"index": 0, "text": text or ""}
            logprobs = None
            if entries is not None:
                logprobs = (logprob_forms.chat_form(entries, tok) if chat
                            else logprob_forms.completion_form(entries, tok, offset))
            c.update(logprobs=logprobs, finish_reason=reason)
            return {**head, "choices": [c]}

        if chat:
            yield sse(chunk("", None, role=True))
        if echoed and job.logprobs is None:
            yield sse(chunk(echoed, None))
            offset = len(echoed)
        try:
            async for event in events:
                if event[0] == "prompt":
                    yield sse(chunk(echoed, None, entries=event[1]))
                    offset = len(echoed)
                elif event[0] == "delta":
                    yield sse(chunk(event[1], None, entries=event[2] if len(event) > 2 else None))
                    offset += sum(len(logprob_forms.token_text(tok, e["token"])) for e in
                                  (event[2] if len(event) > 2 else ()))
                elif event[0] == "error":     # mid-stream: the status line is gone; say it here
                    yield sse(event[1].body())
                else:
                    _, reason, usage = event
                    yield sse(chunk(None, reason))
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage})
        except ServerStopping:
            yield sse(STOPPING.body())
        yield sse("[DONE]")
        events.completed = True

    async def read_body(request: Request) -> bytes:
        headers = request.headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if not chunked and length is None:
            raise APIError(411, "a Content-Length header is required", code="length_required")
        # The unread rest of a refused body is not waited for: the connection closes.
        close = {"Connection": "close"}
        if length is not None and not (length.isascii() and length.isdigit()):
            raise APIError(400, f"bad Content-Length: {length!r}", code="invalid_request", headers=close)
        if length is not None and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {int(length)} bytes; the limit is {MAX_BODY_BYTES}",
                           code="request_too_large", headers=close)
        body = bytearray()
        try:
            with anyio.fail_after(SOCKET_TIMEOUT):
                async for piece in request.stream():
                    body += piece
                    if len(body) > MAX_BODY_BYTES:
                        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes, the limit",
                                       code="request_too_large", headers=close)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {SOCKET_TIMEOUT} s",
                           code="request_timeout", headers=close) from None
        except ClientDisconnect:
            raise ClientGone() from None
        return bytes(body)

    # -- the OpenAPI document: the request bodies' schemas from their pydantic models ----------

    def openapi() -> dict:
        if api.openapi_schema is None:
            from pydantic.json_schema import models_json_schema

            from .api_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)
            schema = get_openapi(title=api.title, version=api.version, description=api.description,
                                 routes=api.routes)
            _, defs = models_json_schema([(m, "validation") for m in (ChatCompletionRequest, CompletionRequest,
                                                                       TokenizeRequest, DetokenizeRequest)],
                                         ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(defs.get("$defs", {}))
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi

    def stop_replies():
        """The server is stopping: every reply in progress ends now, saying so (a stream with
        an error event, a waiting reply with a 503), instead of being cut off."""
        state["stopping"] = True
        for events in list(live):
            events.server_stopping()

    guard = Guard(api, brass.metrics)
    guard.stop_replies = stop_replies
    return guard


class Guard:
    """The outermost ASGI layer: counts responses by status class for /metrics, and logs a
    fault of ours with its traceback (FastAPI has already answered it with a 500 in OpenAI's
    body; if it had not begun to answer, this does)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    def __getattr__(self, name):        # the FastAPI app's attributes (openapi, routes, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] != 499:    # a client that left is not answered
                    self.metrics.response(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            print(f"brass: internal error on {scope.get('method')} {scope.get('path')}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            if not started:
                await error_response(APIError(500, "internal error"))(scope, receive, counted)


# --------------------------------------------------------------------------------------------
# uvicorn


class BrassH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse in OpenAI's error body
    (uvicorn's own answer is plain text)."""

    _last_data = b""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # uvicorn starts the keep-alive clock only once a response is out: a connection that
        # never sends a request would hold its socket (a file descriptor) for ever, and enough
        # of them stop the server accepting anyone. It gets the kept-alive connection's time.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        self._last_data = data      # to quote a header h11 refuses without saying its value
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        exc = sys.exc_info()[1]     # called while handling h11's RemoteProtocolError
        status = getattr(exc, "error_status_hint", 400)
        status = status if 400 <= status < 500 else 400
        # h11 shows a broken request line as bytearray(b'...'); the bytes are what matter.
        detail = re.sub(r"bytearray\((b'.*')\)", r"\1", str(exc)) if exc else msg
        lengths = re.findall(rb"(?im)^content-length:[ \t]*([^\r\n]*?)[ \t]*\r?$", self._last_data)
        if "Content-Length" in detail and lengths:
            message = f"bad Content-Length: {b', '.join(lengths).decode('latin-1')!r}"
        else:
            message = f"bad HTTP request: {detail}"
        body = json.dumps(APIError(status, message, code="invalid_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had begun already: nothing more to say
            pass
        self.transport.close()


LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"brass": {"format": "brass: %(message)s"},
                   "warning": {"format": "brass: warning: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "brass", "stream": "ext://sys.stderr"},
                 "warnings": {"class": "logging.StreamHandler", "formatter": "warning",
                              "stream": "ext://sys.stderr"}},
    "loggers": {
        # the App's own (engine/server.py: request fields it ignored)
        "brass": {"handlers": ["warnings"], "level": "WARNING", "propagate": False},
        "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
    },
}


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, or one line saying why there is none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1024)
        except BaseException:
            sock.close()
            raise
    except (OSError, OverflowError) as e:
        raise BrassError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    return sock


class _Server(uvicorn.Server):
    async def shutdown(self, sockets=None):
        self.config.app.stop_replies()      # before uvicorn waits for the connections to end
        await super().shutdown(sockets)


def uvicorn_server(brass: App, log_config: dict | None = LOG_CONFIG) -> uvicorn.Server:
    """uvicorn serving `brass`: `.run(sockets=[sock])` serves until `.should_exit` is set (or, on
    the main thread, Ctrl-C or SIGTERM); replies in progress then end at once, saying so."""
    config = uvicorn.Config(create_app(brass), http=BrassH11Protocol, loop="asyncio", lifespan="off",
                            log_config=log_config, timeout_keep_alive=SOCKET_TIMEOUT,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, server_header=False,
                            headers=[("server", f"brass/{__version__}")])
    return _Server(config)


def serve(brass: App, sock: socket.socket):
    """Serve until Ctrl-C or SIGTERM (uvicorn stops gracefully, then raises KeyboardInterrupt for
    Ctrl-C: the caller says it stopped)."""
    uvicorn_server(brass).run(sockets=[sock])
