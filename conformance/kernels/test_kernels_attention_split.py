"""attention.cu's split-K decode attention (attention_split_logits, _sums, _values: a (head,
query) row's splits of ATTN_SPLIT_SLOTS slots taken in turn by a few blocks, in passes 1 and 3
a block per (block column of a KV group, lane) computing the column's query heads, the column
cut on the device by the splits in use, the last of a column's lanes to finish combining its
heads' splits) on the CPU and on CUDA.

On the CPU (conformance/harness/attn_host.py build_rowwise: the source under g++, a std::thread
per CUDA thread, each grid's blocks one at a time in a shuffled order, so that any block may be
the one that combines) it is held to:
- the numpy reference within conformance.harness.cases.ATTENTION (its derivation: every
  probability off by at most one F16 ulp; the split's logits, max and exponentials are the
  one-block kernel's, its sums reordered, which moves a probability by at most that);
- the one-block kernel's CPU build (`attention`): bit for bit where one split holds every
  visible slot (then every sum is added in the one-block kernel's order), else within the
  worst-case error of the two float32 orders of V.softmax's sums (below);
- its scratch: each used split's max is the max of its logits, splits past the visible slots
  leave theirs unwritten (no logit, max, sum or partial sum: they read no K or V), and every
  block of a group counts itself done (one counter a group);
- the done counter's fences: a release before the count and an acquire before the combining
  block's loads, as the PTX memory model asks (checked as rules: one block at a time cannot
  show a reordering).
Fresh random inputs (the `rng` fixture prints the seed), block tables shuffled (`paged`),
outputs and scratch poisoned (NaN, 0xFF, -1), slots no query sees NaN on the kernel's side.

On CUDA (skipped without a GPU): the backend's dispatch with the attn_split option forced on,
against the reference and the one-block kernel; a batched step's rows; a context past the
one-block kernel's shared memory; a captured graph replayed while the position grows (and
after a larger call grew the scratch); the combine's bits over many launches; split calls
sharing the counters in one graph; queries in groups; a model's decode graph; a batched step's
rows through bucket graphs prepared in advance, bit for bit as alone. Their Python also runs
here, under the fake CuPy.
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from conformance.harness.cases import ATTENTION, cuda_reference
from conformance.harness.kernel_checks import check
from conformance.harness.mmq_host import built, q8_1_blocks

F16, F32 = np.float16, np.float32
U = 2.0 ** -24                  # float32's unit roundoff

needs_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: the split kernels' GPU tests run on the GPU runner; CI compiles them "
           "in test_nvrtc_compile.py and runs their source on the CPU here")


def _lib(slots: int | None = None, text: str | None = None):
    """The CPU build of attention.cu (or `text`), with ATTN_SPLIT_SLOTS = `slots` if given:
    small splits give many splits at contexts the CPU build runs quickly."""
    from conformance.harness import attn_host
    src = text if text is not None else (attn_host.KERNEL_DIR / "attention.cu").read_text()
    if slots is not None:
        src = f"#define ATTN_SPLIT_SLOTS {slots}\n" + src
    return built(attn_host.build_rowwise, src)


def _inputs(rng, T, past, H, Hkv, D, DV, window, cap):
    from conformance.harness.attn_host import random_case, unseen_slots
    q, k, v, pos = random_case(rng, T, past, H, Hkv, D, DV, cap=cap, window=window)
    unseen = unseen_slots(pos, k.shape[0], window)
    kk, vk = k.copy(), v.copy()
    kk[unseen], vk[unseen] = np.nan, np.nan
    return q, k, v, kk, vk, pos


def reorder_bound(v, pos, cap, window, H, slots, splits_used):
    """Per output element, the worst-case difference between the split kernels' and the
    one-block kernel's V.softmax when both have the same probabilities p_j: each adds the
    products p_j * v_jd (exact in float32: two F16 values) in its own order, and a sum's float32
    error is at most u * sum_j |p_j v_jd| * (the additions on a term's path to the result).
    One-block: a chain of ceil(n / 4) a warp, then 3 warps added; split: ceil(slots / 4) a
    warp, 3 warps, then up to (splits used - 1) splits. sum_j p_j <= 1 + 2^-11 (each p_j
    rounded to F16), so sum_j |p_j v_jd| <= (1 + 2^-11) max_j |v_jd|; the factor 1.01 covers the
    bound's second-order terms. The same p_j: the logits, M and e_j are bit for bit the same,
    and S's reordered double sum (~1e-16 relative) changes f16(float(e_j / S)) only where the
    quotient lies within that of a float rounding boundary that is also an F16 one (odds of
    order 2^-40 a slot). [T, H * DV]."""
    T = len(pos)
    Hkv, DV = v.shape[1], v.shape[2]
    out = np.empty((T, H, DV))
    for t, p in enumerate(pos):
        hi = min(int(p), cap - 1)
        lo = max(0, int(p) - window + 1) if window else 0
        n = hi - lo + 1
        vmax = np.abs(v[lo:hi + 1].astype(np.float64)).max(axis=0)           # [Hkv, DV]
        paths = (-(-n // 4) + 3) + (-(-slots // 4) + 3 + splits_used[t])
        out[t] = 1.01 * paths * U * (1 + 2.0 ** -11) * np.repeat(vmax, H // Hkv, axis=0)
    return out.reshape(T, -1)


def _used(pos, cap, window, slots):
    n = [min(int(p), cap - 1) - (max(0, int(p) - window + 1) if window else 0) + 1 for p in pos]
    return [max(0, -(-x // slots)) for x in n], n


def _check_scratch(sc, pos, cap, window, slots, blocks, H, Hkv, fill=0):
    """The scratch the kernels left: per query, the done counters of the block columns its cut
    took (attention.py split_group_blocks at its splits in use), each counting the column's
    lanes (0 where one split is in use: its one lane writes out itself, counting nothing), and
    no other counter touched; every used split's logits, max, sum and part written (no part
    where one split is in use), nothing past them."""
    from brass.backends.cuda.attention import split_group_blocks
    used, ns = _used(pos, cap, window, slots)
    G, T = H // Hkv, len(pos)
    for t, u in enumerate(used):
        gb = split_group_blocks(G, Hkv, u, T, fill)
        lanes = max(1, min(u, G * blocks // gb))
        want = np.full(H, -1, np.int32)
        want[:Hkv * gb] = lanes if u != 1 else 0
        assert np.array_equal(sc["done"][t], want), \
            f"query {t} ({u} splits used): done counters {sc['done'][t]}, expected {want} ({gb} columns a group)"
    for t, (u, n) in enumerate(zip(used, ns)):
        lg, mx = sc["logit"][t], sc["split_max"][t]
        assert not np.isnan(lg[:, :n]).any(), "a visible slot's logit was not written"
        assert np.isnan(lg[:, max(n, 0):]).all(), "a logit past the visible slots was written"
        for s in range(u):
            assert np.array_equal(mx[:, s], lg[:, s * slots:min(n, (s + 1) * slots)].max(axis=1)), \
                f"split {s}'s max is not the max of its logits"
        for name in ("split_max", "split_sum", "part"):
            assert np.isnan(sc[name][t, :, u:]).all(), f"{name}: a split past the visible slots wrote it"
            if name == "part" and u == 1:
                assert np.isnan(sc[name][t]).all(), "part: a row of one split wrote it (its output goes out directly)"
                continue
            assert not np.isnan(sc[name][t, :, :u]).any(), f"{name}: a used split left it unwritten"


# (T, past, H, H_kv, D, DV, window, capacity, ATTN_SPLIT_SLOTS or None = the default, blocks a
# row or 0 = one a split): decode steps with every split used, one split used of several (the
# others wholly past pos), a window starting inside a split (lo not a multiple of the split or
# the KV block), the warp-per-slot layout (D 256, D 36 without Q8_1 blocks), DV != D, a few
# queries at once, rows whose blocks take several splits each (more blocks than used splits,
# fewer, one); KV groups of G = 1, 2, 4, 6 (chunks of 4 + 2 heads), 8, 10, 11 and 12 query heads
# (more than ATTN_SPLIT_HEADS: chunks of 8 + 2, 8 + 2 + 1, 8 + 4), each a block's heads at once
CASES = [
    (1, 600, 4, 2, 128, 128, 0, 700, None, 0),
    (1, 100, 4, 2, 128, 128, 0, 1000, None, 0),
    (1, 300, 4, 1, 64, 64, 100, 400, 32, 0),
    (1, 700, 2, 1, 128, 128, 333, 800, None, 0),
    (1, 200, 2, 1, 256, 256, 0, 260, 32, 3),
    (1, 90, 2, 1, 36, 36, 0, 120, 32, 0),
    (1, 150, 4, 2, 128, 64, 0, 170, 32, 2),
    (3, 70, 2, 2, 128, 64, 0, 80, 32, 1),
    (1, 45, 2, 1, 64, 64, 0, 200, 16, 5),
    (1, 300, 8, 2, 64, 64, 0, 320, 32, 3),
    (1, 120, 4, 1, 256, 256, 0, 130, 32, 2),
    (1, 200, 6, 1, 64, 64, 50, 260, 32, 0),
    (1, 50, 6, 1, 64, 64, 0, 300, None, 0),
    (1, 100, 16, 2, 64, 64, 0, 120, None, 0),
    (1, 150, 8, 1, 128, 128, 0, 160, None, 0),
    (1, 150, 10, 1, 128, 128, 0, 170, 64, 2),
    (1, 60, 11, 1, 36, 36, 0, 80, 16, 0),
    (2, 90, 12, 1, 64, 32, 40, 130, 16, 4),
]


def _cid(c):
    return "T%d-past%d-H%d-%d-D%d-%d-w%d-cap%d-slots%s-blocks%d" % c


@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_split_attention_on_the_cpu(rng, case, record_property):
    from conformance.harness.attn_host import attention_rowwise, attention_split, split_count
    T, past, H, Hkv, D, DV, window, cap, slots, blocks = case
    lib = _lib(slots)
    slots = lib.split_slots()
    blocks = blocks or split_count(lib, cap, window)
    q, k, v, kk, vk, pos = _inputs(rng, T, past, H, Hkv, D, DV, window, cap)
    used, _ = _used(pos, cap, window, slots)
    # the usual scale, and one that spreads a row's logits over hundreds (an exponential taken
    # against a max that is not the row's own would overflow or vanish)
    for scale in (float(1 / np.sqrt(D)), float(400 / np.sqrt(D))):
        sc = {}
        got, q8 = attention_split(lib, q, kk, vk, pos, scale, window, rng=rng, blocks=blocks, scratch=sc)
        want = cuda_reference().attention(q, k, v, pos, scale, window)
        check(got, want.reshape(T, -1), ATTENTION, record_property)
        if q8 is not None:
            assert np.array_equal(q8, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"
        _check_scratch(sc, pos, cap, window, slots, blocks, H, Hkv)
        one, _ = attention_rowwise(lib, q, kk, vk, pos, scale, window, rng=rng)
        if max(used) == 1:
            assert np.array_equal(got.view(np.uint32), one.view(np.uint32)), \
                "one split used: every sum in the one-block kernel's order, yet the bits differ"
        else:
            diff = np.abs(got.astype(np.float64) - one)
            bound = reorder_bound(v, pos, cap, window, H, slots, used)
            assert (diff <= bound).all(), (f"split vs one-block: {diff.max():.3e} at "
                                           f"{np.unravel_index(diff.argmax(), diff.shape)}, beyond the "
                                           f"float32 reordering bound")


# (positions of the rows, H, H_kv, D, DV, window, ATTN_SPLIT_SLOTS): a batched decode step's
# rows, each its own sequence and length (so its own number of used splits), in one pool pair
ROW_CASES = [((40, 3, 17, 0, 95), 4, 2, 128, 128, 0, 16), ((100, 15, 16, 33), 4, 1, 64, 64, 24, 16),
             ((5, 70), 2, 2, 128, 64, 0, 32), ((40, 3, 17, 0, 95), 8, 2, 64, 64, 0, 16),
             ((10, 50), 6, 1, 64, 64, 0, 16), ((30, 70, 5), 12, 1, 64, 64, 20, 16)]


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "rows%d-H%d-%d-D%d-%d-w%d-slots%d" % ((len(c[0]),) + c[1:]))
def test_split_per_row_tables_on_the_cpu(rng, case, record_property):
    from conformance.harness.attn_host import attention_rows, attention_split_rows, split_count
    positions, H, Hkv, D, DV, window, slots = case
    lib = _lib(slots)
    ref = cuda_reference()
    q = rng.uniform(-1, 1, (len(positions), H, D)).astype(F32)
    caches, want, vis = [], [], []
    for t, p in enumerate(positions):
        cap = p + 1 + int(rng.integers(0, 20))             # each row's own capacity
        k = rng.uniform(-1, 1, (cap, Hkv, D)).astype(F16)
        v = rng.uniform(-1, 1, (cap, Hkv, DV)).astype(F16)
        want.append(ref.attention(q[t:t + 1], k, v, np.array([p], np.int32), 0.1, window).reshape(1, -1))
        unseen = np.arange(cap) > p
        if window:
            unseen |= np.arange(cap) <= p - window
        vis.append(v.copy())
        k[unseen], v[unseen] = np.nan, np.nan
        caches.append((k, v))
    pos = np.array(positions, np.int32)
    cap = max(c[0].shape[0] for c in caches)
    sc = {}
    got, blocks = attention_split_rows(lib, q, caches, pos, 0.1, window, rng=rng, scratch=sc)
    check(got, np.concatenate(want), ATTENTION, record_property)
    if blocks is not None:
        assert np.array_equal(blocks, q8_1_blocks(got)), "the Q8_1 blocks are not those of the output"
    _check_scratch(sc, pos, cap, window, slots, split_count(lib, cap, window), H, Hkv)
    # fewer blocks than splits, each taking several: the same bits
    again, _ = attention_split_rows(lib, q, caches, pos, 0.1, window, rng=rng, blocks=2)
    assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), "2 blocks a row changed the output"
    one, _ = attention_rows(lib, q, caches, pos, 0.1, window, rng=rng)
    used, _ = _used(pos, cap, window, slots)
    for t in range(len(positions)):
        vt = np.nan_to_num(vis[t].astype(np.float64))
        bound = reorder_bound(vt, pos[t:t + 1], vt.shape[0], window, H, slots, used[t:t + 1])
        diff = np.abs(got[t:t + 1].astype(np.float64) - one[t:t + 1])
        assert (diff <= bound).all(), f"row {t}: split vs one-block {diff.max():.3e} beyond the reordering bound"


def test_the_bits_depend_on_neither_the_capacity_nor_the_grid(rng):
    # a bucket graph bounds a row by more than its own capacity (more splits, most unused) and
    # launches another grid than the row alone: the same position must give the same bits
    # (what lets a batched row equal its alone logits with the split kernels on)
    from conformance.harness.attn_host import attention_split
    lib = _lib(32)
    q, k, v, kk, vk, pos = _inputs(rng, 1, 150, 4, 2, 64, 64, 0, 170)
    got, _ = attention_split(lib, q, kk, vk, pos, 0.125, rng=rng)
    pad = np.full((330, 2, 64), np.nan, F16)            # capacity 500: 16 splits where 170 has 6
    for blocks in (16, 5, 1):
        again, _ = attention_split(lib, q, np.concatenate([kk, pad]), np.concatenate([vk, pad]), pos, 0.125,
                                   rng=rng, blocks=blocks)
        assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), \
            f"capacity 500, {blocks} blocks a row: other bits than at capacity 170"



@pytest.mark.parametrize("H, Hkv, D, past, window", [(4, 2, 128, 600, 0), (2, 1, 256, 200, 0), (12, 1, 64, 290, 37)],
                         ids=["G2-D128", "G2-D256", "G12-D64-window"])
def test_values_in_flight_give_the_same_bits(rng, H, Hkv, D, past, window):
    # pass 3 reads ATTN_VALUES_SLOTS V rows a warp before adding them; the adds keep slot order,
    # so 1 (a slot at a time), 3 (a count that leaves a ragged last group) and the default give
    # the same bits, output and Q8_1 blocks. Splits of 32 slots, rows of several splits whose
    # last split is partly filled (past + 1 not a multiple of 32, nor of 4 warps x 3 slots).
    from conformance.harness.attn_host import KERNEL_DIR, attention_split
    text = (KERNEL_DIR / "attention.cu").read_text()
    assert "#ifndef ATTN_VALUES_SLOTS" in text
    q, k, v, kk, vk, pos = _inputs(rng, 1, past, H, Hkv, D, D, window, past + 40)
    want = None
    for slots in (None, 1, 3):
        lib = _lib(32, text if slots is None else f"#define ATTN_VALUES_SLOTS {slots}\n" + text)
        got, got_q = attention_split(lib, q, kk, vk, pos, D ** -0.5, window, rng=rng, blocks=2)
        assert not np.isnan(got).any()
        if want is None:
            want, want_q = got, got_q
            continue
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"ATTN_VALUES_SLOTS {slots}: other bits than the default"
        assert np.array_equal(got_q, want_q), f"ATTN_VALUES_SLOTS {slots}: other Q8_1 blocks"

def test_block_columns_follow_the_work_there_is():
    # attention.py split_group_blocks on an H100 (132 SMs: split_fill 396) for the Qwen3-8B
    # shape (8 KV heads of 4): the cuts its measured points took (SPLIT_GROUP_FILL's comment)
    # and a batched step; the kernels take the same rule at each step's splits in use
    from brass.backends.cuda.attention import split_fill, split_group_blocks
    fill = split_fill(132)
    assert fill == 396
    assert split_group_blocks(4, 8, 1, 1, fill) == 4          # near an empty context: a block a head
    assert split_group_blocks(4, 8, 17, 1, fill) == 4         # depth 4,096: a block a head won
    assert split_group_blocks(4, 8, 65, 1, fill) == 1         # depth 16,384: a column a group won
    assert split_group_blocks(4, 8, 9, 16, fill) == 1         # 16 rows at depth ~2,100
    assert split_group_blocks(4, 8, 40, 1, fill) == 2         # between: two columns of two heads
    assert split_group_blocks(6, 1, 4, 1, fill) == 6          # G 6, few splits: every divisor short
    assert split_group_blocks(6, 1, 100, 1, fill) == 6        # 6 columns fill it, 3 do not (300 < 396)
    assert split_group_blocks(6, 1, 200, 1, fill) == 2        # 400 >= 396 at 2 columns
    assert split_group_blocks(1, 8, 1, 1, fill) == 1          # no group to cut
    assert split_group_blocks(4, 8, 0, 1, fill) == 4          # nothing visible: a block a head
    assert split_fill(10**9) == 2**31 - 1                     # an int32 however many SMs


@pytest.mark.parametrize("H, Hkv", [(24, 2), (32, 8), (6, 1)], ids=["G12", "G4", "G6"])
def test_the_bits_do_not_depend_on_the_block_columns(rng, H, Hkv):
    # The kernels cut a KV group's query heads into as many block columns as fill the GPU at
    # each query's splits in use (split_columns: one at depth, one a head near an empty
    # context), so a sequence's step alone, in a bucket graph, or at another capacity may take
    # different cuts: every divisor of the group gives the same bits, one sequence and per-row
    # tables (rows of 10, 3 and 16 splits used, each its own cut) alike; the done counters
    # show that the kernels took the cut split_group_blocks gives.
    from brass.backends.cuda.attention import split_group_blocks
    from conformance.harness.attn_host import attention_split, attention_split_rows, split_count
    lib = _lib(32)
    slots, G = lib.split_slots(), H // Hkv
    q, k, v, kk, vk, pos = _inputs(rng, 1, 300, H, Hkv, 64, 64, 0, 600)
    used = _used(pos, 600, 0, slots)[0][0]
    want, want_q = attention_split(lib, q, kk, vk, pos, 0.125, rng=rng, blocks=3)
    qr = rng.standard_normal((3, H, 64)).astype(np.float32)
    caches = [(rng.standard_normal((c, Hkv, 64)).astype(F16), rng.standard_normal((c, Hkv, 64)).astype(F16))
              for c in (300, 90, 520)]
    pr = np.array([299, 70, 511], np.int32)
    rows_cap = 520
    used_rows = _used(pr, rows_cap, 0, slots)[0]
    assert used_rows == [10, 3, 16] and split_count(lib, rows_cap) == 17
    want_rows, _ = attention_split_rows(lib, qr, caches, pr, 0.125, rng=rng, blocks=2)
    for gb in [d for d in range(2, G + 1) if G % d == 0]:
        fill = Hkv * gb * used            # the fewest items at which gb columns are taken
        assert split_group_blocks(G, Hkv, used, 1, fill) == gb
        sc = {}
        got, got_q = attention_split(lib, q, kk, vk, pos, 0.125, rng=rng, blocks=3, fill=fill, scratch=sc)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{gb} columns a group: other bits"
        assert np.array_equal(got_q, want_q), f"{gb} columns a group: other Q8_1 blocks"
        _check_scratch(sc, pos, 600, 0, slots, 3, H, Hkv, fill)
        sc = {}
        fill = Hkv * gb * used_rows[0] * 3    # row 0 takes gb columns, row 1 a block a head
        rows, _ = attention_split_rows(lib, qr, caches, pr, 0.125, rng=rng, blocks=2, fill=fill, scratch=sc)
        assert np.array_equal(rows.view(np.uint32), want_rows.view(np.uint32)), \
            f"{gb} columns a group, per-row tables: other bits"
        _check_scratch(sc, pr, rows_cap, 0, slots, 2, H, Hkv, fill)


@pytest.mark.parametrize("fill", [0, 10**6], ids=["a-column-a-group", "a-block-a-head"])
def test_a_window_past_the_capacity_writes_zeros(rng, fill):
    # pos past the capacity with a window that ends before it: no visible slot (n <= 0), as
    # the one-block kernel has it: every split empty, the combining block writes zeros, under
    # either cut (no split in use: a block a head unless the fill is 0)
    from conformance.harness.attn_host import attention_rowwise, attention_split
    lib = _lib(16)
    q, k, v, kk, vk, pos = _inputs(rng, 1, 20, 4, 1, 64, 64, 0, 48)
    pos = np.array([80], np.int32)
    sc = {}
    got, blocks = attention_split(lib, q, kk, vk, pos, 0.1, 8, rng=rng, fill=fill, scratch=sc)
    one, _ = attention_rowwise(lib, q, kk, vk, pos, 0.1, 8, rng=rng)
    assert np.array_equal(got, np.zeros_like(got)) and np.array_equal(one, got)
    assert np.array_equal(blocks, q8_1_blocks(got))
    _check_scratch(sc, pos, 48, 8, 16, 1, 4, 1, fill)      # one split (8 slots), one block a head


def test_shared_memory_sized_short_is_caught(rng):
    # the harness's check of the host's sizing (on the GPU an illegal address): columns of a
    # whole group of 4 heads (fill 0) in shared memory sized for one head's chunk
    from conformance.harness.attn_host import attention_split
    lib = _lib(32)
    q, k, v, kk, vk, pos = _inputs(rng, 1, 100, 8, 2, 64, 64, 0, 128)
    attention_split(lib, q, kk, vk, pos, 0.125, rng=rng, blocks=2, heads=4)
    with pytest.raises(AssertionError, match="past the dynamic shared memory"):
        attention_split(lib, q, kk, vk, pos, 0.125, rng=rng, blocks=2, heads=1)


# Bugs planted in the split kernels, each to be caught by the checks above: the splits' slot
# ranges shifted (every pass), the count of used splits rounded down, a split's partial sum
# left out of the combination, the combination done by the first block instead of the last,
# the global max taken over the first split only, a block's later splits skipped. Logit scale
# 1 / sqrt(D) spreads the probabilities over the slots (a slot counted twice or a split dropped
# moves the output); 50 spreads the logits over hundreds (an exponential against a max below
# the row's overflows; M cancels out of e_j / S otherwise). Two blocks a row, each taking
# several splits.
PLANTED = [
    ("const int j0 = s * ATTN_SPLIT_SLOTS,", "const int j0 = s * (ATTN_SPLIT_SLOTS - 1),", 0.125),
    ("return n > 0 ? (n + ATTN_SPLIT_SLOTS - 1) / ATTN_SPLIT_SLOTS : 0;", "return n > 0 ? n / ATTN_SPLIT_SLOTS : 0;",
     0.125),
    ("for (int u = 1; u < n_used; ++u) acc +=", "for (int u = 2; u < n_used; ++u) acc +=", 0.125),
    ("last = atomicAdd(done + c, 1) == Ls - 1;", "last = atomicAdd(done + c, 1) == 0;", 0.125),
    ("for (int s = threadIdx.x; s < n_used; s += ATTN_THREADS) m[i] = fmaxf(m[i], split_max[i * S + s]);",
     "for (int s = threadIdx.x; s < 1; s += ATTN_THREADS) m[i] = fmaxf(m[i], split_max[i * S + s]);", 50.0),
    ("s < n_used; s += ds) {", "s < n_used; s += ds + 1) {", 0.125),
]


@pytest.mark.parametrize("planted", PLANTED, ids=["split-range", "splits-used", "combine-drops-a-split",
                                                  "first-block-combines", "max-of-one-split", "block-skips-splits"])
def test_planted_bugs_are_caught(rng, planted, record_property):
    from conformance.harness.attn_host import KERNEL_DIR, attention_split
    old, new, scale = planted
    text = (KERNEL_DIR / "attention.cu").read_text()
    assert old in text, f"the planted bug's anchor {old!r} is gone from attention.cu"
    lib = _lib(32, text.replace(old, new))
    q, k, v, kk, vk, pos = _inputs(rng, 1, 150, 2, 1, 64, 64, 0, 160)
    if scale > 1:
        # the row's max in the last split, far above every other logit (its dot product is
        # sum |q| ~ 32 where the others are ~N(0, 2.7)): a max taken short of it leaves an
        # exponential of ~50 * 20 that overflows, whatever the draw
        for c in (k, kk):
            c[140, 0] = np.where(q[0, 0] >= 0, 1, -1).astype(F16)
    got, _ = attention_split(lib, q, kk, vk, pos, scale, 0, rng=rng, blocks=2)
    want = cuda_reference().attention(q, k, v, pos, scale, 0).reshape(1, -1)
    with pytest.raises((AssertionError, pytest.fail.Exception)):     # NaN left, or beyond the bound
        check(got, want, ATTENTION, record_property)


# The done counter's memory ordering, planted wrong: the CPU build checks the protocol against
# the PTX memory model's release / acquire rule (attn_host.py ROWWISE_HARNESS says how), since
# blocks run one at a time there and every store is visible anyway. The fence before the block
# barrier instead of after it (every thread's own fence, then the count: other threads' stores
# are not ordered before the counting thread's fence), no release fence, no acquire fence.
PROTOCOL = [
    ("    __syncthreads();\n    if (threadIdx.x == 0) {\n        __threadfence();\n",
     "    __threadfence();\n    __syncthreads();\n    if (threadIdx.x == 0) {\n", "release"),
    ("        __threadfence();\n        last = atomicAdd(", "        last = atomicAdd(", "release"),
    ("        if (last) __threadfence();\n", "", "acquire"),
]


@pytest.mark.parametrize("planted", PROTOCOL, ids=["fence-before-the-barrier", "no-release", "no-acquire"])
def test_counter_protocol_breaches_are_caught(rng, planted):
    from conformance.harness.attn_host import KERNEL_DIR, attention_split
    old, new, rule = planted
    text = (KERNEL_DIR / "attention.cu").read_text()
    assert text.count(old) == 1, f"the planted breach's anchor {old!r} is not in attention.cu once"
    lib = _lib(32, text.replace(old, new))
    q, k, v, kk, vk, pos = _inputs(rng, 1, 150, 2, 1, 64, 64, 0, 160)
    with pytest.raises(AssertionError, match=f"without an? {rule}"):
        attention_split(lib, q, kk, vk, pos, 0.125, 0, rng=rng, blocks=2)



# Bugs planted in the sharing of a KV head's K and V rows across its query heads (passes 1
# and 3 a block per (KV head, query) group), each to be caught: every head of a chunk dotted
# with the chunk's first query; every head's probabilities against the first head's max;
# every head's output combined from the first head's partial sums; one done counter for all
# the groups (a group whose count another group's blocks took is combined early or never);
# heads past ATTN_SPLIT_HEADS left out of pass 3. 24 heads in 2 groups of 12 (chunks of 8 and
# 4), two blocks a group, each taking several splits.
GROUP_PLANTED = [
    ("dot[i] += q16[i * Dh + d] * k0 + q16[i * Dh + d + 1] * k1;", "dot[i] += q16[d] * k0 + q16[d + 1] * k1;"),
    ("expf(__fsub_rn(lr[i * row + j], m[i]))", "expf(__fsub_rn(lr[i * row + j], m[0]))"),
    ("part + ((r0 + x / Dv) * S) * Dv + x % Dv;", "part + (r0 * S) * Dv + x % Dv;"),
    ("last = atomicAdd(done + c, 1)", "last = atomicAdd(done + t, 1)"),
    ("for (int i = 0, nh; i < HB; i += nh) {", "for (int i = 0, nh; i < min(HB, ATTN_SPLIT_HEADS); i += nh) {"),
]
# ... and in the cutting of a group into block columns (split_columns), run with 3 columns of 4
# heads a group (5 splits used of the capacity's 10: fill 2 * 3 * 5): every column of pass 1 taking the group's
# first heads; every column of pass 3 writing the group's first rows; the columns of a group
# sharing one done counter; pass 1 cutting by the capacity's splits where pass 3 cuts by those
# in use (pass 3 then counts on done counters pass 1 did not zero).
COLUMN_PLANTED = [
    ("h0 = g * G + sb.x % sb.GB * HB;", "h0 = g * G;"),
    ("(i64) g * G + (i64) (sb.x % sb.GB) * HB;", "(i64) g * G;"),
    ("last = atomicAdd(done + c, 1)", "last = atomicAdd(done + c - sb.x % sb.GB, 1)"),
    ("    if (!split_block(G, n_used, p, sb)) return;               // past its column's lanes\n",
     "    if (!split_block(G, split_count(p), p, sb)) return;\n"),
]


@pytest.mark.parametrize("planted, fill",
                         [(p, 0) for p in GROUP_PLANTED] + [(p, 30) for p in COLUMN_PLANTED],
                         ids=["chunk-first-query", "group-first-max", "combine-first-head",
                              "one-counter-for-all-groups", "heads-past-a-chunk-dropped",
                              "columns-take-the-first-heads", "columns-write-the-first-rows",
                              "one-counter-for-a-group's-columns", "passes-cut-differently"])
def test_planted_group_bugs_are_caught(rng, planted, fill, record_property):
    from conformance.harness.attn_host import KERNEL_DIR, attention_split
    old, new = planted
    text = (KERNEL_DIR / "attention.cu").read_text()
    assert text.count(old) == 1, f"the planted bug's anchor {old!r} is not in attention.cu once"
    lib = _lib(32, text.replace(old, new))
    q, k, v, kk, vk, pos = _inputs(rng, 1, 150, 24, 2, 64, 64, 0, 300)
    got, _ = attention_split(lib, q, kk, vk, pos, 0.125, 0, rng=rng, blocks=2, fill=fill)
    want = cuda_reference().attention(q, k, v, pos, 0.125, 0).reshape(1, -1)
    with pytest.raises((AssertionError, pytest.fail.Exception)):     # NaN left, or beyond the bound
        check(got, want, ATTENTION, record_property)


# ---- on CUDA ---------------------------------------------------------------------------------

def _launched(cuda, monkeypatch) -> list[str]:
    names: list[str] = []
    real = cuda.launch
    monkeypatch.setattr(cuda, "launch", lambda src, name, *a, **kw: (names.append(name), real(src, name, *a, **kw))[1])
    return names


@needs_cuda
@pytest.mark.parametrize("case", [c for c in CASES if c[8] is None] + [(1, 5000, 8, 2, 128, 128, 0, 9000, None, 0),
                                                                      (2, 3000, 4, 1, 256, 256, 1000, 3100, None, 0),
                                                                      (1, 200, 32, 8, 128, 128, 0, 4096, None, 0),
                                                                      (1, 3000, 32, 8, 128, 128, 0, 4096, None, 0),
                                                                      (1, 700, 12, 2, 128, 128, 0, 900, None, 0),
                                                                      (1, 2000, 12, 1, 128, 128, 0, 2100, None, 0),
                                                                      (1, 700, 16, 2, 512, 512, 0, 800, None, 0)],
                         ids=_cid)
def test_split_attention_on_cuda(cuda, rng, monkeypatch, case, record_property):
    # the backend with attn_split on takes every decode call to the split kernels; the same
    # inputs through the one-block kernel (attn_split off) within the reordering bound, bit for
    # bit where one split holds every visible slot. KV groups of 4 (Qwen3-8B's 32 / 8 heads, one
    # split used and many), 6 and 12 (chunks of 4 + 2, 8 + 4), and 8 at head dims 512 (pass 3's
    # shared memory past 48 KiB: the opt-in)
    from conformance.harness.attn_host import device_sequence
    from brass.backends.cuda import quantize
    from brass.backends.cuda.attention import SPLIT_SLOTS
    T, past, H, Hkv, D, DV, window, cap, _, _ = case
    q, k, v, kk, vk, pos = _inputs(rng, T, past, H, Hkv, D, DV, window, cap)
    scale = float(1 / np.sqrt(D))
    monkeypatch.setattr(cuda.options, "attn_tiled", False)     # prompts (T >= 2) here too
    layers = device_sequence(cuda, rng, kk, vk)
    names = _launched(cuda, monkeypatch)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(cuda.options, "attn_split", on)
        names.clear()
        out = cuda.attention(cuda.asarray(q), *layers, cuda.asarray(pos), scale, window)
        outs[on] = cuda.to_numpy(out)
        assert ("attention_split_values" in names) == on and ("attention" in names) != on, names
        if DV % 32 == 0:
            assert quantize.blocks_of(cuda, out) is not None, "the output's Q8_1 blocks were not remembered"
    want = cuda_reference().attention(q, k, v, pos, scale, window)
    check(outs[True], want.reshape(T, -1), ATTENTION, record_property)
    used, _ = _used(pos, cap, window, SPLIT_SLOTS)
    diff = np.abs(outs[True].astype(np.float64) - outs[False])
    assert (diff <= reorder_bound(v, pos, cap, window, H, SPLIT_SLOTS, used)).all(), \
        f"split vs one-block on the GPU: {diff.max():.3e}, beyond the float32 reordering bound"
    if max(used) == 1:
        # every sum in the one-block kernel's order, each head's expressions its own: NVRTC
        # must have contracted them alike (a K.Q or V.softmax FMA taken otherwise shows here)
        assert np.array_equal(outs[True].view(np.uint32), outs[False].view(np.uint32)), \
            "one split used: the split kernels' bits differ from the one-block kernel's on the GPU"


@needs_cuda
@pytest.mark.parametrize("H, Hkv", [(32, 8), (24, 2)], ids=["G4", "G12"])
def test_block_columns_give_the_same_bits_on_cuda(cuda, rng, monkeypatch, H, Hkv):
    # the kernels choose the columns a KV group is cut into by how full the GPU would be at
    # the splits in use (split_columns); under a fill that makes the step alone (12 splits in
    # use) take each divisor of the group in turn (G = 12: columns of 12, 6, 4, 3, 2 and 1
    # heads, the odd ones in chunks of 2 + 1), the same bits, a step alone and a batched
    # step's rows (9, 1 and 3 splits in use, each its own cut). The fill goes through
    # split_fill, which the host's shared memory sizing reads too (a cut forced on the host
    # alone would let the kernels take wider columns than it sized for).
    from conformance.harness.attn_host import device_rows, device_sequence
    from brass.backends.cuda import attention as attn
    monkeypatch.setattr(cuda.options, "attn_split", True)
    G = H // Hkv
    q, k, v, kk, vk, pos = _inputs(rng, 1, 3000, H, Hkv, 128, 128, 0, 4096)
    used = -(-3001 // attn.SPLIT_SLOTS)
    layers = device_sequence(cuda, rng, kk, vk)
    seqs = [(rng.uniform(-1, 1, (c, Hkv, 128)).astype(F16), rng.uniform(-1, 1, (c, Hkv, 128)).astype(F16))
            for c in (2100, 40, 900)]
    qr = rng.uniform(-1, 1, (3, H, 128)).astype(F32)
    pr = np.array([2099, 39, 600], np.int32)
    rows = device_rows(cuda, rng, seqs)
    outs = {}
    for gb in [d for d in range(1, G + 1) if G % d == 0]:
        fill = Hkv * gb * used
        assert attn.split_group_blocks(G, Hkv, used, 1, fill) == gb
        monkeypatch.setattr(attn, "split_fill", lambda n_sms, fill=fill: fill)
        one = cuda.to_numpy(cuda.attention(cuda.asarray(q), *layers, cuda.asarray(pos), 0.088))
        many = cuda.to_numpy(cuda.attention_rows(cuda.asarray(qr), rows, cuda.asarray(pr), 0.088))
        outs[gb] = (one, many)
    for gb, (one, many) in outs.items():
        assert np.array_equal(one.view(np.uint32), outs[1][0].view(np.uint32)), f"{gb} columns: other bits alone"
        assert np.array_equal(many.view(np.uint32), outs[1][1].view(np.uint32)), f"{gb} columns: other bits in rows"


@needs_cuda
def test_split_rows_on_cuda(cuda, rng, monkeypatch, record_property):
    # a batched step's rows (per_row tables), each its own sequence and length
    from conformance.harness.attn_host import device_rows
    monkeypatch.setattr(cuda.options, "attn_split", True)
    H, Hkv, D = 8, 2, 128
    positions = (700, 3, 300, 1500)
    ref = cuda_reference()
    q = rng.uniform(-1, 1, (len(positions), H, D)).astype(F32)
    seqs, want = [], []
    for t, p in enumerate(positions):
        cap = p + 1 + int(rng.integers(0, 300))
        k = rng.uniform(-1, 1, (cap, Hkv, D)).astype(F16)
        v = rng.uniform(-1, 1, (cap, Hkv, D)).astype(F16)
        want.append(ref.attention(q[t:t + 1], k, v, np.array([p], np.int32), 0.088).reshape(1, -1))
        k[p + 1:], v[p + 1:] = np.nan, np.nan
        seqs.append((k, v))
    layers = device_rows(cuda, rng, seqs)
    names = _launched(cuda, monkeypatch)
    got = cuda.to_numpy(cuda.attention_rows(cuda.asarray(q), layers, cuda.asarray(np.array(positions, np.int32)), 0.088))
    assert "attention_split_values" in names, names
    check(got, np.concatenate(want), ATTENTION, record_property)


@needs_cuda
def test_past_the_one_block_shared_memory(cuda, rng, monkeypatch, record_property):
    # a capacity whose row of logits does not fit one block's shared memory: the split kernels
    # take it with attn_split off too (the one-block launch would fail)
    from conformance.harness.attn_host import device_sequence
    from brass.backends.cuda.attention import ATTN_STATIC_SMEM, ATTN_WARPS
    H, Hkv, D = 4, 1, 128
    cap = cuda.smem_optin_limit // 4 - D - ATTN_WARPS * D + 16
    assert 4 * (D + cap + ATTN_WARPS * D) + ATTN_STATIC_SMEM > cuda.smem_optin_limit
    q, k, v, kk, vk, pos = _inputs(rng, 1, cap - 10, H, Hkv, D, D, 0, cap)
    monkeypatch.setattr(cuda.options, "attn_split", False)
    names = _launched(cuda, monkeypatch)
    got = cuda.to_numpy(cuda.attention(cuda.asarray(q), *device_sequence(cuda, rng, kk, vk), cuda.asarray(pos), 0.088))
    assert "attention_split_values" in names and "attention" not in names, names
    check(got, cuda_reference().attention(q, k, v, pos, 0.088).reshape(1, -1), ATTENTION, record_property)


@needs_cuda
def test_split_graph_replays_as_the_position_grows(cuda, rng, monkeypatch, record_property):
    # captured once for the capacity (the number of splits fixed), replayed with pos rewritten
    # on the device: each replay attends over its own position's slots (the done counters are
    # reset by every replay's first pass)
    from conformance.harness.attn_host import device_sequence
    monkeypatch.setattr(cuda.options, "attn_split", True)
    # a scratch of this test's own: the module's backend kept the largest of the earlier
    # tests' (a 57,000-slot context's), which the larger call below would not outgrow
    monkeypatch.setattr(cuda, "_split_scratch", None)
    H, Hkv, D, cap = 8, 2, 128, 2000
    q, k, v, kk, vk, _ = _inputs(rng, 1, cap - 1, H, Hkv, D, D, 0, cap)
    layers = device_sequence(cuda, rng, k, v)
    dq, dpos = cuda.asarray(q), cuda.asarray(np.zeros(1, np.int32))
    with cuda.activate():
        cuda.attention(dq, *layers, dpos, 0.088)      # eagerly first: the kernels loaded, as a decode step does
        graph = cuda.capture(lambda: cuda.attention(dq, *layers, dpos, 0.088))
    ref = cuda_reference()
    for p in (0, 255, 256, 700, cap - 1):
        with cuda.activate():
            dpos[...] = p
            graph.replay()
            got = cuda.to_numpy(graph.result)
        check(got, ref.attention(q, k, v, np.array([p], np.int32), 0.088).reshape(1, -1), ATTENTION, record_property)
    # a call over a larger capacity grows the backend's scratch: the graph keeps reading its own
    big = _inputs(rng, 1, 3 * cap, H, Hkv, D, D, 0, 4 * cap)
    before = cuda._split_scratch
    cuda.attention(cuda.asarray(big[0]), *device_sequence(cuda, rng, big[3], big[4]), cuda.asarray(big[5]), 0.088)
    assert cuda._split_scratch is not before, "the larger call did not grow the scratch: the check proves nothing"
    with cuda.activate():
        dpos[...] = 900
        graph.replay()
        got = cuda.to_numpy(graph.result)
    check(got, ref.attention(q, k, v, np.array([900], np.int32), 0.088).reshape(1, -1), ATTENTION, record_property)


@needs_cuda
def test_split_combine_gives_the_same_bits_under_load(cuda, rng, monkeypatch, record_property):
    # the done counter's protocol under real concurrency (the CPU build runs one block at a
    # time): 32 heads in 8 KV groups of a 16,384-slot row (64 splits in use: one column a
    # group), a column's 64 splits taken by ~36 lanes (one or two each: 2 blocks an SM, where
    # the default gives a lane a split here), relaunched. Whichever block counts last adds each head's splits in split order, so every
    # launch gives the same bits: a partial sum read stale or before it was written (a fence
    # missing or misplaced) changes them, or leaves the poisoned scratch's NaN.
    from conformance.harness.attn_host import device_sequence
    from brass.backends.cuda import attention
    monkeypatch.setattr(cuda.options, "attn_split", True)
    monkeypatch.setattr(attention, "SPLIT_BLOCKS_PER_SM", 2)
    H, Hkv, D, cap = 32, 8, 128, 16384
    S = cap // attention.SPLIT_SLOTS
    gb = attention.split_group_blocks(H // Hkv, Hkv, S, 1, attention.split_fill(cuda.n_sms))
    per_head = min(S, -(-attention.SPLIT_BLOCKS_PER_SM * cuda.n_sms // H))      # the grid's y
    lanes = min(S, H * per_head // (Hkv * gb))                                   # as split_block
    assert 1 < lanes < S, f"{lanes} lanes a column: no block takes two splits, or one takes all"
    q, k, v, kk, vk, pos = _inputs(rng, 1, cap - 1, H, Hkv, D, D, 0, cap)
    layers = device_sequence(cuda, rng, kk, vk)
    dq, dpos = cuda.asarray(q), cuda.asarray(pos)
    with cuda.activate():
        outs = [cuda.attention(dq, *layers, dpos, 0.088) for _ in range(100)]
        got = [cuda.to_numpy(o) for o in outs]
    check(got[0], cuda_reference().attention(q, k, v, pos, 0.088).reshape(1, -1), ATTENTION, record_property)
    differ = [i for i, g in enumerate(got) if not np.array_equal(g.view(np.uint32), got[0].view(np.uint32))]
    assert not differ, f"launches {differ[:10]} of 100 gave other bits than the first"


@needs_cuda
def test_split_layers_share_the_counters_in_a_graph(cuda, rng, monkeypatch):
    # as a decode graph's layers do: four split attentions back to back (each one's first pass
    # resets the done counters the one before counted up, launched with PDL in the graph, so
    # it waits at PDL_ENTRY for that one's last pass), over one scratch, at positions whose
    # rows use 64, 36, 2 and 1 splits; replayed 20 times, each the eager calls' bits
    from conformance.harness.attn_host import device_sequence
    monkeypatch.setattr(cuda.options, "attn_split", True)
    H, Hkv, D, cap = 16, 4, 128, 16384
    q, k, v, kk, vk, _ = _inputs(rng, 1, cap - 1, H, Hkv, D, D, 0, cap)
    layers = device_sequence(cuda, rng, k, v)
    dq = cuda.asarray(q)
    dpos = [cuda.asarray(np.array([p], np.int32)) for p in (cap - 1, 9000, 300, 0)]
    with cuda.activate():
        want = [cuda.to_numpy(cuda.attention(dq, *layers, p, 0.088)) for p in dpos]
        graph = cuda.capture(lambda: tuple(cuda.attention(dq, *layers, p, 0.088) for p in dpos))
        for rep in range(20):
            graph.replay()
            for i, out in enumerate(graph.result):
                assert np.array_equal(cuda.to_numpy(out).view(np.uint32), want[i].view(np.uint32)), \
                    f"replay {rep}: call {i} (pos {int(cuda.to_numpy(dpos[i])[0])}) differs from its eager bits"


@needs_cuda
def test_split_in_groups_of_queries(cuda, rng, monkeypatch, record_property):
    # queries whose scratch exceeds SPLIT_SCRATCH_BYTES go in groups, each group its three
    # launches over its own queries' rows (here 2, 2 and 1 of 5)
    from conformance.harness.attn_host import device_sequence
    from brass.backends.cuda import attention
    T, H, Hkv, D, cap = 5, 4, 2, 128, 600
    S = -(-cap // attention.SPLIT_SLOTS)
    per_query = H * S * (4 * attention.SPLIT_SLOTS + 4 * D + 4 + 8) + 4 * Hkv
    monkeypatch.setattr(attention, "SPLIT_SCRATCH_BYTES", 2 * per_query + 100)
    monkeypatch.setattr(cuda.options, "attn_tiled", False)
    monkeypatch.setattr(cuda.options, "attn_split", True)
    q, k, v, kk, vk, pos = _inputs(rng, T, 500, H, Hkv, D, D, 0, cap)
    names = _launched(cuda, monkeypatch)
    got = cuda.to_numpy(cuda.attention(cuda.asarray(q), *device_sequence(cuda, rng, kk, vk), cuda.asarray(pos), 0.088))
    assert names.count("attention_split_values") == 3, names
    check(got, cuda_reference().attention(q, k, v, pos, 0.088).reshape(T, -1), ATTENTION, record_property)


@needs_cuda
def test_model_decode_graph_with_split_attention(monkeypatch, record_property):
    # synth-qwen3's decode steps (the first eager, the rest replays of the captured decode
    # graph, kernels launched with PDL, one scratch shared by every layer) with attn_split on
    # and off, the same teacher-forced tokens: the logits within tolerances.FREE_RUNNING, the
    # free-running bound of test_kernels_model.py (the split's reordered sums move the
    # attention output by float32 ulps, which the next Q8_1 quantization can turn into a whole
    # quant step)
    import brass
    from conformance.harness.cases import nmse
    from conformance.harness.goldens import GOLDEN_DIR
    from conformance.harness.tolerances import FREE_RUNNING
    path = str(GOLDEN_DIR / "models" / "synth-qwen3.gguf")
    logits = {}
    for on in (True, False):
        m = brass.load(path, backend="cuda", quiet=True, attn_split=on)
        V = m.config.n_vocab
        names = _launched(m.backend, monkeypatch)
        seq = np.random.default_rng(7).integers(0, V, 40).tolist()
        s = m.new_session(64)
        s.prefill(seq[:30])
        b = m.backend
        with b.activate():
            logits[on] = [b.to_numpy(s.decode(tok)).reshape(-1, V)[-1] for tok in seq[30:]]
        assert ("attention_split_values" in names) == on, sorted(set(names))
    worst = max(nmse(x, y) for x, y in zip(logits[True], logits[False]))
    record_property("nmse", f"{worst:.3e}")
    assert worst <= FREE_RUNNING, f"decode logits with attn_split on vs off: NMSE {worst:.3e}"


@needs_cuda
@pytest.mark.parametrize("mode", ["on", "default"])
def test_bucket_graph_rows_equal_alone_with_split(monkeypatch, mode):
    # a batched step's rows through bucket graphs (per-row block tables, bounded by their
    # capacity rounded up: more splits a row than alone, and another grid) with the split
    # kernels give each row's alone logits bit for bit, since the split's result depends on
    # neither. The graphs are prepared in advance as a server's warm-up does, then replayed;
    # the alone sessions replay their decode graphs. "on": attn_split on, rows of 600 slots
    # under a bound of 1,024. "default": the option at its default (the split for every
    # decode-sized call), rows of 3,000 slots under 4,096 (synth-qwen3 holds 4,096 positions)
    import brass
    from brass.batch import BatchDecoder
    from brass.kv_cache import blocks_for
    from conformance.harness.goldens import GOLDEN_DIR
    on = mode == "on"
    m = brass.load(str(GOLDEN_DIR / "models" / "synth-qwen3.gguf"), backend="cuda", quiet=True,
                   attn_split=True if on else None)
    b, V, n_ctx, lengths = m.backend, m.config.n_vocab, 600 if on else 3000, (540, 40, 5) if on else (2700, 300, 5)
    if not on:
        assert m.n_ctx == 4096 and BatchDecoder._capacity_for(BatchDecoder(m), n_ctx) == 4096
    launched: list[tuple[str, bool]] = []
    real = b.launch
    monkeypatch.setattr(b, "launch", lambda src, name, *a, **kw: (launched.append((name, b._graph_refs is not None)),
                                                                  real(src, name, *a, **kw))[1])
    pool = m.new_block_pool(3 * blocks_for(n_ctx) + 1)
    sessions = [m.new_session(n_ctx, pool=pool) for _ in range(3)]
    for s in sessions:
        s.cache.assign(pool.allocate(blocks_for(n_ctx))[::-1])     # blocks out of order
    dec = BatchDecoder(m, buckets=True)
    assert dec.buckets and dec.prepare_buckets(3, n_ctx, pool) >= 1
    captures = dec.captures
    split = [capturing for name, capturing in launched if name == "attention_split_values"]
    assert split and any(split), f"split kernels launched (capturing): {split[:3]}"
    alone = [m.new_session(n_ctx) for _ in range(3)]
    rng = np.random.default_rng(5)
    for s, a, n in zip(sessions, alone, lengths):
        prompt = rng.integers(0, V, n).tolist()
        s.prefill(prompt)
        a.prefill(prompt)
    launched.clear()
    for step in range(6):
        toks = [int(t) for t in rng.integers(0, V, 3)]
        got = b.to_numpy(dec.step(sessions, toks))
        for i, (a, tok) in enumerate(zip(alone, toks)):
            want = b.to_numpy(a.decode(tok)).reshape(-1, V)[-1]
            assert np.array_equal(got[i].view(np.uint32), want.view(np.uint32)), \
                f"step {step}, row {i}: batched logits differ from alone (max |diff| {np.abs(got[i] - want).max():.3g})"
    assert dec.captures == captures and dec.replays >= 6, (dec.captures, dec.replays)
    assert ("attention", False) not in launched, "a decode alone took the one-block kernel"


def _columns_g12(cuda, rng, monkeypatch):
    test_block_columns_give_the_same_bits_on_cuda(cuda, rng, monkeypatch, 24, 2)


def test_the_gpu_tests_python_runs_under_the_fake_cupy(rng):
    # The GPU tests above run on the GPU runner only; their Python (the backend's calls, the
    # state the module's one backend carries from test to test) runs here under the fake CuPy
    # (conformance/harness/fake_cupy.py: no kernel runs, outputs stay the poisoned NaN), in file
    # order on one backend as the module fixture gives it to them, the numeric checks off. The
    # first, whose reordering bound fails on NaN, and the decode graph's, whose NMSE is of
    # logits no kernel wrote, are left out. This caught the graph test asserting that a larger call grows the scratch after an
    # earlier test had grown it further.
    import sys
    from conformance.harness import fake_cupy
    from conformance.harness.launch_recording import fake_cuda
    here = sys.modules[__name__]
    tests = [test_split_rows_on_cuda, test_past_the_one_block_shared_memory, test_split_graph_replays_as_the_position_grows,
             test_split_combine_gives_the_same_bits_under_load, test_split_layers_share_the_counters_in_a_graph,
             test_split_in_groups_of_queries, test_bucket_graph_rows_equal_alone_with_split, _columns_g12]
    with pytest.MonkeyPatch.context() as mp, fake_cuda(fake_cupy.Recorder()) as backend:
        mp.setattr(here, "check", lambda *a, **kw: None)
        cuda = backend.CudaBackend(poison_outputs=True)
        for test in tests:
            for mode in ("on", "default"):
                with pytest.MonkeyPatch.context() as inner:
                    args = {"cuda": cuda, "rng": rng, "monkeypatch": inner, "record_property": lambda *a: None,
                            "mode": mode}
                    names = test.__code__.co_varnames[:test.__code__.co_argcount]
                    test(**{k: v for k, v in args.items() if k in names})
                if "mode" not in names:
                    break
