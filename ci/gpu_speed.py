"""Speed figures of the CUDA backend on the GPU runner, in one call:

1. the device copy bandwidth (bytes read + written per second, a 2 GiB device-to-device copy),
   the ceiling every mat-vec figure is a share of;
2. decode mat-vec kernels alone (no Python in the timing: 20 calls captured as a CUDA graph and
   replayed; several copies of the weight rotated so that no call is served from the 60 MB L2),
   GB/s of weight bytes and the share of the copy bandwidth; beside each, the floor of any
   kernel reading those bytes once in the same harness (a streaming read of the same number of
   bytes, 16 per load, the same graph of 20 calls and rotation; the best of a few grid shapes):
   what the launch, the ramp-up and the tail of a call of that size leave of the copy rate;
3. with --models: shape-true models (conformance/harness/shape_models.py) written to --dir, then
   brass bench on each (pp512 / tg128 and the kernels per decode token).

    python3 ci/gpu_speed.py [--models qwen3-0.6b,qwen3-8b] [--dir /tmp/shapes] [--json OUT]
                            [--types Q4_K,Q6_K] [--no-floor]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile  # noqa: E402
from conformance.harness.cases import random_weight_file  # noqa: E402

MATVEC_CASES = [  # (type, N rows, K)
    (GGMLType.Q4_K, 12288, 4096), (GGMLType.Q6_K, 12288, 4096), (GGMLType.Q8_0, 12288, 4096),
    (GGMLType.Q5_K, 12288, 4096), (GGMLType.Q4_0, 12288, 4096), (GGMLType.MXFP4, 12288, 4096),
    (GGMLType.Q6_K, 4096, 12288), (GGMLType.Q4_K, 4096, 12288), (GGMLType.Q4_K, 4096, 4096),
    (GGMLType.Q4_K, 3072, 1024),
    (GGMLType.Q6_K, 151936, 1024), (GGMLType.F16, 4096, 4096),
]


def copy_bandwidth(cp) -> float:
    n = 1 << 31
    src = cp.random.randint(0, 255, n, dtype=np.uint8)
    dst = cp.empty_like(src)
    for _ in range(2):
        cp.copyto(dst, src)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    reps = 10
    start.record()
    for _ in range(reps):
        cp.copyto(dst, src)
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / reps
    return 2 * n / (ms * 1e-3) / 1e9


READ_SRC = r"""
extern "C" __global__ void read_words(const uint4 * __restrict__ p, const long long n, unsigned * out) {
    unsigned acc = 0;
    const long long stride = (long long) gridDim.x * blockDim.x;
    long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {       // four loads in flight a thread
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) { const uint4 a = p[i]; acc ^= a.x ^ a.y ^ a.z ^ a.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;                // keeps the loads; (almost) never taken
}
"""


def graph_us(b, calls, reps: int) -> float:
    """Microseconds per call of `calls()` (reps launches on b's stream), captured once as a
    graph, replayed once to warm up, then timed over 5 replays. Call inside b.activate()."""
    import cupy as cp
    g = b.capture(calls)
    g.replay()
    b.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(b.stream)
    for _ in range(5):
        g.replay()
    end.record(b.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (5 * reps)


def read_floor(b, nbytes: int, reps=20) -> float:
    """GB/s of the best streaming read of nbytes (16-byte words), timed as matvec_speed times a
    mat-vec: reps calls in one graph over copies rotated past the L2."""
    import cupy as cp
    kern = cp.RawKernel(READ_SRC, "read_words")
    words = nbytes // 16
    copies = max(1, -(-(240 << 20) // nbytes))
    with b.activate():
        bufs = [cp.random.randint(0, 2 ** 31, words * 4, dtype=np.int64).astype(np.uint32) for _ in range(copies)]
        out = cp.zeros(1, np.uint32)
        best = 0.0
        for blocks_per_sm, threads in ((4, 256), (8, 256), (2, 1024), (16, 128)):
            grid = b.n_sms * blocks_per_sm

            def calls():
                for i in range(reps):
                    kern((grid,), (threads,), (bufs[i % copies], np.int64(words), out), stream=b.stream)  # noqa: B023 (the function runs at once, inside this iteration)
            calls()
            b.synchronize()
            best = max(best, words * 16 / graph_us(b, calls, reps) / 1e3)
    return best


def matvec_speed(b, tmp: Path, qtype, N, K, reps=20, with_output=False):
    """(microseconds per call, GB/s of weight bytes) of the decode mat-vec alone; with_output:
    and the output of one call (numpy), for comparing builds."""
    from brass.backends.cuda import quantize
    rng = np.random.default_rng(0)
    gf = GGUFFile(random_weight_file(tmp / f"w-{qtype.name}-{N}-{K}.gguf", rng, {"w": (qtype, (N, K))}))
    w = b.weight(gf, "w")
    nbytes = N * K // BLOCK_SIZES[qtype][0] * BLOCK_SIZES[qtype][1]
    copies = max(1, -(-(240 << 20) // nbytes))          # > 4x the L2 in rotation
    ws = [w] + [type(w)(w.name, w.type, w.shape, data=w.data.copy()) for _ in range(copies - 1)]
    with b.activate():
        x = b.asarray(rng.uniform(-1, 1, (1, K)).astype(np.float32))
        if qtype not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            quantize.remember(b, x, b.quantize_q8_1(x))        # time the mat-vec, not the quantization
        y = b.to_numpy(b.matmul(x, w))
        b.synchronize()
        us = graph_us(b, lambda: [b.matmul(x, ws[i % copies]) for i in range(reps)], reps)
    return (us, nbytes / us / 1e3, y) if with_output else (us, nbytes / us / 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="", help="comma-separated shape names (conformance/harness/shape_models.py)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/brass-shapes"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--types", default="", help="comma-separated weight types: only their mat-vec cases")
    ap.add_argument("--no-floor", action="store_true", help="without the read-only floor of each case")
    ap.add_argument("-r", "--reps", type=int, default=3)
    args = ap.parse_args(argv)

    import cupy as cp
    from tabulate import tabulate

    from brass.backends.cuda import CudaBackend
    out = {}
    b = CudaBackend()
    print(f"device: {b.device_name}", flush=True)
    bw = copy_bandwidth(cp)
    out["copy_GB_per_s"] = bw
    print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
    if not args.skip_kernels:
        rows = []
        tmp = args.dir / "kernels"
        tmp.mkdir(parents=True, exist_ok=True)
        types = {t.strip().upper() for t in args.types.split(",") if t.strip()}
        for qtype, N, K in MATVEC_CASES:
            if types and qtype.name not in types:
                continue
            us, gbs = matvec_speed(b, tmp, qtype, N, K)
            nbytes = N * K // BLOCK_SIZES[qtype][0] * BLOCK_SIZES[qtype][1]
            floor = float("nan") if args.no_floor else read_floor(b, nbytes)
            rows.append((qtype.name, N, K, f"{us:.1f}", f"{gbs:.0f}", f"{100 * gbs / bw:.0f} %",
                         f"{floor:.0f}", f"{100 * floor / bw:.0f} %", f"{100 * gbs / floor:.0f} %"))
        out["matvec"] = rows
        print(tabulate(rows, headers=["type", "N", "K", "us/call", "GB/s", "of copy", "read-only GB/s",
                                      "read-only of copy", "of read-only"], tablefmt="github"), flush=True)
    if args.models:
        import brass
        from brass.bench import bench
        from conformance.harness import shape_models
        results = []
        for name in args.models.split(","):
            path = args.dir / f"{name}.gguf"
            if not path.exists():
                shape_models.write(name, args.dir)
            t0 = time.time()
            m = brass.load(str(path), backend="cuda", quiet=True)
            print(f"{name}: loaded in {time.time() - t0:.1f} s", flush=True)
            for r in bench(m, reps=args.reps):
                results.append(r.as_dict())
                print(f"  {r.test}: {r.tokens_per_s:.1f} ± {r.stddev:.1f} tok/s"
                      + (f"  ({r.kernels_per_token} kernels per token)" if r.kernels_per_token else ""), flush=True)
            del m
            cp.get_default_memory_pool().free_all_blocks()
        out["bench"] = results
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
