"""Continuous batching: many requests decoded together, as a server needs it.

`BatchScheduler` runs one worker thread over `Request`s. Each loop iteration admits waiting
requests (up to `parallel` running), spends at most one prompt chunk's worth of tokens
(`prefill_chunk`; at least one chunk) on requests still reading their prompts, then takes one batched decode step (engine/batch.py)
over every running request that has its next token: the weights are read once for all of them.
A request joins the batch after its prompt and leaves when it ends or is cancelled, between
steps, without disturbing the others: rows are computed as alone, so each request gets the
tokens it would get by itself (greedy or sampled with its own seed).

A long prompt is read in chunks between decode steps, so it delays the running requests by one
chunk per step instead of by the whole prompt; short prompts arriving together are read in the
same iteration (up to one chunk's worth of tokens), so they join the batch together. A step of one request goes through the
single-sequence path (`Session.decode`, a CUDA graph replay on the GPU), which gives the same
logits as a batch row.

Sessions outlive their requests (`SessionPool`): a finished request's session (its KV cache and,
on the GPU, its captured decode graph) is reset and serves the next request whose length fits,
so a request costs neither a cache allocation nor a capture. `warm_up()` loads every kernel and
captures the decode graphs before the first request, which would otherwise wait for them.

On a paged backend (numpy) the sessions' caches are block tables into one BlockPool
(engine/prefix_cache.py): a request admitted gets every block it may need at once, sharing the
cached blocks of its prompt's longest cached prefix, and reads only the rest of its prompt
(`cached_tokens`); one the pool has no room for yet waits, first in line, and one larger than
the whole pool is refused at submit (PoolTooSmall, a QueueFull: the server's 503).

The scheduler knows nothing of HTTP: a Request is told its tokens through `on_token(token) ->
bool` (True: it is finished) and a failure through `on_error(exc)`, and `on_end()` once the
scheduler has let go of it; it reads `cancelled` (a threading.Event) to leave early.

Logprobs (engine/logprobs.py): a request whose `logprobs` is not None is told, before each
token, `on_logprobs(row)`, the log-softmax of the logits the token is picked from (before any
sampling penalty); its steps then bring their logits to the host (no greedy run on the device).
A request with `echo` set is told `on_prompt_logprobs(rows)` before its prompt is read: with
logprobs, the log-softmax of Model.score over the prompt, the very pass `brass score
--logprobs` prints (else None); with `max_tokens` 0 it then ends, generating nothing.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from collections import deque

import numpy as np

from .batch import FINISH_RUN, BatchDecoder, supports_batched_decode
from .errors import BrassError
from .kv_cache import BLOCK_TOKENS, PoolExhausted
from .prefix_cache import PrefixCache, default_blocks
from .sampling import Sampler, SamplingParams, generation_length

PREFILL_CHUNK = 256
# Tokens a request decoding alone takes per loop iteration (greedy, graph backend): the loop
# looks at the queue between them.
SOLO_TOKENS = 8
# Pooled sessions hold at least this many positions (and a power of two): sizes recur, so a
# session fits many later requests, and the batched graphs' attention bound (engine/batch.py)
# is the same power of two.
MIN_POOLED_CTX = 256


class SessionPool:
    """Sessions kept across requests. `take(n)` gives a reset session of at least n positions:
    an idle one of the smallest size that fits, else a new one of the next power of two (at
    least MIN_POOLED_CTX, at most the model's context); `give(s)` returns it. At most `limit`
    sessions exist at once, taken or idle (idle ones are dropped, oldest first, to make room),
    so the pool holds no more memory than `limit` running requests do."""

    def __init__(self, model, limit: int, new_session=None):
        self.model, self.limit = model, limit
        self._new_session = new_session or model.new_session
        self._idle: list = []             # oldest first
        self.taken = 0
        self.created = self.reused = 0

    def size_for(self, n: int) -> int:
        return max(n, min(self.model.n_ctx, max(MIN_POOLED_CTX, 1 << max(n - 1, 0).bit_length())))

    def take(self, n: int):
        fits = [s for s in self._idle if s.n_ctx >= n]
        if fits:
            s = min(fits, key=lambda s: s.n_ctx)
            self._idle.remove(s)
            s.reset()
            self.reused += 1
        else:
            while self._idle and self.taken + len(self._idle) >= self.limit:
                self._idle.pop(0)
            s = self._new_session(self.size_for(n))
            self.created += 1
        self.taken += 1
        return s

    def give(self, s):
        self.taken -= 1
        self._idle.append(s)
        while self._idle and self.taken + len(self._idle) > self.limit:
            self._idle.pop(0)


class Request:
    """One generation: `prompt_ids`, at most `max_tokens`, `sampling`. Subclasses (the server's
    jobs) override on_token / on_error; the defaults collect the tokens (tests, scripts)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None):
        generation_length(max_tokens, len(prompt_ids))     # the engine's one check of both
        self.prompt_ids, self.max_tokens = list(prompt_ids), max_tokens
        self.sampling = sampling or SamplingParams(temperature=0.0)
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.cached_tokens = 0          # prompt tokens found in the prefix cache (not read)

    # logprobs (see the module's docstring): None is off
    logprobs: int | None = None
    echo: bool = False

    def on_logprobs(self, row):
        """The log-softmax of the logits the next token is picked from."""

    def on_prompt_logprobs(self, rows):
        """The log-softmax of the teacher-forced logits at every prompt position."""

    def on_token(self, token: int) -> bool:
        self.tokens.append(token)
        return len(self.tokens) >= self.max_tokens

    def on_error(self, exc: BaseException):
        self.error = exc

    def on_end(self):
        """Called when the scheduler has let go of the request (after setting `finished`): it
        no longer counts in `counts()` and its session is back in the pool. A reader told
        "finished" from here sees the scheduler without it (the server's /health right after
        a reply)."""


