"""A MoE prompt's expert mat-muls (moe_plan + mmq_id_<type>, kernels/mmq.cu) in tile sizes on
the GPU runner: the #defines of mmq.cu (tile rows / tokens / threads, the K chunk, a register
cap) compiled in turn, each timed on a MoE shape's expert mat-muls at a 512-token prompt,
routing uniform at random (distinct experts per token): --shape 30b-a3b (the default: Qwen3-
30B-A3B, 128 experts, 8 per token, gate / up Q4_K 768 x 2048, down Q6_K 2048 x 768) or 35b-a3b
(Qwen3.6-35B-A3B, 256 experts, 8 per token, gate / up Q4_K 512 x 2048, down Q6_K 2048 x 512:
about 16 tokens an expert, a quarter of a 64-token tile). Every variant's output must equal the default's bit for bit
(each output is one column's own sum in K order, whatever the tile:
conformance/kernels/test_kernels_mmq.py checks the same on the CPU); a variant that differs is
reported and never chosen.

    python3 ci/gpu_tune_mmq.py [--shape 30b-a3b|35b-a3b] [--apply] [--only NAME]

Prints a table (µs per launch, median of 10 after a warm-up; a layer = 2 x gate + down), then
`best: NAME=VALUE ...` (nothing when the default is best, or no variant is 5 % faster per
layer). --apply writes the best variant's values into kernels/mmq.cu's #define lines (the
runner's copy of the tree: the suite and the benchmarks that follow then run it). --only
NAME[,NAME...] runs those variants alone, the first of them the bits' reference; with
"default" first they are compared with it (and --apply applies) as above (under ncu: `ncu -k
regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only default`).
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brass.gguf import GGMLType  # noqa: E402
from brass.quants import random_blocks  # noqa: E402
from brass.backends.cuda.params import pack  # noqa: E402

MMQ_CU = Path(__file__).resolve().parents[1] / "kernels" / "mmq.cu"
T = 512
# experts, experts a token, expert FFN width, hidden size
SHAPES = {"30b-a3b": (128, 8, 768, 2048), "35b-a3b": (256, 8, 512, 2048)}
VARIANTS = {
    "default": (),
    "kb4": ("MMQ_KB=4",),
    "kb2": ("MMQ_KB=2",),
    "no cap": ("MMQ_MIN_BLOCKS=1",),
    "cap4": ("MMQ_MIN_BLOCKS=4",),
    "kb4 no cap": ("MMQ_KB=4", "MMQ_MIN_BLOCKS=1"),
    "128x32 kb4": ("MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4"),
    "128x32 kb4 no cap": ("MMQ_ROWS=128", "MMQ_COLS=32", "MMQ_THREADS=128", "MMQ_KB=4", "MMQ_MIN_BLOCKS=1"),
    "64x32": ("MMQ_COLS=32", "MMQ_THREADS=64"),
    "32x64": ("MMQ_ROWS=32", "MMQ_THREADS=64"),
    "128x64 kb4": ("MMQ_ROWS=128", "MMQ_THREADS=256", "MMQ_KB=4"),
}


def default_of(source: str, name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", source).group(1))


def main() -> int:
    import cupy as cp
    from tabulate import tabulate

    from brass.backends.cuda import CudaBackend
    from brass.backends.cuda.compiler import compile_text, target_for

    argv = sys.argv[1:]
    apply = "--apply" in argv
    # --only NAME[,NAME...]: those variants alone (the first of them is the bits' reference)
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    shape = (argv[argv.index("--shape") + 1:] or [""])[0] if "--shape" in argv else "30b-a3b"
    if shape not in SHAPES:
        print(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
        return 2
    E, K_USED, F, H = SHAPES[shape]
    CASES = (("gate", GGMLType.Q4_K, "q4_k", F, H), ("down", GGMLType.Q6_K, "q6_k", H, F))
    cuda = CudaBackend()
    source = MMQ_CU.read_text()
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(E, K_USED, replace=False) for _ in range(T)]).astype(np.int32)
    data = {}
    with cuda.activate():
        I = cp.asarray(ids)  # noqa: E741 (the name the kernel and the math use)
        for what, qtype, _name, N, K in CASES:
            w = cp.asarray(random_blocks(qtype, E * N, K, rng).reshape(-1))
            x = cp.asarray(rng.uniform(-1, 1, (T if what == "gate" else T * K_USED, K)).astype(np.float32))
            data[what] = (w, cuda.quantize_q8_1(x), w.size // (E * N))
        cuda.synchronize()
    print(f"{cuda.device_name}: {shape}: E {E}, {K_USED} per token, T {T}; median of 10 launches after a warm-up",
          flush=True)
    rows, first, differ, totals = [], {}, [], {}
    for label, defines in VARIANTS.items():
        if only is not None and label not in only:
            continue
        d = dict(x.split("=") for x in defines)
        R, C, TH = (int(d.get(n, default_of(source, n))) for n in ("MMQ_ROWS", "MMQ_COLS", "MMQ_THREADS"))
        plan_threads = default_of(source, "MOE_PLAN_THREADS")
        try:
            image = compile_text("mmq.cu", source, target_for(cuda.cc), tuple(f"-D{x}" for x in defines))
        except Exception as e:              # a variant that does not build is reported, not chosen
            rows.append((label, f"compile failed: {str(e).splitlines()[0][:60]}", "", "", ""))
            continue
        mod = cp.cuda.function.Module()
        mod.load(image)
        S = T * K_USED
        max_tiles = -(-S // C) + min(E, S)
        times = {}
        with cuda.activate():
            stream = cp.cuda.get_current_stream()
            plan = cp.empty(2 * E + 2 * S + 1 + 2 * max_tiles, np.int32)
            mod.get_function("moe_plan")((1,), (plan_threads,), (I, plan, pack("MoePlanParams", n_slots=S, n_experts=E,
                                                                                max_tiles=max_tiles)))
            for what, _qtype, name, N, K in CASES:
                w, xa, row_bytes = data[what]
                fn = mod.get_function(f"mmq_id_{name}")
                y = cp.full((S, N), np.nan, np.float32)
                params = pack("MmqIdParams", n_rows=N, k=K, n_slots=S, n_used=K_USED, row_bytes=row_bytes,
                              expert_bytes=N * row_bytes, n_experts=E, x_per_slot=int(what == "down"),
                              max_tiles=max_tiles)
                args = ((-(-N // R), max_tiles + 1), (TH,), (w, xa, plan, y, params))
                fn(*args)
                samples = []
                for _ in range(10):
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record(stream)
                    fn(*args)
                    b.record(stream)
                    b.synchronize()
                    samples.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
                cp.cuda.runtime.deviceSynchronize()         # a launch error surfaces here
                got = cp.asnumpy(y)
                ref = first.setdefault(what, got)
                same = np.isfinite(got).all() and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
                if not same:
                    differ.append(label)
                times[what] = statistics.median(samples)
        layer = 2 * times["gate"] + times["down"]
        totals[label] = (layer, label not in differ)
        rows.append((label, f"{times['gate']:.0f}", f"{times['down']:.0f}", f"{layer:.0f}",
                     "yes" if label not in differ else "NO"))
    if "default" not in totals:         # (--only without the default: nothing to compare with)
        print(tabulate(rows, headers=["variant", "gate us", "down us", "layer us", "equals default"],
                       tablefmt="github"))
        return 1 if differ else 0
    base = totals["default"][0]
    print(tabulate([(*r, f"{base / totals[r[0]][0]:.2f}x" if r[0] in totals else "") for r in rows],
                   headers=["variant", "gate us", "down us", "layer us", "equals default", "speed-up (layer)"],
                   tablefmt="github"))
    ok = {k: v for k, (v, same) in totals.items() if same}
    best = min(ok, key=ok.get)
    if best == "default" or ok[best] > 0.95 * base:
        print("best: the default")
        return 1 if differ else 0
    print("best:", " ".join(VARIANTS[best]), f"({best}, {base / ok[best]:.2f}x per layer)")
    if apply:
        s = source
        for x in VARIANTS[best]:
            n, v = x.split("=")
            s, count = re.subn(rf"(#define {n} )\d+", rf"\g<1>{v}", s, count=1)
            assert count == 1, n
        MMQ_CU.write_text(s)
        print(f"applied to {MMQ_CU}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
