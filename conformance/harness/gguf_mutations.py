"""Mutation fuzz of model loading: copies of the synthetic GGUFs (golden/models/) with flipped
bytes, truncations, extreme integers and floats in the header, renamed tensors and shifted
chunks, each loaded with `brass.load(..., backend="numpy")` and run on one prompt. Every copy
must either run or fail with a BrassError; anything else (a KeyError from deep in the forward
pass, a ValueError from a mat-mul, a hang) is a bug.

conformance/models/test_fuzz_load.py runs a few thousand copies on every CI run;
ci/fuzz_load.py runs many more over several processes, each copy under a time limit.

A copy is named by (seed, case): the same pair gives the same bytes on any machine.
"""

from __future__ import annotations

import os
import struct
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "golden" / "models").glob("*.gguf"))
PROMPT = "Hello world"

# GGUF metadata value types: struct format of each scalar type (8: string, 9: array)
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_FLOATS = ("<f", "<d")
# Integers that break code which trusts them: zero, negative (read as huge when unsigned),
# the limits of each width, and one past them.
EXTREME_INTS = (0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
                -2**31, 7, 255, 65535)
EXTREME_FLOATS = (0.0, -0.0, -1.0, 1.0, float("nan"), float("inf"), float("-inf"), 1e38, -1e38,
                  1e-45, 3.0e9, 0.5)


@dataclass
class Field:
    """An integer or float somewhere in the header that a mutation may overwrite."""
    what: str
    pos: int
    fmt: str


@dataclass
class Name:
    """A string in the header (metadata key, tensor name, string value): its bytes' position."""
    what: str
    pos: int
    text: bytes


@dataclass
class Layout:
    """Where the parts of a GGUF header are, found by walking it as the reader does."""
    size: int
    header_end: int = 0                    # end of the tensor directory
    values: list[Field] = field(default_factory=list)      # metadata scalars
    structure: list[Field] = field(default_factory=list)   # counts, types, lengths, dims, offsets
    elements: list[Field] = field(default_factory=list)    # a sample of numeric array elements
    tensor_names: list[Name] = field(default_factory=list)
    keys: list[Name] = field(default_factory=list)


