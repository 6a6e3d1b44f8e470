"""CUDA ranks (issue 49): the backend of a tensor-parallel rank on a GPU is
engine/backends/cuda/sharded.py's TPCudaBackend; this module gives it its communicators.

- `HostStagedCommunicator`: CUDA ranks in threads of one process on ONE GPU, for testing the
  shard path without several GPUs. Each rank is a thread with its own TPCudaBackend (its own
  stream) on the same device; an all-reduce copies the rank's device array to the host, adds
  the ranks' arrays in rank order exactly as the CPU communicator does (comm.ThreadGroup: the
  same bits on every rank and every run), and copies the sum back to the device on the rank's
  stream. It synchronises with the host, so it cannot be captured in a CUDA graph
  (`capturable` False): those ranks decode eagerly.
  The same class wraps the pipes of ranks in processes (comm.PipeCommunicator): CUDA ranks in
  processes over "host", several of them sharing one GPU.
- `NcclRank`: CUDA ranks in processes over "nccl", one GPU each: device arrays (the
  all-reduces of a step) go through NCCL on the backend's stream (capturable), host arrays (the
  vocabulary-parallel head's few numbers a row, whole logits of uneven widths) through the
  pipes, which also end at once when a peer process dies.
- `nccl_backend`: a rank's TPCudaBackend over NCCL (nccl.NcclCommunicator on the backend's
  stream, capturable); on one GPU, a group of one rank runs the same path inside a captured
  decode graph.
- `process_comm`, `rank_factory`: the communicator a group of ranks in processes takes and
  the factory of a CUDA rank's backend in its process (workers.py).

CuPy is imported where an array is copied, never at import, so the engine loads without it.
"""

from __future__ import annotations

import numpy as np

from ..errors import BrassError
from .comm import Communicator, on_host

BACKENDS = ("numpy", "cuda")
COMMS = {"numpy": ("thread",), "cuda": ("host",)}
# ranks in processes: the first is the default
PROCESS_COMMS = {"numpy": ("pipes",), "cuda": ("nccl", "host")}


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

    def close(self, why: str = "closed"):
        close = getattr(self.host, "close", None)
        if close is not None:
            close(why)


class NcclRank(Communicator):
    """A CUDA rank in its own process: device arrays through NCCL (`nccl`, on the backend's
    stream: `use_stream`), host arrays through the CPU pipes (`pipes`, a PipeCommunicator: the
    same sums and gathers as the numpy ranks, arrays of uneven widths included, which NCCL's
    all-gather does not take). A layer split's hand-over: its header through the pipes, the
    device arrays through NCCL's send / recv_into. Capturable: a step's collectives on device
    arrays queue on the stream and never wait for the host."""

    capturable = True

    def __init__(self, nccl, pipes):
        self.nccl, self.pipes = nccl, pipes
        self.rank, self.world_size = pipes.rank, pipes.world_size

    _host = staticmethod(on_host)

    def use_stream(self, stream):
        self.nccl.stream = stream

    def all_reduce(self, x):
        return self.pipes.all_reduce(x) if self._host(x) else self.nccl.all_reduce(x)

    def all_gather(self, x, axis: int = -1):
        return self.pipes.all_gather(x, axis) if self._host(x) else self.nccl.all_gather(x, axis)

    def send(self, x, dst: int):
        # a host array through the pipes (recv); a device array through NCCL, on the stream
        # (recv_into: the receiver knows its shape from what came before it, the layer split's
        # header, tp.Stage)
        if self._host(x):
            self.pipes.send(x, dst)
        else:
            self.nccl.send(x, dst)

    def recv(self, src: int):
        return self.pipes.recv(src)

    def recv_into(self, out, src: int):
        return self.nccl.recv_into(out, src)

    def barrier(self):
        self.pipes.barrier()

    def close(self, why: str = "closed"):
        self.pipes.close(why)

    def abort(self):
        """A peer died: NCCL does not see it by itself, so the collectives this rank queued
        would wait on the device for ever; abandon them (they then return)."""
        self.nccl.abort()


def _chosen(backend: str, comm: str | None, table: dict, ranks_in: str) -> str:
    """The communicator named for ranks of `backend` in threads or processes (`table`: those it
    takes, its default first); one-line errors for an unknown backend or communicator."""
    if backend not in BACKENDS:
        raise BrassError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    comm = comm or table[backend][0]
    if comm not in table[backend]:
        raise BrassError(f"the {backend} ranks in {ranks_in} take the communicator "
                         f"{' or '.join(repr(c) for c in table[backend])}, not {comm!r}")
    return comm


def process_comm(backend: str, comm: str | None, world: int, count: int,
                 env: str | None = None) -> str:
    """The communicator of `world` ranks in processes on `backend` (comm None: its default),
    with `count` GPUs visible: "pipes" (numpy), "nccl" (a GPU per rank) or "host" (CUDA ranks
    staged through the host pipes, any number sharing one GPU). One-line errors for the rest,
    before any process starts."""
    comm = _chosen(backend, comm, PROCESS_COMMS, "processes")
    if backend == "numpy":
        return comm
    if count < 1:
        raise BrassError("CUDA ranks need CuPy and an NVIDIA GPU; none was found (use backend='numpy')")
    if comm == "nccl" and world > count:
        seen = f" (CUDA_VISIBLE_DEVICES={env})" if env is not None else ""
        raise BrassError(f"comm 'nccl' needs a GPU per rank (NCCL cannot put two ranks of one "
                         f"communicator on one device): {world} ranks, {count} GPU{'s' if count != 1 else ''} "
                         f"visible{seen}; comm 'host' runs them on one GPU")
    return comm


def rank_factory(device: int):
    """The factory `make(comm, plan)` of a CUDA rank's backend in its process (tp.make_rank): a
    TPCudaBackend on `device`, its communicator's NCCL calls on the backend's stream."""
    def make(comm, plan):
        from ..backends.cuda.sharded import TPCudaBackend
        b = TPCudaBackend(comm, plan, device)
        use = getattr(comm, "use_stream", None)
        if use is not None:
            use(b.stream)
        return b
    return make


def rank_backends(backend: str, comm: str | None, comms: list):
    """(each rank's communicator, the factory `make(comm, plan)` of a rank's backend) for a
    TPModel of ranks in threads: `backend` "numpy" over the CPU communicator ("thread"), or
    "cuda" on one GPU over the host-staged one ("host"). One-line errors for the rest."""
    comm = _chosen(backend, comm, COMMS, "threads")
    if backend == "numpy":
        from .tp import TPBackend
        return comms, TPBackend
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
