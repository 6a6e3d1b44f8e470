"""Profiling helpers for the GPU runner (driven by nsys / ncu from the command line).

    python3 ci/gpu_profile.py decode MODEL.gguf [N]   N decode-graph replays (for nsys with
                                                      --cuda-graph-trace=node: time per kernel)
    python3 ci/gpu_profile.py matvec TYPE N K          three eager decode mat-vecs (for ncu)
    python3 ci/gpu_profile.py prefill MODEL.gguf [T]  a warm-up then one T-token prefill
    python3 ci/gpu_profile.py batch MODEL.gguf [N]    N batched greedy steps of 16 sequences
                                                      (bucket graph replays, run ahead)
    python3 ci/gpu_profile.py torch MODE MODEL.gguf N the kernels' time by name (CUPTI) of MODE
"""

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


def batch(path, n=20, rows=16):
    import brass
    from brass.batch import BatchDecoder
    m = brass.load(path, backend="cuda", quiet=True)
    sessions = [m.new_session(256) for _ in range(rows)]
    for i, s in enumerate(sessions):
        s.prefill([1 + i, 2, 3, 4])
    dec = BatchDecoder(m)
    tokens = [5 + i for i in range(rows)]
    for _ in range(2):                  # eager first step, capture
        _, best = dec.step_argmax(sessions, tokens)
        tokens = [int(t) for t in m.backend.to_numpy(best)]
    run = dec.greedy_steps(sessions, tokens)
    for _, _got in zip(range(n), run):
        pass
    run.close()
    m.backend.synchronize()


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
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(path, n)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_profile(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit()
    if sys.argv[1] in ("decode", "batch"):
        {"decode": decode, "batch": batch}[sys.argv[1]](sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
    elif sys.argv[1] == "prefill":
        prefill(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 512)
    else:
        matvec(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
