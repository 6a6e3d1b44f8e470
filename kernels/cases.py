"""The kernel case table that drives both the conformance tests (conformance/test_kernels.py)
and the benchmarks (perf/test_kernels_matvec.py), and the helpers both need: a writer for
small GGUF files of random weights (so that weights reach a backend the way a model's do,
through `backend.weight(gf, name)`) and the NMSE measure.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from engine.gguf import BLOCK_SIZES, GGMLType

QUANT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
               GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
WEIGHT_TYPES = FLOAT_TYPES + QUANT_TYPES

# Mat-vec / mat-mul shapes (N outputs, K inputs, T tokens): rows that fill no tile evenly,
# one K-quant super-block (k = 256) and longer rows, one token (the decode kernel) and token
# counts on either side of the prefill tile of 8.
MATMUL_SHAPES = ((1, 256, 1), (7, 256, 1), (33, 512, 3), (130, 1024, 1), (67, 2048, 9),
                 (19, 4096, 17))

# Benchmark shapes: a 4096-wide model's attention projection in decode, a matrix large enough
# (32768 x 4096, an output head) that GPU time outweighs Python's launch overhead, and the
# projection over a 64-token prefill.
PERF_MATMUL_SHAPES = ((4096, 4096, 1), (32768, 4096, 1), (4096, 4096, 64))


def nmse(actual, expected) -> float:
    """Normalised mean squared error, sum((a - e)^2) / sum(e^2), in float64 (llama.cpp's
    test-backend-ops measure)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    den = float((e * e).sum())
    num = float(((a - e) ** 2).sum())
    return num / den if den else (0.0 if num == 0 else float("inf"))


def write_gguf(path: str | Path, tensors: dict, alignment: int = 32) -> Path:
    """Write a GGUF v3 file holding `tensors` {name: (GGMLType, numpy_shape, raw uint8 bytes)}
    and no metadata besides general.alignment."""
    path = Path(path)

    def gguf_str(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    infos, offset, blobs = [], 0, []
    for name, (qtype, shape, raw) in tensors.items():
        raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
        blck, tsize = BLOCK_SIZES[qtype]
        n = int(np.prod(shape))
        if raw.size != n // blck * tsize:
            raise ValueError(f"{name}: {raw.size} bytes for {qtype.name} {shape}")
        ne = tuple(reversed(shape))
        infos.append(gguf_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                     + struct.pack("<IQ", int(qtype), offset))
        blobs.append((offset, raw))
        offset = (offset + raw.size + alignment - 1) // alignment * alignment
    header = (b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1)
              + gguf_str("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", alignment))
    head = header + b"".join(infos)
    data_start = (len(head) + alignment - 1) // alignment * alignment
    with open(path, "wb") as f:
        f.write(head + b"\0" * (data_start - len(head)))
        for off, raw in blobs:
            f.seek(data_start + off)
            f.write(raw.tobytes())
        f.truncate(data_start + offset)
    return path


def random_weight_file(path, rng: np.random.Generator, specs: dict) -> Path:
    """A GGUF of random valid tensors: specs {name: (GGMLType, numpy_shape)}."""
    from engine import quants

    tensors = {}
    for name, (qtype, shape) in specs.items():
        rows = int(np.prod(shape[:-1]))
        tensors[name] = (qtype, shape, quants.random_blocks(qtype, rows, shape[-1], rng))
    return write_gguf(path, tensors)
