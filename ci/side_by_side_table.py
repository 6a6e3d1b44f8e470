"""The table of ci/gpu.sh side-by-side: llama-bench's and brass bench's JSON results for each
shape, the ratios, and Brass's decode speed as a share of what memory bandwidth allows (the
weight bytes one token reads, from the file's tensor directory, over the measured copy rate).

    python3 ci/side_by_side_table.py RESULTS_DIR qwen3-0.6b,qwen3-8b,...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES_DIR = Path("/tmp/brass-shapes")


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every tensor but the embedding table (one row; read
    in full when it is also the output head, as Gemma's tied one is), the chosen experts'
    share of each expert tensor."""
    from brass.gguf import GGUFFile
    gf = GGUFFile(path)
    arch = gf.architecture
    n_exp = gf.get(f"{arch}.expert_count") or 0
    n_used = gf.get(f"{arch}.expert_used_count") or 0
    total = 0
    for name, t in gf.tensors.items():
        if name == "token_embd.weight" and "output.weight" in gf.tensors:
            continue
        total += t.nbytes * n_used // n_exp if "_exps." in name and n_exp else t.nbytes
    return total


def best_of(result: dict | None, samples: str, mean: str) -> float | None:
    """The fastest repetition's tokens per second (the mean when no samples were kept)."""
    if not result:
        return None
    return max(result.get(samples) or [result.get(mean) or 0.0]) or None


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main():
    out, shapes = Path(sys.argv[1]), sys.argv[2].split(",")
    from tabulate import tabulate
    try:
        import cupy as cp
        from ci.gpu_speed import copy_bandwidth
        bw = copy_bandwidth(cp)
        cp.get_default_memory_pool().free_all_blocks()
    except Exception as e:       # no GPU here: no ceiling column
        print(f"(no copy bandwidth: {e})")
        bw = None
    rows, best_rows = [], []
    for name in shapes:
        llama = {f"{'pp' if r['n_prompt'] else 'tg'}": r for r in (load(out / f"llama-{name}.json") or [])}
        brass = {r["test"][:2]: r for r in (load(out / f"brass-{name}.json") or [])}
        row = [name]
        for test in ("pp", "tg"):
            lt = llama.get(test, {}).get("avg_ts")
            bt = brass.get(test, {}).get("tokens_per_s")
            row += [f"{lt:,.0f}" if lt else "-", f"{bt:,.0f}" if bt else "-",
                    f"{bt / lt:.2f}" if lt and bt else "-"]
        tg = brass.get("tg", {})
        ceiling = None
        if bw and tg:
            # the file, or (DROP=1 deleted it) the bytes ci/gpu.sh side-by-side kept
            saved = out / f"bytes-{name}.txt"
            nbytes = (bytes_per_token(SHAPES_DIR / f"{name}.gguf") if (SHAPES_DIR / f"{name}.gguf").exists()
                      else int(saved.read_text()) if saved.exists() and saved.read_text().strip() else None)
            ceiling = bw * 1e9 / nbytes if nbytes else None
        row += [f"{100 * tg['tokens_per_s'] / ceiling:.0f} % of {ceiling:,.0f}" if ceiling else "-",
                tg.get("kernels_per_token") or "-"]
        rows.append(row)
        best = [name]
        for test in ("pp", "tg"):
            lt, bt = best_of(llama.get(test), "samples_ts", "avg_ts"), best_of(brass.get(test), "samples", "tokens_per_s")
            best += [f"{lt:,.0f}" if lt else "-", f"{bt:,.0f}" if bt else "-",
                     f"{bt / lt:.2f}" if lt and bt else "-"]
        best_rows.append(best)
    print(tabulate(rows, headers=["shape", "llama.cpp pp512", "Brass pp512", "ratio", "llama.cpp tg128",
                                  "Brass tg128", "ratio", "Brass tg / bandwidth ceiling", "kernels/token"],
                   tablefmt="github", disable_numparse=True))
    # issue 8 states its bars as best of the repetitions: the fastest of each engine's runs
    print("\nbest of the repetitions:\n")
    print(tabulate(best_rows, headers=["shape", "llama.cpp pp512", "Brass pp512", "ratio", "llama.cpp tg128",
                                       "Brass tg128", "ratio"], tablefmt="github", disable_numparse=True))
    if bw:
        print(f"\ncopy bandwidth {bw:,.0f} GB/s (read + write); llama-bench -p 512 -n 128 -fa 1 -ngl 99, "
              f"brass bench -p 512 -n 128; mean of the repetitions")


if __name__ == "__main__":
    main()
