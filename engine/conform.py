"""`brass conform URL`: grade any OpenAI-compatible server by the conformance suite's own rules,
against the llama.cpp goldens of a catalog model (golden/; golden/README.md says what they hold).

A pure client: the standard library's HTTP client and the golden files, nothing of the server
side. Checks, per model (each skipped, and named as skipped, where the server lacks the route or
the field: a 404 or 400):

- greedy: each golden prompt (as token ids) through /v1/completions at temperature 0 with
  `logprobs`; the stream must equal llama.cpp's greedy tokens up to the first step whose
  llama.cpp margin (step or teacher-forced) is below STREAM_EPS (the suite's
  tolerances.STREAM_EPS for real models);
- teacher-forced argmax: prompt + golden tokens with `echo: true, logprobs: K, max_tokens: 0`;
  the top-1 must be llama.cpp's wherever llama.cpp's margin exceeds ARGMAX_EPS
  (tolerances.ARGMAX_EPS, CPU set, real models);
- top-k gaps: at those positions, the gaps top-1 minus top-i (i < GAP_K) of the server's
  logprobs against those of llama.cpp's logits (a logprob is the logit shifted by a constant
  per position: the gaps are what the shift leaves), bounded by SPREAD_FACTOR times the worst
  gap difference between llama.cpp's own CPU and CUDA backends on the positions where those
  two settle (golden/cuda/; test_models.settled_positions);
- top-1 logprob: at those positions, the server's logprob of llama.cpp's top-1 token against
  llama.cpp's logit minus the position's log-sum-exp (the goldens' `lse`), within the gaps'
  bound (the reason is at check_teacher_forced): what a per-position shift hides from the gaps;
- tokenize: /tokenize (llama-server's form; llama-cpp-python's /extras/tokenize where that is
  missing) of every golden prompt and of every tokenizer-golden string with add_special and
  parse_special on, as llama.cpp's completion tokenizes;
- chat template: `usage.prompt_tokens` of a chat request against the length of llama.cpp's
  rendering of the model's template (golden/chat_templates/), for the cases that add the
  generation prompt.

Token identity: a reply that carries ids (llama-server's `logprobs.content[].id`) is compared by
id; one that carries only token text (OpenAI's legacy completions form, Brass's) by text, the
goldens' ids turned into text through the server's /detokenize of each id alone (ids whose texts
coincide, e.g. partial UTF-8 pieces, compare equal: the comparison is as fine as the text the
server gives; a server whose /detokenize of one token differs from the token's text in its
logprobs, e.g. one that strips a SentencePiece leading space there, shows as disagreements).

Prompts go as token ids; to a server that refuses them (llama-cpp-python's takes strings only)
as the golden text, and for the teacher-forced pass the text of the generated ids appended (its
/detokenize): the echo's tokens show whether the server's tokens are the golden ids, and a prompt
whose echo holds other tokens is left out and named. An echo that leaves out the first token
(BOS; llama-cpp-python's does) is aligned by its tokens. `--checks` limits a run to some groups.

Exit status (engine/cli.py): 0 every check holds, 1 a check fails or the server's file is another,
2 usage errors and a server that cannot be graded (unreachable, timing out, answering 5xx).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import catalog
from .errors import BrassError

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
# The suite's bounds for real models against llama.cpp's CPU goldens
# (conformance/harness/tolerances.py gives the measurements behind them):
# greedy tokens are compared up to the first step whose llama.cpp margin is below this
# (llama.cpp's own step-by-step and batched passes differ by up to 1.65 logits);
STREAM_EPS = 1.0
# teacher-forced argmax must agree where llama.cpp's top-1/top-2 margin exceeds this (twice the
# largest margin at which the numpy backend's argmax differed, 0.345);
ARGMAX_EPS = 0.75
# the top-k gaps may be off by this factor times llama.cpp's own CPU-vs-CUDA spread of the same
# gaps (tolerances.SPREAD_ARGMAX_FACTOR: that spread is one sample of a backend's rounding);
SPREAD_FACTOR = 2.0
# gaps compared: top-1 against top-2 .. top-GAP_K (OpenAI's legacy completions allow 5 logprobs)
GAP_K = 5
# the least share of teacher-forced positions with a clear margin for the check to mean anything
# (tolerances.MIN_COVERAGE)
MIN_COVERAGE = 0.5


class ConformError(BrassError):
    """The server cannot be graded (unreachable, timed out, a reply that is not JSON)."""


class Unsupported(Exception):
    """The server answered 400, 404, 405, 422 or 501: it lacks the route or the field."""

    def __init__(self, what: str, status: int, message: str):
        super().__init__(f"{what}: HTTP {status} {message}".strip())
        self.status = status


class ServerError(ConformError):
    """The server answered 5xx: it failed on a request it took. A check that probes a form the
    server may not take (token-id prompts, one token's text) reads it as a refusal."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# The client


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        url = url.rstrip("/")
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConformError(f"not an http(s) URL: {url!r} (e.g. http://127.0.0.1:8080)")
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self.routes: dict[str, bool] = {}      # route → whether the server has it, once known

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            # one line: a server may put a traceback in its error (llama-cpp-python does)
            text = " ".join(str(text).split("\n", 1)[0].split())
            text = text if len(text) <= 160 else text[:157] + "..."
            if e.code in (400, 404, 405, 422, 501):
                raise Unsupported(f"{method} {path}", e.code, text) from None
            if e.code in (401, 403):
                raise ConformError(f"{self.url}{path}: HTTP {e.code} {text} (give --api-key)") from None
            if e.code >= 500:
                raise ServerError(f"{self.url}{path}: HTTP {e.code} {text}", e.code) from None
            raise ConformError(f"{self.url}{path}: HTTP {e.code} {text}") from None
        except TimeoutError:
            raise ConformError(f"{self.url}{path}: no answer within {self.timeout:g} s (--timeout)") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise ConformError(f"{self.url}{path}: no answer within {self.timeout:g} s (--timeout)") from None
            raise ConformError(f"cannot reach {self.url}: {reason}") from None
        except OSError as e:
            raise ConformError(f"cannot reach {self.url}: {e}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ConformError(f"{self.url}{path}: the reply is not JSON: {raw[:80]!r}") from None


# --------------------------------------------------------------------------------------------
# The goldens (read straight from golden/: this module needs no test harness)


def _golden(rel: str) -> dict:
    path = GOLDEN_DIR / rel
    if not path.is_file():
        raise ConformError(f"missing golden file {path}: brass conform reads the goldens of a source checkout")
    return json.loads(path.read_text(encoding="utf-8"))


def _manifest_entry(name: str) -> dict:
    for m in _golden("manifest.json")["models"]:
        if m["name"] == name:
            return m
    raise ConformError(f"no goldens for {name!r}")


def golden_prompts(name: str, reference: str = "") -> list[dict]:
    return _golden(f"{reference}prompts/{name}.json")["prompts"]


def gap_spread(name: str) -> float | None:
    """The worst |Δ(top-1 − top-i)| (i < GAP_K) between llama.cpp's CPU and CUDA goldens, over
    the teacher-forced positions both cover with the same ids where their argmax agrees, the two
    top-1 logits lie within the CUDA margin of each other and the CPU margin exceeds ARGMAX_EPS
    (the positions test_models.settled_positions calls settled); None without a CUDA set."""
    if not (GOLDEN_DIR / "cuda" / "prompts" / f"{name}.json").is_file():
        return None
    worst = 0.0
    for cpu, cuda in zip(golden_prompts(name), golden_prompts(name, "cuda/")):
        ids_c = cpu["prompt_ids"] + cpu["generated_ids"]
        ids_g = cuda["prompt_ids"] + cuda["generated_ids"]
        common = 0
        while common < min(len(ids_c), len(ids_g)) and ids_c[common] == ids_g[common]:
            common += 1
        tc, tg = cpu["teacher_forced"], cuda["teacher_forced"]
        for j in range(min(common, len(tc["topk"]), len(tg["topk"]))):
            if tc["argmax"][j] != tg["argmax"][j] or tc["margin"][j] <= ARGMAX_EPS:
                continue
            if abs(tc["topk"][j][0][1] - tg["topk"][j][0][1]) >= tg["margin"][j]:
                continue
            gc = dict(tc["topk"][j])
            g1 = tc["topk"][j][0][1]
            c1 = tg["topk"][j][0][1]
            for i, v in tg["topk"][j][1:GAP_K]:
                if i in gc:
                    worst = max(worst, abs((c1 - v) - (g1 - gc[i])))
    return worst


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Check:
    name: str
    status: str = "pass"            # pass, fail, skipped
    checked: int = 0
    agreed: int = 0
    worst_gap: float | None = None
    bound: str = ""
    divergence: str = ""            # the first failure, with both engines' top-5
    note: str = ""

    def fail(self, text: str):
        if self.status != "fail":
            self.status, self.divergence = "fail", text

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "status", "checked", "agreed", "worst_gap",
                                               "bound", "divergence", "note")}


