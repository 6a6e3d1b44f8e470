"""The prompt's gated delta rule on the GPU: the chunked kernel (kernels/delta_chunked.cu)
against the sequential one (ssm.cu gated_delta_net_<D>), one delta-net layer's op at the
Qwen3.6-35B-A3B shape (16 key heads, 32 value heads, D 128) by default.

    python3 perf/delta_chunked_timing.py [T] [Hk] [Hv] [D] [reps]     # default 512 16 32 128 50

Prints each kernel's median time (CUDA events around one launch, state reset between runs
outside the timed region) and the NMSE between their outputs and states.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    import cupy
    from conformance.harness.delta_host import random_case
    from brass.backends.cuda import CudaBackend
    from conformance.harness.cases import nmse
    T, Hk, Hv, D, reps = (int(a) for a in (argv + ["512", "16", "32", "128", "50"][len(argv):]))
    cuda = CudaBackend(delta_chunked=False)  # gated_delta_net: the sequential kernel
    q, k, v, g, beta, state = random_case(np.random.default_rng(0), T, Hk, Hv, D, 0.5)
    args = [cuda.asarray(a) for a in (q, k, v, g, beta)]
    state0 = cuda.asarray(state)
    results = {}
    for name, fn in (("sequential", cuda.gated_delta_net),
                     ("chunked", cuda.gated_delta_net_chunked)):
        times = []
        for r in range(reps + 2):
            st = state0.copy()
            with cuda.device, cuda.stream:
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(cuda.stream)
                out = fn(*args, st)
                stop.record(cuda.stream)
                stop.synchronize()
            if r >= 2:                                   # the first runs compile and warm up
                times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        results[name] = (cuda.to_numpy(out), cuda.to_numpy(st))
        print(f"{name:10s} T={T} Hk={Hk} Hv={Hv} D={D}: median {np.median(times):9.1f} us "
              f"(min {min(times):.1f}, {reps} runs)")
        results[name + "_us"] = float(np.median(times))
    (so, ss), (co, cs) = results["sequential"], results["chunked"]
    print(f"speed-up {results['sequential_us'] / results['chunked_us']:.2f}x; chunked vs sequential "
          f"NMSE: output {nmse(co, so):.2e}, state {nmse(cs, ss):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
