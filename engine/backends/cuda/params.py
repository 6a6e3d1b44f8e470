"""Host-side layouts of the parameter structs in params.cuh, read from that header itself.

Every kernel takes its buffers first and one struct by value last; CuPy passes a one-element
numpy array by value (its bytes become the argument), so the structured dtype must match the
C layout byte for byte.
Parsing the header keeps one definition; conformance/kernels/test_nvrtc_compile.py proves with NVRTC
(sizeof/offsetof static_asserts) that the layouts agree.
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np

_CTYPES = {"int": np.int32, "unsigned": np.uint32, "float": np.float32, "long long": np.int64}
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{(.*?)\};", re.S)
_FIELD = re.compile(r"^\s*(long long|int|unsigned|float)\s+(\w+)\s*;")


def _parse(text: str) -> dict[str, np.dtype]:
    structs = {}
    for name, body in _STRUCT.findall(text):
        fields = []
        for line in body.splitlines():
            line = line.split("//")[0]
            if not line.strip():
                continue
            m = _FIELD.match(line)
            if not m:
                raise ValueError(f"params.cuh: cannot read field {line.strip()!r} of {name}")
            fields.append((m.group(2), _CTYPES[m.group(1)]))
        structs[name] = np.dtype(fields, align=True)
    return structs


STRUCTS: dict[str, np.dtype] = _parse(resources.files("brass.kernels").joinpath("params.cuh").read_text())


_PACKED: dict = {}
_PACKED_MAX = 16384


def pack(struct: str, **values) -> np.ndarray:
    """The by-value parameter struct `struct` with `values`, as a 0-d structured array; fields
    named pad* default to 0, every other field must be given. The result is shared between
    calls with the same values (a launch only reads it): building a structured array costs
    more host time than the launch itself."""
    key = (struct, tuple(values.items()))
    try:
        return _PACKED[key]
    except KeyError:
        pass
    except TypeError:           # an unhashable value: build it every time
        key = None
    rec = _build(struct, values)
    if key is not None and len(_PACKED) < _PACKED_MAX:
        _PACKED[key] = rec
    return rec


def _build(struct: str, values: dict) -> np.ndarray:
    dt = STRUCTS[struct]
    missing = [f for f in dt.names if f not in values and not f.startswith("pad")]
    unknown = [f for f in values if f not in dt.names]
    if missing or unknown:
        raise TypeError(f"{struct}: missing fields {missing}, unknown fields {unknown}")
    rec = np.zeros((), dtype=dt)
    for k, v in values.items():
        rec[k] = v
    return rec
