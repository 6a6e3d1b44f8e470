"""Batched decode: one forward step over the next token of each of several sequences.

Every sequence keeps its own Session (KV cache, position). A step stacks their next tokens as
the rows of one batch and runs the model once: each weight matrix is read once for all rows
(decode is bound by reading weights, so B sequences cost about what one does), while attention
reads each row's own cache up to its own position. Rows are computed exactly as they would be
alone (`Backend.rows_independent`): a sequence's tokens do not depend on which others share its
steps, nor on when they join or leave, so serving many requests together changes no answer.

Sequences join and leave between steps by being passed or not; prefill stays per sequence
(`Session.prefill`), so a scheduler interleaves a new request's prompt, in chunks, between the
batched steps of the running ones.

On a graph-capable backend (CUDA) a step is a few hundred kernel launches, each costing more
host time than the GPU spends on it; so a batch composition (the same sessions in the same
order) that is stepped a second time in a row is captured as a CUDA graph (`BatchStep`) and
replayed from then on: the next tokens and positions are uploaded in one copy, the rest stays
on the device. A composition lives as long as no request joins or leaves, i.e. for most steps
of a server under steady load; the first step of a new one runs eagerly (a composition seen
once costs no capture).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

from .errors import BrassError, UnsupportedError


class SequenceBatch:
    """What a batched step's forward pass sees as its cache: the sequences' caches in row
    order (the attention block writes and reads row r in `sequences[r]`)."""

    def __init__(self, caches: list):
        self.sequences = caches


def supports_batched_decode(model) -> bool:
    """Whether the model's architecture decodes several sequences in one step (its layers go
    through the shared attention block, which knows a SequenceBatch)."""
    return bool(getattr(model.arch, "BATCHED_DECODE", False))


# Captured compositions kept at once (each holds its sessions' caches and its own buffers).
GRAPHS_KEPT = 4
# Bucket graphs (BucketStep, BatchDecoder's buckets option, on): a step of n sequences of one
# block pool (a server's) replays the graph of the next power of two rows, whatever the
# sequences (their block tables are data), so requests joining and leaving cost no capture;
# off: the composition graphs only.
# Greedy rows of a lasting composition run one step ahead on the device (greedy_steps, the
# ahead option, on), so the GPU does not wait while the host hands out a step's tokens; off:
# each step is read back before the next is issued (for comparison).

# Sent into a greedy run (run_ahead's generator): yield the step run ahead, then end.
FINISH_RUN = object()


def run_ahead(sessions: list, tokens: np.ndarray, launch):
    """The greedy run of BatchDecoder.greedy_steps apart from the device: `launch(ids)` issues
    one step of `sessions` (ids: the step's tokens, or None for the last step's argmax on the
    device) and returns a function that waits for the step's tokens (np.int32 [n]); the step
    after the one being read is issued before it is read. Closing the generator drops the step
    issued ahead (each session goes back one position: its KV slot is rewritten when reached
    again, with the same token); sending FINISH_RUN instead yields that step's tokens (the
    sessions keep it) and ends the run, or ends it at once when none was issued (a cache full)."""
    launched = yielded = 0

    def full():                         # a session whose cache has no slot left
        return next((s for s in sessions if s.n_past >= s.n_ctx), None)

    def issue(ids):
        nonlocal launched
        if (s := full()) is not None:
            raise BrassError(f"{s.n_past + 1} tokens exceed the context of {s.n_ctx}")
        read = launch(ids)
        launched += 1
        for s in sessions:
            s.n_past += 1
        return read

    try:
        pending = issue(tokens)
        while True:
            ahead = issue(None) if full() is None else None   # none past a cache's end
            got = pending()
            yielded += 1
            if (yield got) is FINISH_RUN:
                if ahead is not None:
                    got = ahead()
                    yielded += 1
                    yield got
                return
            pending = ahead if ahead is not None else issue(None)
    finally:
        for s in sessions:              # the steps issued beyond those read
            s.n_past -= launched - yielded


class BatchDecoder:
    """`step(sessions, tokens)`: logits `[B, n_vocab]` (a backend array) after `tokens[r]` at
    the next position of `sessions[r]`, each session advanced by one. `step_argmax` also gives
    each row's greedy token (a device array [B]), computed on the device."""

    def __init__(self, model, graphs: bool | None = None, buckets: bool = True, ahead: bool = True):
        """`graphs`: compositions (and buckets) replayed as captured graphs (None: as the
        model's sessions do, graphs_enabled); `buckets`, `ahead`: see above."""
        if not supports_batched_decode(model):
            raise UnsupportedError(f"{model.gguf.architecture} does not decode sequences in "
                                   f"batches yet")
        from .model import graphs_enabled
        self.model = model
        self.graphs = graphs_enabled(model) if graphs is None else graphs
        # Bucket graphs need a backend that reads the rows' block tables as data (CUDA, with
        # its row kernels on) and an architecture that reaches its caches only through those
        # (BUCKET_GRAPHS: not gemma4, which writes each row's cache itself; not the hybrids,
        # whose recurrent state the forward addresses per sequence). While a bucket graph is
        # captured, the CUDA backend refuses a cache written or read directly.
        self.buckets = (self.graphs and buckets and model.backend.row_tables
                        and getattr(model.arch, "BUCKET_GRAPHS", False))
        self.ahead = ahead
        self._bucket_steps: dict[tuple, BucketStep] = {}   # (rows, capacity, id(pool))
        self._pads: dict = {}           # id(pool): a sequence of no blocks for a bucket's unused rows
        self._steps: OrderedDict[tuple, BatchStep] = OrderedDict()
        self._last: tuple | None = None
        self.captures = 0               # graphs captured (a composition stepped twice in a row)
        self.replays = 0

    def step(self, sessions: list, tokens: list[int]):
        return self.step_argmax(sessions, tokens, argmax=False)[0]

    def step_argmax(self, sessions: list, tokens: list[int], argmax: bool = True):
        """(logits [B, n_vocab], greedy tokens [B] or None), both backend arrays; on the graph
        path they are the graph's own, rewritten by the next step of the same composition."""
        self._check(sessions, tokens)
        m = self.model
        b = m.backend
        ids = np.asarray([int(t) for t in tokens], np.int32)
        pos = np.asarray([s.n_past for s in sessions], np.int32)
        if self.buckets and self._bucketable(sessions):
            logits, best = self._bucket_step(sessions, ids, pos, argmax)
            for s in sessions:
                s.n_past += 1
            return logits, best
        key = tuple(id(s.cache) for s in sessions)
        st = self._steps.get(key) if self.graphs else None
        if st is None and self.graphs and key == self._last:
            st = self._capture(sessions, key)
        self._last = key
        if st is not None:
            self._steps.move_to_end(key)
            with b.activate():
                st.run(ids, pos)
            self.replays += 1
            logits, best = st.logits, st.best
        else:
            with b.activate(), b.rows_independent():
                logits = m.forward(b.asarray(ids), b.asarray(pos),
                                   SequenceBatch([s.cache for s in sessions]))
                best = b.argmax(logits) if argmax else None
        for s in sessions:
            s.n_past += 1
        return logits, best

    def _bucketable(self, sessions: list) -> bool:
        """Rows of KV caches only (no recurrent state), all of one block pool (a server's)."""
        pool = getattr(sessions[0].cache, "pool", None)
        return len(sessions) > 1 and pool is not None and all(
            s.cache.recurrent is None and s.n_ctx <= self.model.n_ctx and getattr(s.cache, "pool", None) is pool
            for s in sessions)

    def can_run_ahead(self, sessions: list) -> bool:
        """Whether `greedy_steps` takes these sessions: bucket graphs on, caches without
        recurrent state, and the bucket's graph already captured (the first step of a bucket
        goes through step_argmax, which captures it)."""
        return (self.ahead and self.buckets and self._bucketable(sessions)
                and self._bucket_key(sessions) in self._bucket_steps)

    def greedy_steps(self, sessions: list, tokens: list[int]):
        """Yield the greedy tokens (np.int32 [n]) of successive batched steps of the same
        sessions, the first step fed `tokens`, each later one fed the previous step's tokens
        on the device. The device runs one step ahead of the consumer: the step after the one
        being read back is already queued, so the GPU does not wait for the host's handling of
        a step's tokens. Closing the generator drops the step run ahead; sending FINISH_RUN
        yields its tokens and ends the run (run_ahead). Only for sessions `can_run_ahead`
        takes."""
        self._check(sessions, tokens)
        if not self.can_run_ahead(sessions):
            raise BrassError("greedy_steps needs bucket graphs, captured, over KV caches only")
        b = self.model.backend
        n = len(sessions)
        key = self._bucket_key(sessions)
        B, st = key[0], self._bucket_steps[key]
        caches = self._padded(sessions, B)
        host = [b.pinned_empty(n, np.int32) for _ in range(3)]      # read-backs in flight: 2
        issued = 0

        def launch(ids):
            nonlocal issued
            pos = np.asarray([s.n_past for s in sessions] + [-1] * (B - n), np.int32)
            with b.activate():
                if ids is None:             # this step's tokens: the last step's argmax
                    st.run(caches, np.zeros(B, np.int32), pos, ids_from=st.best[:n])
                else:
                    st.run(caches, np.concatenate([ids, np.zeros(B - n, np.int32)]), pos)
                read = b.copy_to_host_async(st.best[:n], host[issued % len(host)])
            self.replays += 1
            issued += 1
            return read

        return run_ahead(sessions, np.asarray([int(t) for t in tokens], np.int32), launch)

    def _bucket_key(self, sessions: list) -> tuple:
        """(rows, attention bound, pool) of the bucket graph a step of these sessions replays."""
        return (self._rows_for(len(sessions)), self._capacity_for(max(s.n_ctx for s in sessions)),
                id(sessions[0].cache.pool))

    def _padded(self, sessions: list, B: int) -> list:
        """The sessions' caches, then the pad cache for the rows up to B."""
        return [s.cache for s in sessions] + [self._pad_cache(sessions[0].cache.pool)] * (B - len(sessions))

    def _rows_for(self, n: int) -> int:
        """The bucket (row count of the graph) that a step of n sequences replays."""
        # A pad row of a mixture-of-experts model reads its chosen experts' weights as a real
        # row does (about as much as a row costs): there, a graph per row count instead.
        return n if self.model.config.n_expert else 1 << (n - 1).bit_length()

    def _capacity_for(self, n_ctx: int) -> int:
        """The attention bound of the graph for rows whose largest cache holds n_ctx slots (its
        shared memory grows with it): the next power of two, at least 256 slots."""
        cap = min(self.model.n_ctx, max(256, 1 << (n_ctx - 1).bit_length()))
        return max(cap, n_ctx)

    def _pad_cache(self, pool):
        """A sequence over `pool` holding no block: a bucket's unused rows are at position -1,
        so they write nothing and see no slot (their results are dropped)."""
        pad = self._pads.get(id(pool))
        if pad is None or pad.pool is not pool:
            from .kv_cache import PagedKVCache
            with self.model.backend.activate():
                pad = self._pads[id(pool)] = PagedKVCache(pool, 1)
        return pad

    def prepare_buckets(self, max_rows: int, n_ctx: int, pool=None) -> int:
        """Capture, ahead of use, the bucket graphs that steps of 2 .. max_rows sequences of
        `pool` (a server's block pool) up to n_ctx slots will replay (pad rows; what they
        compute is discarded). Returns the graphs captured (0 where bucket graphs are off, or
        without a pool)."""
        if not self.buckets or pool is None:
            return 0
        m, b = self.model, self.model.backend
        cap = self._capacity_for(n_ctx)
        before = self.captures
        for B in sorted({self._rows_for(n) for n in range(2, max_rows + 1)}):
            if (B, cap, id(pool)) in self._bucket_steps or not self.buckets:
                continue
            caches = [self._pad_cache(pool)] * B
            zeros, pads = np.zeros(B, np.int32), np.full(B, -1, np.int32)
            with b.activate(), b.rows_independent():          # loads the kernels of this B
                m.forward(b.asarray(zeros), b.asarray(pads), SequenceBatch(caches))
            self._capture_bucket(B, cap, caches)
        return self.captures - before

    def _capture_bucket(self, B: int, cap: int, caches: list):
        try:
            self._bucket_steps[(B, cap, id(caches[0].pool))] = BucketStep(self.model, caches, cap)
            self.captures += 1
        except Exception as e:          # stay on the composition graphs
            print(f"brass: bucket graphs off ({type(e).__name__}: {e})", file=sys.stderr)
            self.buckets = False

    def _bucket_step(self, sessions: list, ids, pos, argmax: bool):
        """A step of n sequences as a step of B = the next power of two rows (n itself for a
        mixture-of-experts model), the rows past n at position -1 of a pad sequence holding no
        block (they write nothing and see nothing; their results are dropped; rows are
        independent, so they change nothing for the others). The first step of a bucket
        runs eagerly (loading its kernels), and captures the bucket's graph for the next."""
        m, b = self.model, self.model.backend
        n = len(sessions)
        key = self._bucket_key(sessions)
        B, cap = key[0], key[1]
        caches = self._padded(sessions, B)
        ids = np.concatenate([ids, np.zeros(B - n, np.int32)])
        pos = np.concatenate([pos, np.full(B - n, -1, np.int32)])
        st = self._bucket_steps.get(key)
        if st is not None:
            with b.activate():
                st.run(caches, ids, pos)
            self.replays += 1
            return st.logits[:n], (st.best[:n] if argmax else None)
        with b.activate(), b.rows_independent():
            logits = m.forward(b.asarray(ids), b.asarray(pos), SequenceBatch(caches))
            best = b.argmax(logits) if argmax else None
        self._capture_bucket(B, cap, caches)
        return logits[:n], (best[:n] if argmax else None)

    def _capture(self, sessions: list, key: tuple):
        try:
            st = BatchStep(self.model, sessions)
        except Exception as e:          # e.g. an op that cannot be captured: stay eager
            print(f"brass: batched decode stays eager ({type(e).__name__}: {e})", file=sys.stderr)
            self.graphs = False
            return None
        self.captures += 1
        self._steps[key] = st
        while len(self._steps) > GRAPHS_KEPT:
            self._steps.popitem(last=False)
        return st

    def _check(self, sessions: list, tokens: list[int]):
        m = self.model
        if not sessions or len(sessions) != len(tokens):
            raise BrassError(f"a batched step needs one token per session "
                             f"({len(sessions)} sessions, {len(tokens)} tokens)")
        if len({id(s) for s in sessions}) != len(sessions):
            raise BrassError("a session appears twice in one batched step")
        for s, tok in zip(sessions, tokens):
            if s.model is not m:
                raise BrassError("a batched step's sessions must belong to its model")
            if not 0 <= int(tok) < m.config.n_vocab:
                raise BrassError(f"token ids must be in [0, {m.config.n_vocab})")
            if s.n_past + 1 > s.n_ctx:
                raise BrassError(f"{s.n_past + 1} tokens exceed the context of {s.n_ctx}")
            if hasattr(s.cache, "check_room"):
                s.cache.check_room(s.n_past + 1)


