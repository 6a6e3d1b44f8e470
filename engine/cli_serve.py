"""`brass serve`: its options, the model, the listening socket, and the server run until Ctrl-C.

The application is engine/server.py's App; HTTP is engine/http_api.py. With --api-key (default
$BRASS_API_KEY) every request must carry `Authorization: Bearer KEY`, except GET /health and
GET /v1/models (open, as in llama-server: load balancers probe one, clients list the model with
the other) and what a browser fetches by navigating: the chat page /, its /web/ files,
/favicon.ico, /docs and /openapi.json. conformance/server/test_server_auth.py holds the table.

Logprobs, as OpenAI defines them (engine/logprobs.py): /v1/completions takes `logprobs` 0-20
(OpenAI's legacy form: tokens, token_logprobs, top_logprobs, text_offset), `echo` (the prompt's
tokens first, the first logprob null; `max_tokens` may then be 0; not with stream) and a batch
of prompts (an array of strings or of token-id lists, one choice each with its index; not with
stream); /v1/chat/completions takes `logprobs: true` and `top_logprobs` 0-20
(choices[].logprobs.content[]: token, logprob, bytes, top_logprobs). A logprob is the float32
log-softmax of the logits the token was picked from, before sampling penalties; an echoed
prompt's are those `brass score --logprobs` prints. POST /tokenize and /detokenize serve the
tokenizer as llama-server does (vLLM's field names accepted).
"""

from __future__ import annotations

import os
import signal
import sys

from . import catalog, flags
from .cli import add_model_args, load_model
from .errors import BrassError

KEY_HELP = ("require 'Authorization: Bearer KEY' on every request but GET /health, GET /v1/models, "
            "the chat page and the API docs (default: $BRASS_API_KEY; unset: no key)")


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
    if args.parallel < 1:
        raise BrassError("--parallel must be >= 1")
    if args.max_waiting < 1:
        raise BrassError("--max-waiting must be >= 1")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise BrassError(f"--kv-blocks must be at least 1, not {args.kv_blocks}")
    if not 0 <= args.port <= 65535:
        raise BrassError(f"--port {args.port} is not a port number (0-65535; 0 picks a free one)")
    if args.api_key == "":
        raise BrassError("--api-key is empty; leave it out to serve without a key")
    api_key = args.api_key if args.api_key is not None else flags.get("BRASS_API_KEY")
    try:
        from . import http_api
    except ImportError as e:
        raise BrassError(f"brass serve needs FastAPI and uvicorn ({e}): pip install -e .") from None
    from .model import graphs_enabled
    from .server import App
    model = load_model(args)
    app = App(model, catalog.model_name(args.model, model.path), api_key, args.parallel, args.max_waiting,
              kv_blocks=args.kv_blocks, prefix_cache=False if args.no_prefix_cache else None)
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
    key = " — API key required (but for /health, /v1/models and the page)" if api_key else ""
    print(f"brass: serving {app.model_id} on the {model.backend.name} backend at http://{shown}:{port}/ "
          f"(API: /v1, chat page: /, API docs: /docs){key}", file=sys.stderr, flush=True)
    try:
        if hasattr(model, "on_failure"):
            # --tp: a worker that dies stops the server as Ctrl-C does, and the error is said
            # below; one that died since the load is told here at once (ProcessRanks.on_failure)
            model.on_failure = lambda why: os.kill(os.getpid(), signal.SIGINT)
        http_api.serve(app, sock)
    except KeyboardInterrupt:   # uvicorn stopped gracefully on Ctrl-C, then raised it again
        pass
    finally:
        sock.close()
        app.scheduler.close()
    if getattr(model, "failure", None) is not None:
        raise BrassError(model.failure)
    print("brass: stopped", file=sys.stderr)


def add_cli(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API and web chat page",
                       description="An OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                                   "/v1/models), /health, /metrics (Prometheus), a chat page at / and "
                                   "the API's documentation at /docs. Logprobs as OpenAI gives them: "
                                   "completions' logprobs (0-20) and echo (max_tokens 0 allowed), a "
                                   "batch of prompts per completion request, chat's logprobs and "
                                   "top_logprobs (0-20); the float32 log-softmax of the logits each "
                                   "token was picked from, before penalties. POST /tokenize {content, "
                                   "add_special, with_pieces} and /detokenize {tokens}, as "
                                   "llama-server (vLLM's prompt and add_special_tokens too). With "
                                   "--api-key, every request "
                                   "needs 'Authorization: Bearer KEY' except GET /health, GET "
                                   "/v1/models and what a browser opens: the page, its files, "
                                   "/favicon.ico, /docs and /openapi.json. Request fields Brass does "
                                   "not read are ignored, logged once, and named in each reply's "
                                   "X-Brass-Ignored-Fields header.")
    add_model_args(p, model_optional=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0: every address)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    # Read when the command runs (flags.get), not here: the parser is built for every command.
    p.add_argument("--api-key", default=None, metavar="KEY", help=KEY_HELP)
    p.add_argument("--parallel", type=int, default=4,
                   help="sequences decoded together, one batched step for all (each holds a KV "
                        "cache); more requests queue (default: 4)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests queued beyond --parallel before new ones get 503 with Retry-After "
                        "(default: 64)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV blocks of 16 tokens shared by all sequences; a request waits until "
                        "its blocks are free (default: BRASS_KV_BLOCKS, else --parallel times the "
                        "context's blocks, on CUDA at most half the free device memory)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="read every prompt whole instead of reusing the cached KV blocks of its "
                        "longest prefix read before (default: BRASS_PREFIX_CACHE, on)")
    p.set_defaults(func=cmd_serve)
