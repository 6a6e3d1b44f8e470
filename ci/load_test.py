"""Load generator for OpenAI-compatible servers (brass serve, llama-server): N concurrent
clients, each sending streaming chat completions one after another with a fixed prompt and
max_tokens, greedy. Reports what a serving comparison needs: requests completed / failed,
generated tokens, aggregate generated tok/s over the wall time, time to first token p50 / p99,
and per-request decode tok/s.

    python3 ci/load_test.py --url http://127.0.0.1:8080/v1 --clients 16 --requests 2 \
        --max-tokens 128 [--model NAME] [--json OUT]

Tokens are counted from the usage the server reports at the end of a stream when it does
(`stream_options.include_usage`), else as the content chunks received (one token per chunk,
as both servers stream). Uses the official `openai` async client; needs nothing else. The last
line is a one-line summary; exit status 1 when a request failed, 2 when no server answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and what the message says.")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        for choice in chunk.choices or []:
            if choice.delta is not None and choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                chunks += 1
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks
    return dict(ttft=(first or end) - start, total=end - start, tokens=tokens,
                decode_tps=(tokens - 1) / (end - first) if first and end > first and tokens > 1 else None)


async def client_loop(client, model, prompt, max_tokens, n, results, errors):
    for _ in range(n):
        try:
            results.append(await one_request(client, model, prompt, max_tokens))
        except Exception as e:          # a failed request is counted and named, the run goes on
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")


async def run(url: str, clients: int, requests: int, max_tokens: int, model: str | None,
              prompt: str, timeout: float, api_key: str) -> dict:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url, api_key=api_key, timeout=timeout, max_retries=0)
    if model is None:
        model = (await client.models.list()).data[0].id
    results: list[dict] = []
    errors: list[str] = []
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(client, model, prompt, max_tokens, requests, results, errors)
                           for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    decode = [r["decode_tps"] for r in results if r["decode_tps"] is not None]
    return dict(url=url, model=model, clients=clients, requests_per_client=requests,
                max_tokens=max_tokens, completed=len(results), failed=len(errors),
                errors=errors[:5], generated_tokens=tokens, wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 2) if wall > 0 else None,
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                decode_tps_per_request_median=statistics.median(decode) if decode else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="base URL of the OpenAI API, e.g. http://127.0.0.1:8080/v1")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be at least 1")
    try:
        out = asyncio.run(run(args.url, args.clients, args.requests, args.max_tokens, args.model,
                              args.prompt, args.timeout, args.api_key))
    except KeyboardInterrupt:
        return 130
    except Exception as e:              # the server is not there, or not an OpenAI API
        print(f"load_test: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")

    def s(v):
        return "-" if v is None else f"{v:.3f}"
    print(f"load_test: {'PASS' if out['failed'] == 0 else 'FAIL'}: {out['clients']} streaming clients x "
          f"{out['requests_per_client']} requests of {out['max_tokens']} tokens on {out['model']}: "
          f"{out['completed']} completed, {out['failed']} failed; {out['generated_tokens']} tokens in "
          f"{out['wall_s']:.1f} s = {out['tokens_per_s']} tok/s; TTFT p50 {s(out['ttft_p50_s'])} s, "
          f"p99 {s(out['ttft_p99_s'])} s")
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
