"""How far Q8_1 rounding alone can move a model's teacher-forced logits: the numpy backend in q8_1
mode (the CUDA kernels' oracle) scores each of the model's CUDA golden prompts twice, the second
time with every activation multiplied by (1 + u), u uniform in +-2^-24 (about one float32 ulp),
just before it is rounded to Q8_1. Per prompt it prints the largest change of llama.cpp's top-1
token's logit between the two runs and how many argmaxes flip at positions whose llama.cpp
margin exceeds 0.25.

Why: two forwards that differ by an ulp before a Q8_1 rounding (llama.cpp's CUDA backend and
Brass's, whose reductions run in other orders) round some activations to other integers; this
measures what that alone does, the floor under any "argmax equal at margin >= x" rule. A
prompt's dense mat-muls go to the float16 GEMM, so only the mat-vec rows (prompts under 32
tokens, decode) round their activations to Q8_1. CPU only.

    python3 ci/rounding_noise.py smollm2-135m [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a model with CUDA goldens (golden/cuda/manifest.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eps", type=float, default=0.25, help="llama.cpp margin above which a flip counts")
    args = ap.parse_args(argv)

    import brass
    from conformance.harness import goldens
    from brass import quants

    m = brass.load(args.model, backend="numpy", act_mode="q8_1", quiet=True)
    prompts = goldens.prompts(args.model, "cuda")
    base = [m.score(p.tf_ids) for p in prompts]
    exact = quants.quantize_q8_1_cuda
    rng = np.random.default_rng(args.seed)

    def nudged(x, *a, **k):
        x = np.asarray(x, np.float32)
        return exact((x * (1 + rng.uniform(-2.0 ** -24, 2.0 ** -24, x.shape))).astype(np.float32), *a, **k)

    quants.quantize_q8_1_cuda = nudged      # the numpy backend calls it through the module
    try:
        total_flips = total_clear = 0
        worst = 0.0
        for p, b in zip(prompts, base):
            logits = m.score(p.tf_ids)
            ids = p.tf_top_ids.astype(np.int64)
            d = np.abs(np.take_along_axis(logits, ids, -1)[:, 0] - np.take_along_axis(b, ids, -1)[:, 0])
            clear = p.tf_margin > args.eps
            flips = int(((logits.argmax(-1) != b.argmax(-1)) & clear).sum())
            total_flips += flips
            total_clear += int(clear.sum())
            worst = max(worst, float(d.max()))
            print(f"{p.name:8s} top-1 logit moved by up to {d.max():.2f} (position {d.argmax()}); "
                  f"argmax flips at margin > {args.eps}: {flips} of {int(clear.sum())}")
        print(f"{args.model}: an ulp before each Q8_1 rounding moves the top-1 logit by up to {worst:.2f} "
              f"and flips {total_flips} of {total_clear} argmaxes at margin > {args.eps}")
    finally:
        quants.quantize_q8_1_cuda = exact
    return 0


if __name__ == "__main__":
    sys.exit(main())
