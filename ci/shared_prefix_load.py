"""Concurrent streaming clients that share a long system prompt, each with its own question
(issue 47's load bar: prefix caching reads the shared prompt once). Reports the generated
tokens per second over the wall time, TTFT p50 / p99, and the prompt tokens the server reports
cached (OpenAI's usage, else llama-server's timings: ci/chat_ttft.py's counts). Lengths are in
the server's tokens (ci/chat_ttft.py's Vocab). --compare prints several runs' JSONs in one
table against a baseline run (llama-server): the ratios and whether the bars are met
(generated tok/s >= 1.5x the baseline's, TTFT p50 <= 0.5x). Standard library only.

    python3 ci/shared_prefix_load.py --url http://127.0.0.1:8185/v1 [--clients 16] [--label L] [--json OUT]
    python3 ci/shared_prefix_load.py --compare brass.json llama.json [--baseline llama-server]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_ttft import counts, ms, one_turn, print_table, served_vocab  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def compare(paths: list[str], baseline: str, tps_bar: float, ttft_bar: float) -> int:
    """One table: each run's figures, its ratios to the baseline's and the bars' verdicts.
    0 when the first run that is not the baseline meets both bars, 1 when it misses one (or a
    figure is missing), 2 when a file cannot be read or no run is the baseline."""
    runs = {}
    for p in paths:
        try:
            r = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            print(f"--compare: cannot read {p}: {e}", file=sys.stderr)
            return 2
        runs[r.get("label") or Path(p).stem] = r
    if baseline not in runs:
        print(f"--compare: no run labelled {baseline!r} among {', '.join(runs)}", file=sys.stderr)
        return 2
    base = runs[baseline]
    head = ["run", "clients", "done/failed", "generated tok/s", "TTFT p50 / p99 ms", "cached / prompt tokens",
            f"tok/s ratio (bar >= {tps_bar})", f"TTFT p50 ratio (bar <= {ttft_bar})"]
    rows, verdicts = [], []
    for label, r in runs.items():
        row = [label, r.get("clients"), f"{r.get('completed')}/{r.get('failed')}", r.get("tokens_per_s"),
               f"{ms(r.get('ttft_p50_s'))} / {ms(r.get('ttft_p99_s'))}",
               f"{r.get('cached_tokens')} / {r.get('prompt_tokens')}"]
        if label == baseline:
            rows.append(row + ["(baseline)", "(baseline)"])
            continue
        tps = (r["tokens_per_s"] / base["tokens_per_s"]
               if r.get("tokens_per_s") and base.get("tokens_per_s") else None)
        ttft = (r["ttft_p50_s"] / base["ttft_p50_s"]
                if r.get("ttft_p50_s") is not None and base.get("ttft_p50_s") else None)
        ok = (tps is not None and tps >= tps_bar, ttft is not None and ttft <= ttft_bar)
        verdicts.append(ok)
        rows.append(row + [f"{'-' if tps is None else f'{tps:.2f}'} {'met' if ok[0] else 'NOT met'}",
                           f"{'-' if ttft is None else f'{ttft:.2f}'} {'met' if ok[1] else 'NOT met'}"])
    print_table(head, rows)
    return 0 if verdicts and all(verdicts[0]) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="base URL of the OpenAI API, e.g. http://127.0.0.1:8185/v1")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print these runs in one table, and stop")
    ap.add_argument("--baseline", default="llama-server", help="--compare: the run the ratios divide by")
    ap.add_argument("--tps-bar", type=float, default=1.5,
                    help="--compare: generated tok/s over the baseline's, at least")
    ap.add_argument("--ttft-bar", type=float, default=0.5, help="--compare: TTFT p50 over the baseline's, at most")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first, sharing no prefix (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--label", default=None, help="the run's name in --compare's table (default: the file's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.baseline, args.tps_bar, args.ttft_bar)
    if not args.url:
        ap.error("--url is required (or --compare JSON...)")
    if min(args.clients, args.requests, args.system_tokens, args.question_tokens, args.max_tokens) < 1 \
            or args.warmup < 0:
        ap.error("every count must be at least 1 (--warmup at least 0)")
    try:
        vocab = served_vocab(args, args.question_tokens)
    except OSError as e:
        print(f"{args.url}: {e}", file=sys.stderr)
        return 2
    system = "System: " + vocab.text(random.Random(0), args.system_tokens) + "\n"
    results, errors, lock = [], [], threading.Lock()

    def client(c: int):
        rng = random.Random(1000 + c)
        for _ in range(args.requests):
            prompt = system + f"User: {vocab.text(rng, args.question_tokens)}\nAssistant:"
            try:
                got = one_turn(args.url, args.model, prompt, args.max_tokens, args.timeout)
            except urllib.error.HTTPError as e:
                with lock:
                    errors.append(f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}")
                continue
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
    n = [counts(r["usage"], r["timings"]) for r in results]
    generated = sum(x["completion_tokens"] or 0 for x in n)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    cached = sum(x["cached_tokens"] or 0 for x in n)
    prompt = sum(x["prompt_tokens"] or 0 for x in n)
    out = dict(label=args.label, clients=args.clients, completed=len(results), failed=len(errors),
               errors=errors[:5], generated_tokens=generated, wall_s=round(wall, 3),
               tokens_per_s=round(generated / wall, 2) if wall > 0 else None,
               ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
               prompt_tokens=prompt, cached_tokens=cached, tokens_measured=vocab.measured)
    print(f"{args.clients} clients: {out['completed']} done, {out['failed']} failed, "
          f"{out['tokens_per_s']} generated tok/s, TTFT p50 {ms(out['ttft_p50_s'])} ms "
          f"p99 {ms(out['ttft_p99_s'])} ms, {cached} of {prompt} prompt tokens cached")
    for e in errors[:3]:
        print(f"  {e}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
