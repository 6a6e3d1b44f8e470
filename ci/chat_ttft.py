"""A multi-turn chat's time to first token, turn by turn, against an OpenAI-style server
(issue 47's bar: with prefix caching the TTFT of turn 10 stays within 1.3x that of turn 1,
where reading the whole history again grows with it).

Each turn sends the whole conversation so far as a text completion (the previous prompt, the
reply it got, then a new user message of --user-tokens tokens), streams the reply (greedy,
--max-tokens), and records the time from sending to the first text chunk and the usage the
server reports (prompt tokens, cached tokens: OpenAI's usage.prompt_tokens_details, else
llama-server's `timings` of the last chunk). brass serve and llama-server both answer.
`--history words` puts words of the reply's length in tokens in its place: a shape-true
file's random replies, read back as text, come to 2 to 4 tokens per generated token, which
would make each turn add several times what it generated (a server that kept the reply's own
tokens reads those words instead). --compare prints the turns of several runs' JSONs side by
side. Standard library only.

    python3 ci/chat_ttft.py --url http://127.0.0.1:8184/v1 [--turns 10] [--label L] [--json OUT]
    python3 ci/chat_ttft.py --compare brass.json llama.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Words for the user messages: varied (a repeated phrase would let a cache match by accident
# where a real conversation would not). Their lengths in tokens depend on the vocabulary (one
# token each in a real BPE vocabulary, two to four in a shape-true file's byte-level one), so
# messages are measured through the server's /tokenize (Vocab).
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one "
         "had not but what all were when we there can an your which their said if do will each about "
         "how up out them then she many some so these would other into has more her two like him see "
         "time could no make than first been its who now people my made over did down only way find "
         "use may water long little very after words called just where most know").split()


def user_message(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Vocab:
    """WORDS with their token ids in the server's vocabulary (POST /tokenize, which brass serve
    and llama-server both answer), so that a text is made to a length in tokens. A BPE
    pre-tokenizer splits " word" off before merging, so a text of words joined by spaces has the
    sum of their lengths (`fetch` checks it against the whole list's /tokenize)."""

    def __init__(self, ids: dict[str, list[int]], measured: bool):
        self.ids, self.measured = ids, measured

    @classmethod
    def fetch(cls, url: str) -> "Vocab":
        """`url`: the API's base (…/v1); /tokenize is at the server's root. Where it does not
        answer (404, or no tokens in its reply), each word counts as one token (said on
        stderr); a server that does not answer at all raises OSError."""
        root = url.rstrip("/").removesuffix("/v1")
        try:
            ids = {w: post_json(f"{root}/tokenize", {"content": " " + w})["tokens"] for w in WORDS}
            text = " " + " ".join(WORDS)
            whole = post_json(f"{root}/tokenize", {"content": text})["tokens"]
        except (urllib.error.HTTPError, ValueError, KeyError, TypeError) as e:
            print(f"no /tokenize at {root} ({e}): lengths counted in words", file=sys.stderr)
            return cls({w: [0] for w in WORDS}, measured=False)
        if whole != [t for w in WORDS for t in ids[w]]:
            print(f"{root}/tokenize: words joined do not tokenize as the sum of each: lengths approximate",
                  file=sys.stderr)
        return cls(ids, measured=True)

    def words(self, rng: random.Random, n_tokens: int) -> list[str]:
        """Random words of n_tokens tokens in all (joined by spaces, each with its space before):
        exact where a word of the length left exists, else short by less than the shortest word."""
        out, left = [], n_tokens
        while left > 0:
            fit = [w for w in WORDS if len(self.ids[w]) <= left]
            if not fit:
                break
            w = rng.choice(fit)
            out.append(w)
            left -= len(self.ids[w])
        return out

    def text(self, rng: random.Random, n_tokens: int) -> str:
        return " ".join(self.words(rng, n_tokens))

    def token_ids(self, rng: random.Random, n_tokens: int) -> list[int]:
        """Exactly n_tokens ids: the words' own, the last word's cut short where needed."""
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += self.ids[rng.choice(WORDS)]
        return ids[:n_tokens]


def counts(usage: dict | None, timings: dict | None) -> dict:
    """The prompt, cached and generated tokens a reply reports: OpenAI's usage (brass serve;
    llama-server too where it fills prompt_tokens_details), else llama-server's timings
    (cache_n: prompt tokens reused from the slot's cache; prompt_n: those read)."""
    u, t = usage or {}, timings or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = t.get("cache_n")
    prompt = u.get("prompt_tokens")
    if prompt is None and "prompt_n" in t:
        prompt = t["prompt_n"] + (t.get("cache_n") or 0)
    generated = u.get("completion_tokens")
    if generated is None:
        generated = t.get("predicted_n")
    return {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": generated}


def one_turn(url: str, model: str | None, prompt: str | list[int], max_tokens: int, timeout: float) -> dict:
    """Stream one completion: {ttft_s, total_s, text, usage, timings} (timings: llama-server's)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage, timings = None, [], None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c["text"])
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage,
            "timings": timings}


def warm_up(url: str, model: str | None, vocab: Vocab, n_tokens: int, max_tokens: int, timeout: float) -> float:
    """One request before the timed ones, sharing no prefix with them (a server's first request
    pays for its lazy set-up: kernels compiled, graphs captured, buffers grown); its seconds."""
    prompt = "Warm-up: " + vocab.text(random.Random(-1), n_tokens) + "\n"
    return one_turn(url, model, prompt, max_tokens, timeout)["total_s"]


def served_vocab(args, n_tokens: int) -> Vocab:
    """The server's vocabulary (args.url), after args.warmup untimed requests of n_tokens
    (warm_up), each one's seconds printed; OSError where the server does not answer."""
    vocab = Vocab.fetch(args.url)
    for _ in range(args.warmup):
        took = warm_up(args.url, args.model, vocab, n_tokens, args.max_tokens, args.timeout)
        print(f"warm-up request: {took:.2f} s")
    return vocab


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def print_table(head: list, rows: list[list]) -> None:
    """A GitHub-markdown table, each column padded to its widest cell (--compare's, here and in
    ci/shared_prefix_load.py)."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |")


def compare(paths: list[str]) -> int:
    """One table of several runs (their --json files): each turn's TTFT and cached / prompt
    tokens per run, then each run's last-over-first ratio and its verdict."""
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            print(f"--compare: cannot read {p}: {e}", file=sys.stderr)
            return 2
    labels = [r.get("label") or Path(p).stem for r, p in zip(runs, paths)]
    head = ["turn"] + [f"{x} TTFT ms (cached/prompt)" for x in labels]
    rows = []
    for i in range(max(len(r["turns"]) for r in runs)):
        row = [str(i + 1)]
        for r in runs:
            t = r["turns"][i] if i < len(r["turns"]) else {}
            row.append(f"{ms(t.get('ttft_s'))} ({t.get('cached_tokens', '-')}/{t.get('prompt_tokens', '-')})")
        rows.append(row)
    ratios = ["last / first"] + [("-" if r.get("ratio") is None else f"{r['ratio']:.2f}")
                                 + f" (bar <= {r.get('bar')}: {'PASS' if r.get('pass') else 'FAIL'})" for r in runs]
    rows.append(ratios)
    print_table(head, rows)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="base URL of the OpenAI API, e.g. http://127.0.0.1:8184/v1")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print these runs' turns side by side, and stop")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-tokens", type=int, default=200, help="tokens of each user message (/tokenize)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first, sharing no prefix (default 1)")
    ap.add_argument("--history", choices=("reply", "words"), default="reply",
                    help="what follows each turn's prompt in the next: the reply's text, or words of its "
                         "length in tokens (a random model's replies; see above)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--bar", type=float, default=1.3, help="the last turn's TTFT over the first's, at most")
    ap.add_argument("--label", default=None, help="the run's name in --compare's table (default: the file's)")
    ap.add_argument("--json", default=None, help="also write the turns here")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    if not args.url:
        ap.error("--url is required (or --compare JSON...)")
    if args.turns < 2 or args.user_tokens < 1 or args.max_tokens < 1 or args.warmup < 0:
        ap.error("--turns must be at least 2, --user-tokens and --max-tokens at least 1, --warmup at least 0")
    rng, words = random.Random(args.seed), random.Random(args.seed + 1)
    try:
        vocab = served_vocab(args, args.user_tokens)
    except OSError as e:
        print(f"{args.url}: {e}", file=sys.stderr)
        return 2
    prompt, turns = "", []
    for i in range(args.turns):
        prompt += f"\nUser: {vocab.text(rng, args.user_tokens)}\nAssistant:"
        try:
            got = one_turn(args.url, args.model, prompt, args.max_tokens, args.timeout)
        except urllib.error.HTTPError as e:
            print(f"turn {i + 1}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"turn {i + 1}: request failed: {e}", file=sys.stderr)
            return 2
        n = counts(got["usage"], got["timings"])
        if args.history == "reply":
            prompt += got["text"]
        else:
            # a server that reports no count gets --max-tokens' worth; a reply that ended at
            # once (0 generated) adds nothing
            made = n["completion_tokens"]
            made = args.max_tokens if made is None else made
            if made > 0:
                prompt += " " + vocab.text(words, made)
        turns.append({"turn": i + 1, "ttft_s": got["ttft_s"], "total_s": got["total_s"], **n})
        t = turns[-1]
        print(f"turn {t['turn']:2d}: TTFT {ms(t['ttft_s'])} ms, prompt {t['prompt_tokens']} tokens "
              f"({t['cached_tokens']} cached), {t['completion_tokens']} generated, {t['total_s']:.2f} s", flush=True)
    first, last = turns[0]["ttft_s"], turns[-1]["ttft_s"]
    ratio = last / first if first and last else None
    ok = ratio is not None and ratio <= args.bar
    print(f"TTFT turn {args.turns} / turn 1: {'-' if ratio is None else f'{ratio:.2f}'} "
          f"(bar <= {args.bar}): {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "turns": turns, "ratio": ratio, "bar": args.bar, "pass": ok,
                       "user_tokens": args.user_tokens, "history": args.history,
                       "tokens_measured": vocab.measured}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
