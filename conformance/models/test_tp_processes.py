"""One process per rank (engine/distributed/workers.py, issue 49): the pipe communicator
(comm.ProcessGroup), the ranks of a TPModel in worker processes, their failures, and `--tp` on
the command line, which runs them.

What is held exactly, and why: a rank in a process runs the same code on the same data as a
rank in a thread (Rank.handle), and the pipe communicator adds the ranks' arrays in the same
order as ThreadGroup's (rank 0's + rank 1's + ...), so TP in processes must give the bits of TP
in threads: logits compared with array_equal, tokens with ==. How far TP in threads is from
TP = 1 and from llama.cpp is test_tensor_parallel.py's business.

Failures are held to time bounds far below the communicator's TIMEOUT_S (600 s): a hang would
show as a timeout, not as a slow pass.
"""

from __future__ import annotations

import gc
import multiprocessing
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref

import numpy as np
import pytest

from conformance.harness import goldens
from brass.distributed import workers
from brass.distributed.comm import CommAborted, PipeCommunicator, PipeEnds, ProcessGroup, ThreadGroup
from brass.distributed.tp import Command, TPModel
from brass.distributed.workers import rank_device, visible_devices
from brass.errors import BrassError

# a failure must end the call within this; the group's own timeout is 600 s
FAIL_S = 10.0


# -- the pipe communicator --------------------------------------------------------------------

