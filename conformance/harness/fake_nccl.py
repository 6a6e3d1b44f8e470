"""A stand-in for CuPy 14's NCCL binding (`cupy.cuda.nccl`, compiled from
cupy_backends/cuda/libs/nccl.pyx) over the fake CuPy's device memory (fake_cupy.py: host
memory, so a device pointer is a host address), for the CPU tests of engine/distributed/nccl.py
and of the CUDA ranks that use it: no test here can load the real one (it needs libnccl and a
GPU).

What it holds the callers to, as the compiled binding of CuPy 14.2 declares it (its docstrings):

    get_unique_id() -> bytes            NCCL_UNIQUE_ID_BYTES (128) bytes; before CuPy 14, a
                                        tuple of ints, which 14's constructor refuses
    NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)
    allReduce(intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op, intptr_t stream)
    allGather(intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, intptr_t stream)
    send(intptr_t sendbuf, size_t count, int datatype, int peer, intptr_t stream)
    recv(intptr_t recvbuf, size_t count, int datatype, int peer, intptr_t stream)
    abort(), destroy()

Arguments convert as Cython converts them to C integers (an int-like, never None, a float, a
stream object or an array); data types and operations are nccl.h's numbers; a buffer must be
`count` elements inside one allocation of the fake's device memory. After abort() (or destroy())
the communicator is gone, and a call on it fails as NCCL's on a null communicator does.

Semantics: the ranks of a communicator live in this one process, driven by one test thread; a
collective completes when its last rank calls it (as NCCL's kernels complete once every rank
has queued its part), a sum in rank order, a send when its receive comes. Each call is logged
in `calls` (op, rank, stream pointer, whether the fake was capturing a graph).
"""

from __future__ import annotations

import ctypes
import operator
import os
import sys

import numpy as np

from . import fake_cupy

available = True
NCCL_UNIQUE_ID_BYTES = 128

# nccl.h's ncclDataType_t and ncclRedOp_t (the binding's constants carry these numbers)
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_TYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
          NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16,
          NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}

calls: list[dict] = []
_groups: dict[bytes, "_Group"] = {}


class NcclError(RuntimeError):
    pass


def reset():
    calls.clear()
    _groups.clear()


def install():
    """Put this module where `from cupy.cuda import nccl` finds it (inside
    launch_recording.fake_cuda, which takes every cupy.* module away again on exit)."""
    reset()
    mod = sys.modules[__name__]
    sys.modules["cupy.cuda.nccl"] = mod
    sys.modules["cupy.cuda"].nccl = mod


def get_unique_id() -> bytes:
    return os.urandom(NCCL_UNIQUE_ID_BYTES)


def groupStart():
    calls.append({"op": "groupStart"})


def groupEnd():
    calls.append({"op": "groupEnd"})


def _c_int(name: str, v, unsigned: bool = False) -> int:
    """`v` as Cython converts a Python object to a C integer argument."""
    if isinstance(v, float) or v is None:
        raise TypeError(f"{name}: an integer is required, got {type(v).__name__}")
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: an integer is required, got {type(v).__name__}") from None
    if unsigned and n < 0:
        raise OverflowError(f"{name}: can't convert negative value to size_t")
    return n


def _buffer(ptr: int, count: int, datatype: int, what: str) -> np.ndarray:
    """The `count` elements of `datatype` at device address `ptr` (a view of the fake's memory)."""
    if datatype not in _TYPES:
        raise NcclError(f"{what}: ncclInvalidArgument (data type {datatype})")
    dtype = np.dtype(_TYPES[datatype])
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.zeros(0, dtype)
    hit = fake_cupy._rec().find(ptr)
    if hit is None or ptr + nbytes > hit[0] + hit[1]:
        raise NcclError(f"{what}: {count} elements of {dtype} at {ptr:#x} are not in one device "
                        f"allocation (ncclInvalidArgument)")
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype)


class _Group:
    def __init__(self, ndev: int):
        self.ndev = ndev
        self.pending: dict[int, dict[int, tuple]] = {}      # collective number -> rank -> call
        self.done = [0] * ndev
        self.sends: dict[tuple[int, int], list] = {}


