"""Planted wrong servers for `brass conform` (engine/conform.py): an HTTP proxy in front of a real
OpenAI-compatible server (`brass serve`) that relays every request and plants one defect, named
by `mode`, into what it relays. `brass conform` graded through it must fail, naming the check
that catches the defect (conformance/tools/test_conform.py; ci/grade_engines.py in CI).

The proxy keeps every upstream reply by (method, path, body): the goldens' prompts are the same
in every run, so the forward passes run once (in the honest run) however many defects are graded.

Modes:
- "swap": in one echo (`swap_at`: the prompt's ids and the echo entry), the top-1 and top-2
  tokens trade logprobs;
- "sharpen": echo logprobs doubled (the logits' gaps twice as wide, their order kept);
- "unnormalized": echo logprobs raised by 10 (a server that leaves out part of the log-sum-exp:
  gaps and order kept, the absolute values wrong);
- "second-best": each greedy stream's first token replaced by the runner-up;
- "drop-bos": a server that never adds BOS: /tokenize loses its leading BOS and token-id prompts
  reach the model without it (on a model whose prompts start with BOS: gemma3-270m);
- "drop-first-token": /tokenize with add_special loses its first token (on a model without BOS);
- "no-generation-prompt": a chat template rendered without the generation prompt, as the server
  counts it in `usage.prompt_tokens` (needs `template`);
- "lacks": no /tokenize (404) and no echo (400);
- "other-file": /v1/models reports another vocabulary (llama-server's `meta.n_vocab`);
- "other-id": /v1/models' one model id is another catalog model.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("swap", "sharpen", "unnormalized", "second-best", "drop-bos", "drop-first-token",
         "no-generation-prompt", "lacks", "other-file", "other-id")


class Proxy:
    """An HTTP proxy to `upstream` on a loopback port of its own (`url`); `mode` names the defect
    planted (None: relay as is). `bos`: the model's BOS id (for "drop-bos"); `template`: its
    brass.chat_template.ChatTemplate (for "no-generation-prompt"); `routes`: paths relayed to
    another upstream (a server's missing routes lent by another, e.g. lm-eval's tokenizer routes)."""

    def __init__(self, upstream: str, bos: int | None = None, template=None, timeout: float = 1800,
                 routes: dict | None = None):
        self.upstream, self.mode, self.bos, self.template, self.timeout = upstream, None, bos, template, timeout
        self.routes = dict(routes or {})        # path → another upstream for it
        self.cache: dict = {}
        self.lock = threading.Lock()
        self.swap_at: tuple[list, int] | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.handle(self, "GET", None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.handle(self, "POST", body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def fetch(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        key = (method, path, body)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
        req = urllib.request.Request(self.routes.get(path, self.upstream) + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                got = (r.status, r.read())
        except urllib.error.HTTPError as e:
            got = (e.code, e.read())
        with self.lock:
            self.cache[key] = got
        return got

    def fetch_json(self, path: str, request: dict) -> dict:
        status, data = self.fetch("POST", path, json.dumps(request).encode())
        if status != 200:
            raise RuntimeError(f"upstream {path}: HTTP {status} {data[:200]!r}")
        return json.loads(data)

    def handle(self, h, method: str, body: bytes | None):
        try:
            request = json.loads(body) if body else {}
            sent = self.rewrite_request(h.path, request)
            if sent is not request:
                body = json.dumps(sent).encode()
            status, data = self.fetch(method, h.path, body)
            if status == 200:
                status, reply = self.plant(h.path, request, status, json.loads(data))
                data = json.dumps(reply).encode()
        except Exception as e:      # a planted server that breaks says why, as a 500
            status, data = 500, json.dumps({"error": {"message": f"planted proxy: {e!r}"}}).encode()
        self.send(h, status, data)

    @staticmethod
    def send(h, status: int, data: bytes):
        """The reply to the request `h` handles: a JSON body with its status."""
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def rewrite_request(self, path: str, request: dict) -> dict:
        """The request as the planted server's model sees it."""
        if self.mode == "drop-bos" and path == "/v1/completions":
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and prompt[0] == self.bos:
                return dict(request, prompt=prompt[1:])
        return request

    def plant(self, path: str, request: dict, status: int, reply: dict):
        mode = self.mode
        echo = path == "/v1/completions" and request.get("echo") and request.get("logprobs")
        stream = path == "/v1/completions" and not request.get("echo") and request.get("logprobs")
        if mode == "swap" and echo:
            ids, entry = self.swap_at
            if request["prompt"] == ids:
                top = reply["choices"][0]["logprobs"]["top_logprobs"][entry]
                (a, va), (b, vb) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
                top[a], top[b] = vb, va
        elif mode in ("sharpen", "unnormalized") and echo:
            lp = reply["choices"][0]["logprobs"]
            f = (lambda v: 2 * v) if mode == "sharpen" else (lambda v: v + 10.0)
            lp["top_logprobs"] = [None if t is None else {k: f(v) for k, v in t.items()}
                                  for t in lp["top_logprobs"]]
            lp["token_logprobs"] = [None if v is None else f(v) for v in lp["token_logprobs"]]
        elif mode == "second-best" and stream:
            lp = reply["choices"][0]["logprobs"]
            best, second = sorted(lp["top_logprobs"][0].items(), key=lambda kv: -kv[1])[:2]
            lp["tokens"][0] = second[0]
        elif mode == "drop-bos" and path == "/tokenize" and request.get("add_special"):
            if reply["tokens"][:1] == [self.bos]:
                reply["tokens"] = reply["tokens"][1:]
        elif mode == "drop-first-token" and path == "/tokenize" and request.get("add_special"):
            reply["tokens"] = reply["tokens"][1:]
        elif mode == "no-generation-prompt" and path == "/v1/chat/completions":
            text = self.template.render(request["messages"], add_generation_prompt=False)
            ids = self.fetch_json("/tokenize", {"content": text, "add_special": True, "parse_special": True})
            reply["usage"]["prompt_tokens"] = len(ids["tokens"])
        elif mode == "lacks" and (path == "/tokenize" or request.get("echo")):
            return (404 if path == "/tokenize" else 400), {"error": {"message": "not supported"}}
        elif mode == "other-file" and path == "/v1/models":
            reply["data"][0]["meta"] = {"n_vocab": 151936}
        elif mode == "other-id" and path == "/v1/models":
            reply["data"][0]["id"] = "gemma3-270m"
        return status, reply
