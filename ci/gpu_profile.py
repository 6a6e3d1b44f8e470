"""Profiling helpers for the GPU runner (driven by nsys / ncu from the command line).

    python3 ci/gpu_profile.py decode MODEL.gguf [N]   N decode-graph replays (for nsys with
                                                      --cuda-graph-trace=node: time per kernel)
    python3 ci/gpu_profile.py matvec TYPE N K          three eager decode mat-vecs (for ncu)
    python3 ci/gpu_profile.py prefill MODEL.gguf [T]  a warm-up then one T-token prefill
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode(path, n=20):
    import engine
    m = engine.load(path, backend="cuda", quiet=True)
    s = m.new_session(256)
    s.prefill([1, 2, 3, 4])
    for t in s.greedy(5, 4):          # eager first step, capture, warm replays
        pass
    m.backend.synchronize()
    print("kernels per token:", s._step.kernels, flush=True)
    for _ in s.greedy(7, n):
        pass
    m.backend.synchronize()


def prefill(path, T=512):
    import engine
    m = engine.load(path, backend="cuda", quiet=True)
    s = m.new_session(T)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, m.config.n_vocab, T)]
    s.prefill(ids, device_logits=True)
    m.backend.synchronize()
    s.reset()
    s.prefill(ids, device_logits=True)
    m.backend.synchronize()


def matvec(tname, N, K):
    from engine.backends.cuda import CudaBackend
    from engine.gguf import GGMLType, GGUFFile
    from kernels.cases import random_weight_file
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
    fn = decode if mode == "decode" else prefill
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(path, n)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_profile(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit()
    if sys.argv[1] == "decode":
        decode(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
    elif sys.argv[1] == "prefill":
        prefill(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 512)
    else:
        matvec(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