@dataclass
class ModelReport:
    model: str
    file: str
    identity: str
    checks: list[Check] = field(default_factory=list)
    refused: str = ""

    @property
    def passed(self) -> bool:
        return not self.refused and all(c.status != "fail" for c in self.checks)

    def as_dict(self) -> dict:
        return {"model": self.model, "file": self.file, "identity": self.identity,
                "refused": self.refused or None, "passed": self.passed,
                "checks": [c.as_dict() for c in self.checks]}

    def table(self) -> str:
        lines = [f"{self.model}: expects {self.file}; server's file: {self.identity}"]
        if self.refused:
            return "\n".join(lines + [f"  REFUSED: {self.refused}"])
        lines.append(f"  {'check':22s} {'status':8s} {'checked':>7s} {'agreed':>7s} {'worst gap':>10s}  bound")
        for c in self.checks:
            gap = "-" if c.worst_gap is None else f"{c.worst_gap:.3f}"
            lines.append(f"  {c.name:22s} {c.status:8s} {c.checked:7d} {c.agreed:7d} {gap:>10s}  {c.bound}")
        for c in self.checks:
            if c.divergence:
                lines.append(f"  {c.name}: first divergence: {c.divergence}")
            if c.note:
                lines.append(f"  {c.name}: {c.note}")
        return "\n".join(lines)


