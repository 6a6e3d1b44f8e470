"""CUDA backend plumbing that needs no GPU: which device is chosen, and how parameter
structs are packed for a launch."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed (pip install -e '.[cuda]')")

from brass.backends.cuda.device import pick_device  # noqa: E402
from brass.backends.cuda.errors import CudaError  # noqa: E402
from brass.errors import BrassError  # noqa: E402
from brass.backends.cuda.params import STRUCTS, pack  # noqa: E402


def test_highest_compute_capability_wins():
    assert pick_device([(8, 0), (9, 0), (8, 9)]) == 1
    assert pick_device([(8, 6), (12, 0), (9, 0)]) == 1
    # Among equals, the lowest index.
    assert pick_device([(8, 0), (9, 0), (9, 0)]) == 1


def test_device_override_by_index():
    assert pick_device([(8, 0), (9, 0)], 0) == 0
    assert pick_device([(8, 0), (9, 0)], "0") == 0      # as BRASS_DEVICE gives it
    assert pick_device([(8, 0), (9, 0)], "") == 1       # an empty variable is no override


@pytest.mark.parametrize("bad", [2, -1, "gpu0", "1.5"])
def test_bad_device_choice_is_a_brass_error(bad):
    with pytest.raises(CudaError, match="device"):
        pick_device([(8, 0), (9, 0)], bad)
    assert issubclass(CudaError, BrassError)


def test_no_device_is_a_brass_error():
    with pytest.raises(CudaError, match="no CUDA device"):
        pick_device([])


def test_pack_fills_every_field():
    p = pack("MatVecParams", n_rows=3, k=256, n_tokens=1, n_used=1, row_bytes=432,
             expert_bytes=0, x_per_slot=0, n_experts=1)
    assert p.shape == () and p.dtype == STRUCTS["MatVecParams"]
    assert p["row_bytes"] == 432 and p.dtype.fields["row_bytes"][1] == 16
    with pytest.raises(TypeError, match="missing fields"):
        pack("MatVecParams", n_rows=3)
    with pytest.raises(TypeError, match="unknown fields"):
        pack("QuantizeParams", n_rows=1, k=32, extra=1)


def _kernel_bodies(sources=None):
    """(file, kernel name, text of its body up to PDL_ENTRY or None, its pointer parameters)
    of every __global__ function under kernels/ (or of `sources`: {name: text}), macro-defined
    ones included."""
    import re
    from pathlib import Path
    if sources is None:
        sources = {path.name: path.read_text()
                   for path in sorted((Path(__file__).resolve().parents[2] / "kernels").glob("*.cu*"))}
    out = []
    for name, text in sources.items():
        text = re.sub(r"//[^\n]*", "", text)
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S).replace("\\\n", "\n")
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+(?:##\w+)*)\s*\(", text):
            params = text[m.end():text.index(")", m.end())]
            pointers = {re.findall(r"\w+", q)[-1] for q in params.split(",") if "*" in q}
            body = text[text.index("{", m.end()) + 1:]
            cut = body.find("PDL_ENTRY();")
            nxt = body.find("__global__")
            head = body[:cut] if cut >= 0 and (nxt < 0 or cut < nxt) else None
            out.append((name, m.group(1), head, pointers))
    return out


# What may come before PDL_ENTRY: arithmetic on the launch's indices and parameters, L2
# prefetches of weights and a decode mat-vec's first weight loads into registers
# (decode_preload, coop_preload: weights are read-only for the whole run, so no predecessor
# writes them), whose pointer parameters are named w* by convention.
PRE_PDL_CALLS = {"prefetch_unit", "prefetch_l2_span", "glu_prefetch", "decode_preload", "coop_preload", "min", "max",
                 "if",
                 # a kind's rows per unit (constexpr: no memory)
                 "unit_rows"}


def _pre_pdl_violations(bodies):
    import re
    bad = []
    for f, k, head, pointers in bodies:
        if head is None:
            continue
        why = [tok for tok in ("[", "->", "__shared__") if tok in head]
        # a call, a template's too: name(...) or name<...>(...)
        why += [f"calls {c}" for c in re.findall(r"(\w+)\s*(?:<[^<>()]*>)?\s*\(", head) if c not in PRE_PDL_CALLS
                and c not in ("long", "int", "unsigned", "float", "double")]
        why += [f"reads {ptr}" for ptr in sorted(pointers) if not ptr.startswith("w")
                and re.search(rf"(?<![.\w]){ptr}\b", head)]       # not a member: blockIdx.x
        if why:
            bad.append(f"{f}:{k} ({', '.join(why)})")
    return bad


def test_every_kernel_begins_with_pdl_entry():
    """Decode graphs launch kernels with programmatic dependent launch: a kernel may start
    before the previous one ends, and only PDL_ENTRY (griddepcontrol.wait) makes it wait for
    that one's writes. A kernel that touched memory before it would race with its
    predecessor; so every kernel begins with PDL_ENTRY, with at most pure arithmetic and
    L2 prefetches or preloads of weights (prefetch_l2_span / prefetch_unit / decode_preload /
    coop_preload) before it: no indexing, no
    calls but those, and no pointer parameter named there but the weights'."""
    bodies = _kernel_bodies()
    assert len(bodies) >= 40, f"found only {len(bodies)} kernels: the scan is broken"
    missing = [f"{f}:{k}" for f, k, head, _ in bodies if head is None]
    assert not missing, f"kernels without PDL_ENTRY: {missing}"
    bad = _pre_pdl_violations(bodies)
    assert not bad, f"kernels that read or write memory before PDL_ENTRY: {bad}"


