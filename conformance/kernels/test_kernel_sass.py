"""conformance/harness/kernel_sass.py, and through it the schedule of mmq.cu's weight unpack: which loads are
in flight together. Needs a CUDA toolkit's ptxas and nvdisasm (CI has neither: these skip
there and say so; the GPU runner and a development machine have them)."""

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


def test_the_unpack_loads_an_item_then_stores_it():
    # mmq_id_q4_k's weight unpack: an item's three 16-byte loads (its 32 quant bytes and the
    # super-block's header) are issued together, then waited for before the item is stored
    # (ptxas does not move the next item's loads above those stores)
    _, lines = kernel_sass.sass("mmq.cu", "mmq_id_q4_k")
    assert first_run_of_weight_loads(lines) == 3


def test_unknown_kernel_is_named():
    with pytest.raises(KeyError, match="nosuch"):
        kernel_sass.sass("mmq.cu", "nosuch")
