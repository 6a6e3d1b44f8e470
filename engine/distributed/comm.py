"""The communicator: what the ranks of one model exchange, and nothing else.

`Communicator` is the interface both implementations give: `rank`, `world_size`,
`all_reduce(x)` (a sum), `all_gather(x, axis)` (the ranks' arrays concatenated in rank order),
`send(x, dst)` / `recv(src)` (the layer split's hidden state) and `barrier()`.

`ThreadGroup(n)` makes the CPU one: numpy ranks in threads of one process. Its all-reduce
adds the ranks' arrays in rank order (rank 0's, plus rank 1's, ...) in float32, the same
order on every rank, so every rank holds the same bits and a run gives the same bits every
time; it is what the conformance suite runs TP=2 and TP=4 with. A rank whose step raises
`abort()`s the group: the other ranks' collectives raise CommAborted instead of waiting for
it forever. The NCCL one (nccl.py) has the same interface over device arrays.

`ProcessGroup(n)` makes the CPU one for ranks in processes (one process per rank, as the
CUDA path runs: workers.py): a one-way pipe for each ordered pair of ranks; `ends(r)` is what
rank r's process takes, `PipeCommunicator` its communicator. Its all-reduce adds the same
arrays in the same order as ThreadGroup's, so the two give the same bits. A peer whose process
ends (killed, or its step raised and it exited) closes its pipes: the others' next read from
it raises CommAborted at once; a peer that hangs is given up after TIMEOUT_S.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from abc import ABC, abstractmethod

import numpy as np

from ..errors import BrassError

# A collective that waits longer than this for the other ranks gives up: a rank that hangs
# (not one that raised: that aborts the group at once) takes the step down instead of the
# process. Generous: a numpy rank's layer can take seconds on a large model.
TIMEOUT_S = 600.0


class CommAborted(BrassError):
    """Another rank of the group failed: this rank's collective was abandoned."""


def on_host(x) -> bool:
    """Whether x is a host value (a numpy array or scalar), as the CPU communicators carry;
    anything else is a device array (CuPy's). By exact type, not isinstance: the CPU tests'
    fake CuPy arrays subclass numpy's."""
    return type(x) is np.ndarray or np.isscalar(x)


class Communicator(ABC):
    rank: int
    world_size: int
    # Whether its collectives can be captured in a CUDA graph (queued on the device stream with
    # no host synchronisation): NCCL's can; a CPU or host-staged one cannot.
    capturable = False

    @abstractmethod
    def all_reduce(self, x):
        """The sum of every rank's `x` (same shape on every rank), on every rank."""

    @abstractmethod
    def all_gather(self, x, axis: int = -1):
        """Every rank's `x` concatenated along `axis` in rank order, on every rank (the
        arrays may differ in size along `axis` only)."""

    @abstractmethod
    def send(self, x, dst: int):
        """Hand `x` to rank `dst` (its matching recv)."""

    @abstractmethod
    def recv(self, src: int):
        """The array rank `src` sent this rank, in the order it sent them."""

    @abstractmethod
    def barrier(self):
        """Return once every rank has called it."""


class ThreadGroup:
    """The shared state of `n` CPU ranks in threads; `comm(r)` is rank r's communicator."""

    def __init__(self, n: int, timeout: float = TIMEOUT_S):
        if n < 1:
            raise BrassError(f"a group needs at least one rank, got {n}")
        self.n = n
        self.timeout = timeout
        self._barrier = threading.Barrier(n, timeout=timeout)
        self._slots: list = [None] * n
        self._queues = {(s, d): queue.Queue() for s in range(n) for d in range(n) if s != d}
        self.aborted: str | None = None
        self._comms = [ThreadCommunicator(self, r) for r in range(n)]

    def comm(self, rank: int) -> "ThreadCommunicator":
        return self._comms[rank]

    def abort(self, why: str):
        """A rank failed: every rank waiting in a collective raises CommAborted."""
        if self.aborted is None:
            self.aborted = why
        self._barrier.abort()
        for q in self._queues.values():
            q.put(None)                 # wakes a recv; None is never a sent array

    def reset(self):
        """Make the group usable again after an abort (between steps, no rank inside)."""
        self.aborted = None
        self._barrier.reset()
        self._slots = [None] * self.n
        for q in self._queues.values():
            while not q.empty():
                q.get_nowait()

    def _wait(self):
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CommAborted(f"another rank failed: {self.aborted or 'a collective timed out'}") from None


