"""A multi-turn chat's time to first token, turn by turn, against an OpenAI-style server
(issue 47's bar: with prefix caching the TTFT of turn 10 stays within 1.3x that of turn 1,
where reading the whole history again grows with it).

Each turn sends the whole conversation so far as a text completion (the previous prompt, the
reply it got, then a new user message of about --user-tokens tokens), streams the reply
(greedy, --max-tokens), and records the time from sending to the first text chunk and the
usage the server reports (prompt tokens, cached tokens). Standard library only.

    python3 ci/chat_ttft.py --url http://127.0.0.1:8184/v1 [--turns 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request

# Words for the user messages: varied (a repeated phrase would let a cache match by accident
# where a real conversation would not), most of them one token in a BPE vocabulary.
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one "
         "had not but what all were when we there can an your which their said if do will each about "
         "how up out them then she many some so these would other into has more her two like him see "
         "time could no make than first been its who now people my made over did down only way find "
         "use may water long little very after words called just where most know").split()


def user_message(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def one_turn(url: str, model: str | None, prompt: str, max_tokens: int, timeout: float) -> dict:
    """Stream one completion: {ttft_s, total_s, text, usage}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
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
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c["text"])
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="base URL of the OpenAI API, e.g. http://127.0.0.1:8184/v1")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-words", type=int, default=200, help="words of each user message (~tokens)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--bar", type=float, default=1.3, help="the last turn's TTFT over the first's, at most")
    ap.add_argument("--json", default=None, help="also write the turns here")
    args = ap.parse_args(argv)
    if args.turns < 2 or args.user_words < 1 or args.max_tokens < 1:
        ap.error("--turns must be at least 2, --user-words and --max-tokens at least 1")
    rng = random.Random(args.seed)
    prompt, turns = "", []
    for i in range(args.turns):
        prompt += f"\nUser: {user_message(rng, args.user_words)}\nAssistant:"
        try:
            got = one_turn(args.url, args.model, prompt, args.max_tokens, args.timeout)
        except OSError as e:
            print(f"turn {i + 1}: request failed: {e}", file=sys.stderr)
            return 2
        prompt += got["text"]
        u = got["usage"] or {}
        turns.append({"turn": i + 1, "ttft_s": got["ttft_s"], "total_s": got["total_s"],
                      "prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
                      "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")})
        t = turns[-1]
        ttft = "-" if t["ttft_s"] is None else f"{t['ttft_s'] * 1e3:.1f}"
        print(f"turn {t['turn']:2d}: TTFT {ttft} ms, prompt {t['prompt_tokens']} tokens "
              f"({t['cached_tokens']} cached), {t['completion_tokens']} generated, {t['total_s']:.2f} s", flush=True)
    first, last = turns[0]["ttft_s"], turns[-1]["ttft_s"]
    ratio = last / first if first and last else None
    ok = ratio is not None and ratio <= args.bar
    print(f"TTFT turn {args.turns} / turn 1: {'-' if ratio is None else f'{ratio:.2f}'} "
          f"(bar <= {args.bar}): {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"turns": turns, "ratio": ratio, "bar": args.bar, "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