@dataclass
class Report:
    url: str
    models: list[ModelReport]

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.models)

    def failures(self) -> list[str]:
        out = []
        for m in self.models:
            if m.refused:
                out.append(f"{m.model}: refused")
            out += [f"{m.model}: {c.name}" for c in m.checks if c.status == "fail"]
        return out

    def as_dict(self) -> dict:
        return {"url": self.url, "passed": self.passed, "failed": self.failures(),
                "models": [m.as_dict() for m in self.models]}

    def table(self) -> str:
        tail = "every check holds" if self.passed else "FAILED: " + ", ".join(self.failures())
        return "\n\n".join([m.table() for m in self.models] + [f"{self.url}: {tail}"])


# --------------------------------------------------------------------------------------------
# Replies: token ids or texts, and their logprobs


@dataclass
class Entry:
    """One position of a reply's logprobs: its token (id or text) and the top alternatives."""
    token: object
    logprob: float | None
    top: dict       # token (id or text) → logprob


def reply_entries(choice: dict) -> tuple[list[Entry], bool]:
    """(the entries, whether they are keyed by id) of a choice's logprobs, in either form:
    llama-server's / OpenAI chat's `content` list, or the legacy completions lists."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return [], False
    if isinstance(lp.get("content"), list):
        content = lp["content"]
        by_id = all("id" in e for e in content) and all("id" in t for e in content for t in e.get("top_logprobs") or ())
        key = (lambda e: e["id"]) if by_id else (lambda e: e["token"])
        return [Entry(key(e), e.get("logprob"), {key(t): t["logprob"] for t in e.get("top_logprobs") or ()})
                for e in content], by_id
    tokens = lp.get("tokens") or []
    lps = lp.get("token_logprobs") or [None] * len(tokens)
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [Entry(t, v, dict(top or {})) for t, v, top in zip(tokens, lps, tops)], False


# The forms of tokenization routes: llama-server's, vLLM's and Brass's /tokenize and /detokenize
# first, then llama-cpp-python's /extras/tokenize (which tokenizes as add_special and
# parse_special do: BOS added, special tokens parsed) and /extras/detokenize.
TOKENIZE_ROUTES = (
    ("/tokenize", lambda text: {"content": text, "add_special": True, "parse_special": True}),
    ("/extras/tokenize", lambda text: {"input": text}),
)
DETOKENIZE_ROUTES = (("/detokenize", "content"), ("/extras/detokenize", "text"))


def _first_route(client: Client, routes, call):
    """call(route) on the first route the server has (remembered per client), raising the first
    route's Unsupported where it has none."""
    first = None
    for route in routes:
        if client.routes.get(route[0]) is False:
            continue
        try:
            out = call(route)
        except Unsupported as e:
            if e.status in (404, 405):     # no such route: the next form, from now on
                client.routes[route[0]] = False
            first = first or e
            continue
        client.routes[route[0]] = True
        return out
    raise first or Unsupported(routes[0][0], 404, "")


