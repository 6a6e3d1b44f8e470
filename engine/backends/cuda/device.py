"""Which GPU the CUDA backend runs on: the highest compute capability among the visible
devices (the lowest index among equals), unless BRASS_DEVICE or the `device` argument names
one by index."""

from __future__ import annotations

from ... import flags
from .errors import CudaError


def pick_device(capabilities: list[tuple[int, int]], requested: int | str | None = None) -> int:
    """The device index to use, given each visible device's (major, minor) compute capability."""
    if not capabilities:
        raise CudaError("no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)")
    if requested is None or requested == "":
        best = max(capabilities)
        return capabilities.index(best)
    try:
        index = int(requested)
    except (TypeError, ValueError):
        raise CudaError(f"device {requested!r} is not a device index (0..{len(capabilities) - 1})") from None
    if not 0 <= index < len(capabilities):
        raise CudaError(f"device {index} does not exist: {len(capabilities)} visible "
                        f"(indices 0..{len(capabilities) - 1})")
    return index


def visible_capabilities() -> list[tuple[int, int]]:
    import cupy
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise CudaError(f"no usable CUDA driver or device: {e}") from None
    caps = []
    for i in range(n):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        caps.append((int(props["major"]), int(props["minor"])))
    return caps


def choose_device(requested: int | str | None = None) -> int:
    """The device index: `requested`, else $BRASS_DEVICE, else the most capable device."""
    if requested is None:
        requested = flags.get("BRASS_DEVICE")
    return pick_device(visible_capabilities(), requested)
