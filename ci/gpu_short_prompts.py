"""Where a server's short prompts spend their time on the GPU runner: N prompts of T tokens
read one after another into pooled sessions as `brass serve` reads them (device logits, the
first token picked on the device): wall time per prompt, then cProfile's top entries by
cumulative time (the kernels' own time: ci/gpu_profile.py torch prefill MODEL T).

    python3 ci/gpu_short_prompts.py MODEL.gguf [N=16] [T=40]
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(path, n=16, t=40):
    import brass
    from brass.sampling import Sampler, SamplingParams
    m = brass.load(path, backend="cuda", quiet=True)
    b = m.backend
    rng = np.random.default_rng(0)
    sessions = [m.new_session(256) for _ in range(n)]
    greedy = Sampler(SamplingParams(temperature=0.0))

    def read_all():
        for s in sessions:
            s.reset()
            ids = [int(x) for x in rng.integers(0, m.config.n_vocab, t)]
            s.pick(s.prefill(ids, device_logits=True), greedy, ids)

    read_all()                                  # warm-up: kernels loaded
    b.synchronize()
    t0 = time.perf_counter()
    read_all()
    b.synchronize()
    wall = time.perf_counter() - t0
    print(f"{n} prompts of {t} tokens: {wall / n * 1e3:.1f} ms each (wall)")
    prof = cProfile.Profile()
    prof.enable()
    read_all()
    b.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(22)
    print("\n".join(text.getvalue().splitlines()[:40]))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