class _Running:
    """A request's place in the worker: its session, sampler, history, next token."""

    def __init__(self, req: Request, session):
        self.req = req
        self.session = session
        self.sampler = Sampler(req.sampling)
        self.history = list(req.prompt_ids)
        self.read = 0                   # prompt tokens prefilled so far (or found cached)
        self.start = 0                  # the position the prompt read started at
        self.snap = 0                   # where a hybrid's read stops for a state snapshot
        self.next: int | None = None    # the token to feed at the next step
        self.generated = 0
        self.solo = None                # Session.greedy generator while it decodes alone


class QueueFull(BrassError):
    """The scheduler's queue holds `max_waiting` requests already."""


class PoolTooSmall(QueueFull):
    """A request needs more KV blocks than the whole pool holds (the server answers as to a
    full queue: 503 with Retry-After)."""


class BatchScheduler:
    """The worker thread. `submit` queues (a full queue raises QueueFull); `counts()` gives
    (running, waiting); `tokens_generated` and `steps` / `batch_rows` count the work done,
    `batch_size` is the rows of the latest step (0 when idle)."""

    QueueFull = QueueFull

    def __init__(self, model, parallel: int = 4, max_waiting: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, start: bool = True, keep_ahead: bool = True,
                 kv_blocks: int | None = None, prefix_cache: bool | None = None):
        """`kv_blocks`: the block pool's size on a paged backend (None: BRASS_KV_BLOCKS, unset:
        prefix_cache.default_blocks); `prefix_cache`: share cached prompt prefixes between
        requests (None: BRASS_PREFIX_CACHE)."""
        if parallel < 1:
            raise BrassError(f"parallel must be at least 1, not {parallel}")
        self.model, self.parallel, self.max_waiting = model, parallel, max_waiting
        self.prefill_chunk = max(1, prefill_chunk)
        self.batch = BatchDecoder(model) if parallel > 1 and supports_batched_decode(model) else None
        # A paged backend's sequences share one block pool (engine/prefix_cache.py); the
        # others keep a contiguous cache per pooled session.
        self.kv: PrefixCache | None = None
        if _paged(model):
            from . import flags
            n = flags.get("BRASS_KV_BLOCKS") if kv_blocks is None else kv_blocks
            n = default_blocks(parallel, model.n_ctx, model) if n is None else int(n)
            on = flags.get("BRASS_PREFIX_CACHE") if prefix_cache is None else bool(prefix_cache)
            self.kv = PrefixCache(model.new_block_pool(n), enabled=on,
                                  snapshots_kept=max(16, 4 * parallel))
            pool = self.kv.pool
            self.sessions = SessionPool(model, parallel, lambda n: model.new_session(n, pool=pool))
        else:
            self.sessions = SessionPool(model, parallel)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self.tokens_generated = 0
        self.steps = 0                  # decode steps taken
        self.batch_size = 0             # rows of the latest step
        self.batch_rows = 0             # rows over all decode steps (mean batch = rows / steps)
        # Seconds the worker spent reading prompts and decoding (what /metrics shows as
        # brass_scheduler_seconds_total): where a server's time goes under load.
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        # The phase the worker is in now (a key of seconds, or None) and when its time was last
        # added: a request that ends mid-phase adds it first (_tick), so that /metrics read
        # after its reply already counts the work that produced it.
        self._phase: str | None = None
        self._phase_t = 0.0
        # Greedy batched steps run one ahead on the device (BatchDecoder.greedy_steps) while
        # the same requests decode together: (their ids, the generator, the requests).
        self._ahead: tuple | None = None
        # A run ended by a change of the batch (a request leaves or joins) keeps its step run
        # ahead for the rows that stay (keep_ahead, on: more tokens a second under a changing
        # load), its tokens left here, (requests, tokens); off, the step is dropped (each session
        # goes back one position and the step is computed again in the next run). The tokens
        # are the same either way.
        self._carry: tuple | None = None
        self.keep_ahead = keep_ahead
        # greedy runs ended by a change of the batch, their step run ahead kept or dropped
        self.runs_ended = {"kept": 0, "dropped": 0}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="brass-batch", daemon=True)
        if start:
            self._thread.start()

    # -- the API --------------------------------------------------------------------------------
    def submit(self, req: Request):
        if self.kv is not None and not self.kv.fits(len(req.prompt_ids) + req.max_tokens):
            raise PoolTooSmall(f"the request needs {len(req.prompt_ids) + req.max_tokens} KV "
                               f"positions; the server's block pool holds "
                               f"{self.kv.pool.n_blocks * BLOCK_TOKENS} (--kv-blocks)")
        with self._cv:
            self._waiting = deque(r for r in self._waiting if not r.cancelled.is_set())
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are "
                                     f"already waiting; retry later")
            self._waiting.append(req)
            self._cv.notify()

    def counts(self) -> tuple[int, int]:
        with self._cv:
            return len(self._running), sum(not r.cancelled.is_set() for r in self._waiting)

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify()

    # -- the worker -----------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self.batch_size = 0
                    self._cv.wait()
                if self._stop:
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.parallel:
                    req = self._waiting.popleft()
                    if not req.cancelled.is_set():
                        admitted.append(req)
            for i, req in enumerate(admitted):  # a session that cannot be made fails its request only
                try:
                    r = self._admit(req)
                    if r is None:       # no room in the block pool yet: it waits, first in line
                        with self._cv:
                            self._waiting.extendleft(reversed(admitted[i:]))
                        break
                except Exception as e:
                    if not isinstance(e, BrassError):
                        traceback.print_exc(file=sys.stderr)
                    req.on_error(e)
                    req.finished.set()
                    req.on_end()
                    continue
                with self._cv:
                    self._running.append(r)
            try:
                self.run_once()
            except Exception:       # a fault of ours outside any one request: keep serving
                traceback.print_exc(file=sys.stderr)

    def _admit(self, req: Request) -> "_Running | None":
        """The request's place: a pooled session and, on a paged backend, its blocks (its
        cached prefix shared); None when the pool has no room for it now."""
        n = len(req.prompt_ids) + req.max_tokens
        s = self.sessions.take(n)
        r = _Running(req, s)
        if self.kv is not None:
            try:
                cached = self.kv.begin(s, req.prompt_ids, n)
            except PoolExhausted:
                self.sessions.give(s)
                return None
            except BaseException:
                self.sessions.give(s)
                raise
            req.cached_tokens = r.read = r.start = cached
            r.snap = self.kv.snapshot_at(req.prompt_ids)
        return r

    def kv_counts(self) -> dict[str, int] | None:
        """The block pool's {"used", "cached", "free"} blocks (None: no pool, a contiguous
        backend). Read from another thread: a snapshot that may be one change old."""
        return self.kv.counts() if self.kv is not None else None

    def run_once(self):
        """One iteration: drop cancelled requests, prompt chunks (one chunk's worth of
        tokens), one decode step."""
        for r in [r for r in self._running if r.req.cancelled.is_set()]:
            self._end(r)
        self._take_carry()
        # Prompt chunks of several requests while they fit in one chunk's worth of tokens
        # (at least one chunk): short prompts that arrive together join the batch together,
        # one change of its composition instead of one per request. Each prompt is still read
        # in the chunks it would be read in alone.
        budget = self.prefill_chunk
        reading = [r for r in self._running if r.next is None]
        if reading:
            # a request streaming alone would keep its steps queued ahead of these prompts
            for r in self._running:
                self._stop_solo(r)
        self._enter("prefill")
        try:
            for r in reading:
                n = self._chunk_end(r) - r.read
                if n > budget and budget < self.prefill_chunk:
                    break
                budget -= n
                self._guard(r, self._prefill_chunk, r)
            ready = [r for r in self._running if r.next is not None]
            self._enter("decode" if ready else None)
            if ready:
                self._decode(ready)
        finally:
            self._enter(None)

    def _tick(self):
        """Add the time since the last tick to the phase the worker is in."""
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] += now - self._phase_t
        self._phase_t = now

    def _enter(self, phase: str | None):
        self._tick()
        self._phase = phase

    def _prefill_chunk(self, r: _Running):
        if r.read == r.start and r.req.echo:
            from .logprobs import log_softmax
            r.req.on_prompt_logprobs(None if r.req.logprobs is None
                                     else log_softmax(self.model.score(r.req.prompt_ids)))
            if r.req.max_tokens == 0:
                self._end(r)
                return
        if self.kv is not None:
            # what requests begun with this one have read of its prompt since (after the echo
            # above, which reads the whole prompt itself)
            got = self.kv.catch_up(r.session, r.req.prompt_ids, r.read)
            r.read += got
            r.req.cached_tokens += got
        ids = r.req.prompt_ids[r.read:self._chunk_end(r)]
        logits = r.session.prefill(ids, device_logits=True)
        r.read += len(ids)
        if self.kv is not None:
            self.kv.publish(r.session, r.req.prompt_ids, r.read)
            if r.read == r.snap:
                self.kv.take_snapshot(r.session, r.req.prompt_ids, r.read)
        if r.read == len(r.req.prompt_ids):
            self._pick_logged(r, logits)

    def _chunk_end(self, r: _Running) -> int:
        """Where the next prompt chunk of r ends: one chunk on, the prompt's end, or a
        hybrid's snapshot position (prefix_cache.snapshot_at) when it lies between."""
        end = min(r.read + self.prefill_chunk, len(r.req.prompt_ids))
        return r.snap if r.read < r.snap < end else end

    def _pick_logged(self, r: _Running, logits):
        """Pick the next token from device logits; a request that wants logprobs is told them
        first, from the same logits."""
        if r.req.logprobs is not None:
            from .logprobs import log_softmax
            b = self.model.backend
            # a session may say how its logits read as a vocabulary row (the tests' stub)
            host_row = getattr(r.session, "host_row", None)
            with b.activate():
                row = host_row(logits) if host_row is not None else b.to_numpy(logits)[-1]
            r.req.on_logprobs(log_softmax(row))
        self._accept(r, r.session.pick(logits, r.sampler, r.history))

    def _decode(self, ready: list[_Running]):
        b = self.model.backend
        if self._ahead is not None and tuple(id(r) for r in ready) != self._ahead[0]:
            # the batch changed: the run ends here (its step run ahead kept or dropped), and
            # the rows it gave a token meanwhile may have finished
            self._end_ahead()
            self._take_carry()
            ready = [r for r in ready if r in self._running and r.next is not None]
            if not ready:
                return
        self.steps += 1
        self.batch_rows += len(ready)
        self.batch_size = len(ready)
        if len(ready) == 1 or self.batch is None:
            self._end_ahead()
            self._take_carry()
            ready = [r for r in ready if r in self._running and r.next is not None]
            for r in ready:
                self._guard(r, self._decode_alone, r)
            return
        for r in ready:
            self._stop_solo(r)
        # Greedy rows need only their argmax (taken on the device): B integers come back
        # instead of B rows of logits.
        greedy = all(r.sampler.p.greedy and r.sampler.p.repetition_penalty == 1.0
                     and r.req.logprobs is None for r in ready)
        # Greedy rows of an unchanged batch continue its run ahead (BatchDecoder.greedy_steps);
        # any change of the rows ends it, and a new one starts where the batch takes one.
        key = tuple(id(r) for r in ready)     # (a run of other rows ended at the top)
        sessions = [r.session for r in ready]
        if greedy and self._ahead is None and self.batch.can_run_ahead(sessions):
            try:        # (greedy_steps checks and allocates when called: a failure fails the rows)
                self._ahead = (key, self.batch.greedy_steps(sessions, [r.next for r in ready]), list(ready))
            except Exception as e:
                for r in ready:
                    self._fail(r, e)
                return
        if self._ahead is not None:
            try:
                rows = next(self._ahead[1])
            except Exception as e:                # the step failed for all its rows
                self._stop_ahead()
                for r in ready:
                    self._fail(r, e)
                return
            for r, tok in zip(ready, rows):
                if r in self._running:    # (a failed read of the step ahead fails the rest)
                    self._guard(r, lambda r: self._accept(r, int(tok)), r)  # noqa: B023 (the function runs at once, inside this iteration)
            self._take_carry()      # a row that finished ended the run: the rest's next tokens
            return
        try:
            logits, best = self.batch.step_argmax(sessions, [r.next for r in ready],
                                                  argmax=greedy)
            with b.activate():
                rows = b.to_numpy(best if greedy else logits)
        except Exception as e:                    # the step failed for all its rows
            for r in ready:
                self._fail(r, e)
            return
        for r, row in zip(ready, rows):
            if greedy:
                self._guard(r, lambda r: self._accept(r, int(row)), r)  # noqa: B023 (the function runs at once, inside this iteration)
            else:
                self._guard(r, lambda r: self._accept(r, _pick_logged(row, r)), r)  # noqa: B023 (the function runs at once, inside this iteration)

    def _decode_alone(self, r: _Running):
        """The next token(s) of a request decoding by itself. Greedy on a graph backend, it runs
        as Session.greedy does (the device steps ahead, tokens read back in chunks: no host
        sync per token), up to SOLO_TOKENS tokens per iteration and only while nothing
        waits; otherwise one step through Session.decode."""
        p = r.sampler.p
        if not (p.greedy and p.repetition_penalty == 1.0 and getattr(r.session, "graphs", False)
                and r.req.logprobs is None):
            self._pick_logged(r, r.session.decode(r.next))
            return
        if r.solo is None:
            r.solo = r.session.greedy(r.next, r.req.max_tokens - r.generated)
        for i in range(SOLO_TOKENS):
            if i:
                self.steps += 1
                self.batch_rows += 1
            self._accept(r, next(r.solo))
            if r not in self._running or r.req.cancelled.is_set() or self._others_pending(r):
                break

    def _others_pending(self, r: _Running) -> bool:
        """Whether another request is waiting for a place or reading its prompt (the solo
        stream must make way for it). Read without the lock: a request submitted meanwhile is
        seen at the next token."""
        return ((bool(self._waiting) and len(self._running) < self.parallel)
                or any(o.next is None for o in self._running if o is not r))

    def _stop_ahead(self):
        """Close the batched greedy run: its sessions go back to the last tokens read (the
        step run ahead is dropped)."""
        if self._ahead is not None:
            gen, self._ahead = self._ahead[1], None
            gen.close()

    def _end_ahead(self, ending=None):
        """End the batched greedy run because its rows change. With keep_ahead the step it ran
        ahead is read, not dropped: its tokens wait in _carry for the rows that stay
        (_take_carry gives them once every row has taken the tokens read before)."""
        if self._ahead is None:
            return
        if not self.keep_ahead:
            self._stop_ahead()
            self.runs_ended["dropped"] += 1
            return
        _, gen, rows = self._ahead
        self._ahead = None
        try:
            tokens = gen.send(FINISH_RUN)
        except StopIteration:           # no step was run ahead (a cache full)
            tokens = None
        except Exception as e:          # the step failed for all its rows but the one ending
            gen.close()
            for r in rows:
                if r in self._running and r is not ending:
                    self._fail(r, e)
            return
        gen.close()
        if tokens is not None:
            self._carry = (rows, tokens)
            self.runs_ended["kept"] += 1

    def _take_carry(self):
        """The tokens of an ended run's last step, to the rows still decoding (a row that
        finished meanwhile drops its own: its session goes back to the pool, reset)."""
        if self._carry is None:
            return
        rows, tokens = self._carry
        self._carry = None
        self.steps += 1
        self.batch_rows += sum(r in self._running for r in rows)
        for r, tok in zip(rows, tokens):
            if r in self._running and r.next is not None:
                self._guard(r, lambda r: self._accept(r, int(tok)), r)  # noqa: B023 (the function runs at once, inside this iteration)

    def _stop_solo(self, r: _Running):
        """Close a request's greedy stream: its session stays at the last token it yielded
        (r.next, not yet in the cache); the steps run ahead are dropped."""
        if r.solo is not None:
            r.solo.close()
            r.solo = None

    def _accept(self, r: _Running, token: int):
        r.history.append(token)
        r.generated += 1
        self.tokens_generated += 1
        done = r.req.on_token(token) or r.generated >= r.req.max_tokens
        if done:
            self._end(r)
        else:
            r.next = token

    def _guard(self, r: _Running, fn, *args):
        try:
            fn(*args)
        except Exception as e:
            self._fail(r, e)

    def _fail(self, r: _Running, e: BaseException):
        if not isinstance(e, BrassError):
            traceback.print_exc(file=sys.stderr)
        try:
            r.req.on_error(e)
        finally:
            self._end(r)

    def _end(self, r: _Running):
        self._stop_solo(r)
        if self._ahead is not None and id(r) in self._ahead[0]:
            self._end_ahead(ending=r)   # before its session goes back to the pool
        if r in self._running:
            with self._cv:
                self._running.remove(r)
                if not self._running:
                    self.batch_size = 0     # idle: the gauge must not wait for the next loop
            if self.kv is not None:
                self.kv.end(r.session)
            self.sessions.give(r.session)
        self._tick()        # the work that ended it counted before its reply ends
        r.req.finished.set()
        r.req.on_end()

    # -- before serving -------------------------------------------------------------------------
    def warm_up(self, prompt_tokens: int = 64, decode_tokens: int = 4) -> float:
        """On a graph backend, do before the first request what it would otherwise wait for:
        one pooled session reads a prompt of `prompt_tokens` (loading the prompt kernels) and
        decodes `decode_tokens` greedy tokens (capturing its decode graph), then returns to the
        pool; the bucket graphs of 2 .. `parallel` rows are captured. Call it before the worker
        takes requests (start=False, or before any submit). Seconds spent (0 when there is
        nothing to capture, e.g. on numpy)."""
        from .model import graphs_enabled
        m = self.model
        if not graphs_enabled(m):
            return 0.0
        t0 = time.perf_counter()
        n = max(1, min(prompt_tokens, m.n_ctx - decode_tokens - 1))
        s = self.sessions.take(n + decode_tokens + 1)
        ids = [(7 + 13 * i) % m.config.n_vocab for i in range(n)]
        if self.kv is not None:         # (not published: the pool starts empty of prefixes)
            self.kv.begin(s, [], n + decode_tokens + 1)
        try:
            first = s.pick(s.prefill(ids, device_logits=True), Sampler(SamplingParams(temperature=0.0)), ids)
            for _ in s.greedy(first, decode_tokens):
                pass
        finally:
            if self.kv is not None:
                self.kv.end(s)
            self.sessions.give(s)
        if self.batch is not None:
            self.batch.prepare_buckets(self.parallel, s.n_ctx, getattr(s.cache, "pool", None))
        return time.perf_counter() - t0


def _paged(model) -> bool:
    """Whether the model's sessions can share a block pool: a paged backend, and sessions
    that take one (a test's stand-in for a model may make its own kind)."""
    if not getattr(getattr(model, "backend", None), "paged_kv", False):
        return False
    try:
        return "pool" in inspect.signature(model.new_session).parameters
    except (TypeError, ValueError):
        return False


def _pick_logged(row: np.ndarray, r: _Running) -> int:
    """_pick, telling a request that wants logprobs the row's first."""
    if r.req.logprobs is not None:
        from .logprobs import log_softmax
        r.req.on_logprobs(log_softmax(row))
    return _pick(row, r.sampler, r.history)


def _pick(row: np.ndarray, sampler: Sampler, history: list[int]) -> int:
    """The token of one row of host logits, as Session.pick chooses it on the device."""
    p = sampler.p
    if p.greedy and p.repetition_penalty == 1.0:
        return int(np.argmax(row))
    return sampler(row, history)
