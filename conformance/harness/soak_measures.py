"""What ci/soak.py measures of a server and how it judges a soak: the server process's resident
memory, its GPU memory (its own where nvidia-smi lists it, else the whole device's), the bytes
its captured prompt graphs hold (brass serve's /metrics), and the verdict on a soak's figures
with its one-line summary. conformance/server/test_load.py and
conformance/models/test_prompt_graphs.py check them without a soak of their own."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path


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


def gpu_mb(pid: int | None = None) -> tuple[float | None, str | None]:
    """(GPU memory in use in MB, what was read: "process" or "device"): the server process's own
    (nvidia-smi's compute apps) when it is listed, so that other work on the GPU during a soak
    does not count; else the whole GPU's. (None, None) when nvidia-smi gives nothing."""
    try:
        if pid:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            for line in out.splitlines():
                fields = [f.strip() for f in line.split(",")]
                if len(fields) == 2 and fields[0] == str(pid):
                    return float(fields[1]), "process"
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0]), "device"
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None, None


def graph_mb(base: str, timeout: float) -> float | None:
    """MB the server says its captured prompt graphs hold (brass serve's /metrics,
    brass_prompt_graph_bytes, all kinds); None where the server reports none (llama-server)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return None
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("brass_prompt_graph_bytes{")]
    return round(sum(vals) / 2**20, 1) if vals else None


def growth(out, key) -> float | None:
    a, b = out[f"{key}_after_warmup"], out[f"{key}_last"]
    return None if a is None or b is None else round(b - a, 1)


def summary(out, args) -> tuple[bool, str]:
    """(every criterion held, the one-line summary)."""
    failures = []
    if out["failed"]:
        failures.append(f"{out['failed']} requests failed")
    h = out["health_s_with_idle"]
    if h is None or h > args.health_limit:
        failures.append(f"/health with {out['idle_open_at_health']} idle connections open: "
                        f"{'no answer' if h is None else f'{h:.3f} s'} (limit {args.health_limit} s)")
    if not out["health_after"]:
        failures.append("no /health answer after the soak")
    rss, gpu = growth(out, "rss_mb"), growth(out, "gpu_mb")
    if rss is not None and rss > args.rss_growth_mb:
        failures.append(f"RSS grew {rss:+.1f} MB after warm-up (limit {args.rss_growth_mb} MB)")
    if len(out.get("gpu_scope") or []) > 1:
        failures.append("GPU memory read from the process in some samples and the whole device in others: "
                        "its growth cannot be judged")
    elif gpu is not None and gpu > args.gpu_growth_mb:
        failures.append(f"GPU memory grew {gpu:+.1f} MB after warm-up (limit {args.gpu_growth_mb} MB)")
    if args.pid and out["rss_mb_last"] is None:
        failures.append(f"no resident memory read for pid {args.pid}")
    parts = [f"{out['clients']} streaming clients for {out['seconds']:.0f} s on {out['model']}: "
             f"{out['completed']} requests completed, {out['dropped']} dropped by their client "
             f"mid-stream, {out['failed']} failed"]
    if out["rss_mb_last"] is not None:
        parts.append(f"server RSS {out['rss_mb_first']:.0f} MB at start, {out['rss_mb_after_warmup']:.0f} MB "
                     f"after {args.warmup:.0f} s warm-up, max {out['rss_mb_max_after_warmup']:.0f}, "
                     f"{out['rss_mb_last']:.0f} MB at the end ({rss:+.1f} MB, limit {args.rss_growth_mb})")
    if out["gpu_mb_last"] is not None:
        scope = "/".join(out.get("gpu_scope") or []) or "?"
        parts.append(f"GPU memory ({scope}) {out['gpu_mb_after_warmup']:.0f} MB after warm-up, {out['gpu_mb_last']:.0f} MB "
                     f"at the end ({gpu:+.1f} MB, limit {args.gpu_growth_mb})")
    parts.append(f"/health in {'-' if h is None else f'{h:.3f}'} s with {out['idle_open_at_health']} of "
                 f"{out['idle_connections']} idle connections open (limit {args.health_limit} s); during the "
                 f"soak median {out['health_s_during_median']} s, max {out['health_s_during_max']} s; "
                 f"{out['idle_open_at_end']} idle connections still open at the end (a server may close silent "
                 f"ones: brass after its 60 s keep-alive time)")
    return not failures, ("soak: PASS: " if not failures else "soak: FAIL (" + "; ".join(failures) + "): ") \
        + "; ".join(parts)
