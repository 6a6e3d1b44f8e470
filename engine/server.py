"""The application behind `brass serve`: what a request becomes (App), and the counters behind
/metrics. No HTTP here, and no command line (engine/cli_serve.py parses `brass serve` and starts
the server).

    POST /v1/chat/completions   POST /v1/completions   (`"stream": true` → server-sent events)
    POST /tokenize              POST /detokenize       (llama-server's; vLLM's field names too)
    GET  /v1/models             GET  /v1/models/{id}   GET /health   GET /metrics (Prometheus)
    GET  / (the chat page)      GET  /docs (the OpenAPI page)        GET /favicon.ico

The layers, each its own module:
    engine/api.py         OpenAI's error body; the request body read as strict JSON
    engine/api_models.py  the request bodies as pydantic models (schema and validation)
    engine/scheduler.py   jobs, and the interface of the worker thread that generates them
                          (engine/serving.py's BatchScheduler: continuous batching)
    engine/server.py      this file: what a request becomes (App), the counters behind /metrics
    engine/http_api.py    HTTP on FastAPI + uvicorn: routes, who needs the API key, server-sent
                          events, clients that leave, error bodies for everything
    engine/cli_serve.py   the `serve` command: its options, the model, the listening socket

Generation runs on the scheduler's thread, never on the event loop. With `--api-key` (or
$BRASS_API_KEY) a request must carry `Authorization: Bearer KEY`, except those a browser or a
load balancer makes without it: the chat page and its files, the favicon, /docs and
/openapi.json, /health and /v1/models (as llama-server leaves /health and /v1/models open).
The page sends the key it is given with each of its API calls.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from urllib.parse import quote

from .api import APIError, parse_json_body
from .errors import BrassError, ParameterError
from .sampling import generation_length
from .scheduler import Job, QueueFull, Scheduler, StopScanner  # noqa: F401 (StopScanner: tests)

WEB_DIR = Path(__file__).parent / "web"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".ico": "image/x-icon"}
# The response header naming the request's fields that Brass ignored (api_models.ignored_fields).
IGNORED_HEADER = "X-Brass-Ignored-Fields"
# A body with hundreds of unknown fields gets a header of this many names, then a count.
IGNORED_SHOWN = 16
log = logging.getLogger("brass.server")
# What a client whose request found the queue full is told to wait before it retries.
RETRY_AFTER_S = 5


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
        kv = scheduler.kv_counts() if hasattr(scheduler, "kv_counts") else None
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
             "their step ahead kept for the rows that stay or dropped (the scheduler's keep_ahead option).",
             [(f'{{step="{k}"}}', v) for k, v in getattr(scheduler, "runs_ended", {}).items()]),
            ("brass_tokens_per_second", "gauge",
             f"Tokens generated per second over the last {self.generated.window} s.",
             [("", round(self.generated.rate(), 3))]),
            ("brass_kv_blocks", "gauge",
             "KV blocks of the shared pool (16 tokens each): held by sequences, "
             "cached (a prompt prefix kept for reuse, evicted least recently used), free.",
             [(f'{{state="{k}"}}', v) for k, v in (kv or {}).items()]),
            ("brass_prompt_tokens_cached_total", "counter",
             "Prompt tokens not read because their KV blocks were cached (prefix caching).",
             [("", getattr(getattr(scheduler, "kv", None), "cached_tokens", 0))]),
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
                 scheduler=None, **scheduler_options):
        from .chat_template import ChatTemplate
        self.model, self.model_id, self.api_key = model, model_id, api_key
        self.parallel, self.max_waiting = parallel, max_waiting
        self.template = ChatTemplate.from_gguf(model.gguf, model.tokenizer)
        # Any worker with engine/scheduler.py's interface will do (tests pass their own).
        # scheduler_options: BatchScheduler's (kv_blocks, prefix_cache)
        self.scheduler = scheduler or Scheduler(model, parallel, max_waiting, **scheduler_options)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._warned: set[str] = set()      # field names already logged as ignored
        # the page, its files, and the icon browsers ask for at /favicon.ico (else a 404 in
        # every browser's console)
        self.web_files = {"/": WEB_DIR / "index.html", "/favicon.ico": WEB_DIR / "favicon.ico"}
        self.web_files.update({f"/web/{p.name}": p for p in sorted(WEB_DIR.iterdir())
                               if p.suffix in (".html", ".js", ".css")})

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "brass"}

    def health(self) -> dict:
        running, waiting = self.scheduler.counts()
        m = self.model
        return {"status": "ok", "model": self.model_id, "backend": m.backend.name, "n_ctx": m.n_ctx,
                "requests_running": running, "requests_waiting": waiting,
                "tokens_generated": self.scheduler.tokens_generated}

    def warn_ignored(self, path: str, names: list[str]):
        """One warning in the server's log for each field name ignored for the first time (a
        client that always sends `user` would otherwise fill the log; every reply still names
        them in its header). A bounded memory: a fuzzer's random names do not grow it for ever."""
        new = [n for n in names if n not in self._warned]
        if not new:
            return
        if len(self._warned) < 1000:
            self._warned.update(new)
        log.warning("%s: ignored field%s %s (Brass does not read %s; reported once per field name, "
                    "and to the client in the %s header)", path, "" if len(new) == 1 else "s",
                    ignored_header(new), "it" if len(new) == 1 else "them", IGNORED_HEADER)

    def prepare(self, body: bytes | dict, chat: bool):
        """Validate a completion request and turn it into a job (nothing runs yet): (job, the
        request as its model). CPU work (JSON, the template, the tokenizer): the HTTP layer
        calls it on a worker thread, off its event loop. Fields it ignores go to the log and
        into the reply's header (reply_headers), an error's included."""
        from .api_models import ChatCompletionRequest, CompletionRequest, ignored_fields
        if isinstance(body, bytes):
            body = parse_json_body(body)
        cls = ChatCompletionRequest if chat else CompletionRequest
        ignored = ignored_fields(cls, body)
        if ignored:
            self.warn_ignored("/v1/chat/completions" if chat else "/v1/completions", ignored)
        try:
            job, req = self._prepare(cls, body, chat)
        except APIError as e:
            if ignored:
                e.headers = {**e.headers, IGNORED_HEADER: ignored_header(ignored)}
            raise
        req._ignored = ignored
        return job, req

    def _prepare(self, cls, body: dict, chat: bool):
        from .api_models import validate
        from .sampling import SamplingParams
        req = validate(cls, body, self.model_id, self.model.config.n_vocab)
        d = SamplingParams()
        try:
            sampling = SamplingParams(
                temperature=d.temperature if req.temperature is None else req.temperature,
                top_p=d.top_p if req.top_p is None else req.top_p,
                top_k=d.top_k if req.top_k is None else req.top_k,
                min_p=d.min_p if req.min_p is None else req.min_p,
                repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed)
        except ParameterError as e:
            raise parameter_error(e) from None
        stop = list(req.stop or [])
        tok = self.model.tokenizer
        if chat:
            prompts, stop = [None], stop + self.template.stop_strings
        else:
            prompts = req.prompts()
        # the client's own name for the length: the newer one wins, as api_models reads them
        length = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        echo = bool(not chat and req.echo)
        # with echo, 0 new tokens is a request of its own: the prompt's logprobs alone
        asked = getattr(req, length)
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        jobs = []
        for i, prompt in enumerate(prompts):
            where = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            try:
                if chat:
                    ids = tok.encode(self.template.render(req.messages), add_special=True, parse_special=True)
                elif isinstance(prompt, str):
                    ids = tok.encode(prompt, add_special=True, parse_special=True)
                else:
                    ids = prompt
            except BrassError as e:     # the template or the tokenizer refused the text
                raise APIError(400, str(e), code="invalid_value", param=where) from None
            try:
                max_tokens = generation_length(None if echo and asked == 0 else asked, len(ids), self.model.n_ctx)
            except ParameterError as e:
                raise parameter_error(e, {"max_tokens": length, "prompt": where}) from None
            if echo and asked == 0:
                max_tokens = 0
            jobs.append(Job(ids, max_tokens, sampling, stop, tok, on_tokens=self.metrics.tokens,
                            logprobs=logprobs, echo=echo))
        req._jobs = jobs
        return jobs[0], req

    def tokenize(self, body: bytes | dict) -> dict:
        """POST /tokenize: {"tokens": [...]} (with_pieces: [{"id", "piece"}]); asked in vLLM's
        form (`prompt`), also its `count` and `max_model_len`. Special-token text is parsed,
        as llama-server does."""
        from .api_models import TokenizeRequest, validate
        if isinstance(body, bytes):
            body = parse_json_body(body)
        req = validate(TokenizeRequest, body, self.model_id)
        add = req.add_special if req.add_special is not None else req.add_special_tokens
        if add is None:
            add = req.content is None       # each server's own default: llama-server's false, vLLM's true
        tok = self.model.tokenizer
        try:
            ids = tok.encode(req.text(), add_special=add, parse_special=True)
        except BrassError as e:
            raise APIError(400, str(e), code="invalid_value",
                           param="content" if req.content is not None else "prompt") from None
        out: dict = {"tokens": ids}
        if req.with_pieces:
            def piece(i):
                b = tok.token_to_piece(i)
                try:
                    return b.decode("utf-8")
                except UnicodeDecodeError:
                    return list(b)
            out["tokens"] = [{"id": i, "piece": piece(i)} for i in ids]
        if req.content is None:
            out.update(count=len(ids), max_model_len=self.model.n_ctx)
        return out

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info, as vLLM serves it: what lm-eval's remote tokenizer reads (it asks
        for it before /tokenize, and takes the special tokens' ids from their texts)."""
        tok = self.model.tokenizer

        def text(i):
            return None if i is None or i < 0 else tok.token_to_piece(i).decode("utf-8", errors="replace")
        eos = tok.eos_id if tok.eos_id is not None and tok.eos_id >= 0 else tok.eot_id
        return {"tokenizer_class": "brass", "eos_token": text(eos), "bos_token": text(tok.bos_id),
                "pad_token": None, "add_bos_token": bool(tok.add_bos), "model_max_length": self.model.n_ctx}

    def detokenize(self, body: bytes | dict) -> dict:
        """POST /detokenize: {"content": text} (and vLLM's name of it, `prompt`)."""
        from .api_models import DetokenizeRequest, validate
        if isinstance(body, bytes):
            body = parse_json_body(body)
        req = validate(DetokenizeRequest, body, self.model_id, self.model.config.n_vocab)
        text = self.model.tokenizer.decode(req.tokens)
        return {"content": text, "prompt": text}

    @staticmethod
    def reply_headers(req) -> dict:
        """The headers of a reply to `req` (from prepare): the fields it ignored, if any."""
        return {IGNORED_HEADER: ignored_header(req._ignored)} if req._ignored else {}

    def submit(self, job: Job):
        """Queue the job; 503 with Retry-After when the queue is full."""
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        self.metrics.prompt(len(job.prompt_ids))


def parameter_error(e: ParameterError, fields: dict | None = None) -> APIError:
    """The engine's ParameterError as a 400 naming the request's field (`fields` maps the
    engine's name of a parameter to the request's, where they differ)."""
    field = (fields or {}).get(e.param, e.param)
    return APIError(400, e.named(f"'{field}'"), code=e.code, param=field)


def ignored_header(names: list[str]) -> str:
    """The field names for a header and a log line: a name of letters, digits and _.- as is,
    any other percent-encoded (a name is any JSON string: a newline, a non-Latin-1 character
    or a lone surrogate must not reach a header), at most IGNORED_SHOWN of them."""
    shown = [n if re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", n)
             else quote(n[:64].encode("utf-8", "backslashreplace"), safe="") or '""'
             for n in names[:IGNORED_SHOWN]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", and {more} more" if more > 0 else "")
