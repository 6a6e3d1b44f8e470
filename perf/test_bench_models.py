"""`brass bench` on shape-true models (conformance/harness/shape_models.py) on the GPU: prompt (pp512) and
generation (tg128) tokens per second, the figures llama.cpp's are compared with
(ci/gpu.sh side-by-side), kept per run and compared with the device's baseline (perf/baseline.py).

Files are written once to $BRASS_TEST_SHAPES (default /tmp/brass-shapes; 0.5 / 5 / 18 GiB). The
figures count only after the CUDA backend's own conformance (kernels in lockstep with the
reference, decode graph == eager) has passed in this checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from brass.backends import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="no CUDA device: model benchmarks run on the GPU runner")

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
_gate: dict = {}


def cuda_conformance_passed() -> tuple[bool, str]:
    if "ok" not in _gate:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "conformance/kernels/test_kernels_model.py", "conformance/models/test_decode_graph.py"],
                           cwd=ROOT, capture_output=True, text=True)
        _gate["ok"] = (r.returncode == 0, (r.stdout.strip().splitlines() or ["no output"])[-1])
    return _gate["ok"]


@pytest.mark.parametrize("shape", SHAPES)
def test_bench_shape(benchmark, shape):
    ok, tail = cuda_conformance_passed()
    if not ok:
        pytest.skip(f"CUDA conformance did not pass ({tail}): no model figures")
    sys.path.insert(0, str(ROOT))
    import cupy
    import brass
    from conformance.harness import shape_models
    from brass.bench import bench
    folder = Path(os.environ.get("BRASS_TEST_SHAPES", "/tmp/brass-shapes"))
    path = folder / f"{shape}.gguf"
    if not path.exists():
        shape_models.write(shape, folder)
    m = brass.load(str(path), backend="cuda", quiet=True)
    results = {}
    benchmark.pedantic(lambda: results.update({r.test: r for r in bench(m, reps=3)}), rounds=1, iterations=1)
    pp, tg = results["pp512"], results["tg128"]
    # One benchmark per figure would double the model loads; the headline is decode speed,
    # the prompt speed rides along.
    benchmark.extra_info.update(tokens_per_s=round(tg.tokens_per_s, 2), pp512_tokens_per_s=round(pp.tokens_per_s, 1),
                                kernels_per_token=tg.kernels_per_token)
    m = None                        # the model's device memory goes back before the next shape
    cupy.get_default_memory_pool().free_all_blocks()
