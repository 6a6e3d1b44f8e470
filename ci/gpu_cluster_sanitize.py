"""One Q4_K split mat-vec (300 x 12288, the grid's last cluster part idle) through the CUDA
backend with matvec_q.cu built for clusters of N blocks (MV_STAGE_CLUSTER=N, kernels/matvec.cuh),
checked against the default build bit for bit: what `compute-sanitizer --tool synccheck` and
`--tool racecheck` run on the GPU runner, so that the cluster barriers and the stores into peers'
shared memory are checked by the tool as well as by their results.

    compute-sanitizer --tool synccheck --error-exitcode 1 python3 ci/gpu_cluster_sanitize.py 2
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cuda import CudaBackend  # noqa: E402
from engine.gguf import GGMLType, GGUFFile  # noqa: E402
from kernels.cases import random_weight_file  # noqa: E402


def main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else 2
    rng = np.random.default_rng()
    K = 12288
    with tempfile.TemporaryDirectory() as d:
        gf = GGUFFile(random_weight_file(Path(d) / "w.gguf", rng, {"a": (GGMLType.Q4_K, (300, K))}))
        x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(np.float32)
        out = []
        for defines in ((), (f"-DMV_STAGE_CLUSTER={n}",)):
            be = CudaBackend(poison_outputs=True)
            be.kernels.options += defines
            (y,) = be.matmul_many(be.asarray(x), [be.weight(gf, "a")])
            out.append(be.to_numpy(y))
            width = be.kernels.cluster_width("matvec_q.cu", "matvec_split_q4_k")
            print(f"build {defines or 'default'}: cluster width {width}")
    if np.isnan(out[1]).any() or not np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32)):
        print(f"MV_STAGE_CLUSTER={n}: differs from the default build")
        return 1
    print(f"MV_STAGE_CLUSTER={n}: the default build's bits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
