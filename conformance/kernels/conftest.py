"""The two backends the CUDA kernel tests compare, one of each per test module: the CUDA
backend with its outputs poisoned with NaN before each kernel runs (an element a kernel forgets
to write fails instead of passing as stale memory), and the reference the kernels are held to
(conformance.harness.cases.cuda_reference). Only this folder's tests use them; a module that
needs other settings defines its own `cuda` or `ref`."""

import pytest

from conformance.harness.cases import cuda_reference


@pytest.fixture(scope="module")
def cuda():
    from brass.backends.cuda import CudaBackend
    return CudaBackend(poison_outputs=True)


@pytest.fixture(scope="module")
def ref():
    return cuda_reference()
