"""What the server asks of generation: jobs, and a scheduler that runs them on its own thread.

The HTTP layer (engine/server.py) only ever touches this interface (the worker itself is
engine/serving.py's BatchScheduler: the running jobs decoded together, one batched step for
all of them):

    scheduler.submit(job)       queue a job; raises QueueFull when `max_waiting` already wait
    scheduler.counts()          (running, waiting)
    scheduler.tokens_generated  tokens generated so far, all jobs together
    scheduler.batch_size        sequences advanced in the latest round (a gauge for /metrics)
    scheduler.close()           stop the worker thread

and a job is what engine/serving.Request is (BatchScheduler drives either): `prompt_ids`,
`max_tokens`, `sampling`; the scheduler calls `on_token(token) -> finished` for each token and
`on_error(exc)` if generation fails, drops the job between tokens once `cancelled` is set (the
client left), and sets `finished` and calls `on_end()` when it is done with it. A Job turns its
tokens into text (stop strings cut, the end-of-generation token left out) and puts events on
`events`, a thread-safe queue: ("delta", text) ... then ("done", finish_reason, usage) or
("error", APIError); after each it calls `wakeup()`, the HTTP layer's bridge to its event loop.
The last event waits for `on_end()`: a client that has its whole reply finds the job gone from
the scheduler's counts (/health, /metrics), not still running.

With logprobs (`logprobs`: the number of alternatives, 0-20; None is off) a delta is
("delta", text, entries): the logprob entries of the tokens whose text it completes (a token
whose text is held back, part of a UTF-8 character or of a possible stop string, goes with the
text that follows; those cut by a stop string go with the last event before "done"). An entry
is {"token": id, "logprob": float, "top": [(id, logprob), ...]}. Every generated token has
one except the end-of-generation token, whose text is left out too. With `echo`, the first
event is ("prompt", entries) for the prompt's tokens (the first with logprob and top None).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .api import APIError
from .errors import BrassError
from .serving import BatchScheduler, QueueFull  # noqa: F401 (QueueFull: the server catches it)




class StopScanner:
    """Cuts generated text before the first stop string to be complete (the one ending first;
    of two ending at the same place, the longer), wherever the text was split into pieces.
    Text that could be the start of a stop string is held back until the next piece shows
    whether it is one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [(i + len(s), i) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)[1]], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job:
    """One request's generation (see the module's docstring for the contract)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling, stop: list[str], tokenizer,
                 on_tokens: Callable[[int], None] | None = None, logprobs: int | None = None,
                 echo: bool = False):
        self.prompt_ids, self.max_tokens, self.sampling = prompt_ids, max_tokens, sampling
        self.logprobs, self.echo = logprobs, echo
        self._row = None                # the log-softmax row of the next token
        self._entries: list[dict] = []  # entries of tokens whose text is not out yet
        self.tokenizer = tokenizer
        self.stops = StopScanner(stop)
        self.events: queue.Queue = queue.Queue()
        self.wakeup: Callable[[], None] | None = None
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.completion_tokens = 0
        self.cached_tokens = 0          # set by the scheduler: prompt tokens found cached
        self._decoder = tokenizer.stream_decoder()
        self._on_tokens = on_tokens     # counts tokens for /metrics
        self._done = False
        self._last = None               # ("done", ...) or ("error", ...), put by on_end()

    # -- what a scheduler calls --------------------------------------------------------------

    def on_token(self, token: int) -> bool:
        """Take the next generated token; True when the job is finished."""
        if self._done:
            return True
        row, self._row = self._row, None
        if row is not None and not self.tokenizer.is_eog(token):
            from .logprobs import top
            self._entries.append({"token": token, "logprob": float(row[token]),
                                  "top": top(row, self.logprobs)})
        self.completion_tokens += 1
        if self._on_tokens is not None:
            self._on_tokens(1)
        if self.tokenizer.is_eog(token):
            return self._finish("stop", self._decoder.flush())
        text, hit = self.stops.feed(self._decoder.feed(token))
        self._emit(text)
        if hit:
            return self._finish("stop", None)
        if self.completion_tokens >= self.max_tokens:
            return self._finish("length", self._decoder.flush())
        return False

    def on_logprobs(self, row):
        self._row = row

    def on_prompt_logprobs(self, rows):
        if rows is not None:
            self._put(("prompt", self._prompt_entries(rows)))
        if self.max_tokens == 0:       # echo alone: nothing is generated
            self._finish("length", None)

    def _prompt_entries(self, rows) -> list[dict]:
        from .logprobs import top
        ids = self.prompt_ids
        n = self.logprobs or 0
        entries = [{"token": ids[0], "logprob": None, "top": None}]
        entries += [{"token": ids[i], "logprob": float(rows[i - 1][ids[i]]), "top": top(rows[i - 1], n)}
                    for i in range(1, len(ids))]
        return entries

    def on_error(self, exc: BaseException):
        if self._done:
            return
        self._done = True
        if isinstance(exc, APIError):
            err = exc
        elif isinstance(exc, BrassError):
            err = APIError(400, str(exc))
        else:   # a fault of ours: the scheduler printed the traceback; the client gets no internals
            err = APIError(500, f"internal error during generation: {type(exc).__name__}")
        self._last = ("error", err)

    def on_end(self):
        if self._last is not None:
            last, self._last = self._last, None
            self._put(last)

    # -- the rest ----------------------------------------------------------------------------

    def _put(self, event):
        self.events.put(event)
        if self.wakeup is not None:
            self.wakeup()

    def _emit(self, text: str, last: bool = False):
        if self.logprobs is None:
            if text:
                self._put(("delta", text))
            return
        if text or (last and self._entries):
            entries, self._entries = self._entries, []
            self._put(("delta", text, entries))

    def _finish(self, reason: str, tail: str | None) -> bool:
        if tail is not None:
            text, hit = self.stops.feed(tail)
            self._emit(text if hit else text + self.stops.flush())
            reason = "stop" if hit else reason
        self._emit("", last=True)       # entries whose text a stop string cut
        n_prompt = len(self.prompt_ids)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": n_prompt + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        self._done = True
        self._last = ("done", reason, usage)
        return True


class Scheduler(BatchScheduler):
    """The server's worker thread: FIFO admission, up to `parallel` jobs decoded together (one
    batched step over every job that has its next token; each row computed as it would be
    alone), a new job's prompt read in chunks between steps, a cancelled job dropped before
    the next step (engine/serving.py)."""
