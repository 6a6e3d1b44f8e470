"""Concurrent streaming clients that share a long system prompt, each with its own question
(issue 47's load bar: prefix caching reads the shared prompt once). Reports the generated
tokens per second over the wall time, TTFT p50 / p99, and the prompt tokens the server reports
cached. Standard library only (ci/chat_ttft.py's streaming request).

    python3 ci/shared_prefix_load.py --url http://127.0.0.1:8185/v1 [--clients 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_ttft import one_turn, user_message  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--system-words", type=int, default=2000)
    ap.add_argument("--question-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if min(args.clients, args.requests, args.system_words, args.question_words, args.max_tokens) < 1:
        ap.error("every count must be at least 1")
    system = "System: " + user_message(random.Random(0), args.system_words) + "\n"
    results, errors, lock = [], [], threading.Lock()

    def client(c: int):
        rng = random.Random(1000 + c)
        for _ in range(args.requests):
            prompt = system + f"User: {user_message(rng, args.question_words)}\nAssistant:"
            try:
                got = one_turn(args.url, args.model, prompt, args.max_tokens, args.timeout)
            except OSError as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(got)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    usage = [r["usage"] or {} for r in results]
    generated = sum(u.get("completion_tokens") or 0 for u in usage)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usage)
    prompt = sum(u.get("prompt_tokens") or 0 for u in usage)
    out = dict(clients=args.clients, completed=len(results), failed=len(errors), errors=errors[:5],
               generated_tokens=generated, wall_s=round(wall, 3),
               tokens_per_s=round(generated / wall, 2) if wall > 0 else None,
               ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
               prompt_tokens=prompt, cached_tokens=cached)
    p50 = "-" if out["ttft_p50_s"] is None else f"{out['ttft_p50_s'] * 1e3:.1f}"
    p99 = "-" if out["ttft_p99_s"] is None else f"{out['ttft_p99_s'] * 1e3:.1f}"
    print(f"{args.clients} clients: {out['completed']} done, {out['failed']} failed, "
          f"{out['tokens_per_s']} generated tok/s, TTFT p50 {p50} ms p99 {p99} ms, "
          f"{cached} of {prompt} prompt tokens cached")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
