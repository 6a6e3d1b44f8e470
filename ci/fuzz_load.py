"""Mutation fuzz of model loading by the hundred thousand: the mutated copies of the synthetic
GGUFs that conformance/harness/gguf_mutations.py makes (flipped bytes, truncations, extreme
integers and floats in the header, renamed tensors, shifted chunks), each loaded and run on one
prompt in worker processes, each copy under a time limit. Every copy must either run or fail
with a BrassError; anything else (a KeyError from deep in the forward pass, a ValueError from a
mat-mul, a hang) is a bug. conformance/models/test_fuzz_load.py runs a few thousand copies on
every CI run.

    python ci/fuzz_load.py -n 100000 --jobs 2              # counts: ok / BrassError / other
    python ci/fuzz_load.py --seed 7 --case 1234 -v         # replay one copy, with its traceback

A copy is named by (seed, case): the same pair gives the same bytes on any machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __name__ == "__main__":
    # One BLAS thread per worker process: the matrices are small, and threads of several
    # processes fighting over the cores made the run slower, not faster.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness.gguf_mutations import MODELS, check, mutant, original  # noqa: E402


# -- the long run: worker processes, a time limit per copy ---------------------------------------

def _worker(conn, seed, directory):
    """Run the cases the parent sends, one at a time, answering each with its result."""
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send((case,) + check(seed, case, directory))


class _Pool:
    """Worker processes, each sent one case at a time, so that a case that runs past the time
    limit is known and its worker can be killed (and replaced) without disturbing the others."""

    def __init__(self, jobs, seed, directory):
        self.ctx = multiprocessing.get_context("fork")
        self.seed, self.directory = seed, directory
        self.busy = {}                     # connection -> (process, case, time sent)
        self.idle = [self._start() for _ in range(jobs)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, self.seed, self.directory), daemon=True)
        p.start()
        child.close()
        return parent, p

    def send(self, case):
        conn, p = self.idle.pop()
        conn.send(case)
        self.busy[conn] = (p, case, time.monotonic())

    def results(self, limit):
        """Wait a little; yield (case, kind, detail) for cases finished or past the limit."""
        for conn in multiprocessing.connection.wait(list(self.busy), timeout=1.0):
            p, case, _ = self.busy.pop(conn)
            try:
                result = conn.recv()
            except EOFError:               # the worker died (killed for memory, say)
                yield self._replace(conn, p, "died", case)
                continue
            self.idle.append((conn, p))
            yield result
        now = time.monotonic()
        for conn, (p, case, sent) in list(self.busy.items()):
            if now - sent > limit:
                del self.busy[conn]
                yield self._replace(conn, p, "hung", case)

    def _replace(self, conn, p, kind, case):
        p.kill()
        p.join()
        conn.close()
        self.idle.append(self._start())
        model, _, done = mutant(self.seed, case)
        return case, kind, f"seed {self.seed} case {case} ({model.name}: {'; '.join(done)}): {kind}"

    def close(self):
        for conn, p in self.idle:
            conn.send(None)
            p.join()
        for _conn, (p, _, _) in self.busy.items():
            p.kill()
            p.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10000, help="number of mutated copies")
    ap.add_argument("--seed", type=int, default=None, help="default: random, printed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--limit", type=float, default=60.0, help="seconds allowed per copy")
    ap.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--case", type=int, default=None, help="replay one copy")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        if a.case is not None:
            model, _, done = mutant(seed, a.case)
            print(f"seed {seed} case {a.case}: {model.name}: {'; '.join(done)}")
            kind, detail = check(seed, a.case, d)
            print(kind, detail)
            return 0 if kind != "other" else 1
        print(f"seed {seed}: {a.n} copies of {len(MODELS)} models, {a.jobs} processes, "
              f"{a.limit:g} s per copy", flush=True)
        for m in MODELS:
            original(m)                    # parsed once, before the workers fork
        counts: Counter = Counter()
        failures: list[str] = []
        messages: Counter = Counter()
        start = last = time.monotonic()
        pool = _Pool(a.jobs, seed, d)
        next_case = 0
        try:
            while next_case < a.n or pool.busy:
                while pool.idle and next_case < a.n:
                    pool.send(next_case)
                    next_case += 1
                for _case, kind, detail in pool.results(a.limit):
                    counts[kind] += 1
                    if kind == "brass":
                        messages[_shape(detail)] += 1
                    elif kind != "ok":
                        failures.append(detail)
                        if a.verbose:
                            print(detail, flush=True)
                now = time.monotonic()
                if now - last > 60:
                    last = now
                    print(f"  {sum(counts.values())} done, {now - start:.0f} s: {dict(counts)}",
                          flush=True)
                if a.budget and now - start > a.budget and next_case < a.n:
                    print("wall-clock budget spent", flush=True)
                    a.n = next_case        # finish the cases in flight, send no more
        finally:
            pool.close()
    total = sum(counts.values())
    print(f"\nseed {seed}: {total} mutated files in {time.monotonic() - start:.0f} s: "
          f"{counts['ok']} loaded and ran, {counts['brass']} BrassError, "
          f"{counts['other']} other exceptions, {counts['hung']} hung (> {a.limit:g} s), "
          f"{counts['died']} workers died")
    if a.verbose:
        print("\nmost common BrassError messages (numbers and paths elided):")
        for msg, n in messages.most_common(60):
            print(f"  {n:6d}  {msg}")
    for f in failures[:20]:
        print("\n" + f)
    return 1 if failures else 0


def _shape(message: str) -> str:
    """A BrassError message with its path and numbers elided, to group them."""
    import re
    message = re.sub(r"\S*fuzz-\d+-\d+\.gguf", "FILE", message)
    return re.sub(r"\d+", "N", message)[:160]


if __name__ == "__main__":
    sys.exit(main())