def _parts(rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s all-reduce input: a value whose sum depends on the order (float32 addition
    does not associate: in rank order ((1e8 + 1) - 1e8) + 1 is 1, any other grouping of these
    gives 0 or 2), then random values of wide range."""
    rng = np.random.default_rng(100 + rank)
    head = np.array([[1e8, 1.0, -1e8, 1.0][rank % 4]], np.float32)
    return np.concatenate([head, (rng.standard_normal(4096) * 10.0 ** rng.integers(-3, 6, 4096)).astype(np.float32)])


def _collectives(comm) -> list:
    r, n = comm.rank, comm.world_size
    out = [comm.all_reduce(_parts(r, n)),
           comm.all_gather(np.arange(r + 1, dtype=np.int64)[None], axis=1),
           comm.all_reduce(np.full((300, 512), r + 0.25, np.float32))]   # beyond a pipe's buffer
    comm.send(np.array([r]), (r + 1) % n)
    out.append(comm.recv((r - 1) % n))
    comm.barrier()
    return out


def _job(ends, what: str, results):
    """A rank in a spawned process (module level: spawn imports it)."""
    comm = PipeCommunicator(ends, timeout=60)
    try:
        if what == "exit":
            return                          # ends without a word: its pipes close
        if what == "hang":
            time.sleep(60)
        results.send(_collectives(comm))
    finally:
        comm.close()


def _group(world: int, what: str, timeout: float = 60):
    """A ProcessGroup: ranks 1.. in spawned processes running `_job(what)`, rank 0's
    communicator here."""
    ctx = multiprocessing.get_context("spawn")
    g = ProcessGroup(world, ctx)
    procs, pipes = [], []
    for r in range(1, world):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_job, args=(g.ends(r), what, theirs), daemon=True)
        p.start()
        theirs.close()
        g.release(r)
        procs.append(p)
        pipes.append(mine)
    return PipeCommunicator(g.ends(0), timeout=timeout), procs, pipes


def _thread_collectives(world: int) -> list:
    g = ThreadGroup(world, timeout=20)
    out = [None] * world
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, _collectives(g.comm(r)))) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_pipe_collectives_give_the_thread_groups_bits_on_every_rank():
    world = 4
    comm, procs, pipes = _group(world, "collectives")
    got = [_collectives(comm)] + [p.recv() for p in pipes]
    comm.close()
    for p in procs:
        p.join(FAIL_S)
    want = _thread_collectives(world)
    ordered = np.float32(0)
    for v in (1e8, 1.0, -1e8, 1.0):
        ordered = np.float32(ordered + np.float32(v))
    for r in range(world):
        assert got[r][0][0] == ordered == 1.0, (r, got[r][0][0])     # summed in rank order
        for a, b in zip(got[r], want[r]):
            assert a.dtype == b.dtype and np.array_equal(a, b), r
        assert np.array_equal(got[r][0], got[0][0])                  # the same bits everywhere
    assert np.array_equal(got[0][1], [[0, 0, 1, 0, 1, 2, 0, 1, 2, 3]])
    assert [int(g[3][0]) for g in got] == [3, 0, 1, 2]


def test_a_peer_that_ends_or_hangs_aborts_the_collective():
    comm, procs, _ = _group(2, "exit")
    procs[0].join(60)                   # timed from its end, not from its (load-dependent) start
    t0 = time.perf_counter()
    with pytest.raises(CommAborted, match="rank 0: rank 1 is gone"):
        comm.all_reduce(np.ones(4, np.float32))
    assert time.perf_counter() - t0 < FAIL_S
    comm.close()
    comm, procs, _ = _group(2, "hang", timeout=1.0)      # the timeout, made short here
    t0 = time.perf_counter()
    with pytest.raises(CommAborted, match="nothing from rank 1 in 1 s"):
        comm.all_reduce(np.ones(4, np.float32))
    assert time.perf_counter() - t0 < FAIL_S
    comm.close()
    for p in procs:
        p.kill()
        p.join(FAIL_S)


# -- devices ----------------------------------------------------------------------------------

def test_rank_device_follows_cuda_visible_devices():
    assert visible_devices(None) is None
    assert visible_devices("2,3") == ["2", "3"]
    assert visible_devices("1,-1,2") == ["1"]           # CUDA stops at the first invalid entry
    assert visible_devices("") == []
    assert rank_device(1, 2, 2, "2,3") == (1, "3")      # index in this process, the GPU it is
    assert rank_device(0, 2, 2, "GPU-aa,GPU-bb") == (0, "GPU-aa")
    assert rank_device(3, 4, 8, None) == (3, "3")
    with pytest.raises(BrassError, match=r"^--tp 4 needs 4 GPUs; this process sees 2 \(CUDA_VISIBLE_DEVICES=2,3\) \(or run the ranks on the CPU: --backend numpy\)$"):
        rank_device(0, 4, 2, "2,3")
    with pytest.raises(BrassError, match=r"^--tp 2 needs 2 GPUs; this process sees 0 \(or run the ranks on the CPU: --backend numpy\)$"):
        rank_device(0, 2, 0, None)


# -- CUDA ranks in processes: the wiring (the GPU runs: test_tensor_parallel_cuda.py) -----------

def test_group_specs_give_each_rank_its_device_and_one_nccl_id(monkeypatch):
    """nccl: rank r on the r-th visible GPU, the unique id made once (on rank 0, before any
    process) and the same object in every rank's spec; host: the visible GPUs in turn (on one
    GPU every rank shares it), no id; numpy: the pipes, no device."""
    from brass.distributed import nccl
    made = []
    monkeypatch.setattr(nccl, "unique_id", lambda: made.append(object()) or made[-1])
    specs = workers.group_specs("m.gguf", 2, "tensor", "cuda", None, count=2, env="2,3")
    assert len(made) == 1 and all(s.uid is made[0] for s in specs)
    assert [(s.rank, s.device, s.comm, s.backend) for s in specs] == [(0, 0, "nccl", "cuda"), (1, 1, "nccl", "cuda")]
    made.clear()
    specs = workers.group_specs("m.gguf", 4, "tensor", "cuda", "host", count=2)
    assert not made and [s.device for s in specs] == [0, 1, 0, 1] and {s.comm for s in specs} == {"host"}
    assert [s.device for s in workers.group_specs("m.gguf", 2, "tensor", "cuda", "host", count=1)] == [0, 0]
    specs = workers.group_specs("m.gguf", 2, "layer", "numpy")
    assert not made and [(s.device, s.comm, s.backend, s.uid) for s in specs] == [(None, "pipes", "numpy", None)] * 2
    # the layer split on cuda: the same devices and communicators as tensor parallelism
    specs = workers.group_specs("m.gguf", 2, "layer", "cuda", "host", count=1)
    assert not made and [(s.device, s.comm, s.split) for s in specs] == [(0, "host", "layer")] * 2
    specs = workers.group_specs("m.gguf", 2, "layer", "cuda", None, count=2)
    assert len(made) == 1 and [(s.device, s.comm, s.split) for s in specs] == [(0, "nccl", "layer"), (1, "nccl", "layer")]


@pytest.mark.parametrize("backend,comm,world,split,count,message", [
    ("cuda", "nccl", 2, "tensor", 1,
     r"^comm 'nccl' needs a GPU per rank \(NCCL cannot put two ranks of one communicator on one device\): "
     r"2 ranks, 1 GPU visible \(CUDA_VISIBLE_DEVICES=0\); comm 'host' runs them on one GPU$"),
    ("cuda", None, 2, "tensor", 0, r"^CUDA ranks need CuPy and an NVIDIA GPU; none was found \(use backend='numpy'\)$"),
    ("cuda", None, 2, "layer", 0, r"^CUDA ranks need CuPy and an NVIDIA GPU; none was found \(use backend='numpy'\)$"),
    ("cuda", "pipes", 2, "tensor", 1, r"^the cuda ranks in processes take the communicator 'nccl' or 'host', not 'pipes'$"),
    ("numpy", "nccl", 2, "tensor", 0, r"^the numpy ranks in processes take the communicator 'pipes', not 'nccl'$"),
    ("rocm", None, 2, "tensor", 0, r"^backend must be one of numpy, cuda, got 'rocm'$"),
])
def test_group_specs_refuse_in_one_line_before_any_id(monkeypatch, backend, comm, world, split, count, message):
    from brass.distributed import nccl
    made = []
    monkeypatch.setattr(nccl, "unique_id", lambda: made.append(1))
    with pytest.raises(BrassError, match=message):
        workers.group_specs("m.gguf", world, split, backend, comm, count=count, env="0")
    assert not made


class _Log:
    """A stand-in communicator that logs each call it gets: (its name, the method)."""

    def __init__(self, name, log):
        self.name, self.log, self.rank, self.world_size = name, log, 1, 2

    def __getattr__(self, method):
        return lambda *a, **k: self.log.append((self.name, method))


def test_an_nccl_rank_sends_device_arrays_to_nccl_and_host_arrays_to_the_pipes():
    """NcclRank: a step's device arrays (here anything not a numpy array, as CuPy's) through
    NCCL, the host arrays (the argmax's two numbers a row, whole logits of uneven widths, a layer
    split's header) through the pipes; its stream set to the backend's; closing closes the
    pipes, abort aborts NCCL. The host-staged communicator over the pipes closes them too."""
    from brass.distributed.cuda_rank import HostStagedCommunicator, NcclRank

    class Device:
        def get(self, stream=None):
            return np.ones(2, np.float32)
    log = []
    c = NcclRank(_Log("nccl", log), _Log("pipes", log))
    assert c.capturable and (c.rank, c.world_size) == (1, 2)
    c.all_reduce(Device()), c.all_reduce(np.ones(2, np.float32))
    c.all_gather(Device()), c.all_gather(np.ones((1, 1, 2)), axis=1)
    c.barrier(), c.close("x"), c.abort()
    assert log == [("nccl", "all_reduce"), ("pipes", "all_reduce"), ("nccl", "all_gather"), ("pipes", "all_gather"),
                   ("pipes", "barrier"), ("pipes", "close"), ("nccl", "abort")]
    c.use_stream("the backend's")
    assert c.nccl.stream == "the backend's"
    # send: a device array through NCCL (the receiver, told its shape by the header before it,
    # takes it with recv_into), a host array through the pipes (recv)
    log.clear()
    c.send(Device(), 0), c.send(np.ones(2, np.float32), 0), c.recv(0), c.recv_into(Device(), 0)
    assert log == [("nccl", "send"), ("pipes", "send"), ("pipes", "recv"), ("nccl", "recv_into")]
    log.clear()
    HostStagedCommunicator(_Log("pipes", log)).close("x")
    assert log == [("pipes", "close")]


def test_cuda_ranks_in_processes_without_a_gpu_are_one_line_and_start_nothing(monkeypatch):
    """No GPU seen (forced, so that it holds on the GPU runner too): TPModel refuses before any
    process starts."""
    from brass.distributed import tp
    started = []
    monkeypatch.setattr(tp, "gpu_count", lambda: 0)
    monkeypatch.setattr(workers, "_start_without_sigint", started.append)
    with pytest.raises(BrassError, match=r"^CUDA ranks need CuPy and an NVIDIA GPU; none was found"):
        TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes", backend="cuda", comm="host")
    assert not started


@pytest.mark.timeout(60)
def test_a_cuda_worker_without_a_gpu_fails_the_group_in_one_line(monkeypatch):
    """Rank 0 on the CPU tests' fake CuPy (it sees one GPU), its worker a fresh interpreter that
    sees none (CUDA_VISIBLE_DEVICES empty: so on a GPU machine too): the worker's start fails
    before any CUDA call, and the group with it, in one line naming the rank, at once, and no
    process is left."""
    from conformance.harness import fake_cupy, launch_recording as lr
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    procs = []
    start = workers._start_without_sigint
    monkeypatch.setattr(workers, "_start_without_sigint", lambda p: (start(p), procs.append(p)))
    with lr.fake_cuda(fake_cupy.Recorder()):
        t0 = time.perf_counter()
        with pytest.raises(BrassError) as e:
            TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes", backend="cuda", comm="host")
        assert time.perf_counter() - t0 < 30       # a worker's start (a fresh interpreter), not a deadline
    assert str(e.value) == "rank 1: CUDA ranks need CuPy and an NVIDIA GPU; this process found none"
    assert len(procs) == 1 and not _alive(procs[0].pid)


class _NcclLike:
    """Rank 0's communicator made to act as NCCL's when a peer is gone: its all-reduce waits (on
    the device, for ever) until `abort()`; everything else is the real one's."""

    def __init__(self, comm):
        self.inner, self.entered, self.aborted = comm, threading.Event(), threading.Event()
        comm.all_reduce = self._all_reduce

    def _all_reduce(self, x):
        self.entered.set()
        if not self.aborted.wait(60):
            raise AssertionError("never aborted")
        raise CommAborted("rank 0: aborted")

    def abort(self):
        self.aborted.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(120)
def test_a_worker_dying_in_an_nccl_collective_aborts_rank_0s():
    """A collective NCCL queued waits on the device for a peer that died (NCCL does not see it):
    rank 0, waiting in one, is aborted as soon as the worker's process ends, and the call fails
    in one line naming it."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    pr = m.group_ranks
    pr.comm = fake = _NcclLike(pr.comm)
    pids = _pids(m)
    err = []

    def step():
        try:
            m.new_session(16).step([1, 2, 3])
        except BaseException as e:
            err.append(e)
    t = threading.Thread(target=step)
    t.start()
    assert fake.entered.wait(FAIL_S)
    t0 = time.perf_counter()
    os.kill(pids[0], signal.SIGKILL)
    t.join(FAIL_S)
    assert not t.is_alive() and time.perf_counter() - t0 < FAIL_S and fake.aborted.is_set()
    assert isinstance(err[0], BrassError) and str(err[0]) == "rank 1 died (killed by SIGKILL)"
    assert not _alive(pids[0])



@pytest.mark.timeout(120)
def test_a_worker_hanging_in_an_nccl_collective_aborts_rank_0s_at_the_deadline():
    """A worker that hangs without ending (stopped here) never issues its side of the
    collective, and NCCL never times out: rank 0's wait is bounded by the call's deadline, at
    which it aborts its communicator and the call fails in one line (no hang, even under a
    held Ctrl-C)."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    pr = m.group_ranks
    pr.comm = fake = _NcclLike(pr.comm)
    pr.timeout = 2.0
    pids = _pids(m)
    session = m.new_session(16)         # (a call of its own, which a stopped worker would not answer)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with pytest.raises(BrassError) as e:
            session.step([1, 2, 3])
        assert fake.entered.is_set() and fake.aborted.is_set()
        # the deadline, then GRACE_S for the silent worker's reply, then its stop: not the
        # 600 s a default deadline would take, nor for ever
        assert time.perf_counter() - t0 < pr.timeout + workers.GRACE_S + FAIL_S
        assert "\n" not in str(e.value) and str(e.value).startswith("rank ")
        assert "did not end in 2 s" in str(e.value) or "no reply in" in str(e.value), str(e.value)
    finally:
        with contextlib.suppress(ProcessLookupError):     # (the failed group stopped it)
            os.kill(pids[0], signal.SIGCONT)
    assert _wait_gone(pids[0])


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + FAIL_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False



def test_a_failing_worker_aborts_its_nccl_collectives(monkeypatch):
    """A worker whose step raises says so and aborts its communicator (NCCL's collectives it
    queued would otherwise wait on the device for peers that will not come, and freeing the
    device at exit with them), then closes it. worker_main run in this process, its rank and
    communicator stand-ins."""
    import multiprocessing
    calls = []

    class Comm:
        def abort(self):
            calls.append("abort")

        def close(self, why):
            calls.append("close")

    class Rank:
        result_rank = 0

        def handle(self, cmd):
            raise RuntimeError("boom")
    monkeypatch.setattr(workers, "build_rank", lambda spec, ends: (Comm(), Rank()))
    monkeypatch.setattr(workers.signal, "signal", lambda *a: None)     # (this process's Ctrl-C)
    monkeypatch.setattr(workers, "_BlasThreads", contextlib.nullcontext)   # (and its BLAS threads)
    ours, theirs = multiprocessing.Pipe()
    ours.send((1, "a command"))
    workers.worker_main(workers.WorkerSpec(1, 2, "m.gguf", "tensor"), theirs, None)
    assert ours.recv() == (0, "ready", None)
    assert ours.recv() == (1, "err", ("rank 1: RuntimeError: boom", False))
    assert calls == ["abort", "close"]



def test_rank_0s_part_never_holds_the_process_at_exit():
    """Rank 0's part of a call runs on a daemon thread: one stuck for ever (a device wait for a
    peer that hung) does not keep the process from exiting after its error."""
    code = ("import threading; from brass.distributed.workers import _DaemonExecutor; "
            "fut = _DaemonExecutor('brass-rank-0').submit(threading.Event().wait); print('submitted')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "submitted", r.stderr


# -- a TPModel's ranks in processes -----------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _pids(m: TPModel) -> list[int]:
    return m.group_ranks.pids()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,world,split", [
    ("synth-tp-qwen3", 2, "tensor"), ("synth-tp-qwen3moe", 2, "tensor"), ("synth-tp-qwen35", 2, "tensor"),
    ("synth-tp-gemma4", 2, "tensor"), ("synth-tp-qwen35", 4, "tensor"), ("synth-tp-qwen3", 2, "layer"),
    ("synth-tp-qwen35", 2, "layer"),
])
def test_processes_give_the_bits_of_threads(name, world, split):
    """Teacher-forced logits and greedy tokens of TP in processes equal TP in threads', and a
    session's reset and a freed session reach every rank."""
    path = goldens.model(name).path()
    threads = TPModel(path, world, split)
    procs = TPModel(path, world, split, ranks="processes")
    try:
        for p in goldens.prompts(name)[:2]:
            assert np.array_equal(procs.score(p.tf_ids), threads.score(p.tf_ids)), p.name
        p = goldens.prompts(name)[0]
        s_p, s_t = procs.new_session(64), threads.new_session(64)
        for _ in range(2):                  # the second pass after a reset: the same again
            a = list(procs.generate(p.prompt_ids, 6, stop_at_eog=False, session=s_p))
            b = list(threads.generate(p.prompt_ids, 6, stop_at_eog=False, session=s_t))
            assert a == b
            s_p.reset()
            s_t.reset()
        sid = s_p.sid
        del s_p
        procs.new_session(8)                # tells the ranks of the freed session
        assert sid not in procs.ranks[0].sessions
    finally:
        pids = _pids(procs)
        procs.close()
        threads.close()
    assert len(pids) == world - 1 and not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_a_worker_that_raises_fails_the_call_in_one_line():
    """A worker whose step raises (here: rank 1 told to drop the session's cache, which rank 0
    keeps) ends the call with its rank and error; the group is spent, its workers gone."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    pids = _pids(m)
    s = m.new_session(32)
    w = m.group_ranks.workers[0]
    w.ctrl.send((0, Command("free", free=(s.sid,))))       # (seq, command), behind rank 0's back
    assert w.ctrl.recv() == (0, "ok", None)
    t0 = time.perf_counter()
    with pytest.raises(BrassError) as e:
        s.step([1, 2, 3])
    assert time.perf_counter() - t0 < FAIL_S
    assert str(e.value) == f"rank 1: KeyError: {s.sid}"
    with pytest.raises(BrassError, match=f"^rank 1: KeyError: {s.sid}$"):     # spent
        s.step([1])
    assert m.failure == str(e.value)
    assert not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_step_fails_the_call_and_stops_the_others():
    """TP = 4; rank 2 is stopped, a step started (rank 0 then waits in a collective), and rank 2
    killed: the call ends at once naming rank 2 and the signal; ranks 1 and 3, which were
    waiting on it, are gone too."""
    m = TPModel(goldens.model("synth-tp-qwen35").path(), 4, ranks="processes")
    failures = []
    m.on_failure = failures.append
    pids = _pids(m)
    p = goldens.prompts("synth-tp-qwen35")[0]
    gen = m.generate(p.prompt_ids, 64, stop_at_eog=False)
    next(gen)
    os.kill(pids[1], signal.SIGSTOP)
    err = []
    comm, in_step = m.group_ranks.comm, threading.Event()
    get = comm._get

    def waiting(src):                   # rank 0's step reading a peer's part: underway
        in_step.set()
        return get(src)
    comm._get = waiting

    def step():
        try:
            next(gen)
        except BaseException as e:
            err.append(e)
    t = threading.Thread(target=step)
    t.start()
    assert in_step.wait(FAIL_S)
    t0 = time.perf_counter()
    os.kill(pids[1], signal.SIGKILL)
    t.join(FAIL_S)
    assert not t.is_alive() and time.perf_counter() - t0 < FAIL_S
    assert isinstance(err[0], BrassError) and str(err[0]) == "rank 2 died (killed by SIGKILL)"
    assert failures == ["rank 2 died (killed by SIGKILL)"]
    assert not any(_alive(q) for q in pids)


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_step_is_raised_once_the_step_is_over():
    """A Ctrl-C while the ranks are in a step (held there: rank 1 stopped) is raised after the
    step ends on every rank: the group stays usable, the next step gives the threads' bits."""
    name = "synth-tp-qwen35"
    path = goldens.model(name).path()
    m = TPModel(path, 2, ranks="processes")
    try:
        ids = goldens.prompts(name)[0].tf_ids
        worker = _pids(m)[0]
        for hold in ("step", "new"):    # rank 0 waiting in its step / for the worker's reply
            s = m.new_session(len(ids)) if hold == "step" else None
            os.kill(worker, signal.SIGSTOP)
            released = threading.Event()

            def ctrl_c_then_release(released):
                # one timer, in this order: the call cannot end (its worker is stopped) before
                # the Ctrl-C is in, so no Ctrl-C can land after the call, on pytest itself
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)     # (not for the order: lets the Ctrl-C come while the call waits)
                released.set()
                os.kill(worker, signal.SIGCONT)
            threading.Timer(0.3, ctrl_c_then_release, (released,)).start()
            with pytest.raises(KeyboardInterrupt):
                s.step(ids[:5]) if s is not None else m.new_session(8)
            assert released.is_set(), f"{hold}: raised before the call was over"
            assert m.failure is None
            if s is not None:               # the step ran on every rank: its positions are taken
                assert s.n_past == 5
        assert np.array_equal(m.score(ids), TPModel(path, 2).score(ids))
    finally:
        m.close()