def layout(data: bytes) -> Layout:
    lay = Layout(size=len(data))
    pos = 8

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string(what, names=None):
        nonlocal pos
        lay.structure.append(Field(f"length of {what}", pos, "<Q"))
        n = take("<Q")
        if names is not None:
            names.append(Name(what, pos, data[pos:pos + n]))
        pos += n

    lay.structure.append(Field("tensor count", pos, "<Q"))
    n_tensors = take("<Q")
    lay.structure.append(Field("metadata count", pos, "<Q"))
    n_kv = take("<Q")
    for _ in range(n_kv):
        string("metadata key", lay.keys)
        key = lay.keys[-1].text.decode("utf-8", "replace")
        lay.structure.append(Field(f"value type of {key}", pos, "<I"))
        vtype = take("<I")
        if vtype == 8:
            string(key)
        elif vtype == 9:
            lay.structure.append(Field(f"element type of {key}", pos, "<I"))
            etype = take("<I")
            lay.structure.append(Field(f"length of {key}", pos, "<Q"))
            n = take("<Q")
            if etype == 8:
                for i in range(n):
                    if i < 4 or i == n - 1:
                        lay.structure.append(Field(f"length of {key}[{i}]", pos, "<Q"))
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            else:
                fmt = _SCALAR_FMT[etype]
                size = struct.calcsize(fmt)
                for i in sorted({0, 1, n // 2, n - 1} & set(range(n))):
                    lay.elements.append(Field(f"{key}[{i}]", pos + i * size, fmt))
                pos += n * size
        else:
            lay.values.append(Field(key, pos, _SCALAR_FMT[vtype]))
            take(_SCALAR_FMT[vtype])
    for _ in range(n_tensors):
        string("tensor name", lay.tensor_names)
        name = lay.tensor_names[-1].text.decode("utf-8", "replace")
        lay.structure.append(Field(f"dims of tensor {name}", pos, "<I"))
        n_dims = take("<I")
        for d in range(n_dims):
            lay.structure.append(Field(f"ne[{d}] of tensor {name}", pos, "<Q"))
            take("<Q")
        lay.structure.append(Field(f"type of tensor {name}", pos, "<I"))
        take("<I")
        lay.structure.append(Field(f"offset of tensor {name}", pos, "<Q"))
        take("<Q")
    lay.header_end = pos
    return lay


def set_value(data: bytes, what: str, value) -> bytes:
    """`data` with the header field named `what` (a metadata key, or e.g. "ne[1] of tensor
    blk.0.attn_q.weight", "type of tensor output.weight") set to `value`."""
    lay = layout(data)
    f = next(f for f in lay.values + lay.structure + lay.elements if f.what == what)
    buf = bytearray(data)
    buf[f.pos:f.pos + struct.calcsize(f.fmt)] = _pack(f.fmt, value)
    return bytes(buf)


def rename_tensor(data: bytes, old: str, new: str) -> bytes:
    """`data` with tensor `old` renamed to `new` (a name of the same length)."""
    n = next(n for n in layout(data).tensor_names if n.text == old.encode())
    assert len(new) == len(old)
    return data[:n.pos] + new.encode() + data[n.pos + len(old):]


# -- mutations ---------------------------------------------------------------------------------
# Each takes (bytearray, Layout, rng), changes the bytes and returns what it did.

def _pack(fmt: str, value) -> bytes:
    if fmt in _FLOATS:
        return struct.pack(fmt, value)
    width = struct.calcsize(fmt)
    return (int(value) % (1 << (8 * width))).to_bytes(width, "little")


def _set_field(buf, f: Field, rng, values=None) -> str:
    if f.fmt in _FLOATS:
        v = values or EXTREME_FLOATS
        value = v[rng.integers(len(v))]
    else:
        old = int.from_bytes(buf[f.pos:f.pos + struct.calcsize(f.fmt)], "little")
        candidates = EXTREME_INTS + (old + 1, old - 1, old * 2, old // 2)
        value = values[rng.integers(len(values))] if values else candidates[rng.integers(len(candidates))]
    buf[f.pos:f.pos + struct.calcsize(f.fmt)] = _pack(f.fmt, value)
    return f"{f.what} = {value}"


def m_metadata_value(buf, lay, rng):
    return _set_field(buf, lay.values[rng.integers(len(lay.values))], rng)


def m_structure(buf, lay, rng):
    return _set_field(buf, lay.structure[rng.integers(len(lay.structure))], rng)


def m_array_element(buf, lay, rng):
    return _set_field(buf, lay.elements[rng.integers(len(lay.elements))], rng)


def m_retype(buf, lay, rng):
    """A metadata value read as another type (the bytes after it then read as something else),
    or an array whose elements become strings or arrays."""
    types = [f for f in lay.structure if f.what.startswith(("value type of ", "element type of "))]
    return _set_field(buf, types[rng.integers(len(types))], rng, tuple(range(13)))


def m_tensor_dim(buf, lay, rng):
    dims = [f for f in lay.structure if f.what.startswith(("ne[", "dims of"))]
    f = dims[rng.integers(len(dims))]
    small = (0, 1, 2, 32, 64, 128, 255, 256, 257, 512, 1024)
    return _set_field(buf, f, rng, small if rng.random() < 0.6 else None)


def m_tensor_type(buf, lay, rng):
    types = [f for f in lay.structure if f.what.startswith("type of tensor ")]
    f = types[rng.integers(len(types))]
    # mostly real ggml types (some unsupported ones), sometimes an id that is none
    return _set_field(buf, f, rng, (0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 13, 14, 16, 24, 30, 39, 40, 99))


def m_rename_tensor(buf, lay, rng):
    """One character of a tensor name changed: the tensor seems missing, or a block number
    points at another layer."""
    n = lay.tensor_names[rng.integers(len(lay.tensor_names))]
    if not n.text:
        return "rename (empty name)"
    i = int(rng.integers(len(n.text)))
    old = n.text.decode("utf-8", "replace")
    c = n.text[i]
    new = ord("0") + (c - ord("0") + 1 + int(rng.integers(9))) % 10 if chr(c).isdigit() \
        else int(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz_.0123456789")))
    buf[n.pos + i] = new
    return f"rename tensor {old} -> {bytes(buf[n.pos:n.pos + len(n.text)]).decode('utf-8', 'replace')}"


def m_swap_names(buf, lay, rng):
    """Two tensors whose names have the same length trade names (attn_q <-> attn_k,
    ffn_gate <-> ffn_down, blk.0 <-> blk.1): every name exists, the shapes disagree."""
    by_len: dict[int, list[Name]] = {}
    for n in lay.tensor_names:
        by_len.setdefault(len(n.text), []).append(n)
    groups = [g for g in by_len.values() if len(g) > 1]
    g = groups[rng.integers(len(groups))]
    a, b = (g[i] for i in rng.choice(len(g), 2, replace=False))
    buf[a.pos:a.pos + len(a.text)], buf[b.pos:b.pos + len(b.text)] = b.text, a.text
    return f"swap tensor names {a.text.decode()} <-> {b.text.decode()}"


def m_rename_key(buf, lay, rng):
    k = lay.keys[rng.integers(len(lay.keys))]
    i = int(rng.integers(len(k.text)))
    buf[k.pos + i] = (buf[k.pos + i] + 1 + int(rng.integers(60))) % 128 or 65
    new = bytes(buf[k.pos:k.pos + len(k.text)]).decode("utf-8", "replace")
    return f"rename key {k.text.decode()} -> {new}"


def _pos(lay, rng, header=0.8) -> int:
    """A byte position, most often in the header (the data is only weights)."""
    end = lay.header_end if rng.random() < header else lay.size
    return int(rng.integers(8, max(end, 9)))


def m_flip_bits(buf, lay, rng):
    done = []
    for _ in range(int(rng.integers(1, 9))):
        p, bit = _pos(lay, rng), int(rng.integers(8))
        buf[p] ^= 1 << bit
        done.append(f"{p}.{bit}")
    return "flip bits " + ",".join(done)


def m_random_bytes(buf, lay, rng):
    p = _pos(lay, rng)
    n = int(rng.integers(1, 17))
    buf[p:p + n] = rng.integers(0, 256, min(n, len(buf) - p), dtype=np.uint8).tobytes()
    return f"random bytes [{p}, {p + n})"


def m_truncate(buf, lay, rng):
    p = _pos(lay, rng, header=0.5)
    del buf[p:]
    return f"truncate at {p}"


def m_shift_chunk(buf, lay, rng):
    """Bytes inserted or removed in the middle (everything after moves), or a chunk rotated
    in place."""
    p = _pos(lay, rng, header=0.7)
    k = int(rng.choice([1, 2, 3, 4, 7, 8, 16, 32, 100]))
    kind = rng.integers(3)
    if kind == 0:
        buf[p:p] = bytes(k)
        return f"insert {k} bytes at {p}"
    if kind == 1:
        del buf[p:p + k]
        return f"delete {k} bytes at {p}"
    end = min(len(buf), p + int(rng.integers(k + 1, 4096)))
    buf[p:end] = buf[p + k:end] + buf[p:p + k]
    return f"rotate [{p}, {end}) by {k}"


MUTATIONS = {
    "metadata_value": (m_metadata_value, 5), "structure": (m_structure, 4), "retype": (m_retype, 2),
    "array_element": (m_array_element, 2), "tensor_dim": (m_tensor_dim, 3),
    "tensor_type": (m_tensor_type, 2), "rename_tensor": (m_rename_tensor, 2),
    "swap_names": (m_swap_names, 2), "rename_key": (m_rename_key, 2),
    "flip_bits": (m_flip_bits, 3), "random_bytes": (m_random_bytes, 2),
    "truncate": (m_truncate, 1), "shift_chunk": (m_shift_chunk, 2),
}
_NAMES = list(MUTATIONS)
_WEIGHTS = np.array([w for _, w in MUTATIONS.values()], float)
_WEIGHTS /= _WEIGHTS.sum()

_ORIGINALS: dict[Path, tuple[bytes, Layout]] = {}


def original(path: Path) -> tuple[bytes, Layout]:
    if path not in _ORIGINALS:
        data = path.read_bytes()
        _ORIGINALS[path] = (data, layout(data))
    return _ORIGINALS[path]


def mutant(seed: int, case: int) -> tuple[Path, bytes, list[str]]:
    """The bytes of copy `case` of seed `seed`: which model, and the mutations applied
    (one, sometimes two or three)."""
    rng = np.random.default_rng([seed, case])
    model = MODELS[case % len(MODELS)]
    data, lay = original(model)
    buf = bytearray(data)
    done = []
    for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):
        name = _NAMES[rng.choice(len(_NAMES), p=_WEIGHTS)]
        done.append(f"{name}: {MUTATIONS[name][0](buf, lay, rng)}")
        if len(buf) != len(data):
            break           # positions after a truncation or shift no longer match the layout
    return model, bytes(buf), done


def run(path: str | os.PathLike) -> None:
    """Load and generate two tokens. Raises whatever the engine raises."""
    import brass
    m = brass.load(str(path), backend="numpy", quiet=True)
    try:
        ids = m.tokenizer.encode(PROMPT)
        out = list(m.generate(ids, max_tokens=2, stop_at_eog=False))
        m.tokenizer.decode(out)
    finally:
        m.gguf.close()


def check(seed: int, case: int, directory: str | os.PathLike) -> tuple[str, str]:
    """Run one copy: ("ok", ""), ("brass", message) or ("other", traceback)."""
    from brass.errors import BrassError
    model, data, done = mutant(seed, case)
    path = Path(directory) / f"fuzz-{os.getpid()}-{case}.gguf"
    path.write_bytes(data)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # NaN or huge weights from flipped bits are a model that runs, badly
            warnings.simplefilter("ignore", RuntimeWarning)
            run(path)
        return "ok", ""
    except BrassError as e:
        return "brass", str(e)
    except Exception:
        return "other", f"seed {seed} case {case} ({model.name}: {'; '.join(done)})\n" \
                        + traceback.format_exc()
    finally:
        path.unlink()
