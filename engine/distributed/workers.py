"""One process per rank (issue 49): rank 0 is the process the user started; it spawns the other
N - 1 ranks as worker processes and drives them, one small Command a call (tp.Command: the
session, the token ids and positions, the rows wanted; new session, reset, free). Every rank
runs the same `Rank.handle`, the collectives inside, over its own communicator.

    rank 0 (this process)                       worker r (spawned)
    ProcessRanks.__init__: pipes, spawn  ─────▶ worker_main(spec, ctrl, ends)
                                                  signals: Ctrl-C is rank 0's to handle
                                                  communicator(spec, ends)   (spec.uid: NCCL's id)
                                                  make_rank → (0, "ready", None)
    call(cmd): (seq, cmd) to every worker ─────▶  rank.handle(cmd) ──▶ (seq, "ok", result)
               rank 0's handle(cmd) in a thread     or (seq, "err", (line, aborted))
               the workers' replies, or deaths    (collectives between the ranks, over `ends`)

CUDA ranks (`WorkerSpec.backend` "cuda") keep all of this and swap three things: the device,
selected before any CUDA call (`select_device`; `rank_device`, CUDA_VISIBLE_DEVICES order), the
communicator (`communicator()`: "nccl", cuda_rank.NcclRank over `spec.uid`, the unique id rank 0
makes before spawning, or "host", device arrays staged through the pipes, for ranks sharing one
GPU) and the rank's backend (TPCudaBackend: cuda_rank.rank_factory). `group_specs` makes every
rank's spec, its one-line refusals included, before any process starts; rank 0 builds its own
rank from its spec in a thread while the workers load (NCCL's start waits for every rank). NCCL
does not see a dead peer: a worker that ends while rank 0 waits in its part of a call aborts
rank 0's communicator (`_local`), and a CUDA worker ends with rank 0's process.

Each command travels as (seq, cmd), seq counting the calls, and each reply as (seq, kind,
value): a reply to another call than the one in progress is seen as such, never taken for its
answer. Rank 0 writes the commands from a sender thread per worker (as the communicator does),
so a worker that hangs without reading cannot block it: the reply's deadline (`timeout`)
bounds every call. A Ctrl-C in rank 0's main thread during a call is held until the call is
over on every rank, then raised (the ranks are never left mid-step); during the start it
stops the workers at once. Anything else escaping a call half-way fails the group.

Failure, never a hang: a worker that raises replies with its error (one line naming its rank)
and exits; one that is killed ends its pipes. Either way the peers' collectives raise
CommAborted at once (comm.PipeCommunicator), rank 0 closes its own pipes (every rank still
waiting then sees the end), collects what each worker said or how it ended, stops them all,
and raises one BrassError naming the rank that failed first and why. The group is then spent:
every later call raises the same error. A worker that dies between calls is seen by a watcher
thread, which does the same and calls `on_failure(why)` (the server stops on it). A worker
whose rank 0 ends (closed, killed) reads the end of its control pipe and exits: no orphans.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

from ..errors import BrassError
from .comm import TIMEOUT_S, CommAborted, PipeCommunicator, ProcessGroup
from .tp import _BlasThreads, make_rank

# After a rank failed, how long rank 0 waits for the others to say why or to end before it
# stops them: their collectives fail at once when a pipe ends, so this is only a bound.
GRACE_S = 5.0


@dataclass
class WorkerSpec:
    """What a rank's process is started with (rank 0's too: it builds its rank the same way)."""
    rank: int
    world_size: int
    path: str
    split: str
    uid: object = None          # the rendezvous: NCCL's unique id from rank 0 (CPU pipes: none)
    device: int | None = None   # the rank's CUDA device index (rank_device); None on numpy
    comm: str = "pipes"         # "pipes" (numpy), or on cuda "nccl" (a GPU each) or "host"
    backend: str = "numpy"      # "numpy" (tp.TPBackend) or "cuda" (TPCudaBackend on `device`)


def visible_devices(env: str | None) -> list[str] | None:
    """The entries of a CUDA_VISIBLE_DEVICES value, in order (None: unset, every device). As
    the CUDA runtime reads it: comma-separated indices or UUIDs, the list ending at the first
    invalid entry (a negative index, an empty entry)."""
    if env is None:
        return None
    out = []
    for e in env.split(","):
        e = e.strip()
        if not e or (e.lstrip("-").isdigit() and int(e) < 0):
            break
        out.append(e)
    return out


def rank_device(local_rank: int, world: int, count: int, env: str | None = None) -> tuple[int, str]:
    """(the CUDA device index rank `local_rank` selects in its process, the device it names in
    CUDA_VISIBLE_DEVICES terms). Every process sees the devices CUDA_VISIBLE_DEVICES lists, in
    its order, numbered from 0 (`count` of them), and rank r takes the r-th: with
    CUDA_VISIBLE_DEVICES=2,3 rank 0 runs on GPU 2 and rank 1 on GPU 3. A one-line error where
    there are fewer devices than ranks."""
    entries = visible_devices(env)
    if world > count:
        seen = f" (CUDA_VISIBLE_DEVICES={env})" if env is not None else ""
        raise BrassError(f"--tp {world} needs {world} GPUs; this process sees {count}{seen} "
                         f"(or run the ranks on the CPU: --backend numpy)")
    if not 0 <= local_rank < world:
        raise BrassError(f"rank {local_rank} is not one of the {world} ranks")
    name = entries[local_rank] if entries is not None and local_rank < len(entries) else str(local_rank)
    return local_rank, name


def group_specs(path, world: int, split: str, backend: str = "numpy", comm: str | None = None,
                count: int = 0, env: str | None = None) -> list[WorkerSpec]:
    """Every rank's spec, in rank order (rank 0's is this process's), before any process starts:
    the communicator (cuda_rank.process_comm: its one-line refusals), each rank's device (nccl:
    rank r on the r-th visible GPU, rank_device; host: the visible GPUs in turn, so that on one
    GPU every rank shares it) and, for nccl, the unique id made here once, on rank 0, and handed
    to every rank."""
    from .cuda_rank import process_comm
    comm = process_comm(backend, comm, world, count, env)
    uid = None
    if comm == "nccl":
        from . import nccl
        uid = nccl.unique_id()
    specs = []
    for r in range(world):
        device = None
        if backend == "cuda":
            device = rank_device(r, world, count, env)[0] if comm == "nccl" else r % count
        specs.append(WorkerSpec(r, world, str(path), split, uid=uid, device=device, comm=comm, backend=backend))
    return specs


def select_device(spec: WorkerSpec):
    """A CUDA rank's device made current in this thread, before anything else touches CUDA (a
    one-line error where this process has no GPU or CuPy)."""
    if spec.backend != "cuda":
        return
    from ..backends import cuda_available
    if not cuda_available():
        raise BrassError(f"rank {spec.rank}: CUDA ranks need CuPy and an NVIDIA GPU; this process "
                         f"found none")
    import cupy
    cupy.cuda.Device(spec.device).use()


def communicator(spec: WorkerSpec, ends, timeout: float = TIMEOUT_S):
    """The rank's communicator (its device already current, select_device): the CPU pipes; on
    cuda "host" (the pipes, device arrays staged through the host) or "nccl" (NCCL over
    `spec.uid` for device arrays, the pipes for host ones)."""
    if spec.comm not in ("pipes", "host", "nccl"):
        raise BrassError(f"no communicator {spec.comm!r}")
    pipes = PipeCommunicator(ends, timeout)
    if spec.comm == "pipes":
        return pipes
    from .cuda_rank import HostStagedCommunicator, NcclRank
    if spec.comm == "host":
        return HostStagedCommunicator(pipes)
    try:
        from .nccl import NcclCommunicator
        return NcclRank(NcclCommunicator(spec.world_size, spec.uid, spec.rank), pipes)
    except BaseException:
        pipes.close("NCCL did not start")
        raise


def build_rank(spec: WorkerSpec, ends, timeout: float = TIMEOUT_S):
    """(the communicator, the rank) of `spec` in this process: device, communicator, shards."""
    select_device(spec)
    comm = communicator(spec, ends, timeout)
    try:
        factory = None
        if spec.backend == "cuda":
            from .cuda_rank import rank_factory
            factory = rank_factory(spec.device)
        return comm, make_rank(spec.path, comm, spec.split, factory)
    except BaseException:
        comm.close("the rank did not load")
        raise


def _exit_with_parent():
    """A CUDA worker ends when rank 0's process does: a collective it queued on the device may
    wait there for ever for a rank that is gone (NCCL does not see a dead peer), where the CPU
    pipes would have ended."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="brass-parent-watch").start()