def tokenize(client: Client, text: str) -> list[int]:
    def call(route):
        r = client.request("POST", route[0], route[1](text))
        return [t["id"] if isinstance(t, dict) else t for t in r.get("tokens", [])]
    return _first_route(client, TOKENIZE_ROUTES, call)


def detokenize(client: Client, ids: list[int]) -> str:
    def call(route):
        r = client.request("POST", route[0], {"tokens": list(ids)})
        return r.get(route[1], r.get("content", r.get("prompt")))
    return _first_route(client, DETOKENIZE_ROUTES, call)


class Texts:
    """Golden ids as the server's token texts, through its /detokenize (cached). An id the server
    fails to detokenize alone (llama-cpp-python answers 500 for a partial UTF-8 piece) gets a
    text no reply can hold: a position that needs it disagrees."""

    def __init__(self, client: Client, pool: ThreadPoolExecutor):
        self.client, self.pool, self.cache = client, pool, {}

    def need(self, ids):
        todo = sorted({int(i) for i in ids} - set(self.cache))

        def one(i):
            try:
                return i, detokenize(self.client, [i])
            except ServerError:
                return i, f"\x00(id {i}: the server cannot detokenize it alone)"
        for i, text in self.pool.map(one, todo):
            self.cache[i] = text

    def __getitem__(self, i):
        return self.cache[int(i)]


def _fmt_top(top: dict, limit: int = 5) -> str:
    items = sorted(top.items(), key=lambda kv: -kv[1])[:limit]
    return "[" + ", ".join(f"{k!r} {v:.2f}" for k, v in items) + "]"


# --------------------------------------------------------------------------------------------
# The checks


# Sent with every completion: llama.cpp's repeat penalty off. llama-cpp-python's server applies
# its default 1.1 even at temperature 0 unless told, and a penalized stream is not greedy; servers
# without the field ignore it (Brass, vLLM) or default it to 1.0 already (llama-server).
NO_PENALTY = {"repeat_penalty": 1.0}


@dataclass
class PromptForm:
    """How the golden prompts reach the server: as token ids where it takes them, else as text
    (llama-cpp-python's server takes strings only), whose tokenization the tokenize check
    grades and the echo shows."""
    ids: bool = True
    note: str = ""


def probe_prompt_form(client: Client, model_id: str, name: str) -> PromptForm:
    p = golden_prompts(name)[0]
    body = {"model": model_id, "prompt": p["prompt_ids"], "max_tokens": 1, "temperature": 0, **NO_PENALTY}
    try:
        client.request("POST", "/v1/completions", body)
        return PromptForm()
    except (Unsupported, ServerError) as e:
        refused = e
    client.request("POST", "/v1/completions", dict(body, prompt=p["text"]))
    return PromptForm(False, f"the server takes no token-id prompts ({refused}): prompts sent as text")


