#!/usr/bin/env python
"""NCCL through CuPy on the runner, by Brass's own communicator (brass.distributed.nccl): one
process per GPU, the unique id made by rank 0 and handed to the others, as `brass --tp` will
start its workers (docs/multi-gpu.md).

    python ci/tp_nccl.py                 # every visible GPU (CUDA_VISIBLE_DEVICES respected)
    python ci/tp_nccl.py --ranks 1       # one GPU: does NCCL load, does a one-rank group work

Each rank first checks the collectives' results (all-reduce sum, all-gather order, a send/recv
ring), then times the all-reduce of each size two ways: called from Python one after another
(the host's cost per call included, as an eager decode step pays it), and replayed from a
CUDA graph holding 32 of them (as a captured decode step would). Prints a table (rank 0) and
writes it as JSON to $OUT/tp_nccl.json. Bus bandwidth is NCCL's convention for all-reduce:
bytes x 2(N-1)/N / time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = [8 << 10, 16 << 10, 32 << 10, 256 << 10, 4 << 20, 64 << 20]
GRAPH_CALLS = 32


def worker(rank: int, world: int, uid, sizes, iters: int, q):
    import cupy as cp
    from brass.distributed.nccl import NcclCommunicator
    try:
        cp.cuda.Device(rank).use()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            comm = NcclCommunicator(world, uid, rank, stream=stream)
            x = cp.full((1024,), rank + 1, cp.float32)
            comm.all_reduce(x)
            got = float(x[0].get())
            assert got == world * (world + 1) / 2, f"all-reduce gave {got}"
            g = comm.all_gather(cp.full((2,), rank, cp.int32), axis=0).get()
            assert list(g) == [r for r in range(world) for _ in range(2)], f"all-gather gave {list(g)}"
            if world > 1:
                out = cp.empty((4,), cp.float32)
                from cupy.cuda import nccl
                nccl.groupStart()       # a ring: every rank sends and receives at once
                comm.send(cp.full((4,), rank, cp.float32), (rank + 1) % world)
                comm.recv_into(out, (rank - 1) % world)
                nccl.groupEnd()
                stream.synchronize()
                assert float(out[0].get()) == (rank - 1) % world, "send/recv ring"
            rows = []
            for size in sizes:
                buf = cp.ones((size // 4,), cp.float32)
                for _ in range(10):
                    comm.all_reduce(buf)
                stream.synchronize()
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce(buf)
                stream.synchronize()
                eager = (time.perf_counter() - t0) / iters
                graph_t = None
                try:
                    stream.begin_capture()
                    for _ in range(GRAPH_CALLS):
                        comm.all_reduce(buf)
                    graph = stream.end_capture()
                    graph.launch(stream)
                    stream.synchronize()
                    comm.barrier()
                    reps = max(1, iters // GRAPH_CALLS)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        graph.launch(stream)
                    stream.synchronize()
                    graph_t = (time.perf_counter() - t0) / (reps * GRAPH_CALLS)
                except Exception as e:      # capture unsupported here: say so, keep the eager figure
                    graph_t = f"{type(e).__name__}: {e}"
                bus = size * 2 * (world - 1) / world / eager / 1e9 if world > 1 else 0.0
                rows.append({"bytes": size, "eager_us": eager * 1e6,
                             "graph_us": graph_t * 1e6 if isinstance(graph_t, float) else graph_t,
                             "bus_GBps": bus})
        q.put((rank, "ok", rows, cp.cuda.runtime.getDeviceProperties(rank)["name"].decode()))
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}", None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=None, help="GPUs to use (default: every visible one)")
    ap.add_argument("--iters", type=int, default=256)
    args = ap.parse_args(argv)
    import multiprocessing as mp

    import cupy as cp
    from brass.distributed.nccl import unique_id
    n = cp.cuda.runtime.getDeviceCount()
    world = args.ranks or n
    if world < 1 or world > n:
        print(f"tp_nccl: --ranks {world}: this process sees {n} GPUs", file=sys.stderr)
        return 2
    uid = unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, uid, SIZES, args.iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + 300
    while len(results) < world and time.time() < deadline:
        try:
            r, status, rows, gpu = q.get(timeout=5)
            results[r] = (status, rows, gpu)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break           # a worker died without reporting: do not wait for it
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    if len(results) < world or bad:
        print(f"tp_nccl: {world - len(results)} ranks did not report; errors: {bad}", file=sys.stderr)
        return 1
    status, rows, gpu = results[0]
    print(f"NCCL all-reduce, {world} x {gpu} (NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '0')}); "
          f"collectives checked on every rank")
    print(f"{'bytes':>10} {'eager us':>9} {'graph us':>9} {'bus GB/s':>9}")
    for row in rows:
        g = row["graph_us"]
        print(f"{row['bytes']:>10} {row['eager_us']:>9.1f} {g if isinstance(g, str) else f'{g:9.1f}':>9} "
              f"{row['bus_GBps']:>9.1f}")
    out = Path(os.environ.get("OUT", "."))
    (out / "tp_nccl.json").write_text(json.dumps({"world": world, "gpu": gpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
