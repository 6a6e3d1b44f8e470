"""GGUF reading: header, metadata and tensor directory, with tensor data memory-mapped.

We parse the file ourselves instead of using gguf-py's GGUFReader because the reader builds a
numpy object per array element: on a 150k-entry vocabulary it takes 6-9 s, where this parser
takes a fraction of a second. Tensor bytes are never read here: `GGUFFile.tensor_bytes(name)`
returns a zero-copy view of the memory map, so a tensor is read from disk when it is used.

Every way a file can be wrong is reported as a GGUFError with the path and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from .errors import GGUFError, UnsupportedError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_NESTING = 16


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block), as ggml defines them.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2), GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4), GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136), GGMLType.IQ1_M: (256, 56),
    GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17),
}


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] (ne0) is the contiguous row length
    type: GGMLType
    offset: int              # absolute offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str):
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: file is truncated (reading {what} at byte {self.pos})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # Token texts may hold invalid UTF-8 (partial byte tokens); keep them lossless.
        return b.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0):
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}") from None
        if vt == GGUFValueType.STRING:
            return self.string(what)
        if vt == GGUFValueType.ARRAY:
            et = self.scalar("<I", what)
            n = self.scalar("<Q", what)
            try:
                et = GGUFValueType(et)
            except ValueError:
                raise GGUFError(f"{self.path}: unknown array element type {et} in {what}") from None
            if et in _NUMPY:
                dt = np.dtype(_NUMPY[et])
                self.need(n * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr.astype(bool) if et == GGUFValueType.BOOL else arr
            if et == GGUFValueType.STRING:
                return self._string_array(n, what)
            # Arrays of arrays are legal GGUF (llama.cpp reads none); a corrupt file can chain
            # array headers deep enough to exhaust Python's stack.
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"{self.path}: arrays nested more than {MAX_ARRAY_NESTING} deep in {what}")
            return [self.value(et, what, depth + 1) for _ in range(n)]
        v = self.scalar(_SCALAR[vt], what)
        return v

    def _string_array(self, n: int, what: str) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        size = len(buf)
        unpack = struct.unpack_from
        for _ in range(n):
            if pos + 8 > size:
                raise GGUFError(f"{self.path}: file is truncated (reading {what})")
            ln = unpack("<Q", buf, pos)[0]
            pos += 8
            if pos + ln > size:
                raise GGUFError(f"{self.path}: file is truncated (reading {what})")
            out.append(bytes(buf[pos:pos + ln]).decode("utf-8", errors="surrogateescape"))
            pos += ln
        self.pos = pos
        return out


class GGUFFile:
    """An open GGUF file: `metadata` (dict), `tensors` (name → TensorInfo), memory-mapped data."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: not a GGUF file (only {size} bytes)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        self._parse()

    def _parse(self):
        c = _Cursor(memoryview(self._mm), self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.scalar("<I", "version")
        if self.version not in (2, 3):
            raise UnsupportedError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = c.scalar("<Q", "tensor count")
        n_kv = c.scalar("<Q", "metadata count")
        # A count larger than the file could hold means a corrupt header; refuse before looping.
        if n_tensors > size_limit(self.size) or n_kv > size_limit(self.size):
            raise GGUFError(f"{self.path}: header claims {n_tensors} tensors and {n_kv} metadata "
                            f"entries, more than a {self.size}-byte file can hold")
        self.metadata: dict = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.scalar("<I", f"type of {key}")
            self.metadata[key] = c.value(vtype, key)
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            n_dims = c.scalar("<I", f"dims of {name}")
            if n_dims > 4:
                raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions (at most 4)")
            shape = tuple(c.scalar("<Q", f"shape of {name}") for _ in range(n_dims))
            ttype = c.scalar("<I", f"type of {name}")
            offset = c.scalar("<Q", f"offset of {name}")
            infos.append((name, shape, ttype, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, (int, np.integer)) or isinstance(alignment, bool) \
                or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment!r:.40} is not a power of two")
        self.alignment = int(alignment)
        self.data_offset = (c.pos + self.alignment - 1) // self.alignment * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, offset in infos:
            try:
                t = GGMLType(ttype)
            except ValueError:
                raise UnsupportedError(f"{self.path}: tensor {name} has unknown type id {ttype}") from None
            if t not in BLOCK_SIZES:
                raise UnsupportedError(f"{self.path}: tensor {name} has type {t.name}, not supported")
            blck, tsize = BLOCK_SIZES[t]
            n = 1
            for d in shape:
                n *= d
            if shape and shape[0] % blck:
                raise GGUFError(f"{self.path}: tensor {name} row length {shape[0]} is not a multiple "
                                f"of the {t.name} block size {blck}")
            nbytes = n // blck * tsize
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise GGUFError(f"{self.path}: tensor {name} data [{start}, {start + nbytes}) lies "
                                f"beyond the end of the file ({self.size} bytes): truncated or corrupt")
            self.tensors[name] = TensorInfo(name, shape, t, start, nbytes)

    # -- metadata helpers -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture is missing")
        return arch

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    # -- tensor data ------------------------------------------------------------------------
    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 view of the memory map (no copy)."""
        t = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def close(self):
        # Views handed out keep the map alive; closing is best effort.
        try:
            self._mm.close()
        except BufferError:
            pass


def size_limit(file_size: int) -> int:
    # Every tensor info or metadata entry takes at least 8 bytes on disk.
    return file_size // 8 + 1
