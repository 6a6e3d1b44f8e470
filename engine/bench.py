"""Prompt and generation speed, measured the way llama-bench measures them, through the same
engine code as `brass generate`:

- pp N: one prefill forward of N random tokens into an empty context (the logits of the last
  row, as generation needs), timed to the end of the GPU work;
- tg N: N tokens generated greedily one after another from an empty context (first token
  random), through Session.greedy: on the GPU the captured decode graph with the argmax fed
  back on the device, exactly what `generate` runs;
- tg N xP (parallel P > 1): P sequences generating N tokens each together, one batched decode
  step (engine/batch.py) for all of them per token, as the server runs them; tokens per second
  counts all P sequences' tokens (llama-batched-bench's S_TG).

Each test runs once untimed (kernel compilation, graph capture, memory pools; the prompt
twice with BRASS_PROMPT_GRAPHS, whose second read captures), then `reps` times; the result is tokens per second, mean and standard deviation over the repetitions,
as llama-bench reports them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from .errors import BrassError


@dataclass
class BenchResult:
    model: str
    size_bytes: int
    backend: str
    test: str                 # "pp512", "tg128"
    n_tokens: int
    reps: int
    tokens_per_s: float       # mean over repetitions
    stddev: float
    samples: list
    kernels_per_token: int | None = None    # tg on a graph backend: kernels in the decode graph
    # pp: whether its timed reads replayed a prompt graph captured in the warm-up (a length read
    # before, as the bench's is; BRASS_PROMPT_GRAPHS=0, a backend without graphs or a failed
    # capture: read eagerly); None for tg
    prompt_graph: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(backend, fn) -> float:
    backend.synchronize()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t0


def bench(model, n_prompt: int = 512, n_gen: int = 128, reps: int = 3, seed: int = 0,
          progress=None, parallel: int = 1) -> list[BenchResult]:
    """pp`n_prompt` and tg`n_gen` of `model` (either may be 0 to skip it); with parallel > 1,
    the generation test is `parallel` sequences decoded in batched steps."""
    if n_prompt < 0 or n_gen < 0 or not (n_prompt or n_gen):
        raise BrassError("bench: give a positive prompt (-p) and/or generation (-n) length")
    if reps < 1:
        raise BrassError("bench: repetitions (-r) must be >= 1")
    if parallel < 1:
        raise BrassError("bench: parallel sequences (--parallel) must be >= 1")
    n_ctx = max(n_prompt, n_gen + 1)
    if n_ctx > model.config.n_ctx_train:
        raise BrassError(f"bench: {n_ctx} tokens exceed the model's context of {model.config.n_ctx_train}")
    rng = np.random.default_rng(seed)
    b = model.backend
    s = model.new_session(n_ctx)
    vocab = model.config.n_vocab
    size = model.path.stat().st_size
    results = []

    def prefill():
        s.reset()
        s.prefill([int(t) for t in rng.integers(0, vocab, n_prompt)], device_logits=True)

    def generate():
        s.reset()
        n = 0
        for _ in s.greedy(int(rng.integers(0, vocab)), n_gen):
            n += 1
        if n != n_gen:
            raise BrassError(f"bench: generated {n} of {n_gen} tokens")

    sessions, dec = [], None
    if parallel > 1 and n_gen:
        from .batch import BatchDecoder
        dec = BatchDecoder(model)           # refuses an architecture that does not batch
        sessions = [model.new_session(n_gen + 1) for _ in range(parallel)]

    def generate_batched():
        for q in sessions:
            q.reset()
        toks = [int(t) for t in rng.integers(0, vocab, parallel)]
        if dec.can_run_ahead(sessions):
            # as the server decodes greedy requests together: each step fed the last one's
            # tokens on the device, one step queued ahead of the read-back (its time is
            # counted: the timing waits for the device, which runs the step dropped at the end)
            steps = dec.greedy_steps(sessions, toks)
            for _ in range(n_gen):
                next(steps)
            steps.close()
            return
        for _ in range(n_gen):
            _, best = dec.step_argmax(sessions, toks)
            toks = [int(t) for t in b.to_numpy(best)]

    tg = ("tg", n_gen, generate) if parallel == 1 else (f"tg{n_gen}x", parallel, generate_batched)
    def name(test, n):
        return f"{test}{parallel}" if test.endswith("x") else f"{test}{n}"

    for test, n, fn in (("pp", n_prompt, prefill), tg):
        if not n:
            continue
        if fn is generate_batched:
            n = n_gen * parallel
        with b.activate():
            fn()                                   # warm-up, untimed
            if fn is prefill and s.prompt_graphs:
                fn()                               # and the prompt graph's capture
            secs = []
            for r in range(reps):
                secs.append(_timed(b, fn))
                if progress:
                    progress(f"{name(test, n)} {r + 1}/{reps}: {n / secs[-1]:.1f} tok/s")
        tps = [n / t for t in secs]
        results.append(BenchResult(model=model.name, size_bytes=size, backend=b.name, test=name(test, n),
                                   n_tokens=n, reps=reps, tokens_per_s=statistics.fmean(tps),
                                   stddev=statistics.stdev(tps) if len(tps) > 1 else 0.0, samples=tps,
                                   kernels_per_token=s._step.kernels if test == "tg" and s._step else None,
                                   prompt_graph=bool(s.prompt_graphs and n in s._prompt_steps) if test == "pp" else None))
    return results


def table(results: list[BenchResult]) -> str:
    from tabulate import tabulate
    rows = [(r.model, f"{r.size_bytes / 2**30:.2f} GiB", r.backend, r.test,
             f"{r.tokens_per_s:.2f} ± {r.stddev:.2f}") for r in results]
    out = tabulate(rows, headers=["model", "size", "backend", "test", "t/s"], tablefmt="github",
                   disable_numparse=True)
    if any(r.prompt_graph for r in results):
        out += ("\npp: every timed read replayed a prompt graph captured in the warm-up "
                "(BRASS_PROMPT_GRAPHS=0 reads prompts eagerly)")
    return out
