"""The host side of an eager prompt (a length not read before: no prompt graph) on the CUDA
backend, measured on the CPU through the fake CuPy (conformance/harness/fake_cupy.py): what a
layer launches (kernels, cuBLAS GEMMs, CuPy's own array work, copies) and the Python time the
engine spends a layer and a launch.

    python3 perf/eager_prompt_host.py [--shape qwen3-0.6b] [--tokens 512] [--layers 2,8] [--reps 15]

Two shape-true files of the shape (conformance/harness/shape_models.py), shrunk to the two
layer counts and a 4096-token vocabulary, are read with prompts of lengths not read before
(each after one read of another length, which makes the f16 weight copies and loads the
kernels, as a server's first prompt of a new length finds them); the difference between the
two files, over the difference of their layer counts, is one layer's share (embedding, output
head and the per-prompt work fall out).

Counts: one read with the fake recording every launch. Times: the fastest of `reps` reads with
the fake's own work cut to nothing (no recording, kernel launches and GEMMs that return at
once), so what remains is the engine's Python, numpy on the host-side arrays, and the fake's
allocations (numpy buffers). What CuPy itself costs on a real GPU, its kernel call and its
memory pool (a few microseconds a launch), is not in it: the figures are a floor of the real
host time, not the whole of it.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness import fake_cupy, launch_recording  # noqa: E402
from conformance.harness.shape_models import write  # noqa: E402


METHODS = ("__new__", "__array_ufunc__", "__setitem__", "__getitem__", "copy", "astype", "fill")
FUNCTIONS = ("empty", "zeros", "full", "asarray", "ascontiguousarray", "take", "add", "multiply")
ARENA = 4 << 30      # virtual: the pages no kernel writes (none runs) are never touched


@contextmanager
def quiet_fake(backend_mod):
    """The fake's own work cut to nothing while the block runs: CudaBackend.launch without the
    recording wrapper, kernel calls and GEMMs that return at once, and device memory taken
    from one arena, as a pool hands out blocks it holds (the fake's own allocations are new
    zeroed buffers, kept for its life: mapping them costs more than the engine's whole layer).
    Yields `fresh()`, which gives the arena back (before a read: what the last one allocated is
    dead by then, and no kernel runs to read it)."""
    cls = backend_mod.CudaBackend
    wrapped, call, gemm = cls.launch, fake_cupy.Function.__call__, fake_cupy.FakeCublasLib.cublasGemmEx
    alloc = fake_cupy.Recorder.alloc
    arena = np.empty(ARENA, np.uint8)
    base = (-arena.__array_interface__["data"][0]) % fake_cupy.ALIGN
    top = [base]

    def arena_alloc(self, nbytes, kind="device"):
        fresh.allocations += 1
        n = -(-max(nbytes, 1) // fake_cupy.ALIGN) * fake_cupy.ALIGN
        if top[0] + n > ARENA:
            return alloc(self, nbytes, kind)
        buf = arena[top[0]:top[0] + max(nbytes, 1)]
        top[0] += n
        return buf

    def fresh():
        top[0] = base
        fresh.fake_secs = 0.0
    fresh.allocations, fresh.fake_secs = 0, 0.0
    # one allocation of the fake's: an address in it finds the arena, at its own offset
    fake_cupy._rec().register(arena.__array_interface__["data"][0], ARENA, arena)

    # CuPy's own work as the fake does it (array making, views, and the array operations a GPU
    # runs as CuPy kernels, which the fake computes with numpy on real data): timed apart
    # (fresh.fake_secs), the outermost call only
    import cupy
    depth = [0]

    def timed(fn):
        def run(*a, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    fresh.fake_secs += time.perf_counter() - t0
        return run

    methods = {k: fake_cupy.ndarray.__dict__[k] for k in METHODS}
    functions = {k: getattr(cupy, k) for k in FUNCTIONS}
    cls.launch = wrapped.__wrapped__
    fake_cupy.Function.__call__ = lambda self, *a, **kw: None
    fake_cupy.FakeCublasLib.cublasGemmEx = lambda self, *a: 0
    fake_cupy.Recorder.alloc = arena_alloc
    for k, f in methods.items():
        setattr(fake_cupy.ndarray, k, timed(f))
    for k, f in functions.items():
        setattr(cupy, k, timed(f))
    try:
        yield fresh
    finally:
        cls.launch, fake_cupy.Function.__call__, fake_cupy.FakeCublasLib.cublasGemmEx = wrapped, call, gemm
        fake_cupy.Recorder.alloc = alloc
        for k, f in methods.items():
            setattr(fake_cupy.ndarray, k, f)
        for k, f in functions.items():
            setattr(cupy, k, f)


def measure(path: Path, backend_mod, rec, tokens: int, reps: int):
    """(the events of one eager read, the fastest of `reps` eager reads in seconds with the
    fake's array making taken off, the device arrays a read allocates) of `path`."""
    import brass
    # every read eager (a prompt graph of a length class would replay lengths not read before),
    # through the cuBLAS handle a model with prompt graphs uses for its eager reads
    m = brass.load(str(path), backend="cuda", quiet=True, prompt_graphs=False, own_cublas=True)
    V = m.config.n_vocab
    s = m.new_session(tokens + reps + 8)
    length = iter(range(tokens + 1, tokens + reps + 8))

    def read(n):
        s.reset()
        s.prefill([(5 + 37 * j) % V for j in range(n)], device_logits=True)

    read(tokens)                            # the f16 copies, the kernels: then every read is new
    rec.on, n0 = True, len(rec.events)
    read(next(length))
    rec.on = False
    events = rec.events[n0:]
    secs = []
    with quiet_fake(backend_mod) as fresh:
        for _ in range(reps):
            n = next(length)
            fresh()
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            read(n)
            secs.append(time.perf_counter() - t0 - fresh.fake_secs)
            gc.enable()
        allocations = fresh.allocations / reps
    if s._prompt_steps or m._start_steps:
        raise SystemExit("a timed read replayed a prompt graph: the reads were not eager")
    return events, min(secs), allocations


def kinds(events) -> collections.Counter:
    c = collections.Counter()
    for e in events:
        if e["op"] == "launch":
            c[f"kernel {e['kernel']}"] += 1
        elif e["op"] == "cupy":
            c[f"CuPy {e['fn']}"] += 1
        else:
            c[e["op"]] += 1
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", default="2,8", help="two layer counts (default: 2,8)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.layers.split(","))
    rec = fake_cupy.Recorder()
    out = {}
    with tempfile.TemporaryDirectory() as tmp, launch_recording.fake_cuda(rec) as backend_mod:
        for n_layer in (lo, hi):
            path = write(args.shape, Path(tmp) / f"l{n_layer}", layers=n_layer, vocab=4096)
            out[n_layer] = measure(path, backend_mod, rec, args.tokens, args.reps)
            path.unlink()
    (ev_lo, t_lo, a_lo), (ev_hi, t_hi, a_hi) = out[lo], out[hi]
    k_lo, k_hi = kinds(ev_lo), kinds(ev_hi)
    per_layer = {k: (k_hi[k] - k_lo[k]) / (hi - lo) for k in k_hi if k_hi[k] != k_lo[k]}
    calls = sum(v for k, v in per_layer.items() if not k.startswith(("upload", "copy", "phase")))
    secs = (t_hi - t_lo) / (hi - lo)
    allocs = (a_hi - a_lo) / (hi - lo)
    print(f"{args.shape}, eager prompt of ~{args.tokens} tokens, a layer:")
    for k, v in sorted(per_layer.items(), key=lambda kv: -kv[1]):
        print(f"  {v:5.1f}  {k}")
    print(f"  {calls:.1f} launches and GEMMs and {allocs:.1f} device arrays allocated a layer")
    print(f"  the engine's host time {secs * 1e6:,.0f} us a layer, {secs / calls * 1e6:.1f} us a launch "
          "or GEMM (CuPy's own work, as the fake does it, taken off: the engine's Python and host numpy)")
    print(f"  whole prompt: {len(ev_hi)} events at {hi} layers; {t_hi * 1e3:.1f} ms at {hi} layers, "
          f"{t_lo * 1e3:.1f} ms at {lo}")


if __name__ == "__main__":
    main()
