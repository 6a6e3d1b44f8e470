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
twice with BRASS_PROMPT_GRAPHS, whose second read captures), then `reps` times; the result is
tokens per second, mean and standard deviation over the repetitions, as llama-bench reports
them.

Two choices change what a test reads:
- lengths (`--lengths`): each timed prompt has a length the process has not read before (a
  comma list, one a repetition, or `random:A-B` drawn with the seed): what a server's first
  prompt of a new length costs. The warm-up reads N (-p) tokens, a length the timed ones
  leave out; with prompt graphs on, it then reads, twice, one other length of each length
  class (engine/model.py prompt_class) the timed lengths fall in, as a server has after a few
  prompts of the class: each timed read then replays its class's graph, padded to it (where
  a class has no length besides the timed ones, its first timed read is eager). With prompt
  graphs off (BRASS_PROMPT_GRAPHS=0) every read is eager. The test is named after the
  lengths (pp480-544) and its tokens per second are each repetition's length over its time.
- depth D (`--depth`, llama-bench's -d): every repetition, the warm-up's too, starts from D
  random tokens already in the cache, read untimed just before the timed part (in prompts of
  DEPTH_CHUNK tokens, read eagerly: they capture no graph and mark no length as read); the
  test names end in " @ dD", as llama-bench's.
- ctx N (`--ctx`): the sessions hold N positions instead of what the test needs (at least
  that): the capacity some kernels are chosen by, as in a server's or a long chat's sessions.

After each test the result records the memory the run holds (`held_memory`): the weights as
the backend keeps them (on the GPU their quantized bytes; on the numpy backend the float32
arrays dequantized so far), the float16 weight copies of the prompt GEMMs, the KV caches
(with a hybrid's recurrent state) and the captured graphs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from .errors import BrassError

# The depth is read in prompts of this many tokens (llama-bench's default batch), so that a
# 16k-token depth needs no 16k-token working set.
DEPTH_CHUNK = 2048


@dataclass
class BenchResult:
    model: str
    size_bytes: int
    backend: str
    test: str                 # "pp512", "tg128", "pp480-544" (--lengths), "tg128 @ d16384"
    n_tokens: int             # tokens a repetition reads (--lengths: their mean, rounded)
    reps: int
    tokens_per_s: float       # mean over repetitions
    stddev: float
    samples: list
    kernels_per_token: int | None = None    # tg on a graph backend: kernels in the decode graph
    # pp: whether its timed reads replayed a prompt graph captured in the warm-up (a length read
    # before, as the bench's is; BRASS_PROMPT_GRAPHS=0, a backend without graphs, a failed
    # capture or --lengths: read eagerly); None for tg
    prompt_graph: bool | None = None
    depth: int = 0            # tokens already in the cache when each repetition starts
    lengths: list | None = None   # pp: the prompt length each timed repetition read
    # bytes held after the test: weights, f16_weights, kv_cache, graphs, their total, and
    # device_used (the driver's used memory on the device, every process's; None off the GPU)
    memory: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(backend, fn) -> float:
    backend.synchronize()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t0


def prompt_lengths(spec: str | None, n_prompt: int, reps: int, seed: int = 0) -> tuple[str, list[int]] | None:
    """The --lengths test: (its name, the length each timed repetition reads), all distinct and
    none the warm-up's (n_prompt); None without a spec. A bad spec raises one line."""
    if spec is None:
        return None
    if n_prompt <= 0:
        raise BrassError("bench: --lengths needs a prompt test (-p N > 0: the warm-up reads N tokens)")
    spec = spec.strip()
    what = "bench: --lengths wants a comma list of prompt lengths or random:A-B"
    try:
        if spec.startswith("random:"):
            lo, sep, hi = spec[len("random:"):].partition("-")
            lo, hi = int(lo), int(hi)
            if not sep:
                raise ValueError
        else:
            lengths = [int(x) for x in spec.split(",")]
    except ValueError:
        raise BrassError(f"{what}, got {spec!r}") from None
    if spec.startswith("random:"):
        if lo < 1 or hi < lo:
            raise BrassError(f"bench: --lengths {spec}: wants 1 <= A <= B")
        pool = [n for n in range(lo, hi + 1) if n != n_prompt]
        if len(pool) < reps:
            raise BrassError(f"bench: --lengths {spec} has {len(pool)} lengths besides the warm-up's "
                             f"(-p {n_prompt}) for {reps} repetitions (-r)")
        # a generator of its own: the lengths do not depend on the tokens drawn, nor they on them
        drawn = np.random.default_rng([seed, 1]).choice(pool, size=reps, replace=False)
        return f"pp{lo}-{hi}", [int(n) for n in drawn]
    if min(lengths) < 1:
        raise BrassError(f"bench: --lengths {spec}: prompt lengths must be >= 1")
    if len(set(lengths)) != len(lengths):
        twice = next(n for n in lengths if lengths.count(n) > 1)
        raise BrassError(f"bench: --lengths repeats {twice}: each repetition reads a length not read before")
    if n_prompt in lengths:
        raise BrassError(f"bench: --lengths has {n_prompt}, the warm-up's length (-p): each "
                         "repetition reads a length not read before")
    if len(lengths) != reps:
        raise BrassError(f"bench: --lengths gives {len(lengths)} lengths for {reps} repetitions (-r): "
                         "one length a repetition")
    lo, hi = min(lengths), max(lengths)
    return (f"pp{lo}" if lo == hi else f"pp{lo}-{hi}"), lengths


def check_args(n_prompt: int, n_gen: int, reps: int, parallel: int = 1, lengths: str | None = None,
               depth: int = 0, seed: int = 0) -> tuple[str, list[int]] | None:
    """Everything about the arguments that needs no model, one line for the first thing wrong;
    returns prompt_lengths()."""
    if n_prompt < 0 or n_gen < 0 or not (n_prompt or n_gen):
        raise BrassError("bench: give a positive prompt (-p) and/or generation (-n) length")
    if reps < 1:
        raise BrassError("bench: repetitions (-r) must be >= 1")
    if parallel < 1:
        raise BrassError("bench: parallel sequences (--parallel) must be >= 1")
    if depth < 0:
        raise BrassError(f"bench: --depth must be >= 0, got {depth}")
    if depth and parallel > 1:
        raise BrassError("bench: --depth is for one sequence: leave out --parallel")
    return prompt_lengths(lengths, n_prompt, reps, seed)


def _graph_nbytes(steps) -> int:
    return sum(getattr(getattr(st, "graph", None), "nbytes", 0) or 0 for st in steps)


def held_memory(model, sessions=(), decoder=None) -> dict:
    """Bytes the model and `sessions` hold on the backend's device (the numpy backend: host
    arrays): "weights" as the backend keeps them, "f16_weights" (the prompt GEMMs' float16
    copies), "kv_cache" (the sessions' keys, values and recurrent state), "graphs" (the model's
    prompt graphs, the sessions' decode graphs, `decoder`'s batched-step graphs), "total" (their
    sum) and "device_used" (the device's used memory as its driver reports it, every process's
    and the CUDA context's; None on a backend without a device)."""
    b = model.backend
    graphs = sum(model.graph_bytes().values())
    graphs += _graph_nbytes(s._step for s in sessions if s._step is not None)
    if decoder is not None:
        graphs += _graph_nbytes(list(getattr(decoder, "_steps", {}).values())
                                + list(getattr(decoder, "_bucket_steps", {}).values()))
    mem = {"weights": model.weights.nbytes, "f16_weights": int(getattr(b, "f16_weight_bytes", 0)),
           "kv_cache": sum(getattr(s.cache, "nbytes", 0) for s in sessions), "graphs": int(graphs)}
    mem["total"] = sum(mem.values())
    if hasattr(model, "rank_memory"):       # --tp: each rank's share (the figures above: rank 0's)
        mem["ranks"] = model.rank_memory()
    used = getattr(b, "device_memory_used", None)
    mem["device_used"] = used() if used else None
    return mem


def bench(model, n_prompt: int = 512, n_gen: int = 128, reps: int = 3, seed: int = 0,
          progress=None, parallel: int = 1, lengths: str | None = None, depth: int = 0,
          n_ctx: int | None = None) -> list[BenchResult]:
    """pp`n_prompt` and tg`n_gen` of `model` (either may be 0 to skip it); with parallel > 1,
    the generation test is `parallel` sequences decoded in batched steps; `lengths` (a
    --lengths spec) and `depth`: see the module's docstring. `n_ctx`: the sessions' positions
    (`--ctx`; default: what the test needs). A kernel may be chosen by a sequence's capacity
    (the split attention's cut: engine/backends/cuda/attention.py), which a server's sessions
    and a long chat have larger than a bench's."""
    from .model import prompt_class
    fresh = check_args(n_prompt, n_gen, reps, parallel, lengths, depth, seed)
    longest = max([n_prompt] + (fresh[1] if fresh else []))
    capacity = n_ctx
    n_ctx = depth + max(longest, n_gen + 1)
    if n_ctx > model.config.n_ctx_train:
        what = f" ({depth} of depth and {n_ctx - depth} of the test)" if depth else ""
        raise BrassError(f"bench: {n_ctx} tokens{what} exceed the model's context of {model.config.n_ctx_train}")
    if capacity is not None:
        if capacity < n_ctx:
            raise BrassError(f"bench: --ctx {capacity} is less than the {n_ctx} positions the test needs")
        n_ctx = capacity
    elif longest >= 2:
        # room for the padding rows of the longest prompt's class graph (a prompt whose class
        # does not fit after the depth is read eagerly)
        n_ctx = min(model.config.n_ctx_train, max(n_ctx, depth + prompt_class(longest)))
    rng = np.random.default_rng(seed)
    b = model.backend
    s = model.new_session(n_ctx)
    vocab = model.config.n_vocab
    size = model.path.stat().st_size
    results = []

    def tokens(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    def start():
        """A sequence of `depth` tokens in s's cache (none: an empty one)."""
        s.reset()
        if not depth:
            return
        was, s.prompt_graphs = s.prompt_graphs, False   # read eagerly: no graph, no length marked read
        try:
            for i in range(0, depth, DEPTH_CHUNK):
                s.prefill(tokens(min(DEPTH_CHUNK, depth - i)), device_logits=True)
        finally:
            s.prompt_graphs = was

    # each test: prepare(n) does the untimed part and returns the timed one
    def prefill(n):
        start()
        ids = tokens(n)
        return lambda: s.prefill(ids, device_logits=True)

    def generate(_):
        start()
        tok = int(rng.integers(0, vocab))

        def run():
            k = 0
            for _ in s.greedy(tok, n_gen):
                k += 1
            if k != n_gen:
                raise BrassError(f"bench: generated {k} of {n_gen} tokens")
        return run

    sessions, dec = [], None
    if parallel > 1 and n_gen:
        from .batch import BatchDecoder
        dec = BatchDecoder(model)           # refuses an architecture that does not batch
        rows = n_gen + 1 if capacity is None else capacity      # each row's positions
        if getattr(b, "paged_kv", False):
            # one block pool for the rows, as a server's (the row kernels and bucket graphs
            # take rows of one pool), each holding its whole context's blocks
            from .kv_cache import blocks_for
            pool = model.new_block_pool(parallel * blocks_for(rows))
            sessions = [model.new_session(rows, pool=pool) for _ in range(parallel)]
            for q in sessions:
                q.cache.assign(pool.allocate(blocks_for(rows)))
        else:
            sessions = [model.new_session(rows) for _ in range(parallel)]

    def generate_batched(_):
        for q in sessions:
            q.reset()
        toks = tokens(parallel)

        def run():
            if dec.can_run_ahead(sessions):
                # as the server decodes greedy requests together: each step fed the last one's
                # tokens on the device, one step queued ahead of the read-back (its time is
                # counted: the timing waits for the device, which runs the step dropped at the end)
                steps = dec.greedy_steps(sessions, toks)
                for _ in range(n_gen):
                    next(steps)
                steps.close()
                return
            t = toks
            for _ in range(n_gen):
                _, best = dec.step_argmax(sessions, t)
                t = [int(x) for x in b.to_numpy(best)]
        return run

    at = f" @ d{depth}" if depth else ""
    tests = []
    if n_prompt:
        name, timed = fresh if fresh else (f"pp{n_prompt}", [n_prompt] * reps)
        tests.append(("pp", name + at, prefill, timed))
    if n_gen:
        if parallel == 1:
            tests.append(("tg", f"tg{n_gen}{at}", generate, [n_gen] * reps))
        else:
            tests.append(("tg", f"tg{n_gen}x{parallel}", generate_batched, [n_gen * parallel] * reps))

    for kind, name, prepare, timed in tests:
        with b.activate():
            prepare(n_prompt)()                              # warm-up, untimed
            if kind == "pp" and not fresh and s.prompt_graphs:
                prepare(n_prompt)()                          # and the prompt graph's capture
            if kind == "pp" and fresh and s.prompt_graphs:
                for n in class_warmups(timed, n_prompt):     # each class read eagerly, then captured
                    prepare(n)()
                    prepare(n)()
            secs = []
            for r, n in enumerate(timed):
                secs.append(_timed(b, prepare(n)))
                if progress:
                    progress(f"{name} {r + 1}/{reps}: {n / secs[-1]:.1f} tok/s")
        tps = [n / t for n, t in zip(timed, secs)]
        pp = kind == "pp"
        results.append(BenchResult(
            model=model.name, size_bytes=size, backend=b.name, test=name,
            n_tokens=round(statistics.fmean(timed)), reps=reps, tokens_per_s=statistics.fmean(tps),
            stddev=statistics.stdev(tps) if len(tps) > 1 else 0.0, samples=tps,
            kernels_per_token=s._step.kernels if kind == "tg" and parallel == 1 and s._step else None,
            prompt_graph=bool(s.prompt_graphs and all(n >= 2 and prompt_class(n) in s._prompt_steps
                                                      for n in timed)) if pp else None,
            depth=depth, lengths=list(timed) if pp else None,
            memory=held_memory(model, [s] + sessions, dec)))
    return results


def class_warmups(timed: list[int], n_prompt: int) -> list[int]:
    """For each length class of the `timed` lengths (first seen first), the longest length of
    the class that is neither timed nor the warm-up's `n_prompt` (whose class is read already);
    a class without one is left out."""
    from .model import prompt_class
    out, seen = [], set()
    for n in timed:
        if n < 2 or prompt_class(n) in seen:
            continue
        c = prompt_class(n)
        seen.add(c)
        m = c
        while m >= 2 and prompt_class(m) == c and (m in timed or m == n_prompt):
            m -= 1
        if m >= 2 and prompt_class(m) == c:
            out.append(m)
    return out


def _gib(n: int | None) -> str:
    """Bytes in GiB, or MiB under one GiB (a synthetic model's few MiB)."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def table(results: list[BenchResult]) -> str:
    from tabulate import tabulate
    rows = [(r.model, f"{r.size_bytes / 2**30:.2f} GiB", r.backend, r.test,
             f"{r.tokens_per_s:.2f} ± {r.stddev:.2f}", _gib((r.memory or {}).get("total"))) for r in results]
    out = tabulate(rows, headers=["model", "size", "backend", "test", "t/s", "memory"], tablefmt="github",
                   disable_numparse=True)
    if any(r.prompt_graph for r in results):
        out += ("\npp: every timed read replayed a prompt graph of its length class captured in the "
                "warm-up (BRASS_PROMPT_GRAPHS=0 reads prompts eagerly)")
    for r in results:
        if r.lengths and len(set(r.lengths)) > 1:
            out += f"\n{r.test}: each repetition a length not read before: {', '.join(map(str, r.lengths))}"
    mem = results[-1].memory if results else None
    if mem:
        where = "on the device" if mem.get("device_used") is not None else "in host arrays"
        out += (f"\nmemory held {where} after {results[-1].test}: weights {_gib(mem['weights'])}, "
                f"f16 weight copies {_gib(mem['f16_weights'])}, KV cache {_gib(mem['kv_cache'])}, "
                f"graphs {_gib(mem['graphs'])}")
        if mem.get("device_used") is not None:
            out += f"; the device's used memory {_gib(mem['device_used'])}"
        if mem.get("ranks"):
            out += ("\nper rank (weights, KV cache): " +
                    "; ".join(f"rank {i} {_gib(m['weights'])}, {_gib(m['kv_cache'])}" for i, m in enumerate(mem["ranks"])))
    return out
