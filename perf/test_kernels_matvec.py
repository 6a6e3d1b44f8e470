"""Mat-vec / mat-mul kernel speed per weight type on the GPU, over the same case table as the
conformance tests (kernels/cases.py). GPU time comes from CUDA events around a run of
back-to-back launches (launch overhead from Python would otherwise dominate a 10 us kernel);
`extra_info` carries the time per call and the weight bytes read per second. A call is
still host-bound when its kernels take less than Python's ~40 us per matmul call (activation
quantization, output allocation, two launches): small shapes measure that floor, not the
kernel; CUDA graphs (the next step) remove it.
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile
from conformance.harness.cases import PERF_MATMUL_SHAPES, WEIGHT_TYPES, random_weight_file

pytestmark = pytest.mark.skipif(not cuda_available(), reason="no CUDA device: GPU benchmarks run on the GPU runner")

REPEAT = 50


@pytest.fixture(scope="module")
def cuda():
    from brass.backends.cuda import CudaBackend
    return CudaBackend()


@pytest.mark.parametrize("shape", PERF_MATMUL_SHAPES, ids=lambda s: "N%d-K%d-T%d" % s)
@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: GGMLType(t).name)
def test_matmul_speed(benchmark, cuda, tmp_path, qtype, shape):
    N, K, T = shape
    rng = np.random.default_rng(0)
    gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {"w": (qtype, (N, K))}))
    w = cuda.weight(gf, "w")
    x = cuda.asarray(rng.uniform(-1, 1, (T, K)).astype(np.float32))

    def run():
        for _ in range(REPEAT):
            cuda.matmul(x, w)
        cuda.synchronize()

    run()                                   # compile, warm up
    with cuda.timer() as t:
        for _ in range(REPEAT):
            cuda.matmul(x, w)
    blck, tsize = BLOCK_SIZES[qtype]
    weight_bytes = N * K // blck * tsize
    gpu_us = t["ms"] * 1e3 / REPEAT
    benchmark.extra_info.update(gpu_us=gpu_us, GB_per_s=weight_bytes / gpu_us / 1e3)
    benchmark.pedantic(run, rounds=3)
