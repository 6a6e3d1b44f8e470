"""Decode at depth with the split-K attention kernels on and off (`bash ci/gpu.sh depth`):
`brass bench` tg N at each depth (llama-bench's -d: N tokens generated after D already in the
cache), once with the CUDA backend's attn_split option off (the one-block kernel: a block per
head reads the whole context) and once on (kernels/attention.cu's split kernels), the same
process and model, then one table: tokens per second (mean and standard deviation of the
repetitions), on / off (the default, attn_split None, takes the split kernels for every
decode step: engine/backends/cuda/attention.py takes_split). The option is flipped between the
runs on the loaded backend: each bench run makes a new session, whose decode graph is captured
with the option as it is then.

    python3 ci/depth_split.py MODEL.gguf [--depths 4096,16384,32768] [--n-gen 128] [--reps 3] [--json OUT]

--ctx N: the session's positions (a kernel may be chosen by the capacity; default: what the
depth and the test need). --group-fills F1,F2,...: the split kernels (the default) at each
SPLIT_GROUP_FILL of engine/backends/cuda/attention.py instead (0: a block column a KV group,
the reads of K and V shared by its query heads; 1e9: a block a head; the default's value
chooses by the work there is), one column a fill.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def depths_arg(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths must be a comma list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"depths must be integers >= 1, got {text!r}")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--depths", type=depths_arg, default=[4096, 16384, 32768])
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write every run's bench result here")
    ap.add_argument("--ctx", type=int, default=None,
                    help="the bench session's positions (default: the depth and the test's)")
    ap.add_argument("--group-fills", type=lambda t: [float(x) for x in t.split(",") if x.strip()], default=None,
                    help="time these SPLIT_GROUP_FILL values (split kernels on) instead of attn_split off / on")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        print(f"depth_split: no model file {a.model}", file=sys.stderr)
        return 2

    import brass
    from brass.bench import bench
    from brass.errors import BrassError

    m = brass.load(str(a.model), backend="cuda", quiet=True)
    b = m.backend
    if a.group_fills:
        return group_fills(m, a)
    rows, runs = [], []
    for depth in a.depths:
        got = {}
        for on in (False, True):
            b.options.attn_split = on
            try:
                r = bench(m, n_prompt=0, n_gen=a.n_gen, reps=a.reps, depth=depth, n_ctx=a.ctx)[0]
            except BrassError as e:
                print(f"depth {depth}, attn_split {on}: {e}", file=sys.stderr)
                break
            got[on] = r
            runs.append({"attn_split": on, **r.as_dict()})
            print(f"depth {depth} attn_split={on}: {r.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        if len(got) == 2:
            rows.append((depth, got[False], got[True]))
    b.options.attn_split = None
    if a.json:
        a.json.write_text(json.dumps({"device": b.device_name, "model": str(a.model), "runs": runs}, indent=1))
    print(f"{b.device_name}, {a.model.name}: tg{a.n_gen} at depth, attn_split off (one block per head) "
          f"and on (split-K, the default)\n")
    print("| depth | off tok/s | on tok/s | on / off | kernels a token (off / on) |")
    print("|---|---|---|---|---|")
    for depth, off, on in rows:
        print(f"| {depth} | {off.tokens_per_s:.1f} ± {off.stddev:.1f} | {on.tokens_per_s:.1f} ± {on.stddev:.1f} "
              f"| {on.tokens_per_s / off.tokens_per_s:.2f} | {off.kernels_per_token} / {on.kernels_per_token} |")
    return 0 if len(rows) == len(a.depths) else 1


def group_fills(m, a) -> int:
    """tg at each depth under each SPLIT_GROUP_FILL of a.group_fills: one table, a column a fill."""
    from brass.backends.cuda import attention
    from brass.bench import bench
    from brass.errors import BrassError
    default, b = attention.SPLIT_GROUP_FILL, m.backend
    rows, runs, rc = [], [], 0
    for depth in a.depths:
        got = []
        for fill in a.group_fills:
            attention.SPLIT_GROUP_FILL = fill
            try:
                r = bench(m, n_prompt=0, n_gen=a.n_gen, reps=a.reps, depth=depth, n_ctx=a.ctx)[0]
            except BrassError as e:
                print(f"depth {depth}, group fill {fill:g}: {e}", file=sys.stderr)
                got.append(None)
                rc = 1
                continue
            got.append(r)
            runs.append({"group_fill": fill, **r.as_dict()})
            print(f"depth {depth} group fill {fill:g}: {r.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        rows.append((depth, got))
    attention.SPLIT_GROUP_FILL = default
    if a.json:
        a.json.write_text(json.dumps({"device": b.device_name, "model": str(a.model), "runs": runs}, indent=1))
    print(f"{b.device_name}, {a.model.name}: tg{a.n_gen} at depth, split kernels, by SPLIT_GROUP_FILL "
          f"(default {default:g})\n")
    print("| depth | " + " | ".join(f"fill {f:g} tok/s" for f in a.group_fills) + " |")
    print("|---|" + "---|" * len(a.group_fills))
    for depth, got in rows:
        print(f"| {depth} | " + " | ".join(f"{r.tokens_per_s:.1f} ± {r.stddev:.1f}" if r else "failed"
                                           for r in got) + " |")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