class _CtrlCBeforeRecv:
    """A control pipe whose recv() is preceded by a Ctrl-C (rank 0 reading a reply: outside any
    wait of its own)."""

    def __init__(self, conn):
        self.conn = conn

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def recv(self):
        os.kill(os.getpid(), signal.SIGINT)
        return self.conn.recv()


@pytest.mark.timeout(60)
def test_ctrl_c_anywhere_in_a_call_is_raised_once_it_is_over():
    """A Ctrl-C while rank 0 reads a worker's reply is held as one in a wait: the reply is read,
    then KeyboardInterrupt. Under the layer split a step's result is the last rank's reply, so
    a reply left unread would be the next step's result."""
    name = "synth-tp-qwen3"
    path = goldens.model(name).path()
    ids = goldens.prompts(name)[0].tf_ids
    m, ref = TPModel(path, 2, "layer", ranks="processes"), TPModel(path, 2, "layer")
    try:
        s, t = m.new_session(len(ids)), ref.new_session(len(ids))
        w = m.group_ranks.workers[0]
        w.ctrl = _CtrlCBeforeRecv(w.ctrl)
        with pytest.raises(KeyboardInterrupt):
            s.step(ids[:5])
        w.ctrl = w.ctrl.conn
        assert m.failure is None and s.n_past == 5
        t.step(ids[:5])
        assert np.array_equal(s.step(ids[5:]), t.step(ids[5:]))
        # a reply left unread all the same (a command sent behind rank 0's back) is not taken
        # for the next call's: each reply names its call
        w.ctrl.send((0, Command("memory")))
        with pytest.raises(BrassError, match=r"^rank 1: a reply \('ok'\) to call 0 where call \d+'s "
                                             r"\('ok'\) was due$"):
            s.reset()
    finally:
        m.close()
        ref.close()


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_workers_load_stops_them_at_once(monkeypatch):
    """Rank 0 loaded, its worker still loading (held: stopped), a Ctrl-C: KeyboardInterrupt at
    once (nothing is mid-step), the worker stopped, not waited for."""
    started, released = [], threading.Event()
    start, wait = workers._start_without_sigint, workers.wait

    def start_held(p):
        start(p)
        os.kill(p.pid, signal.SIGSTOP)
        started.append(p.pid)

    def ctrl_c_then_wait(*args, **kw):      # rank 0 waiting for its workers' "ready"
        monkeypatch.setattr(workers, "wait", wait)
        os.kill(os.getpid(), signal.SIGINT)
        return wait(*args, **kw)

    def release():                          # the bound on a start that waits for its workers
        released.set()
        for q in started:
            os.kill(q, signal.SIGCONT)
    monkeypatch.setattr(workers, "_start_without_sigint", start_held)
    monkeypatch.setattr(workers, "wait", ctrl_c_then_wait)
    timer = threading.Timer(FAIL_S, release)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    finally:
        timer.cancel()
    assert not released.is_set(), "the Ctrl-C waited for the worker's load"
    assert len(started) == 1 and not _alive(started[0])


