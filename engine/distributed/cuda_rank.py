"""CUDA ranks (issue 49): the backend of a tensor-parallel rank on a GPU is
engine/backends/cuda/sharded.py's TPCudaBackend; this module gives it its communicators.

- `HostStagedCommunicator`: CUDA ranks in threads of one process on ONE GPU, for testing the
  shard path without several GPUs. Each rank is a thread with its own TPCudaBackend (its own
  stream) on the same device; an all-reduce copies the rank's device array to the host, adds
  the ranks' arrays in rank order exactly as the CPU communicator does (comm.ThreadGroup: the
  same bits on every rank and every run), and copies the sum back to the device on the rank's
  stream. It synchronises with the host, so it cannot be captured in a CUDA graph
  (`capturable` False): those ranks decode eagerly.
- `nccl_backend`: a rank's TPCudaBackend over NCCL (nccl.NcclCommunicator on the backend's
  stream, capturable): what the one-process-per-GPU workers build; on one GPU, a group of one
  rank runs the same path inside a captured decode graph.

CuPy is imported where an array is copied, never at import, so the engine loads without it.
"""

from __future__ import annotations

import numpy as np

from ..errors import BrassError, UnsupportedError
from .comm import Communicator

BACKENDS = ("numpy", "cuda")
COMMS = {"numpy": ("thread",), "cuda": ("host",)}


class HostStagedCommunicator(Communicator):
    """A CPU communicator (comm.ThreadCommunicator) for device arrays: each collective copies the
    rank's array to the host, runs the CPU collective, and copies the result back to the device
    on the current stream (inside a TPCudaBackend op: the rank's own). Host arrays pass through
    as the CPU communicator takes them."""

    capturable = False

    def __init__(self, host):
        self.host = host
        self.rank, self.world_size = host.rank, host.world_size

    @staticmethod
    def _cupy(x):
        if type(x) is np.ndarray:       # (not isinstance: the CPU tests' fake CuPy arrays are numpy's)
            return None
        import cupy
        return cupy if isinstance(x, cupy.ndarray) else None

    @staticmethod
    def _down(cp, x):
        stream = cp.cuda.get_current_stream()
        out = cp.asnumpy(x, stream=stream)
        stream.synchronize()
        return out

    def _staged(self, fn, x):
        cp = self._cupy(x)
        if cp is None:
            return fn(x)
        return cp.asarray(fn(self._down(cp, x)))

    def all_reduce(self, x):
        return self._staged(self.host.all_reduce, x)

    def all_gather(self, x, axis: int = -1):
        return self._staged(lambda h: self.host.all_gather(h, axis), x)

    def send(self, x, dst: int):
        cp = self._cupy(x)
        self.host.send(x if cp is None else self._down(cp, x), dst)

    def recv(self, src: int):
        return self.host.recv(src)      # a host array: the receiver puts it where it needs it

    def barrier(self):
        self.host.barrier()


def rank_backends(backend: str, comm: str | None, split: str, comms: list):
    """(each rank's communicator, the factory `make(comm, plan)` of a rank's backend) for a
    TPModel of ranks in threads: `backend` "numpy" over the CPU communicator ("thread"), or
    "cuda" on one GPU over the host-staged one ("host"). One-line errors for the rest."""
    if backend not in BACKENDS:
        raise BrassError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    comm = comm or COMMS[backend][0]
    if comm not in COMMS[backend]:
        raise BrassError(f"the {backend} ranks in threads take the communicator "
                         f"{' or '.join(repr(c) for c in COMMS[backend])}, not {comm!r}")
    if backend == "numpy":
        from .tp import TPBackend
        return comms, TPBackend
    if split != "tensor":
        raise UnsupportedError(f"--split {split} on the cuda backend is not built; use --backend numpy")
    from ..backends import cuda_available
    if not cuda_available():
        raise BrassError("CUDA ranks need CuPy and an NVIDIA GPU; none was found (use backend='numpy')")
    from ..backends.cuda.sharded import TPCudaBackend
    return [HostStagedCommunicator(c) for c in comms], TPCudaBackend


def nccl_backend(plan, uid, device=None, **options):
    """Rank plan.rank of plan.world on the current (or given) device: a TPCudaBackend whose
    communicator is NCCL's over the unique id `uid`, on the backend's stream (capturable)."""
    from ..backends.cuda.sharded import TPCudaBackend
    from .nccl import NcclCommunicator
    b = TPCudaBackend(None, plan, device, **options)
    with b.activate():
        b.comm = NcclCommunicator(plan.world, uid, plan.rank, stream=b.stream)
    return b