class BatchStep:
    """One batched decode step of a fixed composition of sessions, captured as a graph: the
    tokens and positions are read from one device array [2, B] (uploaded before each replay),
    then every layer over the rows' caches, the LM head (`logits`) and the rows' argmax (`best`).
    It holds the sessions' caches, so that no other array can take their memory while the
    graph may still write it."""

    def __init__(self, model, sessions: list):
        b = model.backend
        B = len(sessions)
        self.caches = [s.cache for s in sessions]
        with b.activate():
            self.inp = b.zeros((2, B), np.int32)
            self._host = b.pinned_empty(2 * B, np.int32).reshape(2, B)
        self._uploaded = lambda: None

        def step():
            with b.rows_independent():
                logits = model.forward(self.inp[0], self.inp[1], SequenceBatch(self.caches))
                return logits, b.argmax(logits)

        self.graph = b.capture(step)
        self.logits, self.best = self.graph.result
        self.backend = b

    def run(self, ids: np.ndarray, pos: np.ndarray):
        self._uploaded()            # the last copy has read the pinned buffer (usually long ago)
        self._host[0], self._host[1] = ids, pos
        self._uploaded = self.backend.upload_async(self.inp, self._host)
        self.graph.replay()


class BucketStep:
    """A batched decode step of B rows captured once, whatever sequences of one block pool
    fill its rows: the tokens and positions come from one device array [2, B], and the rows'
    block tables from a device table [B, stride] (the kernels take them as data; every layer
    reads the same tables: a block id names the same block in every layer's pool), both
    uploaded before each replay. Every row's sequence must hold at most `capacity` slots (the
    attention kernel's bound, fixed in the graph) and be in the pool the graph was captured
    over (the pools' addresses are fixed in it)."""

    def __init__(self, model, caches: list, capacity: int):
        from .kv_cache import blocks_for
        b = model.backend
        B = len(caches)
        self.backend, self.B = b, B
        self.pool = caches[0].pool
        self.stride = stride = blocks_for(capacity)
        with b.activate():
            self.inp = b.zeros((2, B), np.int32)
            self._host_inp = b.pinned_empty(2 * B, np.int32).reshape(2, B)
            self.tab = b.zeros((B, stride), np.int32)
            self._host_tab = b.pinned_empty(B * stride, np.int32).reshape(B, stride)
        self._uploaded = [lambda: None, lambda: None]

        def tables(layers):
            return self.tab, stride, capacity

        def step():
            with b.rows_independent():
                logits = model.forward(self.inp[0], self.inp[1], SequenceBatch(caches))
                return logits, b.argmax(logits)

        b.row_tables_override = tables
        try:
            self.graph = b.capture(step)
        finally:
            b.row_tables_override = None
        self.logits, self.best = self.graph.result
        self.capacity = capacity

    def run(self, caches: list, ids: np.ndarray, pos: np.ndarray, ids_from=None):
        """Replay over `caches` with tokens `ids` at positions `pos`; `ids_from`, a device
        array of n tokens (e.g. this graph's own `best` of the last replay), replaces the
        first n of `ids` on the device, after the upload and before the replay."""
        for wait in self._uploaded:       # the last copies have read the pinned buffers
            wait()
        self._host_tab[...] = -1
        for r, c in enumerate(caches):
            if c.n_ctx > self.capacity:
                raise BrassError(f"a bucket step's caches hold at most {self.capacity} slots, not {c.n_ctx}")
            if c.pool is not self.pool:
                raise BrassError("a bucket step's sequences must be in the block pool it was captured over")
            self._host_tab[r, :len(c.table)] = c.table
        self._host_inp[0], self._host_inp[1] = ids, pos
        self._uploaded = [self.backend.upload_async(self.tab, self._host_tab),
                          self.backend.upload_async(self.inp, self._host_inp)]
        if ids_from is not None:
            self.inp[0, :len(ids_from)] = ids_from
        self.graph.replay()
