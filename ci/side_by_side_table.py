"""The tables of ci/gpu.sh side-by-side (issue 48's bars): llama-bench's and brass bench's JSON
results for each shape, the ratios against the bars, both engines' device memory, and the
decode speed as a share of the copy rate (the weight bytes one token reads, from the file's
tensor directory, over the time of a token, over the copy rate measured here).

    python3 ci/side_by_side_table.py RESULTS_DIR qwen3-0.6b,qwen3-8b,...

RESULTS_DIR holds, for each shape NAME (missing files leave their cells "-"):
  llama-NAME.json, llama-depth-NAME.json      llama-bench -o json, from an empty context / -d D
  brass-NAME.json, brass-lengths-NAME.json, brass-depth-NAME.json   brass bench --json: pp512
      (replayed) and tg128; pp --lengths; pp512 and tg128 at --depth D
  mem-STEM.txt    the peak of nvidia-smi's used memory while the run STEM went: "MiB apps" (the
                  compute processes'), or "MiB card" (the card's, where they were not visible)
  bytes-NAME.txt  the weight bytes a decode step reads (kept when the file was deleted)
  gpu.txt         the card (nvidia-smi's name, compute capability, driver)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES_DIR = Path("/tmp/brass-shapes")

# (row, llama-bench's test: kind and whether at depth, brass bench's file stem and test kind, bar)
MEASURES = [
    ("tg128", ("tg", False), ("brass", "tg"), 2.0),
    ("pp512 (replay)", ("pp", False), ("brass", "pp"), 2.0),
    ("pp, lengths not read before", ("pp", False), ("brass-lengths", "pp"), 1.5),
    ("tg128 at depth", ("tg", True), ("brass-depth", "tg"), 1.5),
    ("pp512 at depth", ("pp", True), ("brass-depth", "pp"), 1.5),
]


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every tensor but the embedding table (one row; read
    in full when it is also the output head, as Gemma's tied one is), the chosen experts'
    share of each expert tensor (shared experts in full)."""
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


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def number(path: Path) -> int | None:
    """The integer a file starts with (None: no file, or none in it)."""
    try:
        text = path.read_text().split()
        return int(text[0]) if text else None
    except (OSError, ValueError):
        return None


def memory(path: Path) -> str:
    """A mem-STEM.txt sample, "PEAK apps" or "PEAK card" (the card's used memory where the
    processes were not visible), as the table shows it."""
    try:
        peak, src = path.read_text().split()[:2]
        return f"{int(peak):,}" + (" (card)" if src == "card" else "")
    except (OSError, ValueError):
        return "-"


def llama_tests(results) -> dict:
    """{("pp" | "tg", depth): record} of a llama-bench JSON array."""
    out = {}
    for r in results or []:
        kind = "pp" if r.get("n_prompt") else "tg"
        out[(kind, int(r.get("n_depth") or 0))] = r
    return out


def brass_tests(results) -> dict:
    """{"pp" | "tg": record} of a brass bench JSON array."""
    return {r["test"][:2]: r for r in results or []}


def _best(record, samples, mean):
    return max(record.get(samples) or [record.get(mean) or 0.0]) or None


def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def _mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f}"


