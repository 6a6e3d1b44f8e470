"""`brass serve`: an OpenAI-compatible HTTP API and a web chat page over one loaded model.

    POST /v1/chat/completions   POST /v1/completions   (`"stream": true` → server-sent events)
    GET  /v1/models             GET  /v1/models/{id}   GET /health   GET /metrics (Prometheus)
    GET  / (the chat page)      GET  /docs (the OpenAPI page)

The layers, each its own module:
    engine/api.py         OpenAI's error body; the request body read as strict JSON
    engine/api_models.py  the request bodies as pydantic models (schema and validation)
    engine/scheduler.py   jobs, and the interface of the worker thread that generates them
                          (engine/serving.py's BatchScheduler: continuous batching)
    engine/server.py      this file: what a request becomes (App), the counters behind
                          /metrics, and the `serve` command
    engine/http_api.py    HTTP on FastAPI + uvicorn: routes, server-sent events, clients that
                          leave, error bodies for everything

Generation runs on the scheduler's thread, never on the event loop. With `--api-key` (or
$BRASS_API_KEY) every API request must carry `Authorization: Bearer KEY`; the page and /docs
are public (a browser cannot send the header when it navigates; the page sends the key it is
given with each of its API calls).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from .api import APIError, parse_json_body
from .errors import BrassError
from .scheduler import Job, QueueFull, Scheduler, StopScanner  # noqa: F401 (StopScanner: tests)

WEB_DIR = Path(__file__).parent / "web"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}
# What a client whose request found the queue full is told to wait before it retries.
RETRY_AFTER_S = 5


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------------------------
# Counters for /metrics


class RateMeter:
    """Events per second over the last `window` seconds, in one-second buckets (thread-safe)."""

    def __init__(self, window: int = 10, clock=time.monotonic):
        self.window, self.clock = window, clock
        self._lock = threading.Lock()
        self._buckets: dict[int, int] = {}

    def add(self, n: int = 1):
        second = int(self.clock())
        with self._lock:
            self._buckets[second] = self._buckets.get(second, 0) + n
            if len(self._buckets) > self.window + 1:
                for s in [s for s in self._buckets if s <= second - self.window]:
                    del self._buckets[s]

    def rate(self) -> float:
        now = int(self.clock())
        with self._lock:
            return sum(n for s, n in self._buckets.items() if now - self.window < s <= now) / self.window


class Metrics:
    """What /metrics reports, counted where it happens (HTTP responses in the HTTP layer,
    tokens by the jobs), read with the scheduler's own counts."""

    def __init__(self):
        self._lock = threading.Lock()
        self.responses = {"2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0}
        self.cancelled = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generated = RateMeter()

    def response(self, status: int):
        with self._lock:
            key = f"{status // 100}xx"
            self.responses[key] = self.responses.get(key, 0) + 1

    def client_left(self):
        with self._lock:
            self.cancelled += 1

    def prompt(self, n: int):
        with self._lock:
            self.prompt_tokens += n

    def tokens(self, n: int):
        with self._lock:
            self.generated_tokens += n
        self.generated.add(n)

    def prometheus(self, scheduler, parallel: int, max_waiting: int, graph_bytes: dict | None = None) -> str:
        """The Prometheus text format (version 0.0.4); graph_bytes: Model.graph_bytes()."""
        running, waiting = scheduler.counts()
        with self._lock:
            responses, cancelled = dict(self.responses), self.cancelled
            prompt, generated = self.prompt_tokens, self.generated_tokens
        rows = [
            ("brass_requests_total", "counter", "HTTP responses sent, by status class.",
             [(f'{{status="{k}"}}', v) for k, v in responses.items()]),
            ("brass_requests_cancelled_total", "counter",
             "Completion requests whose client left before the reply was complete.", [("", cancelled)]),
            ("brass_prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.",
             [("", prompt)]),
            ("brass_generated_tokens_total", "counter", "Tokens generated.", [("", generated)]),
            ("brass_requests_running", "gauge", "Sequences being generated (each holds a KV cache).",
             [("", running)]),
            ("brass_batch_size", "gauge", "Sequences advanced in the scheduler's latest round.",
             [("", getattr(scheduler, "batch_size", running))]),
            ("brass_requests_waiting", "gauge", "Requests queued for a free sequence slot.",
             [("", waiting)]),
            ("brass_parallel", "gauge", "Sequences generated at once at most (--parallel).",
             [("", parallel)]),
            ("brass_queue_limit", "gauge", "Requests queued at most before new ones get 503 (--max-waiting).",
             [("", max_waiting)]),
            ("brass_scheduler_seconds_total", "counter",
             "Seconds the worker spent reading prompts and decoding.",
             [(f'{{phase="{k}"}}', round(v, 6)) for k, v in getattr(scheduler, "seconds", {}).items()]),
            ("brass_batch_runs_ended_total", "counter",
             "Greedy batched runs (a step queued ahead of the host) ended by a change of the batch, "
             "their step ahead kept for the rows that stay or dropped (BRASS_BATCH_KEEP_AHEAD).",
             [(f'{{step="{k}"}}', v) for k, v in getattr(scheduler, "runs_ended", {}).items()]),
            ("brass_tokens_per_second", "gauge",
             f"Tokens generated per second over the last {self.generated.window} s.",
             [("", round(self.generated.rate(), 3))]),
            # the soak of 2026-12-02 saw a server's GPU memory grow with prompt graphs on
            ("brass_prompt_graph_bytes", "gauge",
             "Device bytes held by captured prompt graphs: sessions' own and the model's shared ones.",
             [(f'{{kind="{k}"}}', v) for k, v in (graph_bytes or {}).items()]),
        ]
        out = []
        for name, kind, doc, samples in rows:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            out += [f"{name}{labels} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# The application: what a request becomes (no HTTP here)


class App:
    def __init__(self, model, model_id: str, api_key: str | None, parallel: int, max_waiting: int,
                 scheduler=None):
        from .chat_template import ChatTemplate
        self.model, self.model_id, self.api_key = model, model_id, api_key
        self.parallel, self.max_waiting = parallel, max_waiting
        self.template = ChatTemplate.from_gguf(model.gguf, model.tokenizer)
        # Any worker with engine/scheduler.py's interface will do (tests pass their own).
        self.scheduler = scheduler or Scheduler(model, parallel, max_waiting)
        self.metrics = Metrics()
        self.created = int(time.time())
        self.web_files = {"/": WEB_DIR / "index.html"}
        self.web_files.update({f"/web/{p.name}": p for p in sorted(WEB_DIR.iterdir())
                               if p.suffix in CONTENT_TYPES})

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "brass"}

    def health(self) -> dict:
        running, waiting = self.scheduler.counts()
        m = self.model
        return {"status": "ok", "model": self.model_id, "backend": m.backend.name, "n_ctx": m.n_ctx,
                "requests_running": running, "requests_waiting": waiting,
                "tokens_generated": self.scheduler.tokens_generated}

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

    def prepare(self, body: bytes | dict, chat: bool):
        """Validate a completion request and turn it into a job (nothing runs yet): (job, the
        request as its model). CPU work (JSON, the template, the tokenizer): the HTTP layer
        calls it on a worker thread, off its event loop."""
        from .api_models import ChatCompletionRequest, CompletionRequest, validate
        from .sampling import SamplingParams
        if isinstance(body, bytes):
            body = parse_json_body(body)
        req = validate(ChatCompletionRequest if chat else CompletionRequest, body, self.model_id,
                       self.model.config.n_vocab)
        d = SamplingParams()
        try:
            sampling = SamplingParams(
                temperature=d.temperature if req.temperature is None else req.temperature,
                top_p=d.top_p if req.top_p is None else req.top_p,
                top_k=d.top_k if req.top_k is None else req.top_k,
                min_p=d.min_p if req.min_p is None else req.min_p,
                repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed)
        except BrassError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        stop = list(req.stop or [])
        tok = self.model.tokenizer
        try:
            if chat:
                ids = tok.encode(self.template.render(req.messages), add_special=True, parse_special=True)
                stop += self.template.stop_strings
            elif isinstance(req.prompt, str):
                ids = tok.encode(req.prompt, add_special=True, parse_special=True)
            else:
                ids = req.prompt
        except BrassError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = Job(ids, self.budget(len(ids), max_tokens), sampling, stop, tok, on_tokens=self.metrics.tokens)
        return job, req

    def submit(self, job: Job):
        """Queue the job; 503 with Retry-After when the queue is full."""
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        self.metrics.prompt(len(job.prompt_ids))


# --------------------------------------------------------------------------------------------
# Command line


def model_id_for(name: str | None, path: Path) -> str:
    """The id clients name the model by: its catalog name, else its file name."""
    from . import catalog
    if name is None:
        return catalog.DEFAULT_MODEL
    return name if name in catalog.CATALOG else path.name


def raise_open_files_limit():
    """Each connection is a file descriptor: the soft limit (often 1,024) goes up to the hard
    one, as servers do. At the limit, accept() fails and no one new is served, not even /health,
    until connections close."""
    try:
        import resource
    except ImportError:     # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):   # e.g. an unlimited hard limit that the kernel caps lower
            pass


def cmd_serve(args):
    from .model import Model, graphs_enabled
    if args.parallel < 1:
        raise BrassError("--parallel must be >= 1")
    if args.max_waiting < 1:
        raise BrassError("--max-waiting must be >= 1")
    if not 0 <= args.port <= 65535:
        raise BrassError(f"--port {args.port} is not a port number (0-65535; 0 picks a free one)")
    try:
        from . import http_api
    except ImportError as e:
        raise BrassError(f"brass serve needs FastAPI and uvicorn ({e}): pip install -e .") from None
    model = Model(args.model, backend=args.backend, n_ctx=args.ctx)
    app = App(model, model_id_for(args.model, model.path), args.api_key, args.parallel, args.max_waiting)
    if graphs_enabled(model):       # what BatchScheduler.warm_up has work for
        print("brass: loading kernels and capturing decode graphs before the first request",
              file=sys.stderr, flush=True)
        print(f"brass: ready in {app.scheduler.warm_up():.1f} s", file=sys.stderr, flush=True)
    raise_open_files_limit()
    sock = http_api.listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if app.template.is_fallback:
        print(f"brass: {app.model_id} has no chat template; chat requests use ChatML, as llama.cpp does",
              file=sys.stderr)
    print(f"brass: serving {app.model_id} on the {model.backend.name} backend at http://{shown}:{port}/ "
          f"(API: /v1, chat page: /, API docs: /docs){' — API key required' if args.api_key else ''}",
          file=sys.stderr, flush=True)
    try:
        http_api.serve(app, sock)
    except KeyboardInterrupt:   # uvicorn stopped gracefully on Ctrl-C, then raised it again
        pass
    finally:
        sock.close()
        app.scheduler.close()
    print("brass: stopped", file=sys.stderr)


def add_cli(sub, add_model_args):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API and web chat page")
    add_model_args(p, model_optional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("BRASS_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every API request (default: $BRASS_API_KEY)")
    p.add_argument("--parallel", type=int, default=4,
                   help="sequences decoded together, one batched step for all (each holds a KV "
                        "cache); more requests queue")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests queued beyond --parallel before new ones get 503 with Retry-After")
    p.set_defaults(func=cmd_serve)
