"""Where a decode token's time goes between kernels, from a CUPTI trace of decode-graph replays
(the Chrome trace torch.profiler exports; `ci/gpu_profile.py timeline` records one, and
`ci/gpu.sh profile` runs it): per token, the kernels, their summed time, the time the GPU was
busy (the union of the kernels' and copies' intervals: under programmatic dependent launch a
kernel may start before the one before it ends) and the time it was idle between them (what
the kernel boundaries cost), then the rate a token would reach if no boundary cost anything.
Each kernel's time on the chain is the time it adds past the end of the work before it (so a
token's chain times add up to its busy time): under PDL a kernel's own duration counts the
time it spent waiting for the one before it, so its mean duration overstates what removing or
speeding it would save, and the table ranks the kernels by their chain time.
Issue 48 asks the Qwen3-0.6B shape for 2,500 tok/s or a profile that says why it can't get
there: this is that profile.

    python3 ci/decode_timeline.py TRACE.json --per-token K

A token starts at each launch of the trace's first kernel (the decode graph's first, the
embedding row), where every token then has at least K kernels (the decode graph's count, which
`gpu_profile.py timeline` passes): kernels launched outside the graph between tokens (a run
ahead's copies) are counted as extra; else (that kernel also inside the graph) the kernels are
cut K a token in order. A token's time runs from its first kernel's start to the next token's.
The last token, whose end is not seen, is left out.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
SHORT_US = 2.0          # a kernel under this is mostly launch and ramp (a few µs a boundary)


def gpu_events(trace: dict) -> list[tuple[float, float, str, str]]:
    """(start µs, end µs, category, name) of the trace's GPU work, by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in GPU_WORK and "ts" in e and "dur" in e:
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["cat"], e.get("name", "?")))
    return sorted(out)


def _busy(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals (sorted by start, as gpu_events gives them) clipped to
    [lo, hi)."""
    total, end = 0.0, lo
    for s, e in intervals:
        if s >= hi:
            break
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total


def token_stats(events: list[tuple[float, float, str, str]], per_token: int) -> dict:
    """Per-token figures (medians over the tokens seen whole) and each kernel name's share."""
    if per_token < 1:
        raise ValueError("per_token must be at least 1")
    kernels = [e for e in events if e[2] == "kernel"]
    first = [i for i, k in enumerate(kernels) if k[3] == kernels[0][3]]
    if len(first) >= 2 and all(b - a >= per_token for a, b in zip(first, first[1:])):
        cut = first                                 # a token a launch of the first kernel
    else:
        cut = list(range(0, len(kernels) - per_token + 1, per_token))
    n_tokens = len(cut) - 1                         # the last token's end is not seen
    if n_tokens < 1:
        raise ValueError(f"{len(kernels)} kernels: fewer than two tokens of {per_token}")
    work = [(s, e) for s, e, _, _ in events]
    starts = [s for s, _ in work]
    tok, busy, ksum, extra, short = [], [], [], [], 0
    by_name: dict[str, list[float]] = defaultdict(list)
    chain: dict[str, float] = defaultdict(float)
    for i in range(n_tokens):
        lo, hi = kernels[cut[i]][0], kernels[cut[i + 1]][0]
        tok.append(hi - lo)
        busy.append(_busy(work, lo, hi))
        ks = kernels[cut[i]:cut[i + 1]]
        extra.append(len(ks) - per_token)
        ksum.append(sum(e - s for s, e, _, _ in ks))
        for s, e, _, name in ks:
            by_name[name].append(e - s)
            short += (e - s) < SHORT_US
        reach = lo                                  # the end of the token's work so far
        for j in range(bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)):
            s, e, _, name = events[j]
            chain[name] += max(0.0, e - max(s, reach))
            reach = max(reach, e)
    t, b = statistics.median(tok), statistics.median(busy)
    durations = [d for ds in by_name.values() for d in ds]
    return {
        "tokens": n_tokens, "kernels_per_token": per_token, "extra_kernels": statistics.median(extra),
        "token_us": t, "tok_per_s": 1e6 / t,
        "busy_us": b, "idle_us": t - b, "idle_share": (t - b) / t,
        "kernel_sum_us": statistics.median(ksum),
        "idle_per_boundary_us": (t - b) / per_token,
        "kernel_median_us": statistics.median(durations),
        "short_share": short / len(durations),
        "no_idle_tok_per_s": 1e6 / b,
        # (name, launches a token, mean µs, µs a token, µs on the chain a token: means over
        # the tokens), by chain time
        "by_name": sorted(((name, len(ds) / n_tokens, statistics.fmean(ds), sum(ds) / n_tokens,
                            chain[name] / n_tokens) for name, ds in by_name.items()),
                          key=lambda r: (-r[4], -r[3])),
    }


def report(st: dict, top: int = 10) -> str:
    lines = [
        f"{st['tokens']} tokens, {st['kernels_per_token']} kernels a token (+{st['extra_kernels']:g} outside the "
        f"graph): {st['token_us']:.1f} µs a token ({st['tok_per_s']:.1f} tok/s, medians)",
        f"GPU busy {st['busy_us']:.1f} µs, idle between kernels {st['idle_us']:.1f} µs "
        f"({100 * st['idle_share']:.1f} %, {st['idle_per_boundary_us']:.2f} µs a boundary); kernels' summed "
        f"time {st['kernel_sum_us']:.1f} µs (over the busy time where they overlap)",
        f"a kernel's median time {st['kernel_median_us']:.2f} µs; {100 * st['short_share']:.1f} % of kernels "
        f"under {SHORT_US:g} µs",
        f"no time between kernels: {st['no_idle_tok_per_s']:.1f} tok/s (the kernels as they are)",
        "",
        "| kernel | a token | mean µs | µs a token | on the chain: µs a launch | µs a token | share of busy |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {n:g} | {mean:.2f} | {tot:.1f} | {ch / n:.2f} | {ch:.1f} | "
              f"{100 * ch / st['busy_us']:.1f} % |" for name, n, mean, tot, ch in st["by_name"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a Chrome trace (torch.profiler export_chrome_trace)")
    ap.add_argument("--per-token", type=int, required=True, metavar="K", help="kernels a decode token")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    try:
        st = token_stats(gpu_events(json.loads(a.trace.read_text())), a.per_token)
    except (OSError, ValueError) as e:
        print(f"decode_timeline: {a.trace}: {e}", file=sys.stderr)
        return 2
    print(report(st))
    if a.json:
        a.json.write_text(json.dumps(st, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
