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
from conformance.harness.mmq_host import built  # noqa: E402

# (T, past, H, H_kv, D, DV, window): decode steps (T = 1) at short and longer contexts, GQA,
# a window, DV != D, an empty past, a few queries at once
CASES = [(1, 40, 4, 2, 128, 128, 0), (1, 3, 2, 1, 64, 64, 0), (1, 0, 2, 1, 64, 64, 0),
         (1, 100, 4, 1, 128, 128, 24), (5, 30, 4, 1, 64, 64, 8), (3, 70, 2, 2, 128, 64, 0)]


def _lib(kernel_text=None):
    from conformance.harness import attn_host
    return built(attn_host.build_rowwise, kernel_text)


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
    got, blocks = attention_rowwise(_lib(), q, kk, vk, pos, scale, window, rng=rng)
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
        a, _ = attention_rowwise(one, q, kk, vk, pos, 0.1, case[-1], rng=rng)
        b, _ = attention_rowwise(many, q, kk, vk, pos, 0.1, case[-1], rng=rng)
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
        got, blocks = attention_rowwise(lib, q, kk, vk, pos, scale, window, rng=rng)
        want = cuda_reference().attention(q, k, v, pos, scale, window)
        check(got, want.reshape(T, -1), ATTENTION, record_property)
        if blocks is not None:
            assert np.array_equal(blocks, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"


# (positions of the rows, H, H_kv, D, DV, window): a batched decode step's rows, each its own
# sequence with its own length, all in one pool pair with their own block table rows
ROW_CASES = [((40, 3, 17, 0), 4, 2, 128, 128, 0), ((100, 15, 16, 33), 4, 1, 64, 64, 24),
             ((5, 70), 2, 2, 128, 64, 0)]


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "rows%d-H%d-%d-D%d-%d-w%d" % ((len(c[0]),) + c[1:]))
def test_per_row_tables_on_the_cpu(rng, case, record_property):
    # per_row: row t reads its own sequence through row t of the block tables; each row's
    # output is that of its sequence alone (the reference, one query at its position).
    from conformance.harness.attn_host import attention_rows
    from conformance.harness.mmq_host import q8_1_blocks
    positions, H, Hkv, D, DV, window = case
    ref = cuda_reference()
    q = rng.uniform(-1, 1, (len(positions), H, D)).astype(np.float32)
    caches, want = [], []
    for t, p in enumerate(positions):
        cap = p + 1 + int(rng.integers(0, 20))            # each row's own capacity
        k = rng.uniform(-1, 1, (cap, Hkv, D)).astype(np.float16)
        v = rng.uniform(-1, 1, (cap, Hkv, DV)).astype(np.float16)
        pos = np.array([p], np.int32)
        want.append(ref.attention(q[t:t + 1], k, v, pos, 0.1, window).reshape(1, -1))
        unseen = np.arange(cap) > p                        # NaN on the kernel's side
        if window:
            unseen |= np.arange(cap) <= p - window
        k[unseen], v[unseen] = np.nan, np.nan
        caches.append((k, v))
    got, blocks = attention_rows(_lib(), q, caches, np.array(positions, np.int32), 0.1, window, rng=rng)
    check(got, np.concatenate(want), ATTENTION, record_property)
    if blocks is not None:
        assert np.array_equal(blocks, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"


def test_kv_store_writes_through_the_table_on_the_cpu(rng):
    # kv_store writes position p at slot p % 16 of block table[p / 16] and nothing else: the
    # pool's other slots keep their bits, positions outside [0, capacity) are not written.
    # A table entry of -1 (past the blocks a server's sequence holds) is not written either.
    from conformance.harness.attn_host import KV_BLOCK, kv_store
    T, Hkv, D, n_blocks = 8, 2, 96, 9
    table = np.append(rng.permutation(n_blocks)[:4], -1).astype(np.int32)
    cap = 5 * KV_BLOCK - 5
    pos = np.array([0, 15, 16, 40, 4 * KV_BLOCK + 2, cap - 1, cap, -1], np.int32)
    x = rng.uniform(-4, 4, (T, Hkv, D)).astype(np.float32)
    pool = rng.uniform(-1, 1, (n_blocks, KV_BLOCK, Hkv, D)).astype(np.float16)
    want = pool.copy()
    for t, p in enumerate(pos):
        if 0 <= p < cap and table[p // KV_BLOCK] >= 0:
            want[table[p // KV_BLOCK], p % KV_BLOCK] = x[t].astype(np.float16)
    kv_store(_lib(), pool, x, pos, table, cap)
    assert np.array_equal(pool.view(np.uint16), want.view(np.uint16))
