"""Loading a model and running it: prefill, decode, teacher-forced scoring, generation."""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import arch as arch_registry
from . import flags
from .arch.common import Forward, Weights
from .backends import BACKENDS, default_backend, get_backend
from .backends.base import Backend
from .catalog import resolve
from .config import read_config
from .errors import BrassError, UnsupportedError
from .gguf import GGUFFile
from .kv_cache import BlockPool, KVCache, PagedKVCache
from .sampling import Sampler, SamplingParams, generation_length
from .tokenizer import Tokenizer
from .validate import check_model

DEFAULT_CTX = 4096
# Greedy decoding on a graph-capable backend runs ahead of the host in chunks of this many
# steps, two chunks in flight: the device never waits for Python, and a stop (end of
# generation) wastes at most two chunks of steps.
GREEDY_CHUNK = 8
# Prompt graphs (the model's prompt_graphs option; default: the BRASS_PROMPT_GRAPHS setting, on):
# a prompt of a length class (prompt_class) the model has read before is captured (PromptStep)
# by the session reading it and replayed the next times, instead of a few hundred launches of
# Python: a small model's prompt on the GPU is bound by them (~50 us of host time a launch).
# A graph reads the last length of its class; a shorter prompt of the class is padded to it,
# and how many rows are real is a device word rewritten before each replay (_PrefillGraph), so
# that a prompt of a length never read before replays too.
# A prompt that starts a sequence (position 0: a new request, a reset session) is not the
# session's to capture: the model keeps those (StartStep, in the same ledger; the
# shared_prompt_graphs option, on), each over a cache of its own, and a replay's keys, values
# and recurrent state are copied into the session's cache (the same bits: a sequence's first
# prompt reads nothing else of its cache). Why: a server's pooled sessions each see a length
# about twice, so each would capture once and hardly replay; shared, a length is captured once
# for all of them. A prompt that goes on from a later position in a server's pooled sessions
# (a request whose prefix came from the prefix cache, a prompt read in chunks) takes the
# model's ContinueStep of the class for the sessions' block pool: a graph over a block table of
# its own, into which each replay first copies the session's, so that the keys and values are
# read and written in the session's blocks (not for the hybrids, whose recurrent state is the
# session's own). Before it, each pooled session captured its own graph of the class: sixteen
# captures where one serves.
# One ledger per model (GraphLedger) holds every prompt graph of the model, its sessions' and
# its StartSteps: at most PROMPT_GRAPHS_KEPT of them, holding at most the model's
# prompt_graphs_mb (default: the BRASS_PROMPT_GRAPHS_MB setting) together, whatever the number
# of sessions; the least recently used make room for a new one, whoever captured it. Each graph
# holds its prompt's peak working set (the blocks of its own memory pool; a StartStep its cache
# too); one larger than the whole budget is dropped once captured, its length read eagerly from
# then on by whoever captured it. Until issue 11 the budget and the count were a session's, so a
# server's graphs could hold --parallel times them (and evicted graphs kept their memory:
# backends/cuda/graphs.py capture). The count bounds what a graph's bytes do not show (its
# instantiated graph, pinned buffers); real shapes reach the bytes first (a StartStep over a
# server's 256-slot cache holds ~29 MB of keys and values on the Qwen3-0.6B shape, ~38 MB on the
# 8B, besides its working set). A new graph is captured before older ones make room: for that
# moment the graphs hold one more.
PROMPT_GRAPHS_KEPT = 32
# The most tokens one forward reads: the CUDA kernels put a prompt's tokens on a grid's y axis
# (the embedding lookup, rope_store, kv_store, attention), which CUDA bounds at 65,535 blocks
# (a launch past it does not start). A longer prompt is read in pieces of this many tokens (the
# cache carries one piece to the next), each piece's class at most this many rows
# (prompt_class(65535) = 65535).
MAX_PREFILL_ROWS = 65535