def rows_for(out: Path, name: str):
    """(speed rows, memory row, the figures the decode row needs) of one shape."""
    llama = llama_tests(load(out / f"llama-{name}.json"))
    llama.update(llama_tests(load(out / f"llama-depth-{name}.json")))
    brass = {stem: brass_tests(load(out / f"{stem}-{name}.json")) for stem in ("brass", "brass-lengths", "brass-depth")}
    speed = []
    for label, (kind, deep), (stem, bkind), bar in MEASURES:
        b = brass[stem].get(bkind)
        depth = (b or {}).get("depth") or 0
        if deep and not depth:
            # no brass run at depth: the row says so only if llama.cpp ran one
            depth = max((d for k, d in llama if k == kind and d), default=0)
            if not depth:
                continue
        ll = llama.get((kind, depth if deep else 0))
        lt, bt = (ll or {}).get("avg_ts"), (b or {}).get("tokens_per_s")
        lb = _best(ll, "samples_ts", "avg_ts") if ll else None
        bb = _best(b, "samples", "tokens_per_s") if b else None
        ratio = bt / lt if lt and bt else None
        test = label
        if b and stem == "brass-lengths":
            test = f"{b['test']} vs llama.cpp pp512"
        elif b:
            test = b["test"] + (" (replay)" if b.get("prompt_graph") else "")
        elif deep:
            test = f"{kind}{'512' if kind == 'pp' else '128'} @ d{depth}"
        met = "-" if ratio is None else ("met" if ratio >= bar else "not met")
        speed.append([name, test, _fmt(lt), _fmt(bt), _fmt(ratio, ".2f"),
                      _fmt(bb / lb if lb and bb else None, ".2f"), f">= {bar:.1f}x: {met}"])
    mem = [name] + [memory(out / f"mem-{stem}-{name}.txt") for stem in
                    ("llama", "brass", "brass-lengths", "llama-depth", "brass-depth")]
    held = (brass["brass"].get("tg") or brass["brass"].get("pp") or {}).get("memory")
    mem.append(" / ".join(_mib(held.get(k)) for k in ("weights", "f16_weights", "kv_cache", "graphs"))
               if held else "-")
    tg_llama, tg_brass = llama.get(("tg", 0)), brass["brass"].get("tg")
    return speed, mem, ((tg_llama or {}).get("avg_ts"), (tg_brass or {}).get("tokens_per_s"),
                        (tg_brass or {}).get("kernels_per_token"))


def decode_row(out: Path, name: str, figures, bw: float | None):
    """Bytes a token, each engine's tg128 in GB/s of weights read and its share of the copy rate."""
    lt, bt, kernels = figures
    path = SHAPES_DIR / f"{name}.gguf"
    nbytes = bytes_per_token(path) if path.exists() else number(out / f"bytes-{name}.txt")
    row = [name, f"{nbytes / 1e9:.2f} GB" if nbytes else "-"]
    for tps in (lt, bt):
        if nbytes and tps:
            gbs = nbytes * tps / 1e9
            row.append(f"{gbs:,.0f} GB/s" + (f" ({100 * gbs / bw:.0f} %)" if bw else ""))
        else:
            row.append("-")
    row.append(str(kernels) if kernels else "-")
    return row


def copy_rate(out: Path) -> float | None:
    """The card's copy rate in GB/s: OUT/copy-gbs.txt where a run wrote it, else measured here."""
    given = out / "copy-gbs.txt"
    if given.exists():
        return float(given.read_text().split()[0])
    try:
        import cupy as cp
        from ci.gpu_speed import copy_bandwidth
        bw = copy_bandwidth(cp)
        cp.get_default_memory_pool().free_all_blocks()
        return bw
    except Exception as e:       # no GPU here: no share of the copy rate
        print(f"(no copy rate: {e})")
        return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out, shapes = Path(argv[0]), argv[1].split(",")
    from tabulate import tabulate
    bw = copy_rate(out)
    speed, mem, decode = [], [], []
    for name in shapes:
        s, m, figures = rows_for(out, name)
        speed += s
        mem.append(m)
        decode.append(decode_row(out, name, figures, bw))
    gpu = out / "gpu.txt"
    if gpu.exists():
        print(f"card: {gpu.read_text().strip()}\n")
    print(tabulate(speed, headers=["shape", "test", "llama.cpp t/s", "Brass t/s", "ratio", "best / best", "bar"],
                   tablefmt="github", disable_numparse=True))
    print("\ndevice memory, MiB (peak of nvidia-smi's used_memory during each run):\n")
    print(tabulate(mem, headers=["shape", "llama.cpp", "Brass", "Brass, new lengths", "llama.cpp at depth",
                                 "Brass at depth", "Brass holds: weights / f16 copies / KV / graphs"],
                   tablefmt="github", disable_numparse=True))
    print("\ndecode, tg128: weights read a token and the rate they are read at (share of the copy rate):\n")
    print(tabulate(decode, headers=["shape", "bytes a token", "llama.cpp", "Brass", "Brass kernels a token"],
                   tablefmt="github", disable_numparse=True))
    if bw:
        print(f"\ncopy rate {bw:,.0f} GB/s (read + write, measured after the runs)")
    print("llama-bench -fa 1 -ngl 99 (-d D at depth); brass bench --backend cuda (--lengths, --depth); "
          "mean of the repetitions; best / best: each engine's fastest repetition")


if __name__ == "__main__":
    main()
