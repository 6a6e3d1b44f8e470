"""The masked tail of a prompt graph (engine/model.py prompt_class, _PrefillGraph): a prompt of n
tokens padded to its class's N rows, the real count n a device word the recurrent kernels read.
The delta-net's states must be those after exactly n rows, and the real rows' outputs those of
an unpadded read of n rows, bit for bit: the same kernel runs over the same n rows (the padding
only lengthens the arrays), so nothing but an exact match is right.

For each op (ssm.cu ssm_conv and gated_delta_net_<D>, delta_chunked.cu
gated_delta_net_chunked_<D>, and the numpy twins the CPU tests' fake replays): N rows of which
the last N - n are padding filled with large random values (a leak of them shows), run with
n_real = n, against the same op on the first n rows alone; both from the same fresh random
state. The padding rows' outputs must be zero (finite: they flow on through the padding rows'
layers), the outputs poisoned with NaN before the kernel runs. n runs over the chunk edges
(63, 64, 65), a prompt shorter than the conv window (1, 2), and n = N (no padding); the
conv's across its 16-token blocks (17, 20, 100).

On the CPU the kernels' own sources run through g++ (conformance/harness/delta_host.py; skips
without g++); on the GPU the backend's launches with n_real a device array.
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.backends.numpy_backend import NumpyBackend
from conformance.harness.mmq_host import built

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the masked-tail kernel tests run on the GPU runner; the same "
           "kernels' sources run on the CPU below")

# (N padded rows, n real rows): a class of the sequential kernel's range, then the chunked one's
SEQ_CASES = ((15, 1), (15, 9), (31, 17), (31, 31))
CHUNK_CASES = ((79, 64), (79, 65), (143, 1), (143, 63), (143, 100), (143, 143))
CONV_CASES = ((7, 1), (7, 2), (15, 3), (31, 20), (31, 31), (47, 17), (143, 100))
HEADS = ((2, 4, 32), (2, 6, 64))


def _case(rng, N, Hk, Hv, D):
    from conformance.harness.delta_host import random_case
    return random_case(rng, N, Hk, Hv, D)


def _pad_garbage(rng, arrays, n):
    """The rows from n on of each array replaced by large random values (in place)."""
    for a in arrays:
        a[n:] = rng.uniform(-50, 50, a[n:].shape).astype(a.dtype)


def _delta_pair(rng, N, n, Hk, Hv, D):
    q, k, v, g, beta, state = _case(rng, N, Hk, Hv, D)
    _pad_garbage(rng, (q, k, v, g, beta), n)
    return (q, k, v, g, beta), state


def _check_delta(got, got_state, want, want_state, n):
    assert np.array_equal(got[:n], want), f"real rows differ (max |diff| {np.nanmax(np.abs(got[:n] - want)):.3g})"
    assert np.array_equal(got_state, want_state), "the state is not the state after the real rows"
    assert np.all(got[n:] == 0), "padding rows' outputs are not zero"


def _host(build):
    from conformance.harness import delta_host
    return delta_host, built(getattr(delta_host, build))


@pytest.mark.parametrize("N,n", CHUNK_CASES)
@pytest.mark.parametrize("Hk,Hv,D", HEADS, ids=str)
def test_chunked_kernel_masks_the_tail_on_the_cpu(rng, N, n, Hk, Hv, D):
    dh, lib = _host("build")
    ins, state = _delta_pair(rng, N, n, Hk, Hv, D)
    got_state, want_state = state.copy(), state.copy()
    got = dh.gated_delta_net_chunked(lib, *ins, got_state, n_real=n)
    want = dh.gated_delta_net_chunked(lib, *(a[:n] for a in ins), want_state)
    _check_delta(got, got_state, want, want_state, n)


@pytest.mark.parametrize("N,n", SEQ_CASES)
@pytest.mark.parametrize("Hk,Hv,D", HEADS, ids=str)
def test_sequential_kernel_masks_the_tail_on_the_cpu(rng, N, n, Hk, Hv, D):
    dh, lib = _host("build_sequential")
    ins, state = _delta_pair(rng, N, n, Hk, Hv, D)
    got_state, want_state = state.copy(), state.copy()
    got = dh.gated_delta_net(lib, *ins, got_state, n_real=n)
    want = dh.gated_delta_net(lib, *(a[:n] for a in ins), want_state)
    _check_delta(got, got_state, want, want_state, n)


def _conv_case(rng, N, n, C=40, K=4):
    x = rng.standard_normal((N, C)).astype(np.float32)
    _pad_garbage(rng, (x,), n)
    w = rng.standard_normal((C, K)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    return x, w, state


@pytest.mark.parametrize("N,n", CONV_CASES)
def test_conv_masks_the_tail_on_the_cpu(rng, N, n):
    dh, lib = _host("build_sequential")
    x, w, state = _conv_case(rng, N, n)
    got_state, want_state = state.copy(), state.copy()
    got = dh.ssm_conv(lib, x, got_state, w, n_real=n)
    want = dh.ssm_conv(lib, x[:n], want_state, w)
    assert np.array_equal(got[:n], want), "real rows differ"
    assert np.array_equal(got_state, want_state), "the conv window is not the one after the real rows"
    assert np.isfinite(got).all(), "a padding row's output was left unwritten"


class _W:
    """A conv weight as the numpy backend takes it (w.dense())."""

    def __init__(self, w):
        self._w = w

    def dense(self):
        return self._w


@pytest.mark.parametrize("N,n", SEQ_CASES + CHUNK_CASES[:2])
def test_numpy_twins_mask_the_tail(rng, N, n):
    # the reference the CPU tests' fake replays (conformance/harness/fakes.py)
    b = NumpyBackend()
    ins, state = _delta_pair(rng, N, n, 2, 4, 32)
    got_state, want_state = state.copy(), state.copy()
    got = b.gated_delta_net(*ins, got_state, n_real=np.array([n], np.int32))
    want = b.gated_delta_net(*(a[:n] for a in ins), want_state)
    _check_delta(got, got_state, want, want_state, n)
    x, w, cs = _conv_case(rng, N, n)
    got_cs, want_cs = cs.copy(), cs.copy()
    got = b.ssm_conv(x, got_cs, _W(w), n_real=np.array([n], np.int32))
    want = b.ssm_conv(x[:n], want_cs, _W(w))
    assert np.array_equal(got[:n], want) and np.array_equal(got_cs, want_cs)


@needs_cuda
@pytest.mark.parametrize("N,n", SEQ_CASES + CHUNK_CASES)
@pytest.mark.parametrize("Hk,Hv,D", HEADS, ids=str)
def test_cuda_delta_net_masks_the_tail(cuda, rng, N, n, Hk, Hv, D):
    # the op as a prompt graph calls it: the kernel chosen by N (sequential below 64 rows,
    # chunked from 64), the real count a device word
    ins, state = _delta_pair(rng, N, n, Hk, Hv, D)
    real = cuda.asarray(np.array([n], np.int32))
    got_state, want_state = cuda.asarray(state), cuda.asarray(state)
    got = cuda.gated_delta_net(*(cuda.asarray(a) for a in ins), got_state, n_real=real)
    if N >= 64:     # the graph's kernel on the real rows alone (an eager read of n < 64 takes
        want = cuda.gated_delta_net_chunked(*(cuda.asarray(a[:n]) for a in ins), want_state)
    else:           # the sequential one: its class does not reach the chunked kernel's range)
        want = cuda.gated_delta_net(*(cuda.asarray(a[:n]) for a in ins), want_state)
    _check_delta(cuda.to_numpy(got), cuda.to_numpy(got_state), cuda.to_numpy(want), cuda.to_numpy(want_state), n)


@needs_cuda
@pytest.mark.parametrize("N,n", CONV_CASES)
def test_cuda_conv_masks_the_tail(cuda, rng, N, n):
    from brass.backends.cuda.common import CudaWeight
    from brass.gguf import GGMLType
    x, w, state = _conv_case(rng, N, n)
    cw = CudaWeight("conv", GGMLType.F32, w.shape, data=cuda.asarray(w).view(np.uint8).ravel())
    got_state, want_state = cuda.asarray(state), cuda.asarray(state)
    got = cuda.ssm_conv(cuda.asarray(x), got_state, cw, n_real=cuda.asarray(np.array([n], np.int32)))
    want = cuda.ssm_conv(cuda.asarray(x[:n]), want_state, cw)
    got, want = cuda.to_numpy(got), cuda.to_numpy(want)
    assert np.array_equal(got[:n], want) and np.isfinite(got).all()
    assert np.array_equal(cuda.to_numpy(got_state), cuda.to_numpy(want_state))
