"""The communicator over NCCL, through CuPy's binding (cupy.cuda.nccl): one process per GPU,
device arrays in and out, every call queued on the rank's stream (so a decode step that
contains them can be captured as one CUDA graph: NCCL supports capture).

Rank 0 makes the unique id (`unique_id()`) and hands it to the other ranks (the launcher
passes it: docs/multi-gpu.md); each rank then builds `NcclCommunicator(world_size, uid, rank)`
with its own device current. NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set
before the first communicator unless the environment says otherwise.

Not run by the suite: it needs CuPy with NCCL and, for more than one rank, several GPUs. CuPy
is imported when a communicator is made, never at import, so the engine loads without it.
"""

from __future__ import annotations

import os

from ..errors import BrassError
from .comm import Communicator


def _nccl():
    try:
        from cupy.cuda import nccl
    except Exception as e:      # no CuPy, or CuPy built without NCCL
        raise BrassError(f"NCCL is not available through CuPy here ({type(e).__name__}: {e}); "
                         f"install cupy with NCCL (pip install nvidia-nccl-cu12)") from None
    if not getattr(nccl, "available", True):
        raise BrassError("CuPy's NCCL binding is present but NCCL did not load")
    return nccl


def unique_id() -> bytes | tuple:
    """Rank 0's NCCL unique id, to hand to every rank (its value is opaque). NCCL opens its
    bootstrap's listening socket here, before any rank starts: where it cannot (no usable
    network interface, an NCCL_SOCKET_IFNAME that names none), one line says so."""
    nccl = _nccl()
    try:
        return nccl.get_unique_id()
    except Exception as e:      # CuPy's NcclError: NCCL's code and its one-line reason
        raise BrassError(f"NCCL could not start the ranks' rendezvous (its unique id: "
                         f"{type(e).__name__}: {' '.join(str(e).split())})") from None


def _dtype(nccl, dtype):
    import numpy as np
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64}
    try:
        return table[np.dtype(dtype)]
    except KeyError:
        raise BrassError(f"NCCL: no data type for {dtype}") from None


class NcclCommunicator(Communicator):
    """Rank `rank` of `world_size`, on the current device, over the unique id `uid`."""

    capturable = True

    def __init__(self, world_size: int, uid, rank: int, stream=None):
        import cupy as cp
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.nccl = _nccl()
        self.cp = cp
        self.rank, self.world_size = rank, world_size
        self.comm = self.nccl.NcclCommunicator(world_size, uid, rank)
        self.stream = stream or cp.cuda.get_current_stream()

    def _ptr(self):
        return self.stream.ptr

    def all_reduce(self, x):
        """In place on a contiguous device array (also returned): the sum of every rank's."""
        x = self.cp.ascontiguousarray(x)
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, _dtype(self.nccl, x.dtype),
                            self.nccl.NCCL_SUM, self._ptr())
        return x

    def all_gather(self, x, axis: int = -1):
        """Every rank's `x` (the same shape on every rank: NCCL's all-gather) concatenated
        along `axis` in rank order."""
        cp = self.cp
        x = cp.ascontiguousarray(x)
        out = cp.empty((self.world_size, *x.shape), x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, _dtype(self.nccl, x.dtype), self._ptr())
        return cp.concatenate(list(out), axis=axis)

    def send(self, x, dst: int):
        x = self.cp.ascontiguousarray(x)
        self.comm.send(x.data.ptr, x.size, _dtype(self.nccl, x.dtype), dst, self._ptr())

    def recv_into(self, out, src: int):
        """Receive into a preallocated device array (its shape and dtype are the sender's)."""
        self.comm.recv(out.data.ptr, out.size, _dtype(self.nccl, out.dtype), src, self._ptr())
        return out

    def recv(self, src: int):
        raise BrassError("NCCL carries no shapes: the receiver allocates (recv_into)")

    def barrier(self):
        one = self.cp.zeros((1,), self.cp.float32)
        self.all_reduce(one)
        self.stream.synchronize()

    def abort(self):
        """Abandon the communicator (a rank died): its pending collectives return."""
        self.comm.abort()
