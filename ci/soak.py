"""Soak and abuse of an OpenAI-compatible server, bounded and on loopback only (issue 11).

1. Idle connections: open --idle TCP connections that send nothing and keep them open; the
   server must still answer GET /health on a new connection within --health-limit seconds.
2. Soak: --clients concurrent streaming chat clients for --seconds, each request with a random
   max_tokens; with probability --disconnect a client drops its stream after a random number of
   chunks (a client that goes away). Every request that was not dropped must complete.
3. Memory: the server's resident memory (--pid, from /proc) and, with --gpu, the GPU memory in
   use (nvidia-smi) are sampled every --sample seconds; the report gives the first sample after
   --warmup seconds and the last, so growth after warm-up shows.

    python3 ci/soak.py --url http://127.0.0.1:8080 --clients 16 --seconds 600 --idle 1000 \
        --pid $(pgrep -f "engine serve") [--gpu] [--json OUT]

Exit status 0 when no request failed and /health answered in time with the idle connections
open; 1 otherwise; 2 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = ["Tell me about the sea.", "Write a haiku about winter.", "List three colours.",
           "What is a lighthouse?", "Describe a forest at night in two sentences."]


def rss_mb(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gpu_mb() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def health_seconds(base: str, timeout: float) -> float | None:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout) as r:
            r.read()
            if r.status != 200:
                return None
    except OSError:
        return None
    return time.perf_counter() - start


def open_idle(host: str, port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=10)
        socks.append(s)
    return socks


async def client(api, model, deadline, disconnect, rng, stats):
    while time.monotonic() < deadline:
        drop_after = rng.randint(1, 8) if rng.random() < disconnect else None
        try:
            stream = await api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
                max_tokens=rng.randint(4, 48), temperature=0, stream=True)
            chunks = 0
            async for _ in stream:
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    await stream.close()            # the client goes away mid-stream
                    stats["dropped"] += 1
                    break
            else:
                stats["completed"] += 1
        except Exception as e:
            stats["failed"] += 1
            stats["errors"].append(f"{type(e).__name__}: {str(e)[:160]}")


async def soak(base, clients, seconds, disconnect, seed, pid, gpu, sample, warmup):
    from openai import AsyncOpenAI
    api = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
    model = (await api.models.list()).data[0].id
    rng = random.Random(seed)
    stats = dict(completed=0, dropped=0, failed=0, errors=[])
    samples = []
    start = time.monotonic()
    deadline = start + seconds

    async def sampler():
        while time.monotonic() < deadline:
            samples.append(dict(t=round(time.monotonic() - start, 1), rss_mb=rss_mb(pid),
                                gpu_mb=gpu_mb() if gpu else None))
            await asyncio.sleep(sample)

    await asyncio.gather(sampler(), *(client(api, model, deadline, disconnect,
                                             random.Random(rng.random()), stats)
                                      for _ in range(clients)))
    samples.append(dict(t=round(time.monotonic() - start, 1), rss_mb=rss_mb(pid),
                        gpu_mb=gpu_mb() if gpu else None))
    await api.close()
    after = [s for s in samples if s["t"] >= warmup] or samples[-1:]
    return dict(stats, errors=stats["errors"][:5], samples=len(samples),
                rss_mb_after_warmup=after[0]["rss_mb"], rss_mb_last=samples[-1]["rss_mb"],
                gpu_mb_after_warmup=after[0]["gpu_mb"], gpu_mb_last=samples[-1]["gpu_mb"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of requests dropped mid-stream")
    ap.add_argument("--idle", type=int, default=1000, help="idle connections held open")
    ap.add_argument("--health-limit", type=float, default=1.0)
    ap.add_argument("--pid", type=int, default=None, help="server process, for its resident memory")
    ap.add_argument("--gpu", action="store_true", help="also sample GPU memory (nvidia-smi)")
    ap.add_argument("--sample", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = args.url.rstrip("/")
    host, port = base.split("//", 1)[1].split("/")[0].rsplit(":", 1)
    if health_seconds(base, 10) is None:
        print(f"soak: no server answering {base}/health", file=sys.stderr)
        return 2
    try:
        idle = open_idle(host, int(port), args.idle)
    except OSError as e:
        print(f"soak: could not open {args.idle} idle connections: {e}", file=sys.stderr)
        return 1
    try:
        health = health_seconds(base, args.health_limit * 5)
        out = asyncio.run(soak(base, args.clients, args.seconds, args.disconnect, args.seed,
                               args.pid, args.gpu, args.sample, args.warmup))
    finally:
        for s in idle:
            s.close()
    out.update(idle_connections=args.idle, health_s_with_idle=None if health is None else round(health, 4),
               health_after=health_seconds(base, 10) is not None)
    ok = (out["failed"] == 0 and health is not None and health <= args.health_limit
          and out["health_after"])
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