def check_greedy(client, pool, model_id, name, key_of, form: PromptForm) -> Check:
    c = Check("greedy", bound=f"up to margin < {STREAM_EPS}", note=form.note)
    prompts = golden_prompts(name)

    def run(p):
        return client.request("POST", "/v1/completions", {
            "model": model_id, "prompt": p["prompt_ids"] if form.ids else p["text"],
            "max_tokens": len(p["generated_ids"]), "temperature": 0, "logprobs": GAP_K, "stream": False,
            **NO_PENALTY})
    try:
        replies = list(pool.map(run, prompts))
    except Unsupported as e:
        c.status, c.note = "skipped", f"server lacks it ({e})"
        return c
    for p, r in zip(prompts, replies):
        choice = r["choices"][0]
        entries, by_id = reply_entries(choice)
        if not entries:
            c.status, c.note = "skipped", "the reply carries no logprobs (tokens cannot be told apart)"
            return c
        keyed = key_of(by_id)
        gen, steps, tf = p["generated_ids"], p["generated_topk"], p["teacher_forced"]
        first = len(p["prompt_ids"]) - 1
        for i, g in enumerate(gen):
            margin = min(steps[i][0][1] - steps[i][1][1], tf["margin"][first + i])
            if margin < STREAM_EPS:
                break
            c.checked += 1
            if i < len(entries) and entries[i].token == keyed(g):
                c.agreed += 1
                continue
            if i == len(entries) and p["stop"] == "eog" and i == len(gen) - 1 \
                    and choice.get("finish_reason") == "stop":
                c.agreed += 1       # the server ended at the same end-of-generation token
                continue
            ours = entries[i].top if i < len(entries) else {}
            got = entries[i].token if i < len(entries) else "(ended)"
            c.fail(f"prompt {p['name']} token {i}: server {got!r}, llama.cpp {keyed(g)!r} (margin {margin:.3f}); "
                   f"server top-5 {_fmt_top(ours)}, llama.cpp top-5 "
                   f"{_fmt_top({keyed(t): v for t, v in steps[i][:5]})}")
            break
    return c


def echo_shift(entries: list[Entry], want: list, keyed) -> int | None:
    """Where token k of `want` sits in an echo: at entry k + 0, or at entry k - 1 where the server
    leaves the first token (BOS) out of its echo (llama-cpp-python does); chosen by which
    alignment matches more of the echo's tokens, None where neither matches most of them."""
    best, shift = 0, None
    for s in (0, 1):
        n = len(want) - s
        if len(entries) < n:
            continue
        hits = sum(entries[k].token == keyed(want[k + s]) for k in range(n))
        if hits > best and 2 * hits > n:
            best, shift = hits, s
    return shift


def _best(top: dict):
    return max(top.items(), key=lambda kv: kv[1])[0] if top else None


