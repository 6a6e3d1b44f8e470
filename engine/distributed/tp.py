"""One model over several ranks on the numpy backend: tensor parallelism (`split="tensor"`,
the plan of shard.py) or a layer split (`split="layer"`: contiguous layers per rank, the
residual stream handed on by send/recv). The ranks run in threads of this process over
comm.ThreadGroup (`ranks="threads"`: `ThreadRanks`) or one process per rank over
comm.ProcessGroup (`ranks="processes"`: workers.ProcessRanks, what the CUDA path will run).
`TPModel` gives what the CLI and the server use of a Model (generate, sessions, score,
tokenizer, config); its sessions (`TPSession`) run every step on all ranks at once: rank 0
hands every rank the same small `Command` (the session, the token ids and positions, the rows
whose logits are wanted; a new session, a reset, the sessions freed) and each rank's
`Rank.handle` runs it, the collectives inside.

Each rank opens the GGUF itself (its own memory map) and reads only its slices of it: a
ShardWeight holds the bytes of its rows, columns or experts, cut on block boundaries, and is
dequantized on first use like any numpy weight. Under a layer split a rank prepares only the
weights its layers use (weights are prepared on first use).

The numbers: a column-parallel mat-mul gives each output element exactly as one rank would
(the same dot product over the same activation, quantized in the same blocks); a row-parallel
one gives partial sums over block-aligned slices of the input, summed by the all-reduce in
rank order: the same terms, added in another order (float32 rounding: ~1e-7 relative per
sum, carried through the layers). The embedding's all-reduce adds zeros (exact); expert
parallelism adds each token's expert outputs in choice order on each rank, then the ranks'
sums (exact for top-2, reordered beyond); the LM head's collectives are exact.
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .. import arch as arch_registry
from ..arch.common import Forward, Weights
from ..backends.base import uses_f16_gemm, uses_mmq_id
from ..backends.numpy_backend import NumpyBackend, NumpyWeight
from ..catalog import resolve
from ..config import read_config
from ..errors import BrassError, UnsupportedError
from ..gguf import BLOCK_SIZES, GGUFFile, TensorInfo
from ..kv_cache import PagedKVCache
from ..sampling import Sampler, SamplingParams, generation_length
from ..tokenizer import Tokenizer
from ..validate import check_model
from . import vocab
from .comm import CommAborted, ThreadGroup, on_host
from .cuda_rank import BACKENDS, rank_backends
from .shard import Cut, layer_stages, tensor_parallel

F32 = np.float32
SPLITS = ("tensor", "layer")
RANKS = ("threads", "processes")
DEFAULT_CTX = 4096      # model.DEFAULT_CTX (not imported: model.py imports this module's users)


def _runs_bytes(a: np.ndarray, runs, axis: int) -> np.ndarray:
    if not runs:                        # a rank holding none of the tensor
        return a[:0] if axis == 0 else a[:, :0]
    parts = [a[x:y] if axis == 0 else a[:, x:y] for x, y in runs]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def shard_bytes(gf, name: str, cut: Cut) -> tuple[np.ndarray, tuple[int, ...]]:
    """(the rank's bytes of tensor `name`, its ggml shape): rows, columns (on block
    boundaries: shard.py checked them) or experts, read from the file's memory map (a row or
    expert range is a view of it; columns are copied, only the rank's)."""
    t = gf.tensors[name]
    blk, bpb = BLOCK_SIZES[t.type]
    mm = gf.tensor_bytes(name)
    shape = list(t.shape)
    if len(shape) == 1:
        runs = [cut.experts] if cut.experts else cut.rows
        raw = _runs_bytes(mm.reshape(shape[0] // blk, bpb), [(a // blk, b // blk) for a, b in runs], 0)
        shape[0] = sum(b - a for a, b in runs)
    elif len(shape) == 3:
        e0, e1 = cut.experts
        raw = mm.reshape(shape[2], -1)[e0:e1]
        shape[2] = e1 - e0
    else:
        K, N = shape
        rows = mm.reshape(N, K // blk * bpb)
        raw = rows
        if cut.rows is not None:
            raw = _runs_bytes(raw, cut.rows, 0)
            shape[1] = sum(b - a for a, b in cut.rows)
        if cut.cols is not None:
            raw = _runs_bytes(raw, [(a // blk * bpb, b // blk * bpb) for a, b in cut.cols], 1)
            shape[0] = sum(b - a for a, b in cut.cols)
    return np.ascontiguousarray(raw).reshape(-1), tuple(shape)


class ShardWeight(NumpyWeight):
    """A rank's part of a GGUF tensor (its Cut), read from the memory map on first use."""

    def __init__(self, gf, name: str, cut: Cut):
        info = gf.tensors[name]
        self.name, self.type, self.cut = name, info.type, cut
        self.reduce, self.vocab, self.experts = cut.reduce, cut.vocab, cut.experts
        self._gf, self._raw, self._dense = gf, None, None
        self._raw, shape = shard_bytes(gf, name, cut)
        self._info = TensorInfo(name, shape, info.type, info.offset, self._raw.nbytes)
        self.shape = tuple(reversed(shape))

    @property
    def raw(self) -> np.ndarray:
        return self._raw


class TPBackend(NumpyBackend):
    """The numpy backend of one rank: its weights are the plan's shards; a row-parallel
    mat-mul, the vocabulary-parallel embedding and the expert-parallel MoE end in an
    all-reduce over the rank's communicator."""

    def __init__(self, comm, plan=None, **options):
        super().__init__(**options)
        self.comm, self.plan = comm, plan

    def weight(self, gf, name):
        cut = self.plan.cut(name) if self.plan is not None else None
        return NumpyWeight(gf, name) if cut is None else ShardWeight(gf, name, cut)

    def matmul(self, x, w):
        if 0 in w.shape:                # a rank holding none of the weight (shard.py)
            y = np.zeros((np.shape(x)[0], w.shape[0]), F32)
        else:
            y = super().matmul(x, w)
        return self.comm.all_reduce(y) if getattr(w, "reduce", False) else y

    def embed(self, table, ids):
        v = getattr(table, "vocab", None)
        if v is None:
            return super().embed(table, ids)
        ids = np.asarray(ids, np.int64)
        mine = (ids >= v[0]) & (ids < v[1])
        out = np.zeros((len(ids), table.shape[-1]), F32)
        if mine.any():
            out[mine] = table.rows(ids[mine] - v[0]).astype(F32, copy=False)
        return self.comm.all_reduce(out)        # one non-zero term per row: exact

    def matmul_id(self, x, w, ids):
        ids = np.asarray(ids)
        if not (ids < 0).any():
            return super().matmul_id(x, w, ids)
        # choices of experts another rank holds (-1): zero rows, nothing computed
        T, k = ids.shape
        x = np.ascontiguousarray(x, F32)
        out = np.zeros((T, k, w.shape[1]), F32)
        f16 = (self.act_mode == "q8_1" and not self._rows_independent and uses_f16_gemm(T, x.shape[-1], w.type)
               and not (self.moe_mmq and uses_mmq_id(T, x.shape[-1], w.type)))
        for e in np.unique(ids):
            if e < 0:
                continue
            tt, jj = np.nonzero(ids == e)
            out[tt, jj] = self._linear(x[tt, jj] if x.ndim == 3 else x[tt], w, int(e), f16=f16)
        return out

    def moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, gelu=False, down_scale=None):
        e = getattr(w_gate, "experts", None)
        if e is None:
            return super().moe_ffn(x, w_gate, w_up, w_down, ids, weights, gelu, down_scale)
        ids = np.asarray(ids)
        mine = (ids >= e[0]) & (ids < e[1])
        local = np.where(mine, ids - e[0], -1).astype(np.int32)
        y = super().moe_ffn(x, w_gate, w_up, w_down, local, np.where(mine, weights, F32(0)).astype(F32),
                            gelu, down_scale)
        return self.comm.all_reduce(y)


# A stage's hand-over: a header (host int64: the count, then per array its kind, dtype and
# shape), then the arrays. Kinds: a host array (sent as it is), a device array (the receiver
# allocates it on its own device and receives into it: NCCL's send/recv carry no shapes; a
# communicator without recv_into stages it through the host), or None.
_HOST, _DEVICE, _NONE = 0, 1, 2
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32), np.dtype(np.int64))


class Stage:
    """A rank's place in a layer split: its layers, and the hand-over of the residual stream to
    the next rank (send) or from the one before (recv). `backend` (set by its Rank): where a
    device array received goes."""

    def __init__(self, comm, layers: tuple[int, int]):
        self.comm, self.layers = comm, layers
        self.first, self.last = comm.rank == 0, comm.rank == comm.world_size - 1
        self.backend = None

    @staticmethod
    def _kind(a) -> int:
        if a is None:
            return _NONE
        return _HOST if on_host(a) else _DEVICE

    def send(self, carry: tuple):
        head = [len(carry)]
        for a in carry:
            head.append(self._kind(a))
            if a is not None:
                head += [_DTYPES.index(np.dtype(a.dtype)), a.ndim, *a.shape]
        nxt = self.comm.rank + 1
        self.comm.send(np.array(head, np.int64), nxt)
        for a in carry:
            if a is not None:
                self.comm.send(a, nxt)

    def recv(self) -> tuple:
        prev = self.comm.rank - 1
        head = [int(v) for v in self.comm.recv(prev)]
        out, i = [], 1
        for _ in range(head[0]):
            kind = head[i]
            if kind == _NONE:
                out.append(None)
                i += 1
                continue
            dtype, ndim = _DTYPES[head[i + 1]], head[i + 2]
            shape = tuple(head[i + 3:i + 3 + ndim])
            i += 3 + ndim
            recv_into = getattr(self.comm, "recv_into", None)
            if kind == _HOST or self.backend is None:
                out.append(self.comm.recv(prev))
            elif recv_into is not None:         # straight into this rank's device (NCCL)
                out.append(recv_into(self.backend.empty(shape, dtype), prev))
            else:                               # staged through the host
                out.append(self.backend.asarray(self.comm.recv(prev), dtype))
        return tuple(out)


def stage_tensors(gf, stage: Stage) -> list[str]:
    """The tensors of `gf` a stage's forward reads: its layers' (blk.N.*), the token embedding
    on the first stage (and on the last where the LM head is tied to it), the output norm and
    head on the last, the tensors of no layer (rope factors and the like) everywhere; and on a
    later stage the layer before's output scale (gemma4's fused residual add scales the
    hand-over with it: engine/arch/gemma4.py)."""
    lo, hi = stage.layers
    out = []
    for name in gf.tensors:
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if lo <= il < hi or (il == lo - 1 and name.endswith(".layer_output_scale.weight")):
                out.append(name)
        elif name == "token_embd.weight":
            if stage.first or (stage.last and "output.weight" not in gf.tensors):
                out.append(name)
        elif name.startswith("output"):
            if stage.last:
                out.append(name)
        else:
            out.append(name)
    return out


@dataclass
class Command:
    """What rank 0 hands every rank for one call (pickled to a worker process: small). `op`:
    "new" (a session of `n_ctx` tokens: each rank makes its own cache), "reset", "step" (run
    `ids` at positions `pos` of session `sid`; `rows`: the rows whose logits are wanted, None
    for all; `want`: "argmax", "logits" or "all", TPSession.step), "memory" (the bytes the rank
    holds) or "free" (nothing but `free`). `free`: the sessions dropped since the last
    command, whose caches every rank lets go."""
    op: str
    sid: int = -1
    n_ctx: int = 0
    ids: np.ndarray | None = None
    pos: np.ndarray | None = None
    rows: np.ndarray | None = None
    want: str = "logits"
    free: tuple = ()


class Rank:
    """One rank: its own GGUF memory map, config (its heads), backend, weights, stage, and the
    caches of the sessions (by id) it holds its part of."""

    def __init__(self, path, comm, plan=None, stage: Stage | None = None, backend=None):
        """`backend`: the factory `backend(comm, plan)` of the rank's backend (TPBackend, numpy;
        or backends/cuda/sharded.py's TPCudaBackend)."""
        self.comm, self.plan, self.stage = comm, plan, stage
        self.sessions: dict[int, PagedKVCache] = {}
        self.gguf = GGUFFile(path)
        self.arch = arch_registry.get(self.gguf.architecture)
        cfg = self.arch.configure(read_config(self.gguf, self.gguf.architecture), self.gguf)
        self.config = plan.config if plan is not None else cfg
        if stage is not None:
            # the caches hold the stage's layers only: the others get no KV heads (zero-size
            # arrays) and no recurrent state (a hybrid's delta-net layers of other stages count
            # as attention layers without heads); the forward never reaches them
            cfg = copy.copy(cfg)
            lo, hi = stage.layers
            cfg.n_head_kv_arr = [cfg.layer_n_head_kv(il) if lo <= il < hi else 0 for il in range(cfg.n_layer)]
            if cfg.recurrent_layers:
                cfg.recurrent_layers = [bool(r) and lo <= il < hi for il, r in enumerate(cfg.recurrent_layers)]
            self.config = cfg
        self.backend = (backend or TPBackend)(comm, plan)
        self.weights = Weights(self.backend, self.gguf)
        if stage is not None:
            stage.backend = self.backend
        if hasattr(self.backend, "load"):
            # the rank's shards (or its stage's tensors) go up now, as a Model's weights do: an
            # out-of-memory or a tensor the backend cannot take shows at the start, not at the
            # first prompt, and the uploads do not queue behind that prompt's collectives on the
            # rank's stream
            with self.backend.activate():
                self.backend.load(self.gguf, self.weights, quiet=True,
                                  names=stage_tensors(self.gguf, stage) if stage is not None else None)
        # a decode step replayed as a captured graph (its collectives inside) where the backend
        # captures over this communicator (NCCL's), BRASS_GRAPH as for a Model; per session
        from .. import flags
        self.graphs = bool(getattr(self.backend, "supports_graphs", False)) and stage is None \
            and bool(flags.get("BRASS_GRAPH"))
        self.decode_steps: dict[int, _RankDecode] = {}
        head = None
        if plan is not None:
            head = plan.cut("output.weight") or plan.cut("token_embd.weight")
        self.vocab0 = head.vocab[0] if head is not None else 0

    def forward(self, ids, pos, cache, out_rows=None):
        f = Forward(self.backend, self.config, self.weights, cache, pos)
        f.stage = self.stage
        with self.backend.activate():
            return self.arch.forward(f, ids, out_rows)

    def argmax(self, logits) -> np.ndarray:
        """The global greedy token of each row: each rank's (max, index), one small all-gather
        (a device backend gives its two numbers a row from the device: row_max)."""
        row_max = getattr(self.backend, "row_max", vocab.row_max)
        return vocab.argmax_of(self.comm, *row_max(logits), self.vocab0)

    def gather(self, logits) -> np.ndarray:
        """The whole rows of the logits, on the host."""
        return vocab.gather(self.comm, self.backend.to_numpy(logits))

    @property
    def result_rank(self) -> int:
        """The rank whose result a step returns: the last stage of a layer split (it holds the
        LM head), rank 0 under tensor parallelism (every rank holds the same)."""
        return self.comm.world_size - 1 if self.stage is not None else 0

    def handle(self, cmd: Command):
        for sid in cmd.free:
            self.sessions.pop(sid, None)
            self.decode_steps.pop(sid, None)
        if cmd.op == "new":
            with self.backend.activate():       # a device rank's cache: on its device and stream
                self.sessions[cmd.sid] = PagedKVCache.private(self.backend, self.config, cmd.n_ctx)
        elif cmd.op == "reset":
            with self.backend.activate():
                self.sessions[cmd.sid].reset()
        elif cmd.op == "step":
            return self.step(self.sessions[cmd.sid], cmd)
        elif cmd.op == "memory":
            out = {"weights": self.weights.nbytes,
                   "kv_cache": sum(getattr(c, "nbytes", 0) for c in self.sessions.values())}
            used = getattr(self.backend, "device_memory_used", None)
            if used is not None:        # a CUDA rank: its device's used memory, as the driver says
                out["device_used"] = used()
            return out
        elif cmd.op != "free":
            raise BrassError(f"rank {self.comm.rank}: unknown command {cmd.op!r}")
        return None

    def step(self, cache, cmd: Command):
        if self.graphs and len(cmd.ids) == 1:
            logits = self.decode(cache, cmd)
        else:
            logits = self.forward(cmd.ids, cmd.pos, cache, cmd.rows)
        if self.stage is not None:          # the last stage holds the whole vocabulary
            if logits is None:
                return None
            logits = self.backend.to_numpy(logits)      # a device rank's: to the host
            return int(np.argmax(logits[-1])) if cmd.want == "argmax" else np.asarray(logits, F32)
        if cmd.want == "argmax":
            return int(self.argmax(logits)[-1])
        return self.gather(logits)


    def decode(self, cache, cmd: Command):
        """A one-token step through the session's decode graph: the first runs eagerly (loading
        every kernel), then is captured; later ones replay it. Every rank gets the same
        commands, so every rank captures and replays at the same steps, its collectives in the
        graph in the same order."""
        g = self.decode_steps.get(cmd.sid)
        if g is None:
            logits = self.forward(cmd.ids, cmd.pos, cache, cmd.rows)
            self.decode_steps[cmd.sid] = _RankDecode(self, cache)
            return logits
        b = self.backend
        with b.activate():
            b.decode_set(g.tok, g.pos, int(cmd.ids[0]), int(cmd.pos[0]))
            g.graph.replay()
        return g.logits


class _RankDecode:
    """A rank's one-token decode step of one session, captured (model.DecodeStep without the
    greedy advance: the argmax takes the ranks' all-gather on the host): the token and the
    position in device scalars, the logits of the rank's vocabulary range in `logits`."""

    def __init__(self, rank: Rank, cache):
        b = rank.backend
        with b.activate():
            self.tok = b.zeros((1,), np.int32)
            self.pos = b.zeros((1,), np.int32)
        tok, pos, forward = self.tok, self.pos, rank.forward
        self.graph = b.capture(lambda: forward(tok, pos, cache))
        self.logits = self.graph.result


def make_rank(path, comm, split: str, backend=None) -> Rank:
    """Rank `comm.rank` of `comm.world_size` over `comm`: its plan (tensor) or stage (layer);
    `backend`: its backend's factory (Rank)."""
    gf = GGUFFile(path)
    try:
        cfg = arch_registry.get(gf.architecture).configure(read_config(gf, gf.architecture), gf)
        if split == "tensor":
            return Rank(path, comm, plan=tensor_parallel(gf, cfg, comm.world_size, comm.rank), backend=backend)
        stages = layer_stages(cfg.n_layer, comm.world_size)
        return Rank(path, comm, stage=Stage(comm, stages[comm.rank]), backend=backend)
    finally:
        gf.close()


class _BlasThreads:
    """OpenBLAS's thread count (numpy's bundled library, found among the loaded ones), set to one
    while the ranks run: the ranks are the parallelism, and OpenBLAS's own threads on top of them
    oversubscribe the cores (measured on 2 cores: 5 prompts of synth-tp-qwen3 at TP = 4 in 4.6 s
    with OpenBLAS's threads, 0.22 s without). Its results do not depend on the count (a thread
    takes whole output elements: the exact tests of test_tensor_parallel.py compare a TP step
    against the model run with OpenBLAS's threads). No-op where the library is not found."""

    def __init__(self):
        self._set = self._get = None
        try:
            import ctypes
            with open("/proc/self/maps") as f:
                paths = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""),
                                       ("openblas", "64_"), ("openblas", "")):
                    if hasattr(lib, f"{prefix}_set_num_threads{suffix}"):
                        self._set = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                        self._get = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                        return
        except OSError:
            pass

    def __enter__(self):
        self._before = self._get() if self._get else None
        if self._set:
            self._set(1)

    def __exit__(self, *exc):
        if self._set and self._before:
            self._set(self._before)


def finish(futures) -> bool:
    """Return once every future is done (its result or exception is then read): whether a
    Ctrl-C came meanwhile. A Ctrl-C must not leave the ranks mid-step (the next step would meet
    them there): the caller waits the step out, then raises the KeyboardInterrupt."""
    interrupted = False
    while True:
        try:
            for f in futures:
                f.exception()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True


class ThreadRanks:
    """Every rank in a thread of this process, over a ThreadGroup. `call(cmd)`: every rank's
    `handle(cmd)` at once; their results in rank order. A rank that raises aborts the others'
    collectives; its error is raised (a BrassError names the rank), and the group is made
    ready for the next step."""

    def __init__(self, path, world: int, split: str, backend: str = "numpy", comm: str | None = None):
        self.world = world
        self.group = ThreadGroup(world)
        # the ranks' backends: numpy over the group, or CUDA on one GPU over it staged (cuda_rank.py)
        comms, make = rank_backends(backend, comm, [self.group.comm(r) for r in range(world)])
        self.local = [make_rank(path, comms[r], split, make) for r in range(world)]
        self._pool = ThreadPoolExecutor(world, thread_name_prefix="brass-rank")
        self._blas = _BlasThreads() if world > 1 else None
        self.on_failure = None
        self.failure = None

    def run(self, fn) -> list:
        def guarded(rank):
            try:
                return fn(rank)
            except BaseException as e:
                self.group.abort(f"rank {rank.comm.rank}: {type(e).__name__}: {e}")
                raise
        with self._blas or contextlib.nullcontext():
            futures = [self._pool.submit(guarded, r) for r in self.local]
            interrupted = finish(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            why = self.group.aborted            # "rank R: Type: message" of the first to fail
            self.group.reset()
            first = next((e for e in errors if not isinstance(e, CommAborted)), errors[0])
            if isinstance(first, BrassError):
                raise first
            raise BrassError(f"a rank failed: {why or f'{type(first).__name__}: {first}'}") from first
        if interrupted:
            raise KeyboardInterrupt
        return [f.result() for f in futures]

    def call(self, cmd: Command) -> list:
        return self.run(lambda rank: rank.handle(cmd))

    def close(self):
        self._pool.shutdown(wait=False)


class _Arch:
    """What the server reads of a TPModel's architecture: no batched decode (each session
    steps alone, every rank at once)."""
    BATCHED_DECODE = False
    BUCKET_GRAPHS = False


class TPModel:
    """A model over `world` ranks (numpy backend): `split` "tensor" (tensor parallel) or "layer"
    (contiguous layers per rank); `ranks` "threads" (ThreadRanks) or "processes" (one process
    per rank: workers.ProcessRanks). Under processes `on_failure(why)`, when set, is called once
    when a worker dies, even between steps (the server stops on it)."""

    def __init__(self, model, world: int, split: str = "tensor", n_ctx: int | None = None,
                 quiet: bool = False, ranks: str = "threads", backend: str = "numpy", comm: str | None = None):
        """`backend` "numpy", or "cuda": CUDA ranks in threads on one GPU over the host-staged
        communicator (`comm` "host", cuda_rank.py), or in processes over `comm` "nccl" (a GPU
        per rank, the default) or "host" (staged through the CPU pipes: several ranks may share
        one GPU, the one-GPU test of the processes)."""
        if split not in SPLITS:
            raise BrassError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if world < 1:
            raise BrassError(f"--tp must be at least 1, got {world}")
        if ranks not in RANKS:
            raise BrassError(f"ranks must be one of {', '.join(RANKS)}, got {ranks!r}")
        self.path = resolve(model, quiet=quiet)
        self.gguf = GGUFFile(self.path)
        name = self.gguf.architecture
        self.config = arch_registry.get(name).configure(read_config(self.gguf, name), self.gguf)
        check_model(self.gguf, self.config)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.world, self.split = world, split
        # every rank's plan first: a shape that does not divide is refused before any load (or
        # any worker started)
        if split == "tensor":
            for r in range(world):
                tensor_parallel(self.gguf, self.config, world, r)
        else:
            layer_stages(self.config.n_layer, world)
        if backend not in BACKENDS:
            raise BrassError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if ranks == "threads":
            self.group_ranks = ThreadRanks(self.path, world, split, backend, comm)
        else:
            from .workers import ProcessRanks
            count = gpu_count() if backend == "cuda" else 0
            self.group_ranks = ProcessRanks(self.path, world, split, backend=backend, comm=comm,
                                            count=count, env=os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.ranks = self.group_ranks.local         # the ranks in this process
        self.group = getattr(self.group_ranks, "group", None)
        self.n_ctx = min(n_ctx or DEFAULT_CTX, self.config.n_ctx_train)
        self.backend = self.ranks[0].backend
        self.arch = _Arch()
        self.graphs = self.prompt_graphs = False
        self._sids = 0
        self._freed: list[int] = []         # sessions dropped, told to the ranks with the next call

    @property
    def on_failure(self):
        return self.group_ranks.on_failure

    @on_failure.setter
    def on_failure(self, fn):
        self.group_ranks.on_failure = fn

    @property
    def weights(self):
        """Rank 0's weights (what `brass bench` counts: one rank's share of the model)."""
        return self.ranks[0].weights

    def rank_memory(self) -> list[dict]:
        """Each rank's bytes, in rank order: "weights" (prepared so far) and "kv_cache" (its
        part of every live session's cache)."""
        return self.call(Command("memory"))

    @property
    def failure(self) -> str | None:
        """Why the ranks stopped (a worker died, or failed a step), in one line; None while they
        run. Under threads a failed step leaves the group usable: always None."""
        return self.group_ranks.failure

    def call(self, cmd: Command) -> list:
        """`cmd` on every rank; the results in rank order (None where a worker returns none)."""
        while self._freed:
            cmd.free += (self._freed.pop(),)
        return self.group_ranks.call(cmd)

    def run(self, fn) -> list:
        """`fn(rank)` on every rank at once (threads only: a function does not travel to a
        process)."""
        if not isinstance(self.group_ranks, ThreadRanks):
            raise UnsupportedError("TPModel.run needs ranks='threads': a function does not travel "
                                   "to a worker process (call() sends a Command)")
        return self.group_ranks.run(fn)

    @property
    def name(self) -> str:
        return self.gguf.get("general.name") or self.path.stem

    @property
    def chat_template(self) -> str | None:
        return self.gguf.get("tokenizer.chat_template")

    def graph_bytes(self) -> dict[str, int]:
        return {"prompt": 0, "start": 0}

    def new_session(self, n_ctx: int | None = None) -> "TPSession":
        return TPSession(self, n_ctx or self.n_ctx)

    def score(self, ids: list[int], trace=None) -> np.ndarray:
        if trace is not None:
            raise UnsupportedError("activation traces are not taken under --tp")
        return self.new_session(max(len(ids), 1)).prefill(ids, all_logits=True)

    def check_generation(self, prompt_ids, max_tokens, n_ctx=None):
        generation_length(max_tokens, len(prompt_ids), n_ctx or self.n_ctx)

    def generate(self, prompt_ids: list[int], max_tokens: int = 32,
                 sampling: SamplingParams | None = None, stop_at_eog: bool = True,
                 session: "TPSession | None" = None) -> Iterator[int]:
        s = session or self.new_session()
        self.check_generation(prompt_ids, max_tokens, s.n_ctx)
        return self._generate(prompt_ids, max_tokens, sampling or SamplingParams(temperature=0.0),
                              stop_at_eog, s)

    def _generate(self, prompt_ids, max_tokens, sampling, stop_at_eog, s):
        sampler = Sampler(sampling)
        history = list(prompt_ids)
        greedy = sampling.greedy and sampling.repetition_penalty == 1.0
        if greedy:
            # the argmax from each rank's own logits and one small all-gather (vocab.argmax)
            tok = s.step(prompt_ids, "argmax")
            for i in range(max_tokens):
                if i:
                    tok = s.step([tok], "argmax")
                yield tok
                if stop_at_eog and self.tokenizer.is_eog(tok):
                    return
            return
        logits = s.prefill(prompt_ids)
        for i in range(max_tokens):
            if i:
                logits = s.decode(tok)
            tok = s.pick(logits, sampler, history)
            yield tok
            history.append(tok)
            if stop_at_eog and self.tokenizer.is_eog(tok):
                return

    def close(self):
        self.group_ranks.close()


class TPSession:
    """One sequence over every rank: each rank's own cache (its KV heads, its value heads'
    recurrent state; under a layer split, the layers of its stage are the ones it writes)."""

    def __init__(self, model: TPModel, n_ctx: int):
        self.model, self.n_ctx = model, n_ctx
        model._sids += 1
        self.sid = model._sids
        model.call(Command("new", self.sid, n_ctx=n_ctx))
        weakref.finalize(self, model._freed.append, self.sid)
        self.cache = self.caches[0]
        self.n_past = 0
        self.graphs = self.prompt_graphs = False
        self.prompt_graphs_error = None
        self._step = None
        self._prompt_steps: dict = {}

    @property
    def caches(self) -> list:
        """The session's caches held in this process (every rank's under threads)."""
        return [r.sessions[self.sid] for r in self.model.ranks]

    def reset(self):
        self.n_past = 0
        self.model.call(Command("reset", self.sid))

    def step(self, ids, want: str = "logits"):
        """Run `ids` at the next positions on every rank. `want`: "argmax" (the last row's
        greedy token, an int), "logits" (the last row's logits `[1, V]`) or "all" (every
        row's `[T, V]`)."""
        m = self.model
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size and (ids.min() < 0 or ids.max() >= m.config.n_vocab):
            raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
        if self.n_past + len(ids) > self.n_ctx:
            raise BrassError(f"{self.n_past + len(ids)} tokens exceed the context of {self.n_ctx}")
        pos = np.arange(self.n_past, self.n_past + len(ids), dtype=np.int32)
        rows = None if want == "all" else np.array([len(ids) - 1], np.int32)
        try:
            out = m.call(Command("step", self.sid, ids=ids, pos=pos, rows=rows, want=want))
        except KeyboardInterrupt:
            # held until the step was over on every rank (finish, workers._sigint_held): the
            # caches hold the step, so the positions move on; a failed group has no positions
            if m.failure is None:
                self.n_past += len(ids)
            raise
        self.n_past += len(ids)
        return out[-1] if m.split == "layer" else out[0]

    def prefill(self, ids, all_logits: bool = False, device_logits: bool = False, trace=None):
        if trace is not None:
            raise UnsupportedError("activation traces are not taken under --tp")
        return self.step(ids, "all" if all_logits else "logits")

    def decode(self, token: int):
        return self.step([token], "logits")

    def greedy(self, token: int, n: int) -> Iterator[int]:
        for _ in range(n):
            token = self.step([token], "argmax")
            yield token

    def pick(self, logits, sampler: Sampler, history: list[int]) -> int:
        p = sampler.p
        if p.greedy and p.repetition_penalty == 1.0:
            return int(np.argmax(np.asarray(logits)[-1]))
        return sampler(np.asarray(logits)[-1], history)


def gpu_count() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES respected); 0 without CuPy."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def check_request(world: int, split: str, backend: str | None):
    """One-line errors for a --tp / --split the machine or backend cannot run (before any load)."""
    if world < 1:
        raise BrassError(f"--tp must be at least 1, got {world}")
    if split not in SPLITS:
        raise BrassError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if backend == "cuda":
        from .workers import rank_device
        # enough devices for every rank (rank r takes the r-th, CUDA_VISIBLE_DEVICES order)
        rank_device(0, world, gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
