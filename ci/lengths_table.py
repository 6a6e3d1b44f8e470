"""The table of `ci/gpu.sh lengths` (issue 48, prompts of any length): per shape, brass bench's
prompt speed for a length read again and again (pp512: every timed read replays its graph), for
lengths not read before read eagerly (BRASS_PROMPT_GRAPHS=0), and for those lengths through the
graph of their length class (engine/model.py prompt_class); with llama-bench's pp512 of the same
file where it ran (LLAMA=1).

    python3 ci/lengths_table.py OUT_DIR SHAPES     # SHAPES: comma list of the files' stems
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def brass_pp(path: Path) -> dict | None:
    """The pp record of a brass bench JSON array, None without one."""
    return next((r for r in load(path) or [] if r.get("test", "").startswith("pp")), None)


def llama_pp(path: Path) -> float | None:
    """llama-bench's pp tokens per second (a JSON array's prompt record), None without one."""
    return next((r.get("avg_ts") for r in load(path) or [] if r.get("n_prompt") and not r.get("n_gen")), None)


def table(out: Path, shapes: list[str]) -> str:
    rows = ["| shape | pp512 replayed | new lengths, eager | new lengths, class graph | class / eager "
            "| llama.cpp pp512 | class / llama.cpp |",
            "|---|---|---|---|---|---|---|"]
    notes = []
    for name in shapes:
        rep, eager, cls = (brass_pp(out / f"lengths-{k}-{name}.json") for k in ("replay", "eager", "class"))
        llama = llama_pp(out / f"lengths-llama-{name}.json")

        def fig(r):
            return "-" if r is None else f"{r['tokens_per_s']:,.0f} ± {r['stddev']:,.0f}"
        ratio = f"{cls['tokens_per_s'] / eager['tokens_per_s']:.2f}x" if cls and eager else "-"
        vs = f"{cls['tokens_per_s'] / llama:.2f}x" if cls and llama else "-"
        rows.append(f"| {name} | {fig(rep)} | {fig(eager)} | {fig(cls)} | {ratio} | "
                    f"{'-' if llama is None else f'{llama:,.0f}'} | {vs} |")
        if cls:
            notes.append(f"{name}: lengths {', '.join(map(str, cls.get('lengths') or []))}; every timed read "
                         f"replayed its class's graph: {cls.get('prompt_graph')}; graphs held "
                         f"{(cls.get('memory') or {}).get('graphs', 0) / 2**20:.1f} MiB")
    return "\n".join(rows + [""] + notes)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]), sys.argv[2].split(",")))
