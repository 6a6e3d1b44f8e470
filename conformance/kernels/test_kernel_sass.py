"""The machine code ci/kernel_sass.py prints (conformance/harness/kernel_sass.py), and through
it what mmq.cu's latency switches are for: the weight unpack's loads of several items in flight
together (MMQ_UNPACK_UNROLL), the activation copies issued as cp.async ahead of them
(MMQ_X_ASYNC). Needs a CUDA toolkit's ptxas and nvdisasm (CI has neither: these skip there and
say so; the GPU runner and a development machine have them)."""

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="no NVRTC (pip install -e '.[cuda]')")

from conformance.harness import kernel_sass  # noqa: E402

try:
    kernel_sass.find_tool("ptxas")
    kernel_sass.find_tool("nvdisasm")
except kernel_sass.NoToolkit as e:
    pytest.skip(f"{e} (kernel_sass needs a CUDA toolkit's ptxas and nvdisasm)", allow_module_level=True)

WEIGHT_LOAD = "LDG.E.128.CONSTANT"      # the Q4_K unpack's 16-byte weight loads (ld.global.nc)


def first_run_of_weight_loads(lines):
    """The weight loads issued before the first shared store that follows the first of them."""
    start = next(i for i, x in enumerate(lines) if WEIGHT_LOAD in x)
    n = 0
    for x in lines[start:]:
        if x.split()[0].startswith("STS") or " STS" in x:
            break
        n += WEIGHT_LOAD in x
    return n


def test_unpack_unroll_puts_two_items_loads_in_flight():
    # the default waits for one item's three 16-byte loads before storing it; with
    # MMQ_UNPACK_UNROLL=2 both items' six are issued first
    _, default = kernel_sass.sass("mmq.cu", "mmq_id_q4_k")
    _, unrolled = kernel_sass.sass("mmq.cu", "mmq_id_q4_k", ("-DMMQ_UNPACK_UNROLL=2",))
    assert first_run_of_weight_loads(default) == 3
    assert first_run_of_weight_loads(unrolled) == 6


def test_x_async_issues_the_activation_copies_before_the_weights():
    _, default = kernel_sass.sass("mmq.cu", "mmq_id_q4_k")
    _, lines = kernel_sass.sass("mmq.cu", "mmq_id_q4_k", ("-DMMQ_X_ASYNC=1",))
    assert not any("LDGSTS" in x for x in default)
    first_weight = next(i for i, x in enumerate(lines) if WEIGHT_LOAD in x)
    copies = [i for i, x in enumerate(lines) if "LDGSTS" in x]
    assert copies and max(copies) < first_weight, "every cp.async ahead of the weight loads"
    assert any("DEPBAR" in x for x in lines[first_weight:]), "and waited for after them"
    # (No claim on spills: ptxas 13.0 here spills nothing with the switch, the runner's ptxas
    # 8 bytes (2026-12-04); spills are the toolkit's choice, the order above is the source's.)


def test_mv_ldg_makes_the_q4k_weight_loads_global():
    # the preloading Q4_K mat-vec's 16-byte weight loads are generic (LD.E.128) by default: the
    # row pointer reaches them through the kernel's structs; MV_LDG=1 makes them ld.global.nc
    _, default = kernel_sass.sass("matvec_q.cu", "matvec_split_q4_k")
    _, ldg = kernel_sass.sass("matvec_q.cu", "matvec_split_q4_k", ("-DMV_LDG=1",))
    generic = [x for x in default if " LD.E.128" in x or x.startswith("LD.E.128")]
    assert generic, "the default's loop loads are generic"
    assert not any(" LD.E.128" in x or x.startswith("LD.E.128") for x in ldg)
    assert sum("LDG.E.128.CONSTANT" in x for x in ldg) >= len(generic)


def test_unknown_kernel_is_named():
    with pytest.raises(KeyError, match="nosuch"):
        kernel_sass.sass("mmq.cu", "nosuch")
