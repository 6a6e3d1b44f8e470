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
    src = "#define ATTN_SLOT_LANES 0\n" + (KERNEL_DIR / "attention.cu").read_text()
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
    # Pass 1 with a slot per thread (ATTN_SLOT_LANES=1, the default: its dot product summed in
    # the thread) or per warp (0, the path for head_dim % 8 != 0, and the layout before): other
    # orders of the same additions, each held to the kernel's bound against the reference
    # (head_dim 36: not a multiple of 8, the warp path either way; 256 and 512, Gemma 4's, take
    # a slot per warp by default, ATTN_SLOT_LANES_MAX_DIM: a slot per thread is built here for
    # every head size, so that both layouts are checked at each)
    from conformance.harness.attn_host import KERNEL_DIR, attention_rowwise
    from conformance.harness.mmq_host import q8_1_blocks
    lib = _lib(f"#define ATTN_SLOT_LANES {lanes}\n#define ATTN_SLOT_LANES_MAX_DIM 1024\n"
               + (KERNEL_DIR / "attention.cu").read_text())
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


# (H, H_kv, D, DV, past, window, q/k norms, neox, n_rot): Qwen3's heads (norms, neox), GQA 4:1
# and none, a window, partial rotation (n_rot < D), the interleaved layout, an empty past
# and (a tenth field) a cache smaller than the position (nothing written, the last slots read);
# V heads narrower than K, a 256-dim head (pass 1 a warp per slot), MHA with V wider than K, a
# head of 96
ROPE_CASES = [(4, 2, 128, 128, 40, 0, True, True, 128), (2, 2, 64, 64, 7, 0, False, False, 64),
              (8, 2, 128, 128, 100, 24, True, True, 64), (2, 1, 64, 64, 0, 0, True, False, 32),
              (4, 1, 128, 64, 20, 0, True, True, 128), (2, 1, 256, 256, 50, 0, True, True, 256),
              (4, 4, 64, 128, 12, 0, False, True, 64), (2, 1, 96, 96, 9, 0, True, False, 96),
              (2, 1, 64, 64, 20, 0, True, True, 64, 16)]


def test_rope_attention_and_rope_store_run_on_as_many_threads():
    # The kernels share their float operations only if the head norms' reductions see the same
    # warps: rope_store's block and the attention block must be the same size.
    import re
    from conformance.harness.attn_host import KERNEL_DIR
    threads = {f: int(re.search(rf"#define {d} (\d+)", (KERNEL_DIR / f).read_text()).group(1))
               for f, d in (("fused.cu", "ROPE_STORE_THREADS"), ("attention.cu", "ATTN_THREADS"))}
    assert len(set(threads.values())) == 1, threads


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "H%d-%d-D%d-%d-past%d-w%d-norm%d-neox%d-rot%d" % c[:9]
                         + ("-cap%d" % c[9] if len(c) > 9 else ""))
def test_rope_attention_is_rope_store_then_attention_on_the_cpu(rng, case):
    # rope_attention (a decode step's q/k norms, rope, cache writes and attention in one
    # kernel) must give exactly what fused.cu's rope_store then attention give: the roped q
    # and k, every cache slot, the output and its Q8_1 blocks, bit for bit (the same device
    # code for the rope, the same attention body). Unseen cache slots are NaN on both sides.
    from conformance.harness import fused_host
    from conformance.harness.attn_host import attention_rowwise, rope_attention, unseen_slots
    from conformance.harness.mmq_host import NoHostCompiler
    try:
        flib = fused_host.build()
    except NoHostCompiler as e:
        pytest.skip(f"no CPU build of fused.cu: {e}")
    alib = _lib()
    H, Hkv, D, DV, past, window, norms, neox, n_rot = case[:9]
    cap = case[9] if len(case) > 9 else past + 9
    pos = np.array([past], np.int32)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k = rng.standard_normal((1, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, DV)).astype(np.float32)
    kc = rng.standard_normal((cap, Hkv, D)).astype(np.float16)
    vc = rng.standard_normal((cap, Hkv, DV)).astype(np.float16)
    unseen = unseen_slots(pos, cap, window)
    if past < cap:
        unseen[past] = True             # the slot the kernel writes: NaN until it does
    kc[unseen], vc[unseen] = np.nan, np.nan
    rope = dict(q_norm=rng.uniform(0.5, 1.5, D).astype(np.float32) if norms else None,
                k_norm=rng.uniform(0.5, 1.5, D).astype(np.float32) if norms else None,
                eps=1e-6, n_rot=n_rot, base=1e6, neox=neox)
    scale = float(1 / np.sqrt(D))
    kc1, vc1, kc2, vc2 = kc.copy(), vc.copy(), kc.copy(), vc.copy()
    q1, k1 = fused_host.rope_store(flib, q, k, v, pos, kc1, vc1, **rope)
    out1, blocks1 = attention_rowwise(alib, q1, kc1, vc1, pos, scale, window)
    q2, k2, out2, blocks2 = rope_attention(alib, q, k, v, pos, kc2, vc2, scale, window=window, **rope)
    assert not np.isnan(out1).any(), "the composition read a slot it must not see"
    for what, a, b in (("q", q1, q2), ("k", k1, k2), ("output", out1, out2), ("Q8_1 blocks", blocks1, blocks2),
                       ("K cache", kc1.view(np.uint16), kc2.view(np.uint16)),
                       ("V cache", vc1.view(np.uint16), vc2.view(np.uint16))):
        assert np.array_equal(a, b), f"{case}: rope_attention's {what} differs from rope_store then attention"