def check_teacher_forced(client, pool, model_id, name, key_of, spread, form: PromptForm) -> tuple[Check, ...]:
    arg = Check("teacher-forced argmax", bound=f"margin > {ARGMAX_EPS}", note=form.note)
    bound = None if spread is None else SPREAD_FACTOR * spread
    gaps = Check("top-k gaps", bound="no CUDA set: not judged" if bound is None else
                 f"<= {bound:.3f} ({SPREAD_FACTOR:g}x llama.cpp CPU-vs-CUDA {spread:.3f})")
    # The top-1 token's logprob against llama.cpp's logit minus the position's log-sum-exp
    # (golden `lse`). It is -log(sum_i exp(-gap_i)): its error is sum_i p_i * (gap_i's error),
    # at most the largest gap error, so the gaps' bound holds it too (the tail beyond the top-5
    # that bound was measured on weighs only its probability). A shift the gaps cannot see
    # (logprobs not normalized, or over a part of the vocabulary) shows here.
    prompts = golden_prompts(name)
    has_lse = all("lse" in p["teacher_forced"] for p in prompts)
    absolute = Check("top-1 logprob", bound="no CUDA set: not judged" if bound is None else
                     "goldens without lse: not judged" if not has_lse else f"<= {bound:.3f} (the gaps' bound)")

    def run(p):
        ids = p["prompt_ids"] + p["generated_ids"]
        prompt = ids if form.ids else p["text"] + detokenize(client, p["generated_ids"])
        # max_tokens 1, as lm-eval asks: llama-cpp-python reads 0 as "up to the context's end"
        return client.request("POST", "/v1/completions", {
            "model": model_id, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": GAP_K,
            "temperature": 0, **NO_PENALTY})
    try:
        replies = list(pool.map(run, prompts))
    except Unsupported as e:
        for c in (arg, gaps, absolute):
            c.status, c.note = "skipped", f"server lacks prompt logprobs ({e})"
        return arg, gaps, absolute
    total, worst, late, late_checked, unaligned = 0, 0.0, 0, 0, []
    worst_abs = 0.0
    for p, r in zip(prompts, replies):
        entries, by_id = reply_entries(r["choices"][0])
        ids = p["prompt_ids"] + p["generated_ids"]
        if len(entries) < len(ids) - 1 or not any(e.top for e in entries[1:]):
            for c in (arg, gaps, absolute):
                c.status, c.note = "skipped", (f"no prompt logprobs in the reply to echo ({len(entries)} "
                                               f"entries for {len(ids)} tokens)")
            return arg, gaps, absolute
        keyed = key_of(by_id)
        s = echo_shift(entries, ids, keyed)
        if s is None:
            unaligned.append(p["name"])     # the echo holds other tokens than the golden ids
            continue
        tf = p["teacher_forced"]
        # the entry of token j + 1 holds the distribution that predicted it: golden row j
        for j in range(len(ids) - 1):
            total += 1
            margin = tf["margin"][j]
            e = j + 1 - s
            if margin <= ARGMAX_EPS or e < 0 or not entries[e].top:
                continue
            top = entries[e].top
            golden = tf["topk"][j]
            arg.checked += 1
            if _best(top) == keyed(golden[0][0]):
                arg.agreed += 1
            else:
                arg.fail(f"prompt {p['name']} position {j}: server {_best(top)!r}, llama.cpp "
                         f"{keyed(golden[0][0])!r} (margin {margin:.3f}); server top-5 {_fmt_top(top)}, "
                         f"llama.cpp top-5 {_fmt_top({keyed(t): v for t, v in golden[:5]})}")
            if j + 1 < len(ids) - 1 and tf["margin"][j + 1] > ARGMAX_EPS:
                late_checked += 1       # does this entry hold the next position's distribution?
                late += _best(top) == keyed(tf["topk"][j + 1][0][0])
            if bound is None:
                continue
            if has_lse and keyed(golden[0][0]) in top:
                absolute.checked += 1
                want = golden[0][1] - tf["lse"][j]
                err = abs(top[keyed(golden[0][0])] - want)
                if err > worst_abs:
                    worst_abs = err
                if err <= bound:
                    absolute.agreed += 1
                else:
                    absolute.fail(f"prompt {p['name']} position {j}: server {top[keyed(golden[0][0])]:.3f}, "
                                  f"llama.cpp {want:.3f} for {keyed(golden[0][0])!r}")
            texts = [keyed(t) for t, _ in golden[:GAP_K]]
            if len(set(texts)) < len(texts) or texts[0] not in top:
                continue        # two ids of one text, or the top-1 is not the server's: argmax says so
            gaps.checked += 1
            err = max((abs((top[texts[0]] - top[k]) - (golden[0][1] - v))
                       for k, (_, v) in zip(texts[1:], golden[1:GAP_K]) if k in top), default=0.0)
            if err > worst:
                worst = err
                gaps.note = (f"worst at prompt {p['name']} position {j}: server top-5 {_fmt_top(top)}, "
                             f"llama.cpp top-5 {_fmt_top({keyed(t): v for t, v in golden[:5]})}")
            if err <= bound:
                gaps.agreed += 1
            else:
                gaps.fail(f"prompt {p['name']} position {j}: gap off by {err:.3f}; server top-5 {_fmt_top(top)}, "
                          f"llama.cpp top-5 {_fmt_top({keyed(t): v for t, v in golden[:5]})}")
    arg.worst_gap = None
    gaps.worst_gap = worst if gaps.checked else None
    absolute.worst_gap = worst_abs if absolute.checked else None
    if bound is None:
        gaps.status = "skipped"
    if bound is None or not has_lse:
        absolute.status = "skipped"
    if unaligned:
        for c in (arg, gaps, absolute):
            c.note = "; ".join(x for x in (c.note, "prompts whose echo holds other tokens than llama.cpp's "
                                           f"ids, not graded: {', '.join(unaligned)}") if x)
    if arg.status == "fail" and late_checked and late >= 0.9 * late_checked > arg.agreed:
        arg.note = "; ".join(x for x in (arg.note, (
            f"{late} of {late_checked} entries hold the distribution that follows their token, one "
            "position late (the defect of llama-cpp-python's echo on models without BOS: "
            "abetlen/llama-cpp-python#1983)")) if x)
    if total and arg.checked / total < MIN_COVERAGE:
        arg.fail(f"only {arg.checked}/{total} positions have a clear margin: the check would be vacuous")
    return arg, gaps, absolute


