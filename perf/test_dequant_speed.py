"""Dequantization throughput of engine/quants.py: elements per second for each type, and the
time to dequantize every tensor of a real model.

    BRASS_CACHE=... pytest perf/test_dequant_speed.py --benchmark-columns=min,mean,rounds

Each case's `elements_per_s` (from the fastest round) is in the benchmark's extra_info and in
`--benchmark-json` output. About 15 s in all.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from brass import catalog, quants
from brass.gguf import GGUFFile

N_ROWS, ROW_LEN = 1024, 4096          # 4M elements: big enough that per-call overhead is noise


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=[t.name for t in quants.SUPPORTED_TYPES])
def test_dequantize_throughput(benchmark, qtype):
    raw = quants.random_blocks(qtype, N_ROWS, ROW_LEN, np.random.default_rng())
    out = benchmark(quants.dequantize, raw, qtype, (ROW_LEN, N_ROWS))
    rate = out.size / benchmark.stats.stats.min
    benchmark.extra_info["elements_per_s"] = rate
    print(f"{qtype.name}: {rate / 1e6:.0f} M elements/s")


def test_dequantize_rows_of_a_large_table(benchmark):
    """An embedding lookup in a Gemma-3-sized table (262144 × 640, Q8_0): cost must follow the
    rows asked for, not the table."""
    raw = quants.random_blocks(quants.GGMLType.Q8_0, 262144, 640, np.random.default_rng())
    rows = np.random.default_rng().integers(0, 262144, 64)
    benchmark(quants.dequantize_rows, raw, quants.GGMLType.Q8_0, 640, rows)
    assert benchmark.stats.stats.min < 0.01, "64 rows took longer than 10 ms: the whole table?"


# Seconds allowed for every tensor of Qwen2.5-Coder 0.5B (630M elements): it takes ~2 s on a
# 2-core x86-64 VM with the file in the page cache; ten times that still means "seconds, not
# minutes", and leaves room for a cold cache or a slower CI machine.
WHOLE_MODEL_LIMIT_S = 20.0


def test_dequantize_whole_model():
    path = catalog.cached_path("qwen2.5-coder-0.5b")
    if path is None:
        pytest.skip("qwen2.5-coder-0.5b is not in the model cache (set BRASS_CACHE)")
    gf = GGUFFile(path)
    per_type: dict[str, list[float]] = {}
    start = time.perf_counter()
    for info in gf.tensors.values():
        t0 = time.perf_counter()
        out = quants.dequantize(gf.tensor_bytes(info.name), info.type, info.shape)
        spent = per_type.setdefault(info.type.name, [0.0, 0.0])
        spent[0] += out.size
        spent[1] += time.perf_counter() - t0
    total = time.perf_counter() - start
    n = sum(v[0] for v in per_type.values())
    print(f"qwen2.5-coder-0.5b: {n / 1e6:.0f} M elements in {total:.2f} s; "
          + ", ".join(f"{k} {v[0] / v[1] / 1e6:.0f} M/s" for k, v in sorted(per_type.items())))
    assert total < WHOLE_MODEL_LIMIT_S, f"dequantizing the whole model took {total:.1f} s"
