"""The tensor-parallel bounds against one rank, shared by the numpy (test_tensor_parallel.py)
and CUDA (test_tensor_parallel_cuda.py) tests, with their reason.

TP = 2 and 4 change summation order: a row-parallel mat-mul sums block-aligned slices of the
input on each rank and the all-reduce adds the ranks' partial sums in rank order. Float32
differences of ~1e-7 relative, which the engine's float16 and Q8 roundings (KV cache, softmax
for V, activation quantization) now and then turn into one rounding step that the later layers
carry. Measured on the numpy backend against TP = 1, on the four TP models' teacher-forced
prompts: full-vocabulary NMSE <= 1.2e-4, |Δ| of a logit <= 0.25, no argmax flip
(test_tensor_parallel.py's docstring has the figures). TP_NMSE: the suite's NMSE bound of the
numpy backend against llama.cpp on synthetic models (tolerances.LOGITS), 4x above the worst
measured; the argmax must agree wherever TP = 1's top-1/top-2 margin exceeds TP_MARGIN, twice
the largest logit difference measured (a margin that large cannot flip), and so must the greedy
tokens up to the first step below it.
"""

from __future__ import annotations

import numpy as np

TP_NMSE = 5e-4
TP_MARGIN = 0.5


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def disagreements(logits, ref_logits, margin_bound):
    """(positions whose argmax differs from the reference's where its top-1/top-2 margin
    exceeds margin_bound, how many positions have such a margin)."""
    s = np.sort(ref_logits, axis=-1)
    clear = s[:, -1] - s[:, -2] > margin_bound
    return np.nonzero(clear & (logits.argmax(-1) != ref_logits.argmax(-1)))[0], int(clear.sum())


def cuda_single(path):
    """The single-GPU model the CUDA ranks are held to bit for bit: eager (no decode or prompt
    graphs), its prompt GEMMs through the same kind of cuBLAS handle as the ranks' backends
    (own_cublas, as the BRASS_PROMPT_GRAPHS setting gives it)."""
    from brass import flags
    from brass.model import Model
    return Model(path, backend="cuda", quiet=True, graphs=False, prompt_graphs=False,
                 own_cublas=flags.get("BRASS_PROMPT_GRAPHS"))


def assert_same_bits(got, want, prompts):
    """Two models (TPModel or Model) give the same teacher-forced logits on the first two
    prompts, bit for bit, and the same greedy tokens after the first one."""
    for p in prompts[:2]:
        assert np.array_equal(got.score(p.tf_ids), want.score(p.tf_ids)), p.name
    p = prompts[0]
    n = len(p.generated_ids)
    assert list(got.generate(p.prompt_ids, n, stop_at_eog=False)) == \
        list(want.generate(p.prompt_ids, n, stop_at_eog=False))
