"""Compile-time variants of the decode mat-vecs side by side on the GPU runner, in one process:
kernels/matvec_q.cu built with other values of its knobs (MV_PRELOAD, MV_PRELOAD_Q6K,
MV_PRELOAD_EARLY, or any other #ifndef default of kernels/matvec.cuh given as NAME=VALUE),

1. each variant's matvec_q.cu compiled first, every variant in its own process at once (NVRTC
   takes ~45 s for that file; the cache under ~/.cache/brass keeps the images);
2. the mat-vecs alone, timed as ci/gpu_speed.py times them (the backend's own launches: 20 per
   graph, programmatic dependent launch, weights rotated past L2), in GB/s and as a share of
   the device copy rate, and every output compared bit for bit with the first variant's;
3. with --shapes: tg128 of shape-true models (conformance/harness/shape_models.py) with each variant, the
   variants alternated --rounds times on one loaded model (the backend's matvec_q.cu module
   swapped between them, a new session each: its decode graph captured with that module), and
   64 greedy tokens compared with the first variant's.

A variant is a comma-separated list of NAME=VALUE; variants are separated by ';'. The first is
the baseline (pass "" for the header's defaults). Exit 1 when an output or a token differs.
`--pick JSON` reads such a run's --json and prints the defines of the variant to keep (one
NAME=VALUE a line; nothing: the baseline): among those with no difference, the best geometric
mean of tg128 over the shapes relative to the baseline, if that is at least PICK_GAIN and no
shape is below PICK_FLOOR.

    python3 ci/gpu_preload.py --variants ";MV_PRELOAD=4;MV_PRELOAD=4,MV_PRELOAD_EARLY=1" \
        [--shapes qwen3-0.6b,qwen3-8b] [--dir /tmp/brass-shapes] [--rounds 2] [--json OUT]
    python3 ci/gpu_preload.py --pick OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# prompts read eagerly: a prompt graph captured under one variant would replay its kernels under
# the next (the model keeps sequences' first prompts' graphs)
os.environ["BRASS_PROMPT_GRAPHS"] = "0"

from brass.gguf import GGMLType  # noqa: E402

SOURCE = "matvec_q.cu"
# --pick: a variant is kept when it decodes at least 1 % faster over the shapes (geometric mean)
# and no shape more than 0.5 % slower (tg128 repeats within ~0.2 % on the H200 in one call)
PICK_GAIN, PICK_FLOOR = 1.01, 0.995
CASES = [  # (type, N rows, K): issue 8's Q4_K bar first
    (GGMLType.Q4_K, 4096, 12288), (GGMLType.Q4_K, 12288, 4096), (GGMLType.Q4_K, 4096, 4096),
    (GGMLType.Q4_K, 3072, 1024), (GGMLType.Q6_K, 4096, 12288), (GGMLType.Q6_K, 12288, 4096),
    (GGMLType.Q6_K, 1024, 4096), (GGMLType.Q6_K, 151936, 1024),
]


def parse_variants(text: str) -> list[tuple[str, ...]]:
    out = []
    for part in text.split(";"):
        defs = tuple(d.strip() for d in part.split(",") if d.strip())
        for d in defs:
            name, _, value = d.partition("=")
            if not name.isidentifier() or not value.strip().lstrip("-").isdigit():
                raise SystemExit(f"gpu_preload: a define is NAME=INTEGER, not {d!r}")
        out.append(defs)
    return out


def options(defs: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"-D{d}" for d in defs)


def precompile(variants, target: str):
    """Every variant's matvec_q.cu image into the compile cache, in parallel processes."""
    code = ("import sys; sys.path.insert(0, {root!r}); from brass.backends.cuda.compiler import compile_source; "
            "compile_source({src!r}, {target!r}, {opts!r})")
    root = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", code.format(root=root, src=SOURCE, target=target,
                                                                  opts=options(v))]) for v in variants]
    bad = [v for v, p in zip(variants, procs) if p.wait() != 0]
    if bad:
        raise SystemExit(f"gpu_preload: {SOURCE} did not compile with {bad}")


