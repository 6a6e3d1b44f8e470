"""Regression tracking for `pytest perf/ --benchmark`: each run saves its figures as JSON, and
the figures of a committed baseline for the same device (perf/baselines/<device>.json) are
shown beside them with the change.

A figure is a benchmark's headline number from its extra_info (tokens_per_s, GB_per_s: higher
is better); benchmarks without one are compared by their median time (lower is better).
`python -m perf.baseline RESULTS.json` writes RESULTS.json's figures as the baseline of the
device they were measured on (do that only from a run whose conformance passed, and commit it
with the commit it measured named in it).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

# committed beside the benchmarks they baseline
BASELINES = Path(__file__).resolve().parents[2] / "perf" / "baselines"
HIGHER_IS_BETTER = ("tokens_per_s", "GB_per_s")


def device_name() -> str:
    """The GPU's name when CuPy sees one, else "cpu" (numpy benchmarks)."""
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else name
    except Exception:          # no CuPy, driver or device: the CPU figures
        return "cpu"


def baseline_path(device: str) -> Path:
    return BASELINES / (re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") + ".json")


def figure(bench: dict) -> tuple[str, float] | None:
    """(unit, value) of one benchmark from pytest-benchmark's JSON."""
    extra = bench.get("extra_info") or {}
    for key in HIGHER_IS_BETTER:
        if isinstance(extra.get(key), (int, float)):
            return key, float(extra[key])
    stats = bench.get("stats") or {}
    if isinstance(stats.get("median"), (int, float)):
        return "median_s", float(stats["median"])
    return None


def figures(results: dict) -> dict[str, tuple[str, float]]:
    out = {}
    for b in results.get("benchmarks", []):
        f = figure(b)
        if f is not None:
            out[b.get("fullname") or b["name"]] = f
    return out


def compare(results: dict, baseline: dict | None) -> list[tuple[str, str, str, str]]:
    """Rows (benchmark, now, baseline, change) — change positive when better."""
    base = (baseline or {}).get("figures", {})
    rows = []
    for name, (unit, value) in sorted(figures(results).items()):
        b = base.get(name)
        if b is None or b[0] != unit or not b[1]:
            rows.append((name, f"{value:.4g} {unit}", "-", "new"))
            continue
        better = (value / b[1] - 1) if unit in HIGHER_IS_BETTER else (b[1] / value - 1)
        rows.append((name, f"{value:.4g} {unit}", f"{b[1]:.4g}", f"{100 * better:+.1f} %"))
    return rows


def write_baseline(results_path: Path, device: str | None = None) -> Path:
    results = json.loads(results_path.read_text())
    device = device or results.get("brass_device") or device_name()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    out = baseline_path(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "commit": commit,
                               "date": (results.get("datetime") or "")[:10],
                               "figures": {k: list(v) for k, v in sorted(figures(results).items())}},
                              indent=1) + "\n")
    return out

