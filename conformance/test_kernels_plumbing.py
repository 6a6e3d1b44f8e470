"""CUDA backend plumbing that needs no GPU: which device is chosen, and how parameter
structs are packed for a launch."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed (pip install -e '.[cuda]')")

from engine.backends.cuda.device import pick_device  # noqa: E402
from engine.backends.cuda.errors import CudaError  # noqa: E402
from engine.errors import BrassError  # noqa: E402
from kernels.params import STRUCTS, pack  # noqa: E402


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