def one_line(rank: int, e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return text if isinstance(e, BrassError) and text.startswith(f"rank {rank}") else \
        f"rank {rank}: {type(e).__name__}: {text}"


class _DaemonExecutor:
    """One daemon thread running submitted calls in order, each answered through a Future:
    rank 0's part of a call. Not a ThreadPoolExecutor, whose threads the interpreter joins at
    exit: a rank 0 stuck in a device wait for a peer that hung (an NCCL collective NCCL's abort
    did not end) would then hold the process after its one-line error."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def _run(self):
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:      # (handed to the caller, as a pool does)
                    fut.set_exception(e)

    def submit(self, fn, *args) -> Future:
        fut = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self, wait: bool = False):
        self._jobs.put(None)


def worker_main(spec: WorkerSpec, ctrl, ends):
    """A worker process: build the rank, say (0, "ready", None), then run rank 0's commands
    ((seq, cmd), each answered (seq, "ok", result)) until it says stop (None) or its control
    pipe ends; after an error, say it ((seq, "err", (line, whether a CommAborted))) and exit
    (closing the pipes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches every process; rank 0 acts
    comm, seq = None, 0
    try:
        if spec.backend == "cuda":
            _exit_with_parent()
        blas = _BlasThreads()       # the ranks are the parallelism (tp._BlasThreads)
        blas.__enter__()
        comm, rank = build_rank(spec, ends)
        ctrl.send((0, "ready", None))
        while True:
            try:
                msg = ctrl.recv()
            except (EOFError, OSError):
                return                  # rank 0 is gone
            if msg is None:
                return
            seq, cmd = msg
            out = rank.handle(cmd)
            # a step's result from the rank holding it only (the logits are the same on each)
            ctrl.send((seq, "ok", out if cmd.op != "step" or spec.rank == rank.result_rank else None))
    except BaseException as e:
        try:
            ctrl.send((seq, "err", (one_line(spec.rank, e), isinstance(e, CommAborted))))
        except (OSError, ValueError):
            pass
        # NCCL's collectives this rank queued before it failed wait on the device for peers
        # that will not come: abandon them, so that freeing the device at exit does not wait
        with contextlib.suppress(Exception):
            getattr(comm, "abort", lambda: None)()
    finally:
        if comm is not None and hasattr(comm, "close"):
            comm.close("exited")


def exit_cause(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _died(w) -> str:
    w.proc.join(1.0)            # its sentinel is ready: the exit status is there to read
    return f"rank {w.rank} died ({exit_cause(w.proc.exitcode)})"


class Failure(NamedTuple):
    """What one rank's part of a call came to, in one line (`why`), and what it was (`kind`):
    "error" (its own error), "died" (its process ended without a word), "odd" (a reply not
    due), "aborted" (a CommAborted: its collective was abandoned because another rank failed)
    or "silent" (no reply by the deadline)."""
    why: str
    kind: str


class _Worker:
    """A worker process, its control pipe, and the thread that writes rank 0's commands to it
    (a command beyond the pipe's buffer blocks its writer until the worker reads: the thread
    holds that wait, rank 0 holds only the reply's deadline)."""

    def __init__(self, rank: int, proc, ctrl):
        self.rank, self.proc, self.ctrl = rank, proc, ctrl
        self._out: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_all, daemon=True, name=f"brass-ctrl-to-{rank}")
        self._sender.start()

    def post(self, msg):
        """Send `msg` (a command pickled, or None: stop) through the sender thread; after None
        it sends no more."""
        self._out.put(msg)

    def _send_all(self):
        while True:
            msg = self._out.get()
            try:
                if msg is None:
                    self.ctrl.send(None)
                    return
                self.ctrl.send_bytes(msg)      # what the worker's ctrl.recv() unpickles
            except Exception:   # the worker is gone: how it ended is read from its process
                return

    def close(self):
        """Close the control pipe once the sender is done (the worker ended: a send blocked in it
        fails at once); a sender still blocked keeps it, for process exit to close."""
        self._out.put(None)
        self._sender.join(1.0)
        if not self._sender.is_alive():
            self.ctrl.close()


@contextlib.contextmanager
def _sigint_held():
    """In the main thread, a Ctrl-C (SIGINT) within the block is held and delivered when the
    block ends without an exception (to the handler there was: KeyboardInterrupt by default).
    Elsewhere, or where SIGINT's handler was not set from Python, nothing is held: no
    KeyboardInterrupt is raised outside the main thread."""
    old = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if old is None:
        yield
        return
    came = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if came:
        signal.raise_signal(signal.SIGINT)


class ProcessRanks:
    """Rank 0 in this process, ranks 1..N-1 in worker processes (multiprocessing's spawn: a
    fresh interpreter, as CUDA needs; a script that makes one therefore needs the `if
    __name__ == "__main__":` guard multiprocessing asks for). `call(cmd)` runs a command on
    every rank: the results in rank order (of a step, None but for rank 0 and the rank whose
    result it returns)."""

    def __init__(self, path, world: int, split: str, timeout: float = TIMEOUT_S,
                 backend: str = "numpy", comm: str | None = None, count: int = 0, env: str | None = None):
        """`backend` "numpy" over the pipes, or "cuda" over `comm` "nccl" (default: a GPU per
        rank) or "host" (staged through the pipes; ranks may share a GPU); `count`, `env`: the
        GPUs this process sees and CUDA_VISIBLE_DEVICES (group_specs)."""
        ctx = multiprocessing.get_context("spawn")
        self.world, self.timeout = world, timeout
        self._on_failure = None
        self.failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._notify_lock = threading.Lock()
        self._notified = self._due = False     # told on_failure; a failure found no one to tell
        self._seq = 0
        self.workers: list[_Worker] = []
        # every refusal (communicator, devices) before a process starts; NCCL's id made once here
        self.specs = group_specs(path, world, split, backend, comm, count, env)
        self._done_r, self._done_w = ctx.Pipe(duplex=False)    # rank 0's part of a call is over
        group = ProcessGroup(world, ctx)
        builder = None
        try:
            for r in range(1, world):
                ctrl, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(self.specs[r], child, group.ends(r)),
                                name=f"brass-rank-{r}", daemon=True)
                _start_without_sigint(p)
                child.close()
                group.release(r)
                self.workers.append(_Worker(r, p, ctrl))
            # rank 0 built in a thread while the workers load: NCCL's start returns only once
            # every rank has joined, so a worker failing meanwhile must be seen from here
            builder = _Builder(self.specs[0], group.ends(0), timeout)
            self._pool = _DaemonExecutor("brass-rank-0")
            self._blas = _BlasThreads() if world > 1 else None
            # a Ctrl-C here raises at once: the workers are only loading, nothing to see through
            _, errors = self._collect(0, "ready", timeout, builder)
            if builder.error is not None or errors:
                raise BrassError(self._cause(builder.error, errors))
            self.comm, self.rank0 = builder.result
            self.local = [self.rank0]
        except BaseException:
            self.failure = "the ranks did not start"
            if builder is not None:
                builder.abandon()
            self._stop(grace=0.0)
            raise
        # stopped before multiprocessing's own exit hook terminates them (atexit runs the hooks
        # last registered first), so that the watcher does not take that for a death
        atexit.register(self.close)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="brass-rank-watcher")
        self._watcher.start()

    @property
    def on_failure(self):
        """Called once with the failure's line when the group fails (a call's or a worker's
        death between calls); set after the failure, it is called at once."""
        return self._on_failure

    @on_failure.setter
    def on_failure(self, fn):
        with self._notify_lock:
            self._on_failure = fn
            now = fn is not None and self._due and not self._notified
            self._notified |= now
        if now:
            fn(self.failure)

    # -- one call -------------------------------------------------------------------------------
    def call(self, cmd) -> list:
        with _sigint_held(), self._lock:
            if self.failure is not None:
                raise BrassError(self.failure)
            self._seq += 1
            try:
                return self._call(self._seq, cmd)
            except BaseException as e:
                if self.failure is None:    # cut short: ranks may be mid-step, replies unread
                    text = " ".join(str(e).split())
                    self._fail(f"rank 0: a call was cut short by {type(e).__name__}" + (f": {text}" if text else ""))
                raise

    def _call(self, seq: int, cmd) -> list:
        msg = ForkingPickler.dumps((seq, cmd))     # here, once: a command that does not pickle
        for w in self.workers:                      # fails the call, not a sender thread
            w.post(msg)
        with self._blas or contextlib.nullcontext():
            fut = self._pool.submit(self.rank0.handle, cmd)
            local_error = self._local(fut)
        if local_error is not None:
            self.comm.close("rank 0 failed")    # every rank waiting on rank 0 sees it
        replies, errors = self._collect(seq, "ok", GRACE_S if local_error is not None else self.timeout)
        if local_error is not None or errors:
            self._fail(self._cause(local_error, errors))
            raise BrassError(self.failure)
        results = [fut.result()] + [None] * (self.world - 1)
        for r, v in replies.items():
            results[r] = v
        return results

    def _local(self, fut):
        """Rank 0's part of a call: its exception (None when it ran). Over a communicator that
        can be aborted (NCCL: a collective waits on the device for a peer that is gone, which
        NCCL does not see), a worker that ends meanwhile aborts it, so that rank 0 returns."""
        abort = getattr(self.comm, "abort", None)
        if abort is None:
            return fut.exception()
        fut.add_done_callback(self._local_done)
        # bounded as the replies are: a worker that hangs without ending (its collective never
        # issued) would hold rank 0 in a device wait that NCCL never times out
        ready = wait([self._done_r] + [w.proc.sentinel for w in self.workers], timeout=self.timeout)
        if self._done_r not in ready:           # a worker ended, or none answered in time
            abort()
            if not self._done_r.poll(GRACE_S):
                return BrassError("rank 0: its collectives did not end after NCCL's abort")
            if not ready:
                self._done_r.recv()
                return BrassError(f"rank 0: its collectives did not end in {self.timeout:g} s "
                                  f"(a rank hangs); NCCL's communicator was aborted")
        self._done_r.recv()
        return fut.exception()

    def _local_done(self, fut):
        with contextlib.suppress(OSError, ValueError):     # (closed: the group was stopped)
            self._done_w.send(None)

    def _collect(self, seq: int, due: str, timeout: float, builder=None):
        """Each worker's reply to call `seq` of kind `due` ({rank: value}), or what came instead
        ({rank: Failure}: its error, how it ended, a reply not due), waiting at most `timeout`
        (those still silent then: "no reply in ... s"). With `builder` (rank 0's start), also
        until rank 0 is built, and no longer once it failed."""
        pending = {w.rank: w for w in self.workers}
        replies, errors = {}, {}
        deadline = time.monotonic() + timeout
        local = [builder.done] if builder is not None else []
        while pending or local:
            left = deadline - time.monotonic()
            ready = wait([w.ctrl for w in pending.values()] + [w.proc.sentinel for w in pending.values()]
                         + local, timeout=max(left, 0))
            if not ready:
                for r in pending:
                    errors[r] = Failure(f"rank {r}: no reply in {timeout:.0f} s", "silent")
                if local:
                    builder.error = BrassError(f"rank 0: not built in {timeout:.0f} s")
                break
            if local and local[0] in ready:
                local = []
                if builder.error is not None:
                    break
            for r, w in list(pending.items()):
                if w.ctrl in ready or w.ctrl.poll():
                    try:
                        got, kind, value = w.ctrl.recv()
                    except (EOFError, OSError):
                        errors[r] = Failure(_died(w), "died")
                    else:
                        if kind == "err":
                            errors[r] = Failure(value[0], "aborted" if value[1] else "error")
                        elif (got, kind) != (seq, due):
                            errors[r] = Failure(f"rank {r}: a reply ({kind!r}) to call {got} where "
                                                f"call {seq}'s ({due!r}) was due", "odd")
                        else:
                            replies[r] = value
                    del pending[r]
                elif w.proc.sentinel in ready:
                    errors[r] = Failure(_died(w), "died")
                    del pending[r]
            if builder is not None and errors:
                break       # at the start: the other ranks may wait in NCCL's start for it
        return replies, errors

    def _dead(self) -> dict:
        """What the workers that ended said before (an error) or how they ended."""
        out = {}
        for w in self.workers:
            if not wait([w.proc.sentinel], timeout=0):
                continue                # (its sentinel, not is_alive: a process's pipes close
            msg = None                  # a moment before it can be reaped)
            try:
                if w.ctrl.poll():
                    msg = w.ctrl.recv()
            except (EOFError, OSError):
                pass
            if msg is not None and msg[1] == "err":
                out[w.rank] = Failure(msg[2][0], "aborted" if msg[2][1] else "error")
            else:
                out[w.rank] = Failure(_died(w), "died")
        return out

    @staticmethod
    def _cause(local_error, errors: dict) -> str:
        """The first failure, in one line: a rank's own error before a death without a word,
        before a reply not due, before the CommAborted that the others' collectives then
        raised (or their silence)."""
        if local_error is not None and not isinstance(local_error, CommAborted):
            return one_line(0, local_error)
        for kind in ("error", "died", "odd"):
            for r in sorted(errors):
                if errors[r].kind == kind:
                    return errors[r].why
        if local_error is not None:
            return one_line(0, local_error)
        return errors[min(errors)].why if errors else "a rank failed"

    # -- failure and shutdown -------------------------------------------------------------------
    def _fail(self, why: str):
        if self.failure is None:
            self.failure = why
        self._stop()
        self._notify()

    def _notify(self):
        with self._notify_lock:
            fn = self._on_failure
            if self._notified:
                return
            self._due = fn is None
            self._notified = fn is not None
        if fn is not None:
            fn(self.failure)

    def _watch(self):
        """A worker that ends between calls fails the group at once (in a call, `call` sees it)."""
        sentinels = [w.proc.sentinel for w in self.workers]
        if not sentinels:
            return
        wait(sentinels)
        if self._closing:
            return
        with self._lock:
            if self._closing:
                return
            if self.failure is None:
                self.failure = self._cause(None, self._dead())
            self._stop()
        self._notify()

    def _stop(self, grace: float = 2.0):
        """Stop every worker: ask, wait `grace` seconds, then terminate (then kill)."""
        self._closing = True
        atexit.unregister(self.close)       # nothing left to close: the group may be freed
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.close("stopped")
        if grace > 0:
            for w in self.workers:
                w.post(None)
            deadline = time.monotonic() + grace
            for w in self.workers:
                w.proc.join(max(deadline - time.monotonic(), 0.05))
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(1.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1.0)
        for w in self.workers:
            w.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        self._done_w.close()
        self._done_r.close()

    def close(self):
        atexit.unregister(self.close)
        if self._closing:
            return
        if self.failure is None:
            self.failure = "the model was closed"
        self._stop()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]


class _Builder:
    """Rank 0's rank built in a thread of its own (build_rank): `result` (comm, rank) or
    `error` once `done` (a connection) is readable."""

    def __init__(self, spec: WorkerSpec, ends, timeout: float):
        self.done, self._say = multiprocessing.Pipe(duplex=False)
        self.result = self.error = None
        self._abandoned = False
        threading.Thread(target=self._run, args=(spec, ends, timeout), daemon=True,
                         name="brass-rank-0-start").start()

    def _run(self, spec, ends, timeout):
        try:
            self.result = build_rank(spec, ends, timeout)
        except BaseException as e:
            self.error = e
        if self._abandoned and self.result is not None:
            self.result[0].close("the ranks did not start")
        with contextlib.suppress(OSError):
            self._say.send(None)

    def abandon(self):
        """The start failed elsewhere: the rank, when built, lets its pipes go."""
        self._abandoned = True
        if self.result is not None:
            self.result[0].close("the ranks did not start")


def _start_without_sigint(p):
    """Start a worker with Ctrl-C ignored from its first instruction (an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler): a Ctrl-C in
    the terminal reaches every process of the group, and rank 0 alone decides what it stops."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        p.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
