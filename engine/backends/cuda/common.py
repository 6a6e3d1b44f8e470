"""What the CUDA backend's kernel families share: the weight on the device, the kernels' names
for GGML types, and the checks that turn an op's inputs into the arrays a kernel reads."""

from __future__ import annotations

import cupy
import numpy as np

from ...errors import BrassError
from ...gguf import BLOCK_SIZES, GGMLType
from ..base import Weight

F16, F32 = np.float16, np.float32
Q8_1_BLOCK_BYTES = 36           # a block of 32 activations as int8 quants, its scale and sum

# Type name in kernel names (matvec_<name>, get_rows_<name>, dequant_f16_<name>, ...).
TYPE_NAMES = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q5_0: "q5_0", GGMLType.Q5_1: "q5_1",
    GGMLType.Q8_0: "q8_0", GGMLType.Q4_K: "q4_k", GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
    GGMLType.MXFP4: "mxfp4",
}
# Float weights: their mat-vecs (matvec_f.cu) read float32 activations, the quantized ones'
# (matvec_q.cu) Q8_1 blocks.
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
SUPPORTED_TYPES = tuple(TYPE_NAMES)


def matvec_source(wtype) -> str:
    """The source of the mat-vec kernels for weights of `wtype`."""
    return "matvec_f.cu" if wtype in FLOAT_TYPES else "matvec_q.cu"


class CudaWeight(Weight):
    """A GGUF tensor resident on the device: matrices as their raw ggml bytes (`data`, uint8),
    1-D tensors (norm weights, biases) dequantized to float32 (`dense`)."""

    def __init__(self, name, type_, shape, data=None, dense=None):
        self.name, self.type, self.shape = name, type_, shape
        self.data, self.dense = data, dense

    @property
    def row_bytes(self) -> int:
        blck, tsize = BLOCK_SIZES[self.type]
        return self.shape[-1] // blck * tsize

    @property
    def nbytes(self) -> int:
        return int((self.data if self.data is not None else self.dense).nbytes)


def f32(x, what: str):
    """x as a C-contiguous float32 device array."""
    if not isinstance(x, cupy.ndarray):
        raise BrassError(f"{what}: expected a device array, got {type(x).__name__}")
    if x.dtype != F32:
        raise BrassError(f"{what}: expected float32, got {x.dtype}")
    return cupy.ascontiguousarray(x)


def i32(x, what: str):
    """x (a device array or host integers) as a C-contiguous int32 device array."""
    if not isinstance(x, cupy.ndarray):
        x = cupy.asarray(np.asarray(x))
    if x.dtype.kind not in "iu":
        raise BrassError(f"{what}: expected integers, got {x.dtype}")
    return cupy.ascontiguousarray(x, dtype=np.int32)


def grid_1d(n: int, threads: int, cap: int = 65535 * 8) -> int:
    """Blocks of `threads` for n elements, at most `cap` (the kernels stride over the rest)."""
    return max(1, min(cap, -(-n // threads)))