def use_variant(b, defs: tuple[str, ...]):
    """The backend's matvec_q.cu module replaced by the variant's (compiled with its defines);
    the other sources keep the defaults."""
    k = b.kernels
    if SOURCE in k._modules:        # kept loaded: graphs captured with it may still be alive
        k.__dict__.setdefault("_retired", []).append(k._modules.pop(SOURCE))
    for key in [key for key in k._functions if key[0] == SOURCE]:
        del k._functions[key]
    for key in [key for key in k._smem_optin if key[0] == SOURCE]:
        del k._smem_optin[key]
    for key in [key for key in k._threads if key[0] == SOURCE]:    # (a build's __launch_bounds__)
        del k._threads[key]
    get = type(k).get

    def get_with(source, name, _k=k):
        if source == SOURCE and SOURCE not in _k._modules:
            saved = _k.options
            _k.options = saved + options(defs)
            try:
                return get(_k, source, name)
            finally:
                _k.options = saved
        return get(_k, source, name)
    k.get = get_with


def pick(path: Path) -> list[str]:
    """The defines of the variant to keep from a --json result (see the module's doc)."""
    d = json.loads(path.read_text())
    base = d["variants"][0]
    best, best_gain = [], 1.0
    for name in d["variants"][1:]:
        if name in d["differ"] or not d["tg"]:
            continue
        ratios = [statistics.mean(t[name]) / statistics.mean(t[base]) for t in d["tg"]]
        gain = statistics.geometric_mean(ratios)
        if gain >= PICK_GAIN and min(ratios) >= PICK_FLOOR and gain > best_gain:
            best, best_gain = name.split(","), gain
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants")
    ap.add_argument("--pick", type=Path, default=None)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/brass-shapes"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.pick:
        print("\n".join(pick(args.pick)))
        return
    if args.variants is None:
        ap.error("--variants or --pick")
    variants = parse_variants(args.variants)

    import cupy as cp
    from tabulate import tabulate

    from ci.gpu_speed import copy_bandwidth, matvec_speed
    from brass.backends.cuda import CudaBackend
    label = [",".join(v) or "defaults" for v in variants]
    b = CudaBackend()
    t0 = time.time()
    precompile(variants, b.kernels.target)
    print(f"{len(variants)} variants of {SOURCE} compiled in {time.time() - t0:.0f} s", flush=True)
    bw = copy_bandwidth(cp)
    print(f"device: {b.device_name}, copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    tmp = args.dir / "kernels"
    tmp.mkdir(parents=True, exist_ok=True)
    failures, out = [], {"copy_GB_per_s": bw, "variants": label, "matvec": [], "tg": [], "differ": []}
    rows = []
    for qtype, N, K in CASES:
        row, ref = [qtype.name, N, K], None
        for v, name in zip(variants, label):
            use_variant(b, v)
            us, gbs, y = matvec_speed(b, tmp, qtype, N, K, with_output=True)
            if ref is None:
                ref = y
            elif not (np.isfinite(y).all() and np.array_equal(y.view(np.uint32), ref.view(np.uint32))):
                failures.append(f"{qtype.name} {N}x{K}: {name} differs from {label[0]}")
                out["differ"].append(name)
            row.append(f"{us:.1f} us {100 * gbs / bw:.0f} %")
            out["matvec"].append(dict(type=qtype.name, N=N, K=K, variant=name, us=us, share=gbs / bw))
        rows.append(row)
        print(tabulate([row], tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["type", "N", "K", *label], tablefmt="github"), flush=True)

    if args.shapes:
        import brass
        from conformance.harness import shape_models
        from brass.bench import bench
        for shape in args.shapes.split(","):
            path = args.dir / f"{shape}.gguf"
            if not path.exists():
                shape_models.write(shape, args.dir)
            m = brass.load(str(path), backend="cuda", quiet=True)
            prompt = [int(t) for t in np.random.default_rng(3).integers(0, m.config.n_vocab, 8)]
            tokens0, tg = None, {name: [] for name in label}
            for _ in range(args.rounds):
                for v, name in zip(variants, label):
                    use_variant(m.backend, v)
                    r = [x for x in bench(m, n_prompt=0, n_gen=128, reps=3) if x.test == "tg128"][0]
                    tg[name].append(r.tokens_per_s)
                    tokens = list(m.generate(prompt, max_tokens=64, stop_at_eog=False))
                    if tokens0 is None:
                        tokens0 = tokens
                    elif tokens != tokens0:
                        failures.append(f"{shape}: {name}'s greedy tokens differ from {label[0]}'s")
                        out["differ"].append(name)
            line = "  ".join(f"{name}: {' / '.join(f'{x:.1f}' for x in tg[name])}" for name in label)
            print(f"{shape} tg128 (rounds alternated): {line}", flush=True)
            out["tg"].append(dict(shape=shape, **tg))
            del m
    for f in failures:
        print("FAILED:", f)
    print(f"{len(failures)} differences from the first variant")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
