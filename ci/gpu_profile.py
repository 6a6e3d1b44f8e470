"""Profiling helpers for the GPU runner (driven by nsys / ncu from the command line).

    python3 ci/gpu_profile.py decode MODEL.gguf [N]   N decode-graph replays (for nsys with
                                                      --cuda-graph-trace=node: time per kernel)
    python3 ci/gpu_profile.py matvec TYPE N K          three eager decode mat-vecs (for ncu)
    python3 ci/gpu_profile.py prefill MODEL.gguf [T]  a warm-up then one T-token prefill
    python3 ci/gpu_profile.py batch MODEL.gguf [N]    N batched greedy steps of 16 pooled
                                                      sequences DEPTH (env) tokens deep (bucket
                                                      graph replays, run ahead), ms a step under
                                                      each GROUP_FILLS (env) split cut
    python3 ci/gpu_profile.py torch MODE MODEL.gguf N the kernels' time by name (CUPTI) of MODE
    python3 ci/gpu_profile.py timeline MODEL.gguf N [TRACE]  N decode-graph replays under CUPTI:
                                                      the time between kernels a token
                                                      (ci/decode_timeline.py), the trace kept
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode(path, n=20):
    import brass
    m = brass.load(path, backend="cuda", quiet=True)
    s = m.new_session(256)
    s.prefill([1, 2, 3, 4])
    for _t in s.greedy(5, 4):          # eager first step, capture, warm replays
        pass
    m.backend.synchronize()
    print("kernels per token:", s._step.kernels, flush=True)
    for _ in s.greedy(7, n):
        pass
    m.backend.synchronize()


def prefill(path, T=512):
    import brass
    m = brass.load(path, backend="cuda", quiet=True)
    s = m.new_session(T)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, m.config.n_vocab, T)]
    s.prefill(ids, device_logits=True)
    m.backend.synchronize()
    s.reset()
    s.prefill(ids, device_logits=True)
    m.backend.synchronize()


def batch(path, n=20, rows=16, depth=None):
    """Greedy batched steps of `rows` sequences over one block pool (as brass serve holds
    them: row kernels, bucket graphs, run ahead), each sequence DEPTH (env, default 16) random
    tokens deep. Prints the wall ms a step over n steps; returns a function that runs n more
    (what torch_profile profiles, without the load and the prompts)."""
    import os
    import time

    import brass
    from brass.batch import BatchDecoder
    from brass.kv_cache import blocks_for
    depth = int(os.environ.get("DEPTH", 16)) if depth is None else depth
    m = brass.load(path, backend="cuda", quiet=True)
    ctx = depth + 12 * n + 64          # room for four fills' steps and the profiled ones
    pool = m.new_block_pool(rows * blocks_for(ctx) + 1)
    sessions = [m.new_session(ctx, pool=pool) for _ in range(rows)]
    rng = np.random.default_rng(0)
    for s in sessions:
        s.cache.assign(pool.allocate(blocks_for(ctx)))
        s.prefill([int(t) for t in rng.integers(0, m.config.n_vocab, depth)], device_logits=True)
    tokens = [5 + i for i in range(rows)]
    dec = None

    def steps():
        run = dec.greedy_steps(sessions, tokens)
        for _, got in zip(range(n), run):
            tokens[:] = [int(t) for t in got]
        run.close()
        m.backend.synchronize()
    from brass.backends.cuda import attention
    default = attention.SPLIT_GROUP_FILL
    # GROUP_FILLS (env, a comma list): each SPLIT_GROUP_FILL timed in turn (0: a block column a
    # KV group, split kernels sharing K and V reads; 1e9: a block a head), then the default
    for fill in [float(f) for f in os.environ.get("GROUP_FILLS", "").split(",") if f] + [default]:
        attention.SPLIT_GROUP_FILL = fill
        dec = BatchDecoder(m)           # graphs captured anew under this fill
        for _ in range(2):              # eager first step, capture
            _, best = dec.step_argmax(sessions, tokens)
            tokens = [int(t) for t in m.backend.to_numpy(best)]
        steps()
        t0 = time.perf_counter()
        steps()
        dt = time.perf_counter() - t0
        print(f"batch: {rows} rows at depth {depth}, split group fill {fill:g}: {dt / n * 1e3:.2f} ms a step, "
              f"{rows * n / dt:.1f} tok/s (row_kernels {m.backend.options.row_kernels}, "
              f"buckets {bool(dec.buckets)})", flush=True)
    return steps


def matvec(tname, N, K):
    from brass.backends.cuda import CudaBackend
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    b = CudaBackend()
    rng = np.random.default_rng(0)
    gf = GGUFFile(random_weight_file(Path("/tmp/prof-w.gguf"), rng, {"w": (GGMLType[tname], (N, K))}))
    w = b.weight(gf, "w")
    with b.activate():
        x = b.asarray(rng.uniform(-1, 1, (1, K)).astype(np.float32))
        for _ in range(3):
            b.matmul(x, w)
    b.synchronize()


def torch_profile(mode, path, n):
    """GPU kernel time by kernel name (CUPTI through torch.profiler: it sees CuPy's launches
    and graph replays alike), for decode or prefill."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.init()
    fn = {"decode": decode, "prefill": prefill, "batch": batch}[mode]
    if mode == "batch":                 # its steps only: not the load and the prompts
        fn = batch(path, n)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
    else:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(path, n)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60))


def timeline(path, n=64, trace=None):
    """n greedy decode tokens (graph replays, run ahead as brass generate runs them) under
    CUPTI, after a warm-up outside it; the trace exported (to `trace`, else a temporary file)
    and read by decode_timeline: where a token's time goes between kernels."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    import brass
    from ci import decode_timeline
    torch.cuda.init()
    m = brass.load(path, backend="cuda", quiet=True)
    s = m.new_session(n + 64)
    s.prefill([1, 2, 3, 4])
    for _t in s.greedy(5, 8):          # eager first step, capture, warm replays
        pass
    m.backend.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _t in s.greedy(7, n):
            pass
        m.backend.synchronize()
    out = Path(trace) if trace else Path(tempfile.mkdtemp()) / "decode-trace.json"
    prof.export_chrome_trace(str(out))
    events = decode_timeline.gpu_events(json.loads(out.read_text()))
    print(f"{Path(path).name}: trace {out}")
    print(decode_timeline.report(decode_timeline.token_stats(events, s._step.kernels)))


if __name__ == "__main__":
    if sys.argv[1] == "timeline":
        timeline(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 64, sys.argv[4] if len(sys.argv) > 4 else None)
        sys.exit()
    if sys.argv[1] == "torch":
        torch_profile(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit()
    if sys.argv[1] in ("decode", "batch"):
        {"decode": decode, "batch": batch}[sys.argv[1]](sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
    elif sys.argv[1] == "prefill":
        prefill(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 512)
    else:
        matvec(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
