"""The gated delta rule in chunks (kernels/delta_chunked.cu, the default for prompts of 64 tokens or more: a prompt's
delta-net recurrence as per-chunk matrix products and a state carried chunk to chunk) against
the numpy backend's sequential rule, as llama.cpp runs it.

Outputs and the final state, with the op's whole contract: value head h reads key head h % Hk
(tiled, Hk < Hv), the exp(g) decay, beta, the 1/sqrt(D) scale, the state updated in place.
T on both sides of the 64-token chunk (1, 7, 64, 65, 300, 512), D 32 (the synthetic models),
64 and 128 (the real ones), the Qwen3.6-35B-A3B head counts (16 key, 32 value heads); strong and
weak decay (weak decay keeps every token's rounding in the state). Bound DELTA_CHUNKED
(kernels/cases.py, derived from the numpy twin engine/delta_chunked.py in float32). Fresh
random inputs (the `rng` fixture; the seed is printed on failure), outputs poisoned with NaN
before the kernel runs (CudaBackend(poison_outputs=True)).

Without a GPU the kernel tests skip; what runs everywhere: the kernel's own source compiled
for the CPU with g++ (conformance/harness/delta_host.py) against the same reference. CI also compiles
delta_chunked.cu with NVRTC (test_nvrtc_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.backends.numpy_backend import NumpyBackend
from conformance.harness.kernel_checks import check, record_launches
from conformance.harness.cases import DELTA_CHUNKED, RECURRENCE
from conformance.harness.mmq_host import built  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the chunked delta-net kernel tests run on the GPU runner; CI "
           "compiles delta_chunked.cu in test_nvrtc_compile.py and runs it on the CPU below")

F32 = np.float32

# (Hk, Hv, D): the synthetic models' head dim, a 3:1 tiling, the Qwen3.6-35B-A3B shape.
HEADS = ((2, 4, 32), (2, 6, 64), (16, 32, 128))
TOKENS = (1, 7, 64, 65, 300, 512)


def random_case(rng, T, Hk, Hv, D, g_hi=2.0):
    from conformance.harness.delta_host import random_case
    return random_case(rng, T, Hk, Hv, D, g_hi)


def _fits(cuda, D):
    from brass.backends.cuda.ssm import gdn_chunked_smem
    if gdn_chunked_smem(D) > cuda.smem_optin_limit:
        pytest.skip(f"D = {D} needs {gdn_chunked_smem(D)} bytes of shared memory per block; this "
                    f"GPU allows {cuda.smem_optin_limit} (the switch keeps the sequential kernel)")


@needs_cuda
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hk,Hv,D", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_chunked_kernel(cuda, rng, T, Hk, Hv, D, decay, record_property):
    _fits(cuda, D)
    q, k, v, g, beta, state = random_case(rng, T, Hk, Hv, D, 2.0 if decay == "strong" else 0.01)
    want_state = state.copy()
    want = NumpyBackend().gated_delta_net(q, k, v, g, beta, want_state)
    dev_state = cuda.asarray(state)
    got = cuda.gated_delta_net_chunked(*(cuda.asarray(a) for a in (q, k, v, g, beta)), dev_state)
    check(cuda.to_numpy(got), want, DELTA_CHUNKED, record_property, "output")
    check(cuda.to_numpy(dev_state), want_state, DELTA_CHUNKED, record_property, "state")


@needs_cuda
@pytest.mark.parametrize("on", [False, True], ids=["delta_chunked-off", "default"])
def test_option_routes_prompts(cuda, rng, monkeypatch, on):
    # With the delta_chunked option on, a prompt of at least DELTA_CHUNKED_MIN_TOKENS tokens goes
    # to the chunked kernel and a decode step (T = 1) stays sequential; off, nothing reaches it.
    from brass.backends.cuda import ssm
    monkeypatch.setattr(cuda.options, "delta_chunked", on)
    launched = record_launches(cuda, monkeypatch)
    for T in (1, ssm.DELTA_CHUNKED_MIN_TOKENS):
        q, k, v, g, beta, state = random_case(rng, T, 2, 4, 32)
        cuda.gated_delta_net(*(cuda.asarray(a) for a in (q, k, v, g, beta)), cuda.asarray(state))
    want = ["gated_delta_net_32", "gated_delta_net_chunked_32" if on else "gated_delta_net_32"]
    assert launched == want, launched


@pytest.mark.parametrize("T,Hk,Hv,D", [(1, 2, 4, 32), (65, 2, 6, 64), (130, 1, 2, 128), (300, 2, 4, 32)])
def test_chunked_kernel_on_the_cpu(rng, T, Hk, Hv, D, record_property):
    # delta_chunked.cu's own source on the CPU (conformance/harness/delta_host.py: a std::thread per CUDA
    # thread, shared memory poisoned with NaN), against the sequential rule: the indexing,
    # chunk edges, head mapping and solve of the real source, not timing nor FMA contraction.
    from conformance.harness import delta_host
    lib = built(delta_host.build)
    q, k, v, g, beta, state = random_case(rng, T, Hk, Hv, D, 0.01 if T == 300 else 2.0)
    want_state, got_state = state.copy(), state.copy()
    want = NumpyBackend().gated_delta_net(q, k, v, g, beta, want_state)
    got = delta_host.gated_delta_net_chunked(lib, q, k, v, g, beta, got_state)
    check(got, want, DELTA_CHUNKED, record_property, "output")
    check(got_state, want_state, DELTA_CHUNKED, record_property, "state")



@pytest.mark.parametrize("T,Hk,Hv,D", [(1, 2, 4, 32), (9, 2, 6, 32), (1, 16, 32, 128), (5, 4, 8, 128),
                                       (3, 2, 6, 64)])
def test_decode_kernel_on_the_cpu(rng, T, Hk, Hv, D, record_property):
    # ssm.cu's gated_delta_net_<D> (the decode kernel: a block per 32 state rows, a row over
    # two threads at D = 128, the slab staged through shared memory) on the CPU, against the
    # rule, with the RECURRENCE bound the GPU test uses: the slab indexing, the row split and
    # its shuffles, and the tiled head mapping of the real source.
    from conformance.harness import delta_host
    lib = built(delta_host.build_sequential)
    q, k, v, g, beta, state = random_case(rng, T, Hk, Hv, D)
    want_state, got_state = state.copy(), state.copy()
    want = NumpyBackend().gated_delta_net(q, k, v, g, beta, want_state)
    got = delta_host.gated_delta_net(lib, q, k, v, g, beta, got_state)
    check(got, want, RECURRENCE, record_property, "output")
    check(got_state, want_state, RECURRENCE, record_property, "state")


@pytest.mark.parametrize("T", [1, 3, 16, 17, 40, 300])
@pytest.mark.parametrize("K", [2, 4])
def test_conv_kernel_on_the_cpu(rng, T, K):
    # ssm.cu's ssm_conv on the CPU against the numpy twin, bit for bit (the same products and
    # sums in the same order): a thread per (channel, 16 tokens), so T crosses the token
    # blocks' edges; the first token block alone reads and then moves the carried window, and
    # the CPU build runs it before the others, which would read the moved window if they read
    # any. C = 300 leaves the last channel block part empty.
    from conformance.harness import delta_host
    lib = built(delta_host.build_sequential)
    C = 300
    x = rng.uniform(-1, 1, (T, C)).astype(F32)
    w = rng.uniform(-1, 1, (C, K)).astype(F32)
    state = rng.uniform(-1, 1, (K - 1, C)).astype(F32)
    want_state, got_state = state.copy(), state.copy()

    class Dense:        # a conv weight as the numpy backend takes it
        def dense(self):
            return w
    want = NumpyBackend().ssm_conv(x, want_state, Dense())
    got = delta_host.ssm_conv(lib, x, got_state, w)
    assert np.array_equal(got, want), f"outputs differ at {np.argwhere(got != want)[:4].tolist()}"
    assert np.array_equal(got_state, want_state), "the carried window is not the last K-1 rows"
    assert not np.array_equal(want_state, state), "the reference did not move the window"


def test_decode_kernel_block_matches_the_backend():
    # The threads per block the backend launches (gdn_threads) are the kernel's own.
    pytest.importorskip("cupy")
    from conformance.harness import delta_host
    from brass.backends.cuda.ssm import GDN_HEAD_DIMS, gdn_threads
    lib = built(delta_host.build_sequential)
    assert [lib.gdn_threads(d) for d in GDN_HEAD_DIMS] == [gdn_threads(d) for d in GDN_HEAD_DIMS]

def test_shared_memory_size_matches_the_kernel():
    # The bytes the backend gives at launch (gdn_chunked_smem) are those the kernel carves up
    # (GDN_CHUNK_SMEM_FLOATS), read from the CPU build of the source.
    pytest.importorskip("cupy")
    from conformance.harness import delta_host
    from brass.backends.cuda.ssm import GDN_HEAD_DIMS, gdn_chunked_smem
    lib = built(delta_host.build)
    for d in GDN_HEAD_DIMS:
        assert gdn_chunked_smem(d) == 4 * lib.gdn_chunked_smem_floats(d), d