@pytest.mark.timeout(60)
def test_a_hung_worker_fails_the_call_by_its_deadline():
    """A worker that hangs without reading (stopped) and a command beyond any pipe's buffer:
    rank 0 is not held writing it; the reply's deadline (made 1 s here) ends the call, and the
    worker is stopped."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    m.group_ranks.timeout = 1.0
    worker = _pids(m)[0]
    os.kill(worker, signal.SIGSTOP)
    err = []

    def call():
        try:        # "free" reads no ids: only makes the command 4 MiB
            m.call(Command("free", ids=np.zeros(4 << 20, np.int8)))
        except BaseException as e:
            err.append(e)
    t = threading.Thread(target=call)
    t.start()
    try:
        t.join(FAIL_S)
        assert not t.is_alive(), "rank 0 held writing to the hung worker"
        assert isinstance(err[0], BrassError) and str(err[0]) == "rank 1: no reply in 1 s"
        assert m.failure == str(err[0]) and not _alive(worker)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
        t.join()
        m.close()


@pytest.mark.timeout(60)
def test_an_error_escaping_a_call_half_way_fails_the_group(monkeypatch):
    """Rank 0 raising outside its step (here: reading the replies runs out of memory) leaves
    the replies unread: the group fails in one line and its workers stop, rather than go on out
    of step."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    pids = _pids(m)

    def out_of_memory(*args, **kw):
        raise MemoryError
    monkeypatch.setattr(m.group_ranks, "_collect", out_of_memory)
    with pytest.raises(MemoryError):
        m.score([1, 2])
    assert m.failure == "rank 0: a call was cut short by MemoryError"
    assert not any(_alive(p) for p in pids)
    with pytest.raises(BrassError, match="^rank 0: a call was cut short by MemoryError$"):
        m.score([1, 2])


