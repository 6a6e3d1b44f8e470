"""Whole architectures on the CUDA backend against the numpy reference (q8_1 mode,
kernels.cases.cuda_reference): the same
architecture file runs unchanged on both, over the small synthetic models in golden/models
(every weight type the kernels support, llama / qwen3 / qwen3moe / gemma3). A prefill of
random tokens, then decode steps, each compared at every traced activation and at the logits.

Bound: the ops agree to NMSE <= 1e-9 each (most bit for bit; test_kernels.py) except attention,
whose F16-rounded probabilities can flip (<= 2.5e-7, typically <= 1e-8); a layer can amplify
a relative error by the ratio of its output to its input, O(10) for these random weights, and
the models have 2 layers: 2.5e-7 x 10 x 2 ~ 5e-6 for any activation or logit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends import cuda_available
from kernels.cases import cuda_reference, nmse

pytestmark = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: whole-model CUDA checks run on the GPU runner (ci/gpu_conformance.sh)")

MODEL = 5e-6
SYNTH = Path(__file__).resolve().parents[1] / "golden" / "models"
MODELS = sorted(p.stem for p in SYNTH.glob("synth-*.gguf"))


def run_forward(backend, weights, cfg, arch, cache, ids, pos):
    """Logits and every traced activation, as numpy arrays."""
    from engine.arch.common import Forward

    taps = []
    f = Forward(backend, cfg, weights, cache, backend.asarray(pos),
                lambda name, x: taps.append((name, backend.to_numpy(x))))
    logits = backend.to_numpy(arch.forward(f, backend.asarray(ids)))
    return logits, taps


@pytest.mark.parametrize("name", MODELS)
def test_model_prefill_and_decode(name, rng, record_property):
    from engine import arch as arch_registry
    from engine.arch.common import Weights
    from engine.backends.cuda import CudaBackend
    from engine.config import read_config
    from engine.gguf import GGUFFile
    from engine.kv_cache import KVCache

    gf = GGUFFile(SYNTH / f"{name}.gguf")
    arch = arch_registry.get(gf.architecture)
    cfg = arch.configure(read_config(gf, gf.architecture), gf)
    backends = {"cuda": CudaBackend(poison_outputs=True), "numpy": cuda_reference()}
    caches = {k: KVCache(b, cfg, 32) for k, b in backends.items()}
    weights = {k: Weights(b, gf) for k, b in backends.items()}
    prompt = rng.integers(0, cfg.n_vocab, 12).astype(np.int32)
    steps = [(prompt, np.arange(12, dtype=np.int32))]
    steps += [(rng.integers(0, cfg.n_vocab, 1).astype(np.int32), np.array([12 + i], np.int32)) for i in range(3)]
    worst = 0.0
    for step, (ids, pos) in enumerate(steps):
        got_logits, got_taps = run_forward(backends["cuda"], weights["cuda"], cfg, arch, caches["cuda"], ids, pos)
        want_logits, want_taps = run_forward(backends["numpy"], weights["numpy"], cfg, arch, caches["numpy"], ids, pos)
        assert [n for n, _ in got_taps] == [n for n, _ in want_taps], "the two backends traced different nodes"
        for (tap, got), (_, want) in zip(got_taps + [("logits", got_logits)], want_taps + [("logits", want_logits)]):
            where = f"step {step} ({'prefill' if step == 0 else 'decode'}), {tap}"
            assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
            if np.issubdtype(want.dtype, np.integer):
                assert np.array_equal(got, want), f"{where}: differs"
                continue
            assert not np.isnan(got).any(), f"{where}: NaN"
            err = nmse(got, want)
            worst = max(worst, err)
            assert err <= MODEL, f"{where}: NMSE {err:.3e} exceeds {MODEL:.0e}"
    record_property("nmse", f"{worst:.3e}")