def prompt_class(n: int) -> int:
    """The rows of the prompt graph that reads a prompt of n >= 2 tokens: the last length of
    n's class. The classes are half-open ranges of lengths: [2, 4), [4, 8), [8, 16), then
    steps of 16 up to 128, then eight a doubling (a step of 2^(k-3) between 2^k and 2^(k+1)).
    Why these:
    - a padded prompt computes at most an eighth more rows than it has above 128 tokens (at
      most 15 more below: there a prompt is bound by its launches, not its rows), where a
      fixed step of 64 would waste half of a prompt of 65 and fix nothing for long ones;
    - few classes: 51 up to 4,096 tokens, 75 up to 32,768, so the graphs a server keeps
      (PROMPT_GRAPHS_KEPT) cover the lengths it sees after a few prompts of each class;
    - every length at which the CUDA backend picks another kernel for a prompt of T rows
      starts a class (T >= 2 the tiled attention, GEMM_MIN_TOKENS = 32 the float16 GEMMs and
      the MoE int8 tiles, DELTA_CHUNKED_MIN_TOKENS = 64 the chunked delta rule), so a prompt
      and its class's graph run the same kernels, and the graph gives what an eager read does
      (tests: conformance/models/test_prompt_classes.py)."""
    if n < 2:
        raise ValueError(f"a prompt graph reads at least 2 tokens, not {n}")
    if n < 16:
        step = 1 << (n.bit_length() - 1)
    elif n < 128:
        step = 16
    else:
        step = 1 << (n.bit_length() - 4)
    return (n // step + 1) * step - 1


class GraphLedger:
    """Every captured prompt graph of a model by (shelf, key), least recently used first: at
    most PROMPT_GRAPHS_KEPT, holding at most `budget` bytes together; the least recently used
    make room for a new one, whichever shelf it is on. The ledger holds the only reference to a
    graph it keeps: one evicted (or dropped with its shelf) is freed at once."""

    def __init__(self, budget: int):
        self.budget = budget
        self.steps: OrderedDict = OrderedDict()

    def get(self, shelf: "GraphShelf", key, capture: Callable, failed: Callable):
        """The graph of `key` on `shelf`, captured by `capture()` if not kept; None for a key
        the shelf reads eagerly, or when the capture raised (then `failed(exception)` was
        called)."""
        st = self.steps.pop((shelf, key), None)
        if st is None:
            if key in shelf.eager:
                return None
            budget = self.budget
            try:
                st = capture()
            except Exception as e:
                failed(e)
                return None
            if st.nbytes > budget:
                shelf.eager.add(key)            # its memory is freed with it
                return None
            # list(): one step under the GIL, so that a finalizer dropping a session's or a
            # pool's shelf on another thread cannot change the ledger under the sum
            held = sum(s.nbytes for s in list(self.steps.values()))
            while self.steps and (len(self.steps) >= PROMPT_GRAPHS_KEPT or held + st.nbytes > budget):
                held -= self.steps.popitem(last=False)[1].nbytes
        self.steps[(shelf, key)] = st
        return st

    def drop(self, shelf: "GraphShelf"):
        """Free every graph on `shelf` (a session's when it goes: whichever thread drops it)."""
        for k in [k for k in list(self.steps) if k[0] is shelf]:
            self.steps.pop(k, None)


class GraphShelf:
    """One owner's place in the model's GraphLedger (a session's own graphs, or the model's
    StartSteps), and the keys it reads eagerly (their graph was over the whole budget)."""

    def __init__(self, ledger: GraphLedger):
        self.ledger = ledger
        self.eager: set = set()

    def get(self, key, capture: Callable, failed: Callable):
        return self.ledger.get(self, key, capture, failed)

    def __contains__(self, key) -> bool:
        return (self, key) in self.ledger.steps

    @property
    def steps(self) -> dict:
        """{key: graph} of this shelf's graphs, least recently used first (a copy)."""
        return {k: st for (shelf, k), st in list(self.ledger.steps.items()) if shelf is self}

    def clear(self):
        self.ledger.drop(self)


def graphs_enabled(model) -> bool:
    """Whether `model`'s decode steps replay captured graphs: its backend captures them and its
    graphs option is on (off: the eager path, for comparison and debugging)."""
    return model.backend.supports_graphs and model.graphs


class Model:
    """A GGUF model on a backend. `Model(path_or_catalog_name, backend="numpy"|"cuda")`."""

    def __init__(self, model: str | os.PathLike | None = None, backend: "str | Backend | None" = None,
                 n_ctx: int | None = None, quiet: bool = False, *, graphs: bool | None = None,
                 prompt_graphs: bool | None = None, shared_prompt_graphs: bool = True,
                 prompt_graphs_mb: float | None = None, **backend_options):
        """`graphs`: decode steps replayed as captured graphs where the backend has them;
        `prompt_graphs`: prompts too (PromptStep, StartStep), `shared_prompt_graphs`: a
        sequence's first prompt through the model's graphs, `prompt_graphs_mb`: what the prompt
        graphs may hold together; None: the BRASS_GRAPH, BRASS_PROMPT_GRAPHS and
        BRASS_PROMPT_GRAPHS_MB settings. `backend`: a name, or a Backend already made (its options
        then are its own); `backend_options`: the backend's own (NumpyBackend, CudaBackend)."""
        self.graphs = flags.get("BRASS_GRAPH") if graphs is None else bool(graphs)
        self.prompt_graphs = (flags.get("BRASS_PROMPT_GRAPHS") if prompt_graphs is None
                              else bool(prompt_graphs))
        self.shared_prompt_graphs = bool(shared_prompt_graphs)
        mb = flags.get("BRASS_PROMPT_GRAPHS_MB") if prompt_graphs_mb is None else prompt_graphs_mb
        if not (mb >= 0 and mb < float("inf")):
            raise BrassError(f"prompt_graphs_mb must be a finite number of MiB >= 0, got {mb!r}")
        self.path = resolve(model, quiet=quiet)
        self.gguf = GGUFFile(self.path)
        arch_name = self.gguf.architecture
        self.arch = arch_registry.get(arch_name)
        self.config = self.arch.configure(read_config(self.gguf, arch_name), self.gguf)
        check_model(self.gguf, self.config)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        if isinstance(backend, Backend):
            # a backend made by the caller (a tensor-parallel rank's: distributed/cuda_rank.py)
            _backend_for(arch_name, backend.name)
            self.backend = backend
        else:
            backend = _backend_for(arch_name, backend)
            if backend == "cuda":
                # prompt graphs capture cuBLAS calls: the backend then makes them through its own
                # handle, for eager prompts too (CudaOptions.own_cublas)
                backend_options.setdefault("own_cublas", self.prompt_graphs)
            self.backend = get_backend(backend, **backend_options)
        self.weights = Weights(self.backend, self.gguf)
        self.n_ctx = min(n_ctx or DEFAULT_CTX, self.config.n_ctx_train)
        # prompt classes (prompt_class) some session read eagerly (their kernels loaded):
        # another session's first prompt of such a class is captured at once (prompt_graphs),
        # which is what a server's pooled sessions, each with its own cache, need to replay
        self.prompt_classes_read: set[int] = set()
        # every prompt graph of the model and its sessions, under one budget (PROMPT_GRAPHS_KEPT)
        self.graph_ledger = GraphLedger(int(mb * 2**20))
        # sequences' first prompts, captured once for every session (StartStep): keyed by
        # (length, the sessions' n_ctx); start_graphs_error says why a capture failed (the
        # sessions then capture and fail, or not, on their own, as before)
        self._start_shelf = GraphShelf(self.graph_ledger)
        self.start_graphs_error: str | None = None
        # prompts that go on from a position past 0 in a server's pooled sessions (ContinueStep):
        # a shelf per block pool, keyed by (length class, the sessions' n_ctx), dropped with the
        # pool; continue_graphs_error as start_graphs_error
        self._continue_shelves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.continue_graphs_error: str | None = None
        if hasattr(self.backend, "load"):
            with self.backend.activate():
                self.backend.load(self.gguf, self.weights, quiet=quiet)

    @property
    def name(self) -> str:
        return self.gguf.get("general.name") or self.path.stem

    @property
    def chat_template(self) -> str | None:
        return self.gguf.get("tokenizer.chat_template")

    def new_session(self, n_ctx: int | None = None, pool=None) -> "Session":
        """A session of n_ctx positions (default: the model's). `pool`: a BlockPool it takes
        blocks from per sequence (a server's; paged backends only), else a cache of its own."""
        return Session(self, n_ctx or self.n_ctx, pool)

    def new_cache(self, n_ctx: int, pool=None):
        """A sequence's cache: on a backend with paged_kv a PagedKVCache (over `pool`, holding
        no blocks until given some, or over a pool of its own holding all of its n_ctx
        positions), else a contiguous KVCache."""
        b = self.backend
        with b.activate():
            if getattr(b, "paged_kv", False):
                return PagedKVCache(pool, n_ctx) if pool is not None else \
                    PagedKVCache.private(b, self.config, n_ctx)
            if pool is not None:
                raise BrassError(f"the {b.name} backend keeps contiguous KV caches: no block pool")
            return KVCache(b, self.config, n_ctx)

    def new_block_pool(self, n_blocks: int):
        """A BlockPool of n_blocks for this model's sequences (paged backends only)."""
        if not getattr(self.backend, "paged_kv", False):
            raise BrassError(f"the {self.backend.name} backend keeps contiguous KV caches: no block pool")
        with self.backend.activate():
            return BlockPool(self.backend, self.config, n_blocks)

    @property
    def _start_steps(self) -> dict:
        """{(class, n_ctx): StartStep} kept, least recently used first (a copy)."""
        return self._start_shelf.steps

    def graph_bytes(self) -> dict[str, int]:
        """Device bytes the captured prompt graphs hold: "prompt", the sessions' own
        (PromptStep), "start", the model's first prompts (StartStep, with their caches), and
        "continue", the model's prompts going on over a block pool (ContinueStep); together at
        most the budget (graph_ledger.budget). Read from another thread (a server's /metrics) while
        the worker captures: the ledger is copied whole first (list() of an OrderedDict's items
        runs under the GIL), so it does not change under the sums."""
        out = {"prompt": 0, "start": 0, "continue": 0}
        continuing = {id(shelf) for shelf in list(self._continue_shelves.values())}
        for (shelf, _), st in list(self.graph_ledger.steps.items()):
            kind = ("start" if shelf is self._start_shelf else
                    "continue" if id(shelf) in continuing else "prompt")
            out[kind] += st.nbytes
        return out

    def forward(self, ids, pos, cache: KVCache, out_rows=None, trace: Callable | None = None,
                n_real=None):
        """Logits (backend array) for tokens `ids` at positions `pos`; `out_rows` selects the
        rows whose logits are wanted (None: all); `n_real`: a one-element int32 backend array,
        the rows that are the prompt's when it is padded to its class (Forward.n_real)."""
        f = Forward(self.backend, self.config, self.weights, cache, pos, trace, n_real)
        with self.backend.activate():
            return self.arch.forward(f, ids, out_rows)

    def score(self, ids: list[int], trace: Callable | None = None) -> np.ndarray:
        """Teacher forcing: one prefill over `ids` (no BOS added), logits at every position."""
        s = self.new_session(max(len(ids), 1))
        return s.prefill(ids, all_logits=True, trace=trace)

    def check_generation(self, prompt_ids: list[int], max_tokens: int, n_ctx: int | None = None):
        """Raise BrassError (a ParameterError) unless `max_tokens` after `prompt_ids` fit a
        context of `n_ctx` (default: the model's) and both are non-empty: the engine's one
        check, sampling.generation_length."""
        generation_length(max_tokens, len(prompt_ids), n_ctx or self.n_ctx)

    def generate(self, prompt_ids: list[int], max_tokens: int = 32,
                 sampling: SamplingParams | None = None, stop_at_eog: bool = True,
                 session: "Session | None" = None, cached: int = 0) -> Iterator[int]:
        """Yield generated token ids one by one (greedy when sampling.temperature == 0). With
        stop_at_eog, generation ends after yielding an end-of-generation token (callers that
        print text leave its text out, as llama.cpp does). `cached`: the session already holds
        the first `cached` prompt tokens (its n_past), which are not read again. Bad arguments
        raise here, before any token."""
        s = session or self.new_session()
        self.check_generation(prompt_ids, max_tokens, s.cache.n_ctx)
        if not 0 <= cached < len(prompt_ids) or (cached and s.n_past != cached):
            raise BrassError(f"cached must be the session's {s.n_past} positions and less than "
                             f"the prompt's {len(prompt_ids)} tokens, not {cached}")
        return self._generate(prompt_ids, max_tokens, sampling or SamplingParams(temperature=0.0),
                              stop_at_eog, s, cached)

    def _generate(self, prompt_ids, max_tokens, sampling, stop_at_eog, s, cached=0) -> Iterator[int]:
        sampler = Sampler(sampling)
        history = list(prompt_ids)
        logits = s.prefill(prompt_ids[cached:], device_logits=True)
        tok = s.pick(logits, sampler, history)
        if max_tokens > 1 and sampling.greedy and sampling.repetition_penalty == 1.0 and s.graphs:
            # The whole greedy loop on the device: the argmax feeds the next step there.
            yield tok
            if stop_at_eog and self.tokenizer.is_eog(tok):
                return
            for tok in s.greedy(tok, max_tokens - 1):  # noqa: B020 (tok goes on from the last token yielded)
                yield tok
                if stop_at_eog and self.tokenizer.is_eog(tok):
                    return
            return
        for i in range(max_tokens):
            if i:
                tok = s.pick(logits, sampler, history)
            yield tok
            history.append(tok)
            if stop_at_eog and self.tokenizer.is_eog(tok):
                return
            if i + 1 < max_tokens:
                logits = s.decode(tok)


@dataclass
class Session:
    """One sequence: its KV cache and how many positions are filled."""

    model: Model
    n_ctx: int
    pool: object = None             # a BlockPool the cache takes its blocks from (a server's)

    def __post_init__(self):
        self.cache = self.model.new_cache(self.n_ctx, self.pool)
        self.n_past = 0
        self.graphs = graphs_enabled(self.model)
        self._step: DecodeStep | None = None
        # prompt graphs (the model's prompt_graphs): its PromptSteps by class, in the model's ledger (the
        # classes read eagerly once are the model's), dropped from it when the session goes;
        # prompt_graphs False once a capture failed (the forward synchronised with the host: a
        # MoE prompt whose routing is planned there)
        self._prompt_shelf = GraphShelf(self.model.graph_ledger)
        weakref.finalize(self, self.model.graph_ledger.drop, self._prompt_shelf).atexit = False
        # classes this session read eagerly from position 0: it captures its own graph of
        # them next (a session reading one class again and again, as a bench or a loop does,
        # replays without StartStep's copies); a class it has not read itself goes to the
        # model's StartStep (a server's pooled sessions, each reading a class a few times)
        self._read_here: set[int] = set()
        self.prompt_graphs = self.model.prompt_graphs and self.graphs
        self.prompt_graphs_error: str | None = None     # why a capture failed, if one did

    @property
    def _prompt_steps(self) -> dict:
        """{class: PromptStep} of this session kept, least recently used first (a copy)."""
        return self._prompt_shelf.steps

    def reset(self):
        """Forget the sequence (the cache slots are rewritten as positions are reached again;
        a hybrid model's recurrent state is zeroed)."""
        self.n_past = 0
        with self.model.backend.activate():
            self.cache.reset()

    def prefill(self, ids: list[int], all_logits: bool = False, device_logits: bool = False,
                trace: Callable | None = None):
        m, b = self.model, self.model.backend
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size and (ids.min() < 0 or ids.max() >= m.config.n_vocab):
            raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
        if self.n_past + len(ids) > self.n_ctx:
            raise BrassError(f"{self.n_past + len(ids)} tokens exceed the context of {self.n_ctx}")
        self._check_blocks(self.n_past + len(ids))
        if len(ids) > MAX_PREFILL_ROWS:
            pieces = [ids[i:i + MAX_PREFILL_ROWS] for i in range(0, len(ids), MAX_PREFILL_ROWS)]
            if not all_logits:
                for piece in pieces[:-1]:
                    self.prefill(piece, device_logits=True, trace=trace)
                return self.prefill(pieces[-1], device_logits=device_logits, trace=trace)
            rows = np.concatenate([self.prefill(piece, all_logits=True, trace=trace) for piece in pieces])
            with b.activate():
                return b.asarray(rows) if device_logits else rows
        # a prompt graph's padding rows go to the cache slots after the prompt's (rewritten
        # when decoding reaches them): they must be slots the cache holds
        if self.prompt_graphs and not all_logits and trace is None and len(ids) >= 2 \
                and self.n_past + prompt_class(len(ids)) <= _slots_held(self.cache):
            n = prompt_class(len(ids))
            if m.shared_prompt_graphs and self.n_past == 0 and n not in self._prompt_shelf \
                    and n not in self._read_here and m.start_graphs_error is None:
                # a class this session has not read itself: the model's graph, if any
                st = self._start_step(n)
                if st is not None:
                    with b.activate():
                        logits = st.run(ids, self.cache)
                        self.n_past = len(ids)
                        return logits if device_logits else b.to_numpy(logits)
                st = None
                if self.prompt_graphs:
                    self._read_here.add(n)      # read eagerly here: captured here next time
            elif m.shared_prompt_graphs and self.n_past > 0 and n not in self._prompt_shelf \
                    and self._continues_shared() and m.continue_graphs_error is None:
                # a prompt going on in a pooled session: the model's graph for the pool, if any
                st = self._continue_step(n)
                if st is not None:
                    with b.activate():
                        logits = st.run(ids, self.n_past, self.cache)
                        self.n_past += len(ids)
                        return logits if device_logits else b.to_numpy(logits)
            else:
                st = self._prompt_step(n)
            with b.activate():
                if st is not None:
                    logits = st.run(ids, self.n_past)
                else:
                    # no graph (the class's first read, or one over the budget): read eagerly,
                    # padded as its graph reads it, so that the kernels its capture will record
                    # are the ones loaded, and every read of a class computes the same rows
                    h = padded_rows(ids, self.n_past, n)
                    logits = m.forward(b.asarray(h[:n]), b.asarray(h[n:2 * n]), self.cache,
                                       b.asarray(h[2 * n + 1:]), n_real=b.asarray(h[2 * n:2 * n + 1]))
                self.n_past += len(ids)
                return logits if device_logits else b.to_numpy(logits)
        pos = np.arange(self.n_past, self.n_past + len(ids), dtype=np.int32)
        with b.activate():
            out_rows = None if all_logits else b.asarray(np.array([len(ids) - 1], np.int32))
            logits = m.forward(b.asarray(ids), b.asarray(pos), self.cache, out_rows, trace)
            self.n_past += len(ids)
            return logits if device_logits else b.to_numpy(logits)

    def _prompt_step(self, n: int) -> "PromptStep | None":
        """The captured prefill of class n (prompt_class): None the first time the class comes
        to the model (the prompt read eagerly, loading the kernels its class runs), captured
        the next time, in this session or another; a failed capture turns prompt graphs off
        for this session (its prompts are then read eagerly, as before)."""
        if n not in self._prompt_shelf and n not in self.model.prompt_classes_read:
            self.model.prompt_classes_read.add(n)
            return None
        def failed(e):
            self.prompt_graphs = False
            self.prompt_graphs_error = f"{type(e).__name__}: {e}"
            self._prompt_shelf.clear()
        return self._prompt_shelf.get(n, lambda: PromptStep(self, n), failed)

    def _start_step(self, n: int) -> "StartStep | None":
        """The model's captured prefill of class n from position 0 for caches of this
        session's size: None the first time the model reads the class (eagerly, here), captured
        the next time, by whichever session; None too for a session whose cache would take more
        than half the graphs' budget (a StartStep holds a cache of that size: the session
        captures its own graph instead). A failed capture is the model's (start_graphs_error):
        the sessions go on with their own graphs."""
        m = self.model
        key = (n, self.n_ctx)
        if key not in m._start_shelf:
            if n not in m.prompt_classes_read:
                m.prompt_classes_read.add(n)    # read eagerly by the caller: its kernels load
                return None
            if KVCache.nbytes_for(m.config, self.n_ctx) > m.graph_ledger.budget // 2:
                return None
        def failed(e):
            m.start_graphs_error = f"{type(e).__name__}: {e}"
        return m._start_shelf.get(key, lambda: StartStep(m, n, self.n_ctx), failed)

    def _continues_shared(self) -> bool:
        """Whether this session's later prompts may take the model's ContinueStep: its cache is
        paged over a shared pool (a server's) and holds no recurrent state of its own."""
        return self.pool is not None and getattr(self.cache, "recurrent", True) is None

    def _continue_step(self, n: int) -> "ContinueStep | None":
        """The model's captured prefill of class n from a later position, over this session's
        block pool, for caches of this session's size: None the first time the model reads
        the class (eagerly, here). A failed capture is the model's (continue_graphs_error):
        the sessions then capture their own, as before."""
        m = self.model
        shelf = m._continue_shelves.get(self.pool)
        if shelf is None:
            shelf = m._continue_shelves[self.pool] = GraphShelf(m.graph_ledger)
            # the pool's graphs go with it (they hold its arrays; nothing else replays them)
            weakref.finalize(self.pool, m.graph_ledger.drop, shelf).atexit = False
        key = (n, self.n_ctx)
        if key not in shelf and n not in m.prompt_classes_read:
            m.prompt_classes_read.add(n)        # read eagerly by the caller: its kernels load
            return None
        def failed(e):
            m.continue_graphs_error = f"{type(e).__name__}: {e}"
        return shelf.get(key, lambda: ContinueStep(m, n, self.pool, self.n_ctx), failed)

    def decode(self, token: int):
        """Logits (device array) after `token` at the next position. On a graph-capable backend
        the step replays a captured graph, and the array returned is the graph's own: the next
        decode overwrites it."""
        if not self.graphs:
            return self.prefill([token], device_logits=True)
        if self._step is None:
            # The first step runs eagerly (loading every kernel the step uses), then it is
            # captured for the following ones.
            logits = self.prefill([token], device_logits=True)
            self._step = DecodeStep(self)
            return logits
        self._check_room(1)
        m = self.model
        if not 0 <= token < m.config.n_vocab:
            raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
        b = m.backend
        with b.activate():
            b.decode_set(self._step.tok, self._step.pos, token, self.n_past)
            self._step.graph.replay()
        self.n_past += 1
        return self._step.logits

    def greedy(self, token: int, n: int) -> Iterator[int]:
        """Yield the next `n` greedy tokens after `token` (not yet in the cache), decoding on
        the device ahead of the host (a hybrid model's session one step at a time: see below).
        Stopping early leaves n_past at the last token yielded (steps run ahead are discarded)."""
        self._check_room(n)
        b = self.model.backend
        if not self.graphs:
            for _ in range(n):
                logits = self.decode(token)
                with b.activate():
                    token = int(b.to_numpy(b.argmax(logits))[-1])
                yield token
            return
        if self._step is None and n:
            logits = self.decode(token)
            with b.activate():
                token = int(b.to_numpy(b.argmax(logits))[-1])
            yield token
            n -= 1
        if not n:
            return
        st = self._step
        start = self.n_past                     # token goes to this position
        issued, chunks = 0, deque()
        # Steps run ahead of the consumer are discarded when it stops early: harmless for a KV
        # cache (those slots are rewritten when reached again), not for a recurrent state,
        # which they would advance past the last token kept. So a hybrid model's session
        # issues one step at a time, when the consumer asks for the next token.
        ahead = getattr(self.cache, "recurrent", None) is None
        per_issue = GREEDY_CHUNK if ahead else 1
        with b.activate():
            b.decode_set(st.tok, st.pos, token, start)

        def issue():
            nonlocal issued
            c = min(per_issue, n - issued)
            with b.activate():
                for _ in range(c):
                    st.graph.replay()
                chunks.append((st.read_history(start + 1 + issued, c), c))
            issued += c

        issue()
        done = 0
        while done < n:
            if ahead and issued < n:
                issue()                         # keep the next chunk queued behind this one
            read, c = chunks.popleft()
            for tok in read():
                done += 1
                self.n_past = start + done
                yield int(tok)
            if not ahead and issued < n:
                issue()

    def _check_room(self, n: int):
        if self.n_past + n > self.n_ctx:
            raise BrassError(f"{self.n_past + n} tokens exceed the context of {self.n_ctx}")
        self._check_blocks(self.n_past + n)

    def _check_blocks(self, n: int):
        """A paged cache over a shared pool holds the blocks of its request, not of its whole
        context: positions past them are refused here, before any kernel runs."""
        check = getattr(self.cache, "check_room", None)
        if check is not None:
            check(n)

    def pick(self, logits, sampler: Sampler, history: list[int]) -> int:
        b = self.model.backend
        p = sampler.p
        with b.activate():
            if p.greedy and p.repetition_penalty == 1.0:
                return int(b.to_numpy(b.argmax(logits))[-1])
            return sampler(b.to_numpy(logits)[-1], history)


class DecodeStep:
    """One single-token decode step of a session, captured as a graph: embedding of the token
    in `tok`, every layer at position `pos` (both device scalars), final norm, LM head
    (`logits`), argmax, and the greedy advance (tok = argmax, pos += 1, history[pos] = tok).
    Nothing in it synchronises with the host; replays differ only in what tok and pos hold."""

    def __init__(self, session: Session):
        m = session.model
        b = m.backend
        with b.activate():
            self.tok = b.zeros((1,), np.int32)
            self.pos = b.zeros((1,), np.int32)
            # history[p]: the greedy token for position p; the last step's token is for n_ctx.
            self.history = b.zeros((session.n_ctx + 1,), np.int32)
            self._host = [b.pinned_empty(GREEDY_CHUNK, np.int32) for _ in range(3)]
        self._next_host = 0

        tok, pos, history, cache = self.tok, self.pos, self.history, session.cache

        def step():             # reaches neither the step nor the session (see _PrefillGraph)
            logits = m.forward(tok, pos, cache)
            b.decode_advance(b.argmax(logits), tok, pos, history)
            return logits

        before = getattr(b, "launches", 0)
        self.graph = b.capture(step)
        self.logits = self.graph.result
        self.kernels = getattr(b, "launches", 0) - before     # kernel nodes per decode token

    def read_history(self, start: int, n: int):
        """Queue a copy of history[start:start + n] to host memory; returns a function that
        waits for it and gives the tokens."""
        buf = self._host[self._next_host]
        self._next_host = (self._next_host + 1) % len(self._host)
        return self.graph.backend.copy_to_host_async(self.history[start:start + n], buf[:n])


class _PrefillGraph:
    """A prefill of up to n tokens over `cache`, captured as a graph of n rows (n: a length
    class, prompt_class): the token ids, positions, the count of real rows and the row whose
    logits are wanted come from one device array (uploaded before each replay), then every
    layer and that row's logits (the graph's own array: the next replay rewrites it). A prompt
    shorter than n is padded with token 0 at the positions after its own: attention is causal,
    so no real row sees a padding row; their keys and values go to cache slots after the
    prompt's, rewritten when decoding reaches them; the recurrent layers leave the padding
    rows out of their states (Forward.n_real); everything else is computed row by row. Its
    intermediate arrays share the graph's own memory pool (Backend.capture reuse_freed): it
    holds the peak working set of n rows."""

    def __init__(self, model: Model, n: int, cache):
        b = model.backend
        self.n = n
        with b.activate():
            # [ids (n) | positions (n) | real rows | the row of the logits]
            self.inp = b.zeros((2 * n + 2,), np.int32)
            self._host = b.pinned_empty(2 * n + 2, np.int32)
        self._uploaded = lambda: None
        self.backend = b
        # The captured function reaches only what the graph reads, not this step: a backend may
        # keep it (a replay re-running it, as the CPU tests' fake does), and a reference back
        # would make a cycle that only the garbage collector frees, the graph's memory with it.
        inp = self.inp
        ids, pos, real, rows = inp[:n], inp[n:2 * n], inp[2 * n:2 * n + 1], inp[2 * n + 1:]
        self.graph = b.capture(lambda: model.forward(ids, pos, cache, rows, n_real=real), reuse_freed=True)
        self.nbytes = getattr(self.graph, "nbytes", 0)     # the device memory it holds

    def _replay(self, ids: np.ndarray, start: int):
        self._uploaded()            # the last copy has read the pinned buffer
        padded_rows(ids, start, self.n, self._host)
        self._uploaded = self.backend.upload_async(self.inp, self._host)
        self.graph.replay()
        return self.graph.result


def padded_rows(ids, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """A prompt graph's input for the tokens `ids` at positions start.. (k <= n of them) in a
    graph of n rows: [ids, then token 0 (any id: the padding rows are left out, see
    _PrefillGraph) | positions start .. start + n - 1 | k | k - 1, the row of the logits]."""
    k = len(ids)
    if not 1 <= k <= n:
        raise BrassError(f"a prompt graph of {n} rows cannot read {k} tokens")
    h = np.empty(2 * n + 2, np.int32) if out is None else out
    h[:k] = ids
    h[k:n] = 0
    h[n:2 * n] = np.arange(start, start + n, dtype=np.int32)
    h[2 * n], h[2 * n + 1] = k, k - 1
    return h


class PromptStep(_PrefillGraph):
    """A session's prefill of a prompt of class n, over the session's cache, from any position
    (start + n <= the cache's slots: the padding rows write there too)."""

    def __init__(self, session: Session, n: int):
        super().__init__(session.model, n, session.cache)

    def run(self, ids: np.ndarray, start: int):
        """Logits after the tokens `ids` (of class n) at positions start .. start + len(ids) - 1."""
        return self._replay(ids, start)


class StartStep(_PrefillGraph):
    """A prefill of a prompt of class n from position 0 over a cache of its own (`cache`, n_ctx
    slots like the sessions' it serves), for every session of the model: `run` zeroes the
    cache's recurrent state, replays, and copies the prompt's slots of keys and values (and the
    recurrent state) into the session's cache. The same bits as the session reading the prompt
    itself: the same kernels on the same inputs, and attention from position 0 reads only the
    slots the prompt writes. It holds its cache and its peak working set (own memory pool)."""

    def __init__(self, model: Model, n: int, n_ctx: int):
        self.cache = model.new_cache(n_ctx)
        super().__init__(model, n, self.cache)
        self.nbytes += self.cache.nbytes

    def run(self, ids: np.ndarray, cache: KVCache):
        """Logits after the tokens `ids` at positions 0 .. len(ids) - 1 of `cache` (written
        there). The logits are a copy: the next session's replay rewrites the graph's own."""
        self.cache.reset()
        self._replay(ids, 0)
        cache.copy_prefix(self.cache, len(ids))
        return self.graph.result.copy()


class ContinueStep(_PrefillGraph):
    """A prefill of a prompt of class n from any position over a block pool, for every session
    of the pool whose cache has n_ctx positions and no recurrent state (a server's): captured
    over a PagedKVCache of its own on the pool (`cache`, holding no blocks: it never allocates
    or releases, and refers to the pool weakly, so that the pool's going drops the graph), into
    whose block table `run` copies the session's before each replay. The same kernels on the
    same inputs as the session reading the prompt itself, so the same bits; the keys and values
    go to the session's blocks."""

    def __init__(self, model: Model, n: int, pool, n_ctx: int):
        b = model.backend
        with b.activate():
            self.cache = PagedKVCache(weakref.proxy(pool), n_ctx)
            device = self.cache.device_table
            self._staging = None if device is None else b.pinned_empty(device.shape[0], np.int32)
        self._table_read = lambda: None
        super().__init__(model, n, self.cache)

    def run(self, ids: np.ndarray, start: int, cache: PagedKVCache):
        """Logits after the tokens `ids` at positions start .. start + len(ids) - 1 of `cache`
        (a session's over the pool). The logits are a copy: another session's replay rewrites
        the graph's own."""
        self._table_read()                  # the last table copy has read the staging buffer
        self._table_read = self.cache.follow(cache, self._staging)     # the session's blocks
        self._replay(ids, start)
        return self.graph.result.copy()


def _slots_held(cache) -> int:
    """The positions `cache` can be written at: a contiguous cache's n_ctx; a paged one's, only
    those its block table holds (over a server's shared pool, a position past them is in no
    block of the sequence: a prompt graph's padding must not go there)."""
    table = getattr(cache, "table", None)
    if table is None:
        return cache.n_ctx
    return min(cache.n_ctx, len(table) * cache.pool.block)


def _backend_for(arch_name: str, requested: str | None) -> str | None:
    """The backend to run an architecture on: the one asked for (argument or BRASS_BACKEND),
    refused in one line when the architecture does not run there yet; by default the usual
    default if the architecture runs there, else the first backend it runs on."""
    supported = arch_registry.backends(arch_name)
    name = requested or flags.get("BRASS_BACKEND")
    if name is None:
        default = default_backend()
        return default if default in supported else supported[0]
    if name in BACKENDS and name not in supported:
        raise UnsupportedError(f"{arch_name} is not yet supported on the {name} backend; "
                               f"use --backend {supported[0]}")
    return name


def load(model: str | os.PathLike | None = None, backend: str | None = None, **kw) -> Model:
    """Open a model: a GGUF path, a catalog name, or None for the default (SmolLM2-135M)."""
    return Model(model, backend=backend, **kw)