class ThreadCommunicator(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.n

    def _exchange(self, x) -> list:
        """Every rank's array, in rank order (each rank reads them; none is written until every
        rank has read: the second wait)."""
        g = self.group
        if g.n == 1:
            return [x]
        g._slots[self.rank] = x
        g._wait()
        got = list(g._slots)
        g._wait()
        return got

    def all_reduce(self, x):
        parts = self._exchange(np.asarray(x, np.float32))
        out = parts[0].copy()
        for p in parts[1:]:             # rank order, on every rank: the same bits everywhere
            out += p
        return out

    def all_gather(self, x, axis: int = -1):
        return np.concatenate(self._exchange(np.asarray(x)), axis=axis)

    def send(self, x, dst: int):
        self.group._queues[(self.rank, dst)].put(np.array(x, copy=True))

    def recv(self, src: int):
        try:
            x = self.group._queues[(src, self.rank)].get(timeout=self.group.timeout)
        except queue.Empty:
            raise CommAborted(f"rank {self.rank}: nothing from rank {src} in "
                              f"{self.group.timeout:.0f} s") from None
        if x is None:
            raise CommAborted(f"another rank failed: {self.group.aborted}")
        return x

    def barrier(self):
        self.group._wait()


# -- ranks in processes -------------------------------------------------------------------------

@dataclass
class PipeEnds:
    """Rank `rank`'s ends of a ProcessGroup's pipes: `readers[s]` reads what rank s sends it,
    `writers[d]` writes to rank d. Picklable: handed to the rank's process when it starts."""
    rank: int
    world_size: int
    readers: dict
    writers: dict

    def close(self):
        for c in (*self.readers.values(), *self.writers.values()):
            c.close()


class ProcessGroup:
    """The pipes of `n` CPU ranks in processes: one one-way pipe per ordered pair of ranks
    (made here, in rank 0's process, before the others start). After handing `ends(r)` to
    rank r's process, `release(r)` closes this process's copies, so that the pipes end when
    that process does (a read from a dead rank then sees the end of the pipe, not a wait)."""

    def __init__(self, n: int, ctx=None):
        import multiprocessing
        if n < 1:
            raise BrassError(f"a group needs at least one rank, got {n}")
        ctx = ctx or multiprocessing.get_context("spawn")
        self.n = n
        self._pipes = {(s, d): ctx.Pipe(duplex=False) for s in range(n) for d in range(n) if s != d}

    def ends(self, rank: int) -> PipeEnds:
        return PipeEnds(rank, self.n,
                        readers={s: self._pipes[(s, rank)][0] for s in range(self.n) if s != rank},
                        writers={d: self._pipes[(rank, d)][1] for d in range(self.n) if d != rank})

    def release(self, rank: int):
        self.ends(rank).close()


class PipeCommunicator(Communicator):
    """Rank `ends.rank` of a ProcessGroup, in its own process. Every send goes through one
    sender thread per destination, so a rank never blocks writing to a peer that is itself
    writing (a pipe holds ~64 KiB; the ranks of an all-reduce all send before they read)."""

    def __init__(self, ends: PipeEnds, timeout: float = TIMEOUT_S):
        self.ends, self.rank, self.world_size = ends, ends.rank, ends.world_size
        self.timeout = timeout
        self.closed: str | None = None
        self._queues = {d: queue.Queue() for d in ends.writers}
        self._threads = {d: threading.Thread(target=self._sender, args=(d,), daemon=True,
                                             name=f"brass-comm-{self.rank}-to-{d}") for d in ends.writers}
        for t in self._threads.values():
            t.start()

    def _sender(self, dst: int):
        q, conn = self._queues[dst], self.ends.writers[dst]
        while True:
            x = q.get()
            if x is None:
                return
            try:
                conn.send(x)
            except Exception:   # the peer is gone (its read end closed), or the pipe was
                return          # closed: what it missed, no one waits for (never a traceback
                                # from a thread at shutdown)

    def _put(self, x, dst: int, copy: bool = True):
        if self.closed is not None:
            raise CommAborted(f"rank {self.rank}: the communicator is closed ({self.closed})")
        self._queues[dst].put(np.array(x, copy=True) if copy else x)   # sent later: the caller may reuse x

    def _get(self, src: int):
        if self.closed is not None:
            raise CommAborted(f"rank {self.rank}: the communicator is closed ({self.closed})")
        conn = self.ends.readers[src]
        try:
            if not conn.poll(self.timeout):
                raise CommAborted(f"rank {self.rank}: nothing from rank {src} in {self.timeout:.0f} s")
            return conn.recv()
        except (EOFError, OSError):
            raise CommAborted(f"rank {self.rank}: rank {src} is gone (its pipe closed)") from None

    def _exchange(self, x) -> list:
        """Every rank's array, in rank order: sent to every peer first, then read from each."""
        mine = np.array(x, copy=True)       # one copy for every sender thread (they only read)
        for d in self._queues:
            self._put(mine, d, copy=False)
        return [x if r == self.rank else self._get(r) for r in range(self.world_size)]

    def all_reduce(self, x):
        parts = self._exchange(np.asarray(x, np.float32))
        out = parts[0].copy()
        for p in parts[1:]:             # rank order, as ThreadCommunicator: the same bits
            out += p
        return out

    def all_gather(self, x, axis: int = -1):
        return np.concatenate(self._exchange(np.asarray(x)), axis=axis)

    def send(self, x, dst: int):
        self._put(x, dst)

    def recv(self, src: int):
        return self._get(src)

    def barrier(self):
        self._exchange(np.zeros(1, np.int8))

    def close(self, why: str = "closed"):
        """Close this rank's pipes: the peers' reads from it end at once (CommAborted)."""
        if self.closed is not None:
            return
        self.closed = why
        for q in self._queues.values():
            q.put(None)
        for t in self._threads.values():
            t.join(timeout=1.0)         # a sender blocked on a full pipe ends when the peer does
        for c in self.ends.readers.values():
            c.close()
        # A writer whose sender is still blocked in it stays open (process exit closes it):
        # closed under the sender, the Connection would fail mid-message in that thread.
        for d, c in self.ends.writers.items():
            if not self._threads[d].is_alive():
                c.close()