class _BlockedWriter:
    """A pipe's writer whose send blocks (a full pipe) until released, then fails as a
    Connection does once its fd was closed under the send (os.write(None, ...))."""

    def __init__(self):
        self.sending, self.released = threading.Event(), threading.Event()
        self.closed_under_send = False

    def send(self, x):
        self.sending.set()
        self.released.wait(FAIL_S)
        raise TypeError("'NoneType' object cannot be interpreted as an integer")

    def close(self):
        self.closed_under_send |= self.sending.is_set() and not self.released.is_set()


def test_closing_a_communicator_leaves_a_blocked_sender_quiet(monkeypatch):
    """close() gives a sender blocked on a full pipe 1 s, then leaves its pipe open (for process
    exit) rather than close it under the send; the sender ends without a traceback."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    w = _BlockedWriter()
    comm = PipeCommunicator(PipeEnds(0, 2, readers={}, writers={1: w}))
    comm.send(np.zeros(4, np.float32), 1)
    assert w.sending.wait(FAIL_S)
    comm.close()
    assert not w.closed_under_send
    w.released.set()
    for t in comm._threads.values():
        t.join(FAIL_S)
        assert not t.is_alive()
    assert raised == []


@pytest.mark.timeout(60)
def test_a_worker_dying_between_calls_is_seen_at_once():
    """The watcher fails the group at once; an on_failure set after that (a server sets it once
    loaded) is called at once, and once only; nothing holds the spent group (not the exit hook
    that closes a live one)."""
    m = TPModel(goldens.model("synth-tp-qwen3").path(), 2, ranks="processes")
    with pytest.raises(BrassError, match="^TPModel.run needs ranks='threads': "):
        m.run(lambda rank: None)
    os.kill(_pids(m)[0], signal.SIGKILL)
    m.group_ranks._watcher.join(FAIL_S)
    assert m.failure == "rank 1 died (killed by SIGKILL)"
    told, again = [], []
    m.on_failure = told.append
    m.on_failure = again.append
    assert told == [m.failure] and again == []
    with pytest.raises(BrassError, match="^rank 1 died \\(killed by SIGKILL\\)$"):
        m.score([1, 2])
    spent = weakref.ref(m.group_ranks)
    del m
    gc.collect()
    assert spent() is None


@pytest.mark.timeout(60)
def test_workers_end_when_rank_0_is_killed():
    """Rank 0 killed (no chance to stop anything): its workers read the end of their control
    pipe and exit; none is left."""
    code = ("import sys, time; from brass.distributed.tp import TPModel; "
            "m = TPModel(sys.argv[1], 4, ranks='processes'); print(*m.group_ranks.pids(), flush=True); "
            "time.sleep(60)")
    r0 = subprocess.Popen([sys.executable, "-c", code, str(goldens.model("synth-tp-qwen35").path())],
                          stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in r0.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(q) for q in pids)
    finally:
        r0.kill()
        r0.wait()
    deadline = time.monotonic() + FAIL_S
    while any(_alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(q) for q in pids)


@pytest.mark.timeout(60)
def test_bench_reports_each_ranks_memory():
    """`brass bench --tp`: each rank's weights and its part of the KV cache, from its own
    process (under the layer split the ranks hold different layers: different figures)."""
    from brass import bench
    m = TPModel(goldens.model("synth-tp-qwen35").path(), 2, "layer", ranks="processes")
    try:
        res = bench.bench(m, n_prompt=8, n_gen=4, reps=1)
    finally:
        m.close()
    ranks = res[-1].memory["ranks"]
    assert len(ranks) == 2 and all(r["weights"] > 0 and r["kv_cache"] > 0 for r in ranks)
    assert ranks[0] == {"weights": res[-1].memory["weights"], "kv_cache": ranks[0]["kv_cache"]}
    assert ranks[0]["weights"] != ranks[1]["weights"]
    assert "per rank (weights, KV cache): rank 0 " in bench.table(res)


# -- the command line -------------------------------------------------------------------------

def _marked(mark: str) -> list[int]:
    """Processes whose environment carries `mark` (a command's workers inherit it)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read() and _alive(int(d)):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _env(mark: str) -> dict:
    return {**os.environ, "TP_PROCESSES_TEST_MARK": mark}


@pytest.mark.timeout(120)
def test_cli_run_streams_under_tp_and_leaves_no_process():
    """`brass run MODEL PROMPT --tp 2` prints what one rank prints (greedy), and every process
    it started is gone when it returns."""
    name = "synth-tp-qwen3"
    path = goldens.model(name).path()
    p = goldens.prompts(name)[0]
    mark = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "brass", "run", str(path), p.text, "--max-tokens", "8", "--temperature", "0",
           "--backend", "numpy"]
    one = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    tp = subprocess.run(cmd + ["--tp", "2"], capture_output=True, text=True, timeout=60, env=_env(mark))
    assert one.returncode == 0 and tp.returncode == 0, tp.stderr
    assert tp.stdout == one.stdout and tp.stdout.strip()
    assert _marked(mark) == []


