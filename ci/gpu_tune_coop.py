"""matvec_coop_q6_k's launch shapes on the GPU runner: MV_COOP_WARPS (warps a block), blocks per
SM in the grid and MV_COOP_ROWS (rows a warp at once), on the output heads' Q6_K shapes.

Each variant is the coop kernel alone, compiled with its macros and launched through the
backend's own matmul (its grid rule, shared memory and, inside the captured graph, the PDL
attribute); it is timed alone (20 launches captured as a graph, copies rotated past L2, as
ci/gpu_speed.py times a mat-vec) beside its registers per thread, resident blocks per SM (the
driver's occupancy) and its share of a streaming read of the same bytes. Every variant's output
must equal the first's (the header's defaults) bit for bit, as none changes a row's items,
lanes or order: one that differs is reported and the script exits 1. EXTRA_OPTS
(space-separated NVRTC options, e.g. -DMACRO=1) go into every variant but the first, to weigh a
kernel change against it.

    python3 ci/gpu_tune_coop.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COOP_SRC = '#include "matvec_q.cuh"\nDEFINE_MATVEC_COOP(q6_k, Q6KKind)\n'
SHAPES = [(151936, 1024), (151936, 4096)]
# warps a block, blocks per SM in the grid (at most 64 warps an SM), rows a warp at once; the
# first is the header's defaults, whose bits every other must give
VARIANTS = [dict(warps=w, per_sm=b, rows=r) for r in (1, 2) for w in (8, 4) for b in (8, 4, 16) if w * b <= 64]


def main() -> int:
    import cupy as cp
    from cupy_backends.cuda.api import driver
    from tabulate import tabulate

    import brass.backends.cuda.backend as cb
    from brass.backends.cuda import matvec as mv, quantize
    from ci.gpu_speed import copy_bandwidth, graph_us, read_floor
    from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile
    from brass.backends.cuda.compiler import compile_text
    from conformance.harness.cases import random_weight_file

    b = cb.CudaBackend()
    bw = copy_bandwidth(cp)
    print(f"{b.device_name}: copy {bw:.0f} GB/s, {b.n_sms} SMs", flush=True)
    rng = np.random.default_rng(2)
    tmp = Path("/tmp/brass-tune-coop")
    tmp.mkdir(parents=True, exist_ok=True)
    rows, bad, ref = [], 0, {}
    for N, K in SHAPES:
        gf = GGUFFile(random_weight_file(tmp / f"w-{N}-{K}.gguf", rng, {"w": (GGMLType.Q6_K, (N, K))}))
        w = b.weight(gf, "w")
        nbytes = N * K // BLOCK_SIZES[GGMLType.Q6_K][0] * BLOCK_SIZES[GGMLType.Q6_K][1]
        copies = max(1, -(-(240 << 20) // nbytes))
        ws = [w] + [type(w)(w.name, w.type, w.shape, data=w.data.copy()) for _ in range(copies - 1)]
        floor = read_floor(b, nbytes)
        with b.activate():
            x = b.asarray(rng.uniform(-1, 1, (1, K)).astype(np.float32))
        for v in VARIANTS:
            # the backend's own launch (its grid rule, shared memory and, inside the captured
            # graph, the PDL attribute), with this variant's macros compiled in
            mv.MV_COOP_WARPS, mv.COOP_BLOCKS_PER_SM, mv.MV_COOP_ROWS = v["warps"], v["per_sm"], v["rows"]
            opts = (f"-DMV_COOP_WARPS={v['warps']}", f"-DMV_COOP_ROWS={v['rows']}")
            if v is not VARIANTS[0]:
                opts += tuple(os.environ.get("EXTRA_OPTS", "").split())
            # only the coop kernel, compiled in seconds, stands in for matvec_q.cu's module (the
            # whole file takes a minute a variant): the one kernel these launches take from it
            mod = cp.cuda.function.Module()
            mod.load(compile_text("tune_coop.cu", COOP_SRC, b.kernels.target, opts))
            b.kernels._functions.clear()
            b.kernels._smem_optin.clear()
            b.kernels._threads.clear()
            b.kernels._modules["matvec_q.cu"] = mod
            with b.activate():
                quantize.remember(b, x, b.quantize_q8_1(x))
                got = b.to_numpy(b.matmul(x, ws[0]))
                b.synchronize()
                fn = b.kernels.get("matvec_q.cu", "matvec_coop_q6_k")
                regs = driver.funcGetAttribute(4, fn.ptr)          # CU_FUNC_ATTRIBUTE_NUM_REGS
                try:
                    resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        fn.ptr, 32 * v["warps"], mv.stage_bytes(GGMLType.Q6_K, K))
                except Exception:                                   # noqa: BLE001 (older CuPy)
                    resident = -1
                us = graph_us(b, lambda: [b.matmul(x, ws[i % copies]) for i in range(20)], 20)  # noqa: B023 (the function runs at once, inside this iteration)
            first = ref.setdefault((N, K), got)
            same = bool(np.isfinite(got).all()) and np.array_equal(got.view(np.uint32), first.view(np.uint32))
            bad += not same
            gbs = nbytes / us / 1e3
            rows.append((N, K, v["warps"], v["per_sm"], v["rows"], regs, resident, f"{us:.1f}", f"{gbs:.0f}",
                         f"{100 * gbs / bw:.0f} %", f"{100 * gbs / floor:.0f} %", "yes" if same else "DIFFERS"))
            print(*rows[-1], flush=True)
    print(tabulate(rows, headers=["N", "K", "warps", "blocks/SM", "rows", "regs", "resident", "us", "GB/s",
                                  "of copy", "of read-only", "same bits"], tablefmt="github"))
    print(f"{len(rows) - bad} variants give the first's bits, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
