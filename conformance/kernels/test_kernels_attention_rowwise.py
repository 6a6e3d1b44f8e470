"""attention.cu's `attention` kernel (a block per (head, query): every decode step's attention)
run on the CPU (conformance/harness/attn_host.py build_rowwise: the source under g++, a std::thread per CUDA
thread, warp shuffles through per-warp barriers, shared memory poisoned with NaN) against the
numpy reference, and its pass 1 with several slots in flight per warp against one at a time.

The GPU tests of the kernel are in test_kernels.py (test_attention*); these run everywhere.
Cache slots no query can see are NaN on the kernel's side, so a read of one fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.harness.kernel_checks import check
from conformance.harness.cases import ATTENTION, cuda_reference
from conformance.harness.mmq_host import NoHostCompiler  # noqa: E402

# (T, past, H, H_kv, D, DV, window): decode steps (T = 1) at short and longer contexts, GQA,
# a window, DV != D, an empty past, a few queries at once
CASES = [(1, 40, 4, 2, 128, 128, 0), (1, 3, 2, 1, 64, 64, 0), (1, 0, 2, 1, 64, 64, 0),
         (1, 100, 4, 1, 128, 128, 24), (5, 30, 4, 1, 64, 64, 8), (3, 70, 2, 2, 128, 64, 0)]


def _lib(kernel_text=None):
    from conformance.harness import attn_host
    try:
        return attn_host.build_rowwise(kernel_text)
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of attention.cu: {e}")


def _case(rng, T, past, H, Hkv, D, DV, window):
    from conformance.harness.attn_host import random_case, unseen_slots
    q, k, v, pos = random_case(rng, T, past, H, Hkv, D, DV, window=window)
    unseen = unseen_slots(pos, k.shape[0], window)
    kk, vk = k.copy(), v.copy()
    kk[unseen], vk[unseen] = np.nan, np.nan
    return q, k, v, kk, vk, pos


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T%d-past%d-H%d-%d-D%d-%d-w%d" % c)
def test_rowwise_attention_on_the_cpu(rng, case, record_property):
    from conformance.harness.attn_host import attention_rowwise
    from conformance.harness.mmq_host import q8_1_blocks
    T, past, H, Hkv, D, DV, window = case
    q, k, v, kk, vk, pos = _case(rng, *case)
    scale = float(1 / np.sqrt(D))
    got, blocks = attention_rowwise(_lib(), q, kk, vk, pos, scale, window)
    want = cuda_reference().attention(q, k, v, pos, scale, window)
    check(got, want.reshape(T, -1), ATTENTION, record_property)
    if blocks is not None:
        assert np.array_equal(blocks, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"


def test_slots_in_flight_change_no_bit(rng):
    # Pass 1 with a slot per warp may take ATTN_SLOTS_PER_WARP slots per warp at a time (1 by
    # default: 4 measured slower on the H200); each slot's logit must be the same float
    # operations as with one at a time, so the output too.
    from conformance.harness.attn_host import KERNEL_DIR, attention_rowwise
    src = "#define ATTN_SLOT_LANES_MAX_DIM 0\n" + (KERNEL_DIR / "attention.cu").read_text()
    one = _lib("#define ATTN_SLOTS_PER_WARP 1\n" + src)
    many = _lib("#define ATTN_SLOTS_PER_WARP 4\n" + src)
    for case in CASES:
        q, k, v, kk, vk, pos = _case(rng, *case)
        a, _ = attention_rowwise(one, q, kk, vk, pos, 0.1, case[-1])
        b, _ = attention_rowwise(many, q, kk, vk, pos, 0.1, case[-1])
        assert np.array_equal(a, b), f"{case}: several slots in flight changed the output"


@pytest.mark.parametrize("lanes", [1, 0], ids=["slot-per-thread", "slot-per-warp"])
@pytest.mark.parametrize("case", CASES + [(1, 20, 2, 1, 36, 36, 0), (1, 300, 4, 2, 128, 128, 0), (1, 50, 2, 1, 256, 256, 0),
                                  (2, 33, 2, 1, 512, 512, 16)], ids=lambda c: "T%d-past%d-H%d-%d-D%d-%d-w%d" % c)
def test_pass1_layouts_on_the_cpu(rng, case, lanes, record_property):
    # Pass 1 with a slot per thread (its dot product summed in the thread: the kernel's path for
    # head_dim % 8 == 0 up to ATTN_SLOT_LANES_MAX_DIM) or per warp (the path for the others):
    # other orders of the same additions, each held to the kernel's bound against the reference
    # (head_dim 36: not a multiple of 8, the warp path either way; 256 and 512, Gemma 4's, take
    # a slot per warp: both layouts are built here for every head size, through the limit, so
    # that both are checked at each)
    from conformance.harness.attn_host import KERNEL_DIR, attention_rowwise
    from conformance.harness.mmq_host import q8_1_blocks
    lib = _lib(f"#define ATTN_SLOT_LANES_MAX_DIM {1024 if lanes else 0}\n" + (KERNEL_DIR / "attention.cu").read_text())
    T, past, H, Hkv, D, DV, window = case
    q, k, v, kk, vk, pos = _case(rng, *case)
    # the usual scale, and one that spreads a row's logits over hundreds (exp of the logit
    # less a max that is not the row's own would overflow)
    for scale in (float(1 / np.sqrt(D)), float(400 / np.sqrt(D))):
        got, blocks = attention_rowwise(lib, q, kk, vk, pos, scale, window)
        want = cuda_reference().attention(q, k, v, pos, scale, window)
        check(got, want.reshape(T, -1), ATTENTION, record_property)
        if blocks is not None:
            assert np.array_equal(blocks, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"