class NcclCommunicator:
    def __init__(self, ndev, commId, rank, config=None):
        ndev, rank = _c_int("ndev", ndev), _c_int("rank", rank)
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId: {len(commId)} bytes, not {NCCL_UNIQUE_ID_BYTES}")
        if not 0 <= rank < ndev:
            raise NcclError(f"rank {rank} of {ndev}: ncclInvalidArgument")
        self.group = _groups.setdefault(commId, _Group(ndev))
        if self.group.ndev != ndev:
            raise NcclError(f"{ndev} ranks where the id's first rank said {self.group.ndev}")
        self._rank, self._ndev, self.alive = rank, ndev, True

    # -- what CuPy's communicator answers ----------------------------------------------------
    def rank_id(self):
        return self._rank

    def size(self):
        return self._ndev

    def abort(self):
        self.alive = False

    def destroy(self):
        self.alive = False

    # -- collectives ---------------------------------------------------------------------------
    def _enter(self, op: str, stream) -> int:
        if not self.alive:
            raise NcclError(f"{op}: the communicator was aborted or destroyed (ncclInvalidArgument)")
        stream = _c_int("stream", stream)
        rec = fake_cupy._rec()
        calls.append({"op": op, "rank": self._rank, "stream": stream, "capturing": rec.capturing})
        return stream

    def _collective(self, op: str, args: tuple, finish):
        """Queue rank's part of the group's next collective; the last rank's call completes it."""
        g = self.group
        n = g.done[self._rank]
        g.done[self._rank] += 1
        parts = g.pending.setdefault(n, {})
        parts[self._rank] = (op, *args)
        if len(parts) == g.ndev:
            del g.pending[n]
            kinds = {p[0] for p in parts.values()}
            if len(kinds) != 1:
                raise NcclError(f"collective {n}: the ranks called {sorted(kinds)} (a hang on the GPU)")
            # (count, data type, op): NCCL does not check them across ranks; a mismatch hangs or
            # reads past a buffer on the GPU
            shapes = {r: p[3:] for r, p in parts.items()}
            if len(set(shapes.values())) != 1:
                raise NcclError(f"collective {n} ({op}): the ranks' (count, data type[, op]) differ: {shapes}")
            finish([parts[r][1:] for r in range(g.ndev)])

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        args = (_c_int("sendbuf", sendbuf), _c_int("recvbuf", recvbuf), _c_int("count", count, True),
                _c_int("datatype", datatype), _c_int("op", op))
        self._enter("allReduce", stream)
        if args[4] != NCCL_SUM:
            raise NcclError(f"allReduce: only the sum is stood in for, not op {args[4]}")

        def finish(parts):
            ins = [_buffer(s, c, t, "allReduce").copy() for s, _, c, t, _ in parts]
            total = ins[0].copy()
            for x in ins[1:]:               # rank order
                total += x
            for _, r, c, t, _ in parts:
                _buffer(r, c, t, "allReduce")[...] = total
        self._collective("allReduce", args, finish)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        args = (_c_int("sendbuf", sendbuf), _c_int("recvbuf", recvbuf), _c_int("count", count, True),
                _c_int("datatype", datatype))
        self._enter("allGather", stream)

        def finish(parts):
            ins = [_buffer(s, c, t, "allGather").copy() for s, _, c, t in parts]
            every = np.concatenate(ins)
            for _, r, c, t in parts:
                _buffer(r, c * len(parts), t, "allGather")[...] = every
        self._collective("allGather", args, finish)

    def send(self, sendbuf, count, datatype, peer, stream):
        args = (_c_int("sendbuf", sendbuf), _c_int("count", count, True), _c_int("datatype", datatype))
        peer = _c_int("peer", peer)
        self._enter("send", stream)
        self.group.sends.setdefault((self._rank, peer), []).append(args)

    def recv(self, recvbuf, count, datatype, peer, stream):
        recvbuf, count, datatype = (_c_int("recvbuf", recvbuf), _c_int("count", count, True),
                                    _c_int("datatype", datatype))
        peer = _c_int("peer", peer)
        self._enter("recv", stream)
        queued = self.group.sends.get((peer, self._rank))
        if not queued:
            raise NcclError(f"recv from rank {peer}: nothing sent (a hang on the GPU)")
        s, c, t = queued.pop(0)
        if (c, t) != (count, datatype):
            raise NcclError(f"recv of {count} elements of type {datatype}; rank {peer} sent {c} of type {t}")
        _buffer(recvbuf, count, datatype, "recv")[...] = _buffer(s, c, t, "send")