def test_the_pdl_lint_sees_reads_before_pdl_entry():
    # the lint's own teeth, on kernels written to break it: a dereference of an activation
    # pointer, a call that could read memory, an index; a weight prefetch passes
    src = {"t.cu": """
extern "C" __global__ void __launch_bounds__(128) deref(const float * __restrict__ x, float * y, const P p) {
    const float v = *x;
    PDL_ENTRY();
}
extern "C" __global__ void call(const u8 * w, const float * x, const P p) {
    warm(w);
    PDL_ENTRY();
}
extern "C" __global__ void index(const float * x, const P p) {
    const int i = p.n + blockIdx.x;
    float a = x[i];
    PDL_ENTRY();
}
extern "C" __global__ void templated(const u8 * w, const float * x, const P p) {
    warm<4, 2>(w);
    PDL_ENTRY();
}
extern "C" __global__ void fine(const u8 * w0, const float * x, const P p) {
    prefetch_l2_span(w0 + blockIdx.x * p.row_bytes, (long long) min(4, p.n) * p.row_bytes);
    PDL_ENTRY();
    y[0] = x[0];
}
"""}
    bad = _pre_pdl_violations(_kernel_bodies(src))
    assert [b.split(" ")[0] for b in bad] == ["t.cu:deref", "t.cu:call", "t.cu:index", "t.cu:templated"], bad
    assert "reads x" in bad[0] and "calls warm" in bad[1] and "[" in bad[2] and "calls warm" in bad[3], bad


def test_which_mat_vecs_take_the_coop_q6_k_kernel():
    # uses_q6k_coop (where the q6k_coop option is on): Q6_K, rows not split, every matrix's rows
    # whole 8-byte words (K a multiple of 1024: 4 super-blocks of 210 bytes); coop_blocks: a
    # block per MV_COOP_WARPS rows, at most COOP_BLOCKS_PER_SM an SM
    from brass.backends.cuda import matvec as mv
    from brass.gguf import GGMLType as T
    rb = lambda k: k // 256 * 210          # noqa: E731 (a Q6_K row's bytes)
    for k in (1024, 2048, 3072, 4096):
        assert mv.uses_q6k_coop(T.Q6_K, k, [rb(k)] * 3)
    assert not mv.uses_q6k_coop(T.Q6_K, 1280, [rb(1280)] * 3)           # 1050 bytes
    assert not mv.uses_q6k_coop(T.Q6_K, 1024, [rb(1024), rb(1024), 1050])
    assert not mv.uses_q6k_coop(T.Q4_K, 1024, [576] * 3)
    assert not mv.uses_q6k_coop(T.Q6_K, mv.MV_SPLIT_MIN_K, [rb(mv.MV_SPLIT_MIN_K)] * 3)   # split rows
    assert mv.coop_blocks(37, 132) == -(-37 // (mv.MV_COOP_WARPS * mv.MV_COOP_ROWS))
    assert mv.coop_blocks(151936, 132) == 132 * mv.COOP_BLOCKS_PER_SM


def test_which_decode_groups_take_the_mixed_launch():
    # matvec.mixed_pair (where the mixed_matvec option is on): one token, two types of a
    # MIXED_PAIRS pair (either order), at most two matrices of the first and exactly one of the
    # second, rows not split; else the launches of one type each
    from brass.backends.cuda import matvec as mv
    from brass.gguf import GGMLType as T
    pick = mv.mixed_pair
    q4, q6, q5, q8 = T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0
    assert pick(1, 1024, {q4: [1, 2], q6: [3]}) == (q4, q6)
    assert pick(1, 1024, {q6: [3], q4: [1, 2]}) == (q4, q6)            # either order of the groups
    assert pick(1, 1024, {q5: [1], q6: [3]}) == (q5, q6)
    assert pick(1, 1024, {q4: [1, 2, 3], q6: [4]}) is None               # three of the first type
    assert pick(1, 1024, {q4: [1], q6: [3, 4]}) is None                  # two of the second
    assert pick(1, 1024, {q4: [1], q8: [3]}) is None                     # not a pair
    assert pick(1, 1024, {q4: [1, 2]}) is None                           # one type: one launch anyway
    assert pick(1, 1024, {q4: [1], q6: [2], q8: [3]}) is None
    assert pick(2, 1024, {q4: [1, 2], q6: [3]}) is None                  # a batched step
    assert pick(1, mv.MV_SPLIT_MIN_K, {q4: [1, 2], q6: [3]}) is None     # split rows
