"""The helpers of kernels/cases.py that GPU-only checks lean on, checked where CI runs."""
from __future__ import annotations

import numpy as np

from conformance.harness.cases import f16_steps


def test_f16_steps_counts_float16_values_between():
    """The rope_store cache check's distance (conformance/kernels/test_kernels_model.py, on the GPU;
    checked here): neighbours are 1 apart across zero and across a binade, +0 and -0 are 0 apart."""
    f = np.float16
    a = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -6e-8, 1.0], f)
    b = np.array([-0.0, 0.0, np.nextafter(f(1.0), f(np.inf)), np.nextafter(f(-1.0), f(-np.inf)), np.nextafter(f(2.0), f(0)), 6e-8, 1.0], f)
    assert f16_steps(a, b).tolist() == [0, 0, 1, 1, 1, 2, 0]
    # a sign error or an F16 read as F32 would be far more than one step off
    assert f16_steps(np.array([1.0], f), np.array([-1.0], f))[0] > 1000
