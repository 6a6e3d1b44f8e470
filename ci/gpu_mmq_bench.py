"""A prompt's mat-mul two ways on the GPU: the float16 GEMM (to_f16 + dequant_f16_<type> +
cuBLAS, the default) and MMQ (quantize_q8_1 + mmq_<type>, BRASS_MMQ=1), on the Qwen3-8B
shapes at T = 512 (ci/gpu_mmq.sh runs it). Prints one table row per (type, shape): median
GPU time of each (CUDA events, after a warm-up), the ratio, MMQ's share spent quantizing x,
and the NMSE between the two results (float16 against Q8_1 rounding: ~1e-5 expected; a
broken kernel gives ~1).

Usage: python3 ci/gpu_mmq_bench.py [--tokens 512] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from brass.gguf import GGMLType, GGUFFile
from conformance.harness.cases import nmse, random_weight_file

SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))       # (N, K): q/o, gate/up, down
TYPES = (GGMLType.Q4_K, GGMLType.Q6_K)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from brass.backends.cuda import CudaBackend
    cuda = CudaBackend()
    rng = np.random.default_rng(0)
    T = args.tokens
    print(f"{cuda.device_name}, T = {T}, median of {args.reps} after a warm-up")
    print(f"| type | N x K | f16 GEMM ms | MMQ ms (quantize ms) | MMQ / f16 | MMQ TOPS | NMSE(MMQ, f16) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in TYPES:
            for N, K in SHAPES:
                path = Path(tmp) / f"w-{qtype.name}-{N}x{K}.gguf"
                gf = GGUFFile(random_weight_file(path, rng, {"w": (qtype, (N, K))}))
                w = cuda.weight(gf, "w")
                x = cuda.asarray(rng.uniform(-1, 1, (T, K)).astype(np.float32))
                with cuda.activate():
                    y16, yq = cuda.empty((T, N)), cuda.empty((T, N))

                    def f16():
                        cuda._gemm_f16(x, w, y16)

                    def quant():
                        return cuda.quantize_q8_1(x)

                    def mmq():
                        cuda._gemm_mmq(x, w, yq, cuda.quantize_q8_1(x))

                    times = {}
                    for name, fn in (("f16", f16), ("mmq", mmq), ("quant", quant)):
                        fn()
                        ms = []
                        for _ in range(args.reps):
                            with cuda.timer() as t:
                                fn()
                            ms.append(t["ms"])
                        times[name] = statistics.median(ms)
                    err = nmse(cuda.to_numpy(yq), cuda.to_numpy(y16))
                tops = 2 * T * N * K / (times["mmq"] * 1e-3) / 1e12
                print(f"| {qtype.name} | {N} x {K} | {times['f16']:.3f} | {times['mmq']:.3f} ({times['quant']:.3f}) "
                      f"| {times['mmq'] / times['f16']:.2f} | {tops:.0f} | {err:.2e} |", flush=True)
                del w, x, y16, yq
                path.unlink()


if __name__ == "__main__":
    main()
