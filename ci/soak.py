"""Soak and abuse of an OpenAI-compatible server, bounded and on loopback only (issue 11).

1. Idle connections: open --idle TCP connections that send nothing and keep them open; the
   server must still answer GET /health on a new connection within --health-limit seconds.
2. Soak: --clients concurrent streaming chat clients for --seconds, each request with a random
   max_tokens; with probability --disconnect a client drops its stream after a random number of
   chunks (a client that goes away). Every request that was not dropped must complete.
3. Memory: the server's resident memory (--pid, from /proc) and, with --gpu, the GPU memory in
   use (nvidia-smi) are sampled every --sample seconds; growth from the first sample after
   --warmup seconds to the last must stay within --rss-growth-mb (default 5% of the RSS then,
   at least 16 MB) and --gpu-growth-mb.
   /health is timed at each sample too (reported, not judged: under full load it waits for the
   CPU like everything else).

    python3 ci/soak.py --url http://127.0.0.1:8080 --clients 16 --seconds 600 --idle 1000 \
        --pid $(pgrep -f "engine serve") [--gpu] [--json OUT]

The last line is a one-line summary (PASS / FAIL and the numbers) for a closing note; the JSON
before it has the details. Exit status 0 when every criterion held (no request failed that the
client did not drop; /health in time with the idle connections open; memory flat after
warm-up; the server alive at the end); 1 when one did not; 2 when the test cannot run (no
server answering, or `ulimit -n` too low for --idle connections: it says how much is needed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import socket
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness.soak_measures import gpu_mb, graph_mb, rss_mb, summary  # noqa: E402

PROMPTS = ["Tell me about the sea.", "Write a haiku about winter.", "List three colours.",
           "What is a lighthouse?", "Describe a forest at night in two sentences."]


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


def fd_limit(pid: int | None = None) -> int | None:
    """The soft limit on open files: ours, or the server's (from /proc/PID/limits)."""
    if pid is None:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        return None
    return None


