"""The decode mat-vec kernels' own source on the CPU (conformance/harness/matvec_host.py: g++, a std::thread per
CUDA thread, warp shuffles through per-warp barriers, staged activations in shared memory
poisoned with 0xFF), launched as the CUDA backend launches them, against the numpy q8_1
reference: matvec_<type> with one to three matrices (q/k/v), matvec_cols_<type> (a batched
step) bit for bit against one token at a time, matvec_glu_<type> (the gated FFN, its Q8_1
blocks, experts by id) and matvec_moe_down_<type> (the experts' down projection and weighted
sum). The GPU tests of the same kernels are in test_kernels.py and test_batch.py; these run
everywhere, so a change to the decode kernels is checked before it reaches a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.harness.kernel_checks import check, tname
from brass.gguf import GGMLType, GGUFFile
from conformance.harness.cases import MATMUL, OP_BOUNDS, cuda_reference, random_weight_file
from conformance.harness.mmq_host import built  # noqa: E402

TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_K,
         GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.MXFP4)
F32 = np.float32


@pytest.fixture(scope="module")
def lib():
    from conformance.harness import matvec_host
    return built(matvec_host.build)


def _weights(tmp_path, rng, specs):
    return GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, specs))


def _raw(gf, name, rows):
    return gf.tensor_bytes(name).reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=tname)
def test_matvec_on_the_cpu(lib, rng, tmp_path, qtype, record_property):
    # three matrices in one launch (q, k, v of a decode step: 100, 40 and 33 rows, so units
    # of different matrices share blocks), and one alone
    from conformance.harness.matvec_host import matvec
    K = 512
    gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in (("a", 100), ("b", 40), ("c", 33))})
    x = rng.uniform(-1, 1, (1, K)).astype(F32)
    ref = cuda_reference()
    got = matvec(lib, qtype, [_raw(gf, n, r) for n, r in (("a", 100), ("b", 40), ("c", 33))], x)
    (alone,) = matvec(lib, qtype, [_raw(gf, "b", 40)], x)
    with ref.rows_independent():
        for n, g in zip("abc", got):
            check(g, ref.matmul(x, ref.weight(gf, n)), MATMUL, record_property, f"matrix {n}")
    assert np.array_equal(alone, got[1]), "a matrix's rows depend on the matrices beside it"


@pytest.mark.parametrize("K", [1024, 2048, 3072, 4096, 25600])
def test_coop_q6_k_equals_matvec_q6_k(lib, rng, tmp_path, K, record_property):
    # matvec_coop_q6_k (each chunk of 32 items of a row read by the warp together into shared
    # memory, then each lane's item from there: kernels/matvec.cuh MV_COOP_WARPS) must give
    # matvec_q6_k's floats bit for bit, for one, two and three matrices in one launch (37, 300
    # and 9 rows: not multiples of the block's warps, so matrices share blocks and the last
    # block has idle warps), on the backend's grid and on 3 blocks (each warp then takes several
    # rows, the next row's first chunk loaded during the row before's last); and the reference's
    # within the mat-vec bound. K = 25600 reads x from global memory (past MV_STAGE_MAX_K: the
    # kernel's other loop; the backend splits such rows, so fewer rows there).
    from conformance.harness.matvec_host import matvec, matvec_coop
    qtype = GGMLType.Q6_K
    shapes = (("a", 37), ("b", 300), ("c", 9)) if K <= 4096 else (("a", 21), ("b", 9), ("c", 5))
    gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in shapes})
    ws = [_raw(gf, n, r) for n, r in shapes]
    x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
    for n in (1, 2, 3):
        want = matvec(lib, qtype, ws[:n], x, split=1)
        for blocks in (None, 3):
            got = matvec_coop(lib, ws[:n], x, blocks=blocks)
            assert len(got) == n
            for i, (g, w) in enumerate(zip(got, want)):
                assert not np.isnan(g).any(), f"{n} matrices, {blocks} blocks: matrix {i}'s rows left unwritten"
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), \
                    f"{n} matrices, {blocks} blocks: matrix {i} not matvec_q6_k's (max |d| {np.abs(g - w).max():.3g})"
    ref = cuda_reference()
    with ref.rows_independent():
        for (name, _), g in zip(shapes, got):
            check(g, ref.matmul(x, ref.weight(gf, name)), MATMUL, record_property, f"matrix {name}")


def test_coop_q6_k_other_warps_give_the_same_bits(lib, rng, tmp_path):
    # MV_COOP_WARPS (warps a block) moves time only: a build with 4 warps must still give
    # matvec_q6_k's bits (both grids as above)
    from conformance.harness import matvec_host
    other = built(matvec_host.build, ("MV_COOP_WARPS=4",))
    qtype, K = GGMLType.Q6_K, 2048
    shapes = (("a", 37), ("b", 300), ("c", 9))
    gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in shapes})
    ws = [_raw(gf, n, r) for n, r in shapes]
    x = rng.uniform(-1, 1, (1, K)).astype(F32)
    want = matvec_host.matvec(lib, qtype, ws, x, split=1)
    for blocks in (None, 5):
        got = matvec_host.matvec_coop(other, ws, x, blocks=blocks, warps=4)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{blocks} blocks: matrix {i}"


def test_coop_q6_k_two_rows_at_once_gives_the_same_bits(lib, rng, tmp_path):
    # MV_COOP_ROWS=2 (a warp takes rows r and r + one grid step together, chunk by chunk) must
    # give matvec_q6_k's bits on every row: with one chunk a row (K = 1024: each chunk's
    # lookahead is the next pair's first) and three (K = 3072), on the backend's grid (half the
    # blocks) and on grids of 3 and 5 blocks, where a pair's second row is past the last row
    # on some warps (the row counts are not multiples of anything the grid takes)
    from conformance.harness import matvec_host
    two = built(matvec_host.build, ("MV_COOP_ROWS=2",))
    qtype = GGMLType.Q6_K
    shapes = (("a", 37), ("b", 300), ("c", 9))
    for K in (1024, 3072):
        gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in shapes})
        ws = [_raw(gf, n, r) for n, r in shapes]
        x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
        for n in (1, 3):
            want = matvec_host.matvec(lib, qtype, ws[:n], x, split=1)
            for blocks in (None, 3, 5):
                got = matvec_host.matvec_coop(two, ws[:n], x, blocks=blocks, rows_at_once=2)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert not np.isnan(g).any(), f"K {K}, {n} matrices, {blocks} blocks: matrix {i} left unwritten"
                    assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), \
                        f"K {K}, {n} matrices, {blocks} blocks: matrix {i} not matvec_q6_k's"


@pytest.mark.parametrize("split", [1, 2])
def test_two_preloaded_rows_a_warp_give_the_same_bits(lib, rng, tmp_path, split):
    # MV_PRELOAD_ROWS=2 (a warp or split group takes two rows of a preloaded kind, Q4_K, at
    # once, each staged item read once for both; at one item preloaded a row, as the default,
    # and at two) must give the one-row kernel's bits on every row: odd row counts (a unit's
    # second row past its matrix: the last row read again and dropped), q/k/v's three matrices
    # in one launch, one and several items a lane (K 1024 / 5120), x staged and read from
    # global memory (K 28672), the mixed q/k + v launch (its blocks split by kind on both sides)
    from conformance.harness import matvec_host
    sp = f"MV_SPLIT={max(split, 2)}"
    base = built(matvec_host.build, ("MV_PRELOAD_ROWS=1", "MV_PRELOAD=2", sp))
    twos = [built(matvec_host.build, ("MV_PRELOAD_ROWS=2", f"MV_PRELOAD={d}", sp)) for d in (1, 2)]
    for two in twos:
        _two_rows_case(base, two, rng, tmp_path, split)


# Sizes of kernels/matvec.cuh that change how the decode mat-vecs stage x or share a block but
# not their arithmetic: every output must keep the default build's bits.
SAME_BITS_SIZES = [
    # stage_q8_1: a thread's Q8_1 blocks all loaded before any is converted
    ("MV_STAGE_BATCH=2",), ("MV_STAGE_BATCH=3",),
    # the same for the split kernels alone (2 is the default: 1 is the form without it)
    ("MV_STAGE_BATCH_SPLIT=1",), ("MV_STAGE_BATCH_SPLIT=3",),
    # the split kernels' blocks of 16 and 32 warps (8 or 16 units a block, one staging of x;
    # both macros given, so that the case stays what it says whatever the header's defaults)
    ("MV_SPLIT_WARPS=16", "MV_SPLIT_WARPS_PLAIN=16"), ("MV_SPLIT_WARPS=32", "MV_SPLIT_WARPS_PLAIN=32"),
    # ... for the preloaded kinds only (Q6_K and Q4_1 keep 8; Q4_K takes 16 or 32)
    ("MV_SPLIT_WARPS=16", "MV_SPLIT_WARPS_PLAIN=8"), ("MV_SPLIT_WARPS=32", "MV_SPLIT_WARPS_PLAIN=8"),
]


@pytest.mark.parametrize("defines", SAME_BITS_SIZES, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_1])    # (Q4_1 reads s)
def test_sizes_keep_the_bits(rng, tmp_path, qtype, defines):
    # At K where a block's threads stage one round of blocks, two (12288: 384 of 256 threads)
    # and three with the last part-full (20480), split and not, q/k/v-like launches of two
    # matrices, and x read from global memory (28672, past MV_STAGE_MAX_K).
    from conformance.harness import matvec_host
    base = built(matvec_host.build, ())
    lib = built(matvec_host.build, defines)
    for K in (4096, 12288, 20480, 28672):
        gf = _weights(tmp_path, rng, {"a": (qtype, (19, K)), "b": (qtype, (6, K))})
        ws = [_raw(gf, "a", 19), _raw(gf, "b", 6)]
        x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
        for split in (1, 2):
            want = matvec_host.matvec(base, qtype, ws, x, split=split)
            got = matvec_host.matvec(lib, qtype, ws, x, split=split)
            for i, (g, w) in enumerate(zip(got, want)):
                assert np.isfinite(w).all() and np.array_equal(g.view(np.uint32), w.view(np.uint32)), \
                    f"{tname(qtype)} K {K} split {split}, {defines}: matrix {i} differs"


def _two_rows_case(base, two, rng, tmp_path, split):
    from conformance.harness import matvec_host
    qtype = GGMLType.Q4_K
    shapes = (("a", 37), ("b", 20), ("c", 9))
    for K in ((1024, 5120) if split == 1 else (5120, 28672)):
        gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in shapes}
                      | {"v": (GGMLType.Q6_K, (21, K))})
        ws = [_raw(gf, n, r) for n, r in shapes]
        x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
        for n in (1, 3):
            want = matvec_host.matvec(base, qtype, ws[:n], x, split=split, preload_rows=1)
            got = matvec_host.matvec(two, qtype, ws[:n], x, split=split, preload_rows=2)
            for i, (g, w) in enumerate(zip(got, want)):
                assert not np.isnan(g).any(), f"K {K}, {n} matrices: matrix {i} left unwritten"
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), \
                    f"K {K}, {n} matrices: matrix {i} not the one-row kernel's"
        if split == 1:
            wv = _raw(gf, "v", 21)
            want = matvec_host.matvec_mixed(base, qtype, GGMLType.Q6_K, ws[:2], wv, x, preload_rows=1)
            got = matvec_host.matvec_mixed(two, qtype, GGMLType.Q6_K, ws[:2], wv, x, preload_rows=2)
            for i, (g, w) in enumerate(zip(got, want)):
                assert not np.isnan(g).any(), f"K {K}, mixed: matrix {i} left unwritten"
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"K {K}, mixed: matrix {i}"


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4), ids=tname)
def test_batched_mat_vec_equals_one_token_at_a_time(lib, rng, tmp_path, qtype):
    # matvec_cols_<type> (a batched decode step: tokens side by side per weight row) must give
    # each token the one-token kernel's float, bit for bit: a sequence's tokens must not depend
    # on which others share its step
    from conformance.harness.matvec_host import matvec, matvec_cols
    K, T = 512, 11                              # 11 tokens: two blocks of 8, the second partial
    gf = _weights(tmp_path, rng, {"a": (qtype, (70, K)), "b": (qtype, (45, K))})
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    ws = [_raw(gf, "a", 70), _raw(gf, "b", 45)]
    batched = matvec_cols(lib, qtype, ws, x)    # two groups of tokens: matvec_cols_many_
    for iters in (2, 5):                        # fewer blocks, several rounds of rows each
        strided = matvec_cols(lib, qtype, ws, x, iters=iters)
        for i in range(2):
            assert np.array_equal(strided[i], batched[i]), f"{iters} rounds of rows, matrix {i}"
    few = matvec_cols(lib, qtype, ws, x, many=False)    # MV_COLS_ROWS rows a warp, not _MANY
    for i in range(2):
        assert np.array_equal(few[i], batched[i]), f"matvec_cols_ and matvec_cols_many_ differ, matrix {i}"
    for t in range(T):
        one = matvec(lib, qtype, ws, x[t:t + 1])
        for i in range(2):
            assert np.array_equal(batched[i][t], one[i][0]), f"token {t}, matrix {i}"


@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4), ids=tname)
def test_batched_gated_ffn_equals_one_token_at_a_time(lib, rng, tmp_path, qtype):
    # matvec_glu_cols_<type> (a batched step's gated FFN, gate and up of a row in one pass over
    # the tokens' activations) must give each token the one-token kernel's h
    # and Q8_1 blocks bit for bit. N = 80 leaves the last block's rows part-filled (past the
    # end they are not written); 11 tokens: two blocks of 8, the second partial.
    from conformance.harness.matvec_host import glu, glu_cols
    K, N, T = 512, 80, 11
    gf = _weights(tmp_path, rng, {"g": (qtype, (N, K)), "u": (qtype, (N, K))})
    wg, wu = _raw(gf, "g", N), _raw(gf, "u", N)
    x = (rng.uniform(-1, 1, (T, K)) * rng.uniform(0.1, 10, (T, 1))).astype(F32)
    h, hq = glu_cols(lib, qtype, wg, wu, x)
    assert not np.isnan(h).any(), "rows left unwritten"
    for t in range(T):
        h1, hq1 = glu(lib, qtype, wg, wu, x[t:t + 1])
        assert np.array_equal(h[t], h1[0]), f"token {t}: batched h differs from alone"
        assert np.array_equal(hq[t], hq1[0]), f"token {t}: batched Q8_1 blocks of h differ from alone"


@pytest.mark.parametrize("defines", [("MV_COLS_ROWS=1",), ("MV_COLS_ROWS=3", "MV_COLS_ROWS_MANY=3")],
                         ids=["one-row", "three-rows"])
def test_batched_kernels_rows_at_once_give_the_same_bits(lib, rng, tmp_path, defines):
    # MV_COLS_ROWS (rows a warp of matvec_cols_ takes at once, the tokens' items read once for
    # all) moves time only: other builds must give the default build's bits. Q4_K (the staged
    # pair items) with 45 and 7 rows (units past a matrix's end), K = 512 (staged) and 98560
    # (read from global memory: past the staging budget MV_COLS_STAGE_MAX_K even for one
    # token), split and not.
    from conformance.harness import matvec_host
    from brass.backends.cuda.matvec import MV_SPLIT
    other = built(matvec_host.build, defines)
    rows = dict(d.split("=") for d in defines).get("MV_COLS_ROWS")
    qtype = GGMLType.Q4_K
    for K in (512, 98560):
        gf = _weights(tmp_path, rng, {"a": (qtype, (45, K)), "b": (qtype, (7, K))})
        ws = [_raw(gf, "a", 45), _raw(gf, "b", 7)]
        x = rng.uniform(-1, 1, (5, K)).astype(F32)
        for split in (1, MV_SPLIT) if K > 512 else (1,):     # both builds' split: the default
            want = matvec_host.matvec_cols(lib, qtype, ws, x, split=split, many=False)
            got = matvec_host.matvec_cols(other, qtype, ws, x, split=split, many=False,
                                          unit_rows=int(rows) if rows else None)
            # the _many_ kernel of the other build (its MV_COLS_ROWS_MANY rows a warp; its grid
            # by the header's value: the kernel strides over any grid's units)
            many = matvec_host.matvec_cols(other, qtype, ws, x, split=split, many=True)
            for i in range(2):
                assert np.array_equal(got[i], want[i]), f"K {K}, split {split}, matrix {i}"
                assert np.array_equal(many[i], want[i]), f"K {K}, split {split}, matrix {i}, the many kernel"


@pytest.mark.parametrize("qtype, split, K", [(GGMLType.Q4_K, 2, 5120), (GGMLType.Q6_K, 4, 5120),
                                             (GGMLType.Q8_0, 8, 9216), (GGMLType.MXFP4, 2, 5120),
                                             (GGMLType.Q4_K, 4, 28672)],
                         ids=lambda v: tname(v) if isinstance(v, GGMLType) else str(v))
def test_split_rows_on_the_cpu(rng, tmp_path, qtype, split, K, record_property):
    # matvec_split_ (built here with MV_SPLIT 2 / 4 / 8): a row's items shared by `split` warps
    # (warp s: items lane + 32 s, stepping 32 split), their sums added through shared memory.
    # Against the reference within
    # the mat-mul bound (another order of the same sums). K gives every warp of the split items
    # and some lanes one item more than others (Q4_K: 80 items of 64 values; Q6_K, MXFP4: 160
    # of 32; Q8_0: 288 of 32 over 8 warps; K = 28672: the one-token kernel reads x from global
    # memory, past MV_STAGE_MAX_K); q/k/v's three matrices in one launch (37 rows: units of
    # different matrices share blocks, and the last block has warp groups with no row), and the
    # batched kernel with the same split bit for bit one token at a time.
    from conformance.harness import matvec_host
    lib = built(matvec_host.build, (f"MV_SPLIT={split}",))
    shapes = (("a", 21), ("b", 9), ("c", 7))
    gf = _weights(tmp_path, rng, {n: (qtype, (r, K)) for n, r in shapes})
    ws = [_raw(gf, n, r) for n, r in shapes]
    x = rng.uniform(-1, 1, (3, K)).astype(F32)
    ref = cuda_reference()
    got = matvec_host.matvec(lib, qtype, ws, x[:1], split=split)
    with ref.rows_independent():
        for (n, _), g in zip(shapes, got):
            check(g, ref.matmul(x[:1], ref.weight(gf, n)), MATMUL, record_property, f"matrix {n}")
    batched = matvec_host.matvec_cols(lib, qtype, ws, x, split=split)
    # fewer blocks, each taking several rounds of rows (MV_COLS_ROW_ITERS), and the _many_
    # kernel (MV_COLS_ROWS_MANY rows a group): the same bits
    for iters in (2, 3):
        strided = matvec_host.matvec_cols(lib, qtype, ws, x, split=split, iters=iters)
        for i in range(3):
            assert np.array_equal(strided[i], batched[i]), f"split {split}: {iters} rounds of rows, matrix {i}"
    many = matvec_host.matvec_cols(lib, qtype, ws, x, split=split, many=True)
    for i in range(3):
        assert np.array_equal(many[i], batched[i]), f"split {split}: matvec_cols_split_many_, matrix {i}"
    for t in range(x.shape[0]):
        one = matvec_host.matvec(lib, qtype, ws, x[t:t + 1], split=split)
        for i in range(3):
            assert np.array_equal(batched[i][t], one[i][0]), f"split {split}: token {t}, matrix {i}"


@pytest.mark.parametrize("types", [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q5_K, GGMLType.Q6_K)],
                         ids=lambda t: f"{tname(t[0])}+{tname(t[1])}")
@pytest.mark.parametrize("K", [1024, 5120, 28672])
@pytest.mark.parametrize("n_a", [1, 2])
def test_mixed_matvec_equals_its_two_launches(lib, rng, tmp_path, types, K, n_a):
    # matvec_mixed_<a>_<b> (q, k of one type and v of another in one launch) must give each
    # matrix the bits of its own launch (matvec_<a> over q and k, matvec_<b> over v): 37 + 9
    # rows leave matvec_<a>'s last block part-filled, 21 rows matvec_<b>'s; K = 28672 reads x
    # from global memory (past MV_STAGE_MAX_K), the others stage it
    from conformance.harness import matvec_host
    ta, tb = types
    shapes = {"q": (ta, (37, K)), "k": (ta, (9, K)), "v": (tb, (21, K))}
    gf = _weights(tmp_path, rng, shapes)
    wa = [_raw(gf, "q", 37), _raw(gf, "k", 9)][:n_a]
    wv = _raw(gf, "v", 21)
    x = (rng.uniform(-1, 1, (1, K)) * rng.uniform(0.1, 10)).astype(F32)
    got = matvec_host.matvec_mixed(lib, ta, tb, wa, wv, x)
    want = matvec_host.matvec(lib, ta, wa, x, split=1) + matvec_host.matvec(lib, tb, [wv], x, split=1)
    assert len(got) == len(want) == n_a + 1
    for i, (g, w) in enumerate(zip(got, want)):
        assert not np.isnan(g).any(), f"matrix {i}: rows left unwritten"
        assert np.array_equal(g, w), f"matrix {i}: the mixed launch differs from its own (max |d| {np.abs(g - w).max():.3g})"


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("qtype", (GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q5_0), ids=tname)
def test_gated_ffn_on_the_cpu(lib, rng, tmp_path, qtype, gelu, record_property):
    from conformance.harness.matvec_host import glu
    from conformance.harness.mmq_host import q8_1_blocks
    N, K = 96, 512
    gf = _weights(tmp_path, rng, {"g": (qtype, (N, K)), "u": (qtype, (N, K))})
    x = rng.uniform(-1, 1, (1, K)).astype(F32)
    h, hq = glu(lib, qtype, _raw(gf, "g", N), _raw(gf, "u", N), x, gelu=gelu)
    ref = cuda_reference()
    with ref.rows_independent():
        want = ref.ffn_glu(x, ref.weight(gf, "g"), ref.weight(gf, "u"), gelu=gelu)
    check(h, want, OP_BOUNDS["ffn_glu_gelu" if gelu else "ffn_glu"], record_property)
    assert np.array_equal(hq, q8_1_blocks(h)), "the Q8_1 blocks written are not those of h"


@pytest.mark.parametrize("variant", [("wide",), ("GLU_WARPS=16", "GLU_ROWS=2"), ("GLU_WARPS=32", "GLU_ROWS=1")],
                         ids="+".join)
@pytest.mark.parametrize("qtype, K", [(GGMLType.Q4_K, 1024), (GGMLType.Q6_K, 768), (GGMLType.Q8_0, 28672),
                                      (GGMLType.MXFP4, 512)], ids=lambda v: tname(v) if isinstance(v, GGMLType) else str(v))
def test_gated_ffn_layouts_give_the_same_floats(lib, rng, tmp_path, qtype, K, variant):
    # The gated kernel's sizes (kernels/matvec.cuh: GLU_WARPS x GLU_ROWS splits a block's 32
    # rows), and matvec_glu_wide_ (the backend's kernel for small launches, "wide": gate and up
    # in one loop), must give matvec_glu_'s h and Q8_1 blocks bit for bit, dense (staged;
    # K = 28672 unstaged) and over chosen experts, so that they move time only (and the batched
    # kernel, which keeps 8 x 4, still equals one token at a time)
    from conformance.harness import matvec_host
    wide = variant == ("wide",)
    other = lib if wide else built(matvec_host.build, variant)
    warps = next((int(v.split("=")[1]) for v in variant if v.startswith("GLU_WARPS=")), None)
    E, N, T, k = 4, 96, 3, 2
    gf = _weights(tmp_path, rng, {"g": (qtype, (E, N, K)), "u": (qtype, (E, N, K))})
    g, u = _raw(gf, "g", E * N), _raw(gf, "u", E * N)
    x = rng.uniform(-1, 1, (T, K)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    for what, kw, wg, wu in (("dense", {}, g[:N], u[:N]),
                             ("experts", dict(ids=ids, n_experts=E, expert_rows=N), g, u)):
        xs = x[:1] if what == "dense" else x
        h0, q0 = matvec_host.glu(lib, qtype, wg, wu, xs, **kw)
        h1, q1 = matvec_host.glu(other, qtype, wg, wu, xs, warps=warps, wide=wide, **kw)
        assert np.array_equal(h0, h1, equal_nan=True), f"{what}: h differs (max |d| {np.nanmax(np.abs(h0 - h1)):.3g})"
        assert np.array_equal(q0, q1), f"{what}: the Q8_1 blocks differ"


@pytest.mark.parametrize("qtypes", [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.MXFP4, GGMLType.MXFP4),
                                    (GGMLType.Q8_0, GGMLType.Q5_0)], ids=str)
def test_experts_on_the_cpu(lib, rng, tmp_path, qtypes, record_property):
    # the chosen experts' gate/up (ids on the device) and down with the weighted sum; the down
    # is checked on the kernel's own h (re-quantized to Q8_1 between them: test_kernels'
    # test_moe_ffn_decode says why)
    from conformance.harness.matvec_host import glu, moe_down
    gu, dn = qtypes
    E, N, D, T, k = 8, 256, 512, 2, 4
    gf = _weights(tmp_path, rng, {"g": (gu, (E, N, D)), "u": (gu, (E, N, D)), "d": (dn, (E, D, N))})
    x = rng.uniform(-1, 1, (T, D)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0, 1, (T, k)).astype(F32)
    h, _ = glu(lib, gu, _raw(gf, "g", E * N), _raw(gf, "u", E * N), x, ids=ids, n_experts=E, expert_rows=N)
    ref = cuda_reference()
    with ref.rows_independent():
        want_h = ref.swiglu(ref.matmul_id(x, ref.weight(gf, "g"), ids), ref.matmul_id(x, ref.weight(gf, "u"), ids))
        check(h.reshape(T, k, N), want_h, OP_BOUNDS["ffn_glu"], record_property, "h")
        h3 = h.reshape(T, k, N)
        out = moe_down(lib, dn, _raw(gf, "d", E * D), h3, ids, wts, E)
        want = ref.weighted_sum(ref.matmul_id(h3, ref.weight(gf, "d"), ids), wts)
    check(out, want, MATMUL, record_property, "down")


@pytest.mark.parametrize("qtypes,F", [((GGMLType.Q4_K, GGMLType.Q5_0), 96), ((GGMLType.Q8_0, GGMLType.Q6_K), 256)],
                         ids=str)
def test_experts_gate_up_in_one_tensor_with_down_scale(lib, rng, tmp_path, qtypes, F, record_property):
    # Gemma 4's experts (BRASS_GEMMA4_FUSED_MOE): gate and up in one [E, 2F, D] tensor (the up
    # rows F after each expert's gate rows), GELU, and a factor per expert on the down
    # projection's output before the routing weight (ffn_down_exps.scale), against
    # Backend.moe_ffn's composition on the reference (the down checked on the kernel's own h)
    from conformance.harness.matvec_host import glu, moe_down
    gu, dn = qtypes
    E, D, T, k = 6, 512, 2, 3
    gf = _weights(tmp_path, rng, {"gu": (gu, (E, 2 * F, D)), "d": (dn, (E, D, F)), "s": (GGMLType.F32, (E,))})
    x = rng.uniform(-1, 1, (T, D)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0, 1, (T, k)).astype(F32)
    ref = cuda_reference()
    scales = ref.weight(gf, "s").dense().astype(F32)
    h, _ = glu(lib, gu, _raw(gf, "gu", E * 2 * F), None, x, gelu=True, ids=ids, n_experts=E, expert_rows=F)
    with ref.rows_independent():
        gate_up = ref.matmul_id(x, ref.weight(gf, "gu"), ids)
        want_h = ref.geglu(gate_up[..., :F], gate_up[..., F:])
        check(h.reshape(T, k, F), want_h, OP_BOUNDS["ffn_glu_gelu"], record_property, "h")
        h3 = h.reshape(T, k, F)
        out = moe_down(lib, dn, _raw(gf, "d", E * D), h3, ids, wts, E, scales)
        y = ref.mul_expert_scale(ref.matmul_id(h3, ref.weight(gf, "d"), ids), ref.weight(gf, "s"), ids)
        want = ref.weighted_sum(y, wts)
    check(out, want, MATMUL, record_property, "down")
