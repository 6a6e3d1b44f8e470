"""matvec_coop_q6_k on the GPU runner against matvec_q6_k (BRASS_Q6K_COOP): the same bits on
random Q6_K matrices of the output heads' and smaller shapes, and each one's time alone (CUDA
events over 50 eager launches of one matrix larger than L2, or rotated copies), at
COOP_BLOCKS_PER_SM 4 and 8, against the device copy rate.

    python3 ci/gpu_coop_check.py        # exit 1 when a variant's bits differ
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(151936, 1024), (151936, 4096), (3072, 1024), (1024, 3072), (4096, 4096)]


def main() -> int:
    import cupy as cp

    import brass.backends.cuda.backend as cb
    from ci.gpu_speed import copy_bandwidth
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    b = cb.CudaBackend()
    bw = copy_bandwidth(cp)
    rng = np.random.default_rng(1)
    bad = 0
    for N, K in SHAPES:
        nbytes = N * K // 256 * 210
        copies = max(1, -(-(240 << 20) // nbytes))
        gf = GGUFFile(random_weight_file(Path(f"/tmp/coop-{N}-{K}.gguf"), rng,
                                         {f"w{i}": (GGMLType.Q6_K, (N, K)) for i in range(copies)}))
        ws = [b.weight(gf, f"w{i}") for i in range(copies)]
        with b.activate():
            x = b.asarray(rng.uniform(-1, 1, (1, K)).astype(np.float32))
            outs, times = {}, {}
            for name, coop, blocks in (("plain", False, 8), ("coop 8/SM", True, 8), ("coop 4/SM", True, 4)):
                cb.Q6K_COOP, cb.COOP_BLOCKS_PER_SM = coop, blocks
                outs[name] = cp.asnumpy(b.matmul(x, ws[0])).view(np.uint32)
                for w in ws:
                    b.matmul(x, w)
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(b.stream)
                for i in range(50):
                    b.matmul(x, ws[i % copies])
                end.record(b.stream)
                end.synchronize()
                times[name] = cp.cuda.get_elapsed_time(start, end) * 1e3 / 50
            b.synchronize()
        line = []
        for name, us in times.items():
            same = np.array_equal(outs[name], outs["plain"])
            bad += not same
            line.append(f"{name} {us:.1f} us ({nbytes / us / 1e3 / bw:.0%}){'' if same else ' BITS DIFFER'}")
        print(f"Q6_K {N} x {K}: " + "; ".join(line), flush=True)
    cb.Q6K_COOP, cb.COOP_BLOCKS_PER_SM = False, 8
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