@pytest.mark.timeout(120)
def test_serve_exits_in_one_line_when_a_worker_dies():
    """`brass serve --tp 2`: its worker killed, the server stops by itself with one line
    naming the rank, status 2, and leaves no process behind."""
    path = goldens.model("synth-tp-qwen3").path()
    mark = uuid.uuid4().hex
    srv = _serve(path, mark)
    try:
        _wait_up(srv)
        _kill_the_worker(mark, srv.pid)
        rc = srv.wait(FAIL_S)
        rest = srv.stderr.read().strip()
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    # (before it, the access log's line of the /health probe)
    assert rc == 2 and rest.splitlines()[-1] == "brass: error: rank 1 died (killed by SIGKILL)", (rc, rest)
    assert "Traceback" not in rest
    deadline = time.monotonic() + FAIL_S
    while _marked(mark) and time.monotonic() < deadline:     # multiprocessing's resource tracker
        time.sleep(0.1)                                      # ends when its pipe does
    assert _marked(mark) == []


@pytest.mark.timeout(120)
def test_serve_sees_a_worker_that_died_while_it_started():
    """A worker that dies once the model is loaded, before the server set its on_failure (held
    here: killed as the server's App is made): the server ends in the rank's line at once
    rather than serve with a spent group."""
    code = ("import os, signal, sys\n"
            "from brass import server\n"
            "from brass.cli import main\n"
            "init = server.App.__init__\n"
            "def dying(self, model, *args, **kw):\n"
            "    os.kill(model.group_ranks.pids()[0], signal.SIGKILL)\n"
            "    model.group_ranks._watcher.join(60)\n"
            "    init(self, model, *args, **kw)\n"
            "server.App.__init__ = dying\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "serve", str(goldens.model("synth-tp-qwen3").path()),
                        "--tp", "2", "--backend", "numpy", "--port", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        "brass: error: rank 1 died (killed by SIGKILL)", (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_chat_ends_in_one_line_when_a_worker_dies():
    """`brass chat --tp 2`: a turn, then its worker killed: the next turn ends the chat with
    the rank's line and status 2 (not an error a turn, forever)."""
    path = goldens.model("synth-tp-qwen3").path()
    mark = uuid.uuid4().hex
    chat = subprocess.Popen([sys.executable, "-m", "brass", "chat", str(path), "--tp", "2", "--backend", "numpy",
                             "--max-tokens", "4"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(mark))
    try:
        chat.stdin.write("hello\n")
        chat.stdin.flush()
        for line in chat.stderr:                # the turn's "[4 tokens, ...]"
            if line.startswith("["):
                break
        _kill_the_worker(mark, chat.pid)
        chat.stdin.write("again\n")
        chat.stdin.flush()
        rc = chat.wait(FAIL_S)
        rest = chat.stderr.read().strip()
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
    assert rc == 2 and rest == "brass: error: rank 1 died (killed by SIGKILL)", (rc, rest)


def _serve(path, mark: str):
    """`brass serve --tp 2` in a session of its own (its process group: what a terminal's
    Ctrl-C reaches), once it says it serves."""
    srv = subprocess.Popen([sys.executable, "-m", "brass", "serve", str(path), "--tp", "2", "--backend",
                            "numpy", "--port", "0"], stderr=subprocess.PIPE, text=True, env=_env(mark),
                           start_new_session=True)
    return srv


@pytest.mark.timeout(120)
def test_serve_stops_on_ctrl_c_with_its_workers():
    """Ctrl-C in the terminal (SIGINT to the whole process group, workers included): the
    workers ignore it, the server stops as without --tp and stops them; nothing is left."""
    path = goldens.model("synth-tp-qwen3").path()
    mark = uuid.uuid4().hex
    srv = _serve(path, mark)
    try:
        _wait_up(srv)
        assert len(_marked(mark)) >= 2          # the server and its worker
        os.killpg(srv.pid, signal.SIGINT)
        rc = srv.wait(FAIL_S)
        rest = srv.stderr.read().strip()
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert rc == 0 and rest.endswith("brass: stopped") and "Traceback" not in rest, (rc, rest)
    deadline = time.monotonic() + FAIL_S
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(mark) == []


def _wait_up(srv):
    """Until the server answers /health: it then has its signal handlers (a Ctrl-C between its
    "serving" line and uvicorn's start is an interrupt of the start, status 130)."""
    import re
    import urllib.request
    for line in srv.stderr:
        m = re.search(r"brass: serving .* at (http://\S+/) ", line)
        if m:
            break
    else:
        raise AssertionError("the server did not start")
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(m.group(1) + "health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _kill_the_worker(mark: str, parent: int):
    """SIGKILL the one worker of a `--tp 2` process `parent` (found by its mark; not
    multiprocessing's resource tracker)."""
    workers = [q for q in _marked(mark) if q != parent and "resource_tracker" not in _cmdline(q)]
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("args,message", [
    (("--tp", "0"), "brass: error: --tp must be at least 1, got 0"),
    (("--tp", "2", "--split", "layer", "--ctx", "0"), "brass: error: --ctx must be at least 1, got 0"),
])
def test_cli_bad_tp_is_one_line(args, message):
    from conformance.harness.cli import brass
    r = brass("generate", goldens.model("synth-tp-qwen3").path(), "--prompt", "x", "--backend", "numpy", *args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip() == message, r.stderr


def test_cli_tp_on_cuda_runs_processes_where_the_gpus_are(monkeypatch):
    """With two GPUs seen (forced), `--tp 2 --backend cuda` is no longer refused: the CLI makes
    the TPModel of CUDA ranks in processes over the default communicator (nccl), under tensor
    parallelism and under the layer split alike."""
    import argparse
    from brass import cli
    from brass.distributed import tp
    made = {}
    monkeypatch.setattr(tp, "gpu_count", lambda: 2)
    monkeypatch.setattr(tp, "TPModel", lambda *a, **k: made.update(k) or "the model")
    args = argparse.Namespace(model=str(goldens.model("synth-tp-qwen3").path()), ctx=None, tp=2,
                              split="tensor", backend="cuda")
    assert cli.load_model(args) == "the model"
    assert made["ranks"] == "processes" and made["backend"] == "cuda" and made.get("comm") is None
    made.clear()
    args.split = "layer"
    assert cli.load_model(args) == "the model"
    assert made["ranks"] == "processes" and made["backend"] == "cuda" and made.get("comm") is None


def test_cli_tp_beyond_the_visible_gpus_is_one_line():
    """CUDA_VISIBLE_DEVICES=0 shows at most one GPU: --tp 2 on cuda is refused before loading,
    naming it (here or on a GPU machine alike)."""
    r = subprocess.run([sys.executable, "-m", "brass", "generate", str(goldens.model("synth-tp-qwen3").path()),
                        "--prompt", "x", "--backend", "cuda", "--tp", "2"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line, r.stderr
    assert line.startswith("brass: error: --tp 2 needs 2 GPUs; this process sees ")
    assert line.endswith(" (CUDA_VISIBLE_DEVICES=0) (or run the ranks on the CPU: --backend numpy)")