def ensure_fds(need: int, pid: int | None) -> str | None:
    """None when this process (raising its soft limit up to the hard one if needed) and the
    server can each hold `need` descriptors; else what is wrong, in one line."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY
                                                        else need, hard))
        except (ValueError, OSError):
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < need:
            return (f"ulimit -n is {soft} here (hard limit {hard}); the idle connections and clients "
                    f"need {need}: run `ulimit -n {need}` (or more) in this shell first")
    server = fd_limit(pid) if pid else None
    if server is not None and server < need:
        return (f"the server (pid {pid}) may open {server} files; the idle connections and clients "
                f"need {need}: start it after `ulimit -n {need}` (or more)")
    return None


def still_open(socks: list[socket.socket]) -> int:
    """How many of the idle connections the server has not closed."""
    n = 0
    for s in socks:
        try:
            s.setblocking(False)
            n += s.recv(1, socket.MSG_PEEK) != b""     # data: open (and talkative)
        except BlockingIOError:
            n += 1                                      # nothing to read: still open
        except OSError:
            pass                                        # reset: closed
    return n


async def client(api, model, deadline, disconnect, rng, stats, max_tokens):
    while time.monotonic() < deadline:
        drop_after = rng.randint(1, 8) if rng.random() < disconnect else None
        try:
            stream = await api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
                max_tokens=rng.randint(4, max_tokens), temperature=0, stream=True)
            chunks, finish = 0, None
            async for chunk in stream:
                chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if drop_after is not None and chunks >= drop_after:
                    await stream.close()            # the client goes away mid-stream
                    stats["dropped"] += 1
                    break
            else:
                if finish not in ("stop", "length"):    # a stream cut short without an error
                    raise RuntimeError(f"the stream ended without a finish_reason after {chunks} chunks")
                stats["completed"] += 1
        except Exception as e:
            stats["failed"] += 1
            err = f"{type(e).__name__}: {str(e)[:160]}"
            stats["errors"][err] = stats["errors"].get(err, 0) + 1


async def soak(base, clients, seconds, disconnect, seed, pid, gpu, sample, warmup, max_tokens=48):
    from openai import AsyncOpenAI
    api = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
    model = (await api.models.list()).data[0].id
    rng = random.Random(seed)
    stats = dict(completed=0, dropped=0, failed=0, errors={})
    samples = []
    start = time.monotonic()
    deadline = start + seconds

    async def take_sample():
        health = await asyncio.to_thread(health_seconds, base, 30)
        g, kind = gpu_mb(pid) if gpu else (None, None)
        graphs = await asyncio.to_thread(graph_mb, base, 30) if gpu else None
        samples.append(dict(t=round(time.monotonic() - start, 1), rss_mb=rss_mb(pid), gpu_mb=g, gpu_kind=kind,
                            graph_mb=graphs, health_s=None if health is None else round(health, 4)))

    async def sampler():
        while time.monotonic() < deadline:
            await take_sample()
            await asyncio.sleep(sample)

    await asyncio.gather(sampler(), *(client(api, model, deadline, disconnect,
                                             random.Random(rng.random()), stats, max_tokens)
                                      for _ in range(clients)))
    await take_sample()
    await api.close()
    after = [s for s in samples if s["t"] >= warmup] or samples[-1:]
    healths = sorted(s["health_s"] for s in samples if s["health_s"] is not None)

    def mb(key, which):
        vals = [s[key] for s in after if s[key] is not None]
        return round({"first": vals[0], "max": max(vals), "last": vals[-1]}[which], 1) if vals else None
    return dict(stats, model=model, seconds=seconds, clients=clients, samples=len(samples),
                health_s_during_median=healths[len(healths) // 2] if healths else None,
                health_s_during_max=healths[-1] if healths else None,
                health_unanswered_during=sum(s["health_s"] is None for s in samples),
                rss_mb_first=samples[0]["rss_mb"], rss_mb_after_warmup=mb("rss_mb", "first"),
                rss_mb_max_after_warmup=mb("rss_mb", "max"), rss_mb_last=mb("rss_mb", "last"),
                gpu_mb_after_warmup=mb("gpu_mb", "first"), gpu_mb_max_after_warmup=mb("gpu_mb", "max"),
                gpu_mb_last=mb("gpu_mb", "last"),
                # the process's own and the whole device's memory are not comparable: growth is
                # judged only when every sample after warm-up read the same one
                gpu_scope=sorted({s["gpu_kind"] for s in after if s["gpu_kind"]}),
                rss_series=[(s["t"], s["rss_mb"] and round(s["rss_mb"], 1)) for s in samples],
                # beside the process's GPU memory: what the server's prompt graphs say they hold
                gpu_series=[(s["t"], s["gpu_mb"], s["graph_mb"]) for s in samples] if gpu else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of requests dropped mid-stream")
    ap.add_argument("--idle", type=int, default=1000, help="idle connections held open")
    ap.add_argument("--max-tokens", type=int, default=48,
                    help="each request asks for a random max_tokens from 4 to this")
    ap.add_argument("--health-limit", type=float, default=1.0)
    ap.add_argument("--pid", type=int, default=None, help="server process, for its resident memory")
    ap.add_argument("--gpu", action="store_true", help="also sample GPU memory (nvidia-smi)")
    ap.add_argument("--sample", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--rss-growth-mb", type=float, default=None,
                    help="most the server's RSS may grow from the end of warm-up to the end "
                         "(default: 5%% of its RSS after warm-up, at least 16 MB)")
    ap.add_argument("--gpu-growth-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.max_tokens < 4:
        ap.error("--max-tokens must be at least 4")
    base = args.url.rstrip("/")
    host, port = base.split("//", 1)[1].split("/")[0].rsplit(":", 1)
    if health_seconds(base, 10) is None:
        print(f"soak: cannot run: no server answering {base}/health", file=sys.stderr)
        return 2
    need = args.idle + 2 * args.clients + 64     # + the clients' connections, /health, files
    if (problem := ensure_fds(need, args.pid)) is not None:
        print(f"soak: cannot run: {problem}", file=sys.stderr)
        return 2
    try:
        idle = open_idle(host, int(port), args.idle)
    except OSError as e:
        print(f"soak: FAIL: could only open some of {args.idle} idle connections: {e}", file=sys.stderr)
        return 1
    try:
        health = health_seconds(base, args.health_limit * 5)
        idle_open = still_open(idle)
        out = asyncio.run(soak(base, args.clients, args.seconds, args.disconnect, args.seed,
                               args.pid, args.gpu, args.sample, args.warmup, args.max_tokens))
        out.update(idle_open_at_end=still_open(idle))
    finally:
        for s in idle:
            s.close()
    out.update(idle_connections=args.idle, idle_open_at_health=idle_open,
               health_s_with_idle=None if health is None else round(health, 4),
               health_after=health_seconds(base, 10) is not None)
    if args.rss_growth_mb is None:
        args.rss_growth_mb = round(max(16.0, 0.05 * (out["rss_mb_after_warmup"] or 0)), 1)
    ok, line = summary(out, args)
    out.update(ok=ok, rss_growth_limit_mb=args.rss_growth_mb)
    print(json.dumps({k: v for k, v in out.items() if k != "rss_series"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(out, summary=line), indent=1) + "\n")
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