def check_tokenize(client, pool, name) -> Check:
    c = Check("tokenize", bound="exact ids")
    cases = [(p["text"], p["prompt_ids"]) for p in golden_prompts(name)]
    tok = next((t for t in _golden("manifest.json")["tokenizers"] if name in t.get("models", [])), None)
    if tok is not None:
        cases += [(x["text"], x["ids"]) for x in _golden(tok["file"])["cases"]
                  if x["add_special"] and x["parse_special"]]

    try:
        tokenize(client, cases[0][0])       # which route, once, before the pool asks them all
        replies = list(pool.map(lambda case: tokenize(client, case[0]), cases))
    except Unsupported as e:
        c.status, c.note = "skipped", f"server lacks it ({e})"
        return c
    if client.routes.get("/tokenize") is not True:
        c.note = "through llama-cpp-python's /extras/tokenize (BOS added, special tokens parsed)"
    for (text, want), got in zip(cases, replies):
        c.checked += 1
        if got == want:
            c.agreed += 1
        else:
            c.fail(f"{text[:40]!r}: server {got[:12]}, llama.cpp {want[:12]}")
    return c


def check_chat_template(client, pool, model_id, name) -> Check:
    c = Check("chat template", bound="prompt_tokens equal")
    path = GOLDEN_DIR / "chat_templates" / f"{name}.json"
    if not path.is_file():
        c.status, c.note = "skipped", "no chat template golden (the model has no template)"
        return c
    cases = [x for x in json.loads(path.read_text(encoding="utf-8"))["cases"] if x["add_generation_prompt"]]

    def run(case):
        return client.request("POST", "/v1/chat/completions", {
            "model": model_id, "messages": case["messages"], "max_tokens": 1, "temperature": 0})
    try:
        replies = list(pool.map(run, cases))
    except Unsupported as e:
        c.status, c.note = "skipped", f"server lacks it ({e})"
        return c
    for case, r in zip(cases, replies):
        got = (r.get("usage") or {}).get("prompt_tokens")
        if got is None:
            c.status, c.note = "skipped", "the reply carries no usage.prompt_tokens"
            return c
        c.checked += 1
        if got == len(case["tokens"]):
            c.agreed += 1
        else:
            c.fail(f"case {case['name']}: server {got} prompt tokens, llama.cpp's rendering {len(case['tokens'])}")
    return c


# --------------------------------------------------------------------------------------------
# Which file the server has


def served_identity(client: Client, name: str) -> tuple[str, str, str]:
    """(what the server says of its file, the reason to refuse or '', the model id to send:
    the one card's id where /v1/models lists one, else the catalog name). A reported sha256 must be
    the catalog's; a reported vocabulary size the golden's; a model id that is another catalog
    name is another model. Neither reported: 'file not reported', and the model is graded."""
    m = catalog.CATALOG[name]
    n_vocab = _manifest_entry(name)["n_vocab"]
    said, refuse = [], ""
    try:
        cards = client.request("GET", "/v1/models").get("data") or []
    except Unsupported:
        cards = []
    try:
        props = client.request("GET", "/props")
    except Unsupported:
        props = {}
    for card in cards:
        meta = card.get("meta") or {}
        sha = card.get("sha256") or meta.get("sha256")
        if sha:
            said.append(f"sha256 {sha[:12]}")
            if sha != m.sha256:
                refuse = f"the server's file has sha256 {sha}, not the catalog's {m.sha256}"
        if "n_vocab" in meta:
            said.append(f"n_vocab {meta['n_vocab']}")
            if meta["n_vocab"] != n_vocab:
                refuse = refuse or f"the server's model has {meta['n_vocab']} tokens, {name} has {n_vocab}"
        cid = str(card.get("id", ""))
        if cid in catalog.CATALOG and cid != name and len(cards) == 1:
            refuse = refuse or f"the server serves {cid}, not {name}"
    path = props.get("model_path") if isinstance(props, dict) else None
    if path:
        said.append(f"path {path}")
    model_id = str(cards[0].get("id") or name) if len(cards) == 1 else name
    return (", ".join(said) if said else "file not reported"), refuse, model_id


# --------------------------------------------------------------------------------------------


