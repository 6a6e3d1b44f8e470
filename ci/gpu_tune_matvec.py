"""Decode mat-vec variants side by side on the GPU runner: kernels/matvec_q.cuh compiled with
other MV_WARPS / MV_ROWS / MV_UNROLL values, with and without the activations staged in shared
memory (MV_STAGE_MAX_K=0 turns staging off), and grid sizes (one wave of resident blocks,
looping, or one block per row group), each timed alone (20 launches captured as a graph,
weights rotated so that no launch is served from L2) against the device copy bandwidth. Every
variant's output must equal the first variant's bit for bit (same integer sums, same float
operations in the same order): a variant that differs is reported and the script exits 1.

    python3 ci/gpu_tune_matvec.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brass.gguf import BLOCK_SIZES, GGMLType  # noqa: E402
from brass.quants import random_blocks  # noqa: E402
from brass.backends.cuda.params import pack  # noqa: E402

CASES = [(GGMLType.Q4_K, 12288, 4096), (GGMLType.Q6_K, 4096, 12288), (GGMLType.Q4_K, 4096, 4096),
         (GGMLType.Q4_K, 3072, 1024), (GGMLType.Q6_K, 151936, 1024), (GGMLType.Q6_K, 151936, 4096)]
# stage: 0 global activations, 1 staged
VARIANTS = [dict(warps=w, rows=r, unroll=u, stage=st)
            for st, w, r, u in itertools.product((1, 0), (4, 8), (1,), (1, 2))]
KINDS = {GGMLType.Q4_K: ("q4_k", "Q4KPairKind", 64), GGMLType.Q6_K: ("q6_k", "Q6KKind", 32)}


def main():
    import cupy as cp
    from cupy_backends.cuda.libs import nvrtc
    from tabulate import tabulate

    from brass.backends.cuda.compiler import compile_text, target_for
    from ci.gpu_speed import copy_bandwidth

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    n_sm = props["multiProcessorCount"]
    target = target_for(props["major"] * 10 + props["minor"])
    bw = copy_bandwidth(cp)
    print(f"copy bandwidth {bw:.0f} GB/s, {n_sm} SMs, NVRTC {nvrtc.getVersion()}", flush=True)
    src = '#include "matvec_q.cuh"\n' + "".join(f"DEFINE_MATVEC({n}, {k})\n" for n, k, _ in KINDS.values())
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    data = {}
    for qtype, N, K in CASES:
        nbytes = N * K // BLOCK_SIZES[qtype][0] * BLOCK_SIZES[qtype][1]
        copies = max(1, -(-(240 << 20) // nbytes))
        raw = cp.asarray(random_blocks(qtype, N, K, rng).reshape(-1))
        ws = [raw] + [raw.copy() for _ in range(copies - 1)]
        x = rng.uniform(-1, 1, (1, K)).astype(np.float32)
        from brass import quants
        q = quants.quantize_q8_1_cuda(x)
        blocks = np.zeros((K // 32, 36), np.uint8)
        blocks[:, 0:2] = q.d.reshape(-1, 1).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = q.s.reshape(-1, 1).view(np.uint8).reshape(-1, 2)
        blocks[:, 4:] = q.qs.reshape(-1, 32).view(np.uint8)
        data[(qtype, N, K)] = (ws, cp.asarray(blocks.reshape(-1)), nbytes)
    rows_out = []
    best = {}
    reference: dict = {}
    mismatches: list = []
    for v in VARIANTS:
        # matvec_<kind>, a warp per row (the grids below are one unit per warp); MV_SPLIT=1 so
        # that the split kernels compile at any MV_WARPS
        opts = (f"-DMV_WARPS={v['warps']}", f"-DMV_ROWS={v['rows']}", f"-DMV_UNROLL={v['unroll']}", "-DMV_SPLIT=1")
        if not v["stage"]:
            opts += ("-DMV_STAGE_MAX_K=0",)
        mod = cp.cuda.function.Module()
        mod.load(compile_text("tune_matvec.cu", src, target, opts, use_cache=True))
        for (qtype, N, K), (ws, xq, nbytes) in data.items():
            name, _, _ = KINDS[qtype]
            fn = mod.get_function(f"matvec_{name}")
            y = cp.empty(N, np.float32)
            units = -(-N // v["rows"])
            rb = nbytes // N
            params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=N, n_rows1=0, n_rows2=0, cols=1,
                          row_bytes0=rb, row_bytes1=rb, row_bytes2=rb)
            for grid_kind in ("full", "waves"):
                blocks = -(-units // v["warps"])
                if grid_kind == "waves":
                    # resident blocks per SM at this block size (register-limited estimate: 2048
                    # threads per SM, 64 K registers; use the function's register count)
                    from cupy_backends.cuda.api import driver
                    regs = driver.funcGetAttribute(4, fn.ptr)     # CU_FUNC_ATTRIBUTE_NUM_REGS
                    threads = 32 * v["warps"]
                    per_sm = max(1, min(2048 // threads, 65536 // max(1, regs * threads), 32))
                    blocks = min(blocks, per_sm * n_sm)
                with stream:
                    stream.begin_capture()
                    for i in range(20):
                        w = ws[i % len(ws)]
                        fn((blocks, 1), (32 * v["warps"],), (w, w, w, xq, y, y, y, params), stream=stream,
                           shared_mem=K // 32 * 56 if v["stage"] else 0)
                    g = stream.end_capture()
                    g.launch(stream)
                    stream.synchronize()
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record(stream)
                    for _ in range(5):
                        g.launch(stream)
                    end.record(stream)
                    end.synchronize()
                us = cp.cuda.get_elapsed_time(start, end) * 1e3 / 100
                # y holds the last launch's rows (weights ws[19 % copies]); the same for every variant
                got = cp.asnumpy(y)
                ref = reference.setdefault((qtype, N, K), got)
                if not np.isfinite(got).all() or got.view(np.uint32).tolist() != ref.view(np.uint32).tolist():
                    mismatches.append((qtype.name, N, K, v, grid_kind))
                gbs = nbytes / us / 1e3
                key = (qtype.name, N, K)
                label = f"{('global', 'staged')[v['stage']]} w{v['warps']} r{v['rows']} u{v['unroll']} {grid_kind}"
                rows_out.append((*key, label, f"{us:.1f}", f"{100 * gbs / bw:.0f} %"))
                if key not in best or us < best[key][1]:
                    best[key] = (label, us, gbs)
    print(tabulate([(*k, lab, f"{us:.1f}", f"{gbs:.0f}", f"{100 * gbs / bw:.0f} %") for k, (lab, us, gbs) in best.items()],
                   headers=["type", "N", "K", "best variant", "us", "GB/s", "of copy"], tablefmt="github"))
    Path(sys.argv[1] if len(sys.argv) > 1 else "tune.txt").write_text(
        tabulate(rows_out, headers=["type", "N", "K", "variant", "us", "of copy"]))
    for m in mismatches:
        print("OUTPUT DIFFERS from the first variant:", *m)
    print(f"{len(VARIANTS) * 2 * len(CASES) - len(mismatches)} launches equal the first variant bit for bit, "
          f"{len(mismatches)} differ")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