# --checks: the groups of checks a run may be limited to (each group needs one kind of request)
CHECK_GROUPS = {
    "greedy": ("greedy",),
    "teacher-forced": ("teacher-forced argmax", "top-k gaps", "top-1 logprob"),
    "tokenize": ("tokenize",),
    "chat-template": ("chat template",),
}


def grade_model(client: Client, pool: ThreadPoolExecutor, name: str, checks=tuple(CHECK_GROUPS)) -> ModelReport:
    if name not in catalog.CATALOG:
        raise ConformError(f"unknown catalog model {name!r}; known: {', '.join(catalog.CATALOG)}")
    m = catalog.CATALOG[name]
    identity, refuse, model_id = served_identity(client, name)
    report = ModelReport(name, f"{m.filename} (sha256 {m.sha256})", identity, refused=refuse)
    if refuse:
        return report
    texts = Texts(client, pool)
    state = {"texts_ok": None}

    def key_of(by_id: bool):
        if by_id:
            return lambda i: int(i)
        if state["texts_ok"] is None:
            ids = set()
            for p in golden_prompts(name):
                ids.update(p["prompt_ids"] + p["generated_ids"])
                ids.update(t for row in p["generated_topk"] for t, _ in row[:GAP_K])
                ids.update(t for row in p["teacher_forced"]["topk"] for t, _ in row[:GAP_K])
            try:
                texts.need(ids)
                state["texts_ok"] = True
            except Unsupported as e:
                state["texts_ok"] = e
        if state["texts_ok"] is not True:
            raise Unsupported("token texts", 0, f"replies carry no ids and {state['texts_ok']}")
        return lambda i: texts[i]

    form = None
    if "greedy" in checks or "teacher-forced" in checks:
        try:
            form = probe_prompt_form(client, model_id, name)
        except Unsupported as e:
            form = e
    if isinstance(form, Unsupported):
        report.checks += [Check(n, status="skipped", note=f"server lacks it ({form})")
                          for g in ("greedy", "teacher-forced") if g in checks for n in CHECK_GROUPS[g]]
    elif form is not None:
        if "greedy" in checks:
            report.checks.append(_guard(lambda: check_greedy(client, pool, model_id, name, key_of, form), "greedy"))
        if "teacher-forced" in checks:
            tf = _guard(lambda: check_teacher_forced(client, pool, model_id, name, key_of, gap_spread(name), form),
                        *CHECK_GROUPS["teacher-forced"])
            report.checks += list(tf) if isinstance(tf, tuple) else [tf]
    if "tokenize" in checks:
        report.checks.append(_guard(lambda: check_tokenize(client, pool, name), "tokenize"))
    if "chat-template" in checks:
        report.checks.append(_guard(lambda: check_chat_template(client, pool, model_id, name), "chat template"))
    if all(c.status == "skipped" for c in report.checks):
        report.checks.append(Check("any check", status="fail", divergence="the server supports none of "
                                   "the checks: nothing was graded"))
    return report


def _guard(fn, *names):
    """A check, or (the server lacking what it needs half way, e.g. /detokenize) the check(s)
    skipped with the reason."""
    try:
        return fn()
    except Unsupported as e:
        skipped = tuple(Check(n, status="skipped", note=f"server lacks it ({e})") for n in names)
        return skipped if len(skipped) > 1 else skipped[0]


def conform(url: str, models=DEFAULT_MODELS, api_key: str | None = None, timeout: float = 120.0,
            concurrency: int = 4, checks=tuple(CHECK_GROUPS)) -> Report:
    unknown = [c for c in checks if c not in CHECK_GROUPS]
    if unknown or not checks:
        raise ConformError(f"--checks takes {', '.join(CHECK_GROUPS)}, not {', '.join(unknown) or 'nothing'}")
    if concurrency < 1:
        raise ConformError(f"--concurrency must be at least 1, not {concurrency}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ConformError(f"--timeout must be a positive number of seconds, not {timeout}")
    for name in models:
        if name not in catalog.CATALOG:
            near = catalog.suggest(name)
            raise ConformError(f"unknown catalog model {name!r}" + (f"; did you mean {near}?" if near else
                                                                   f"; known: {', '.join(catalog.CATALOG)}"))
    client = Client(url, api_key, timeout)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return Report(client.url, [grade_model(client, pool, n, tuple(checks)) for n in models])
