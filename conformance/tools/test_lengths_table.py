"""ci/gpu.sh lengths' table (ci/lengths_table.py) from the files its runs leave: per shape the
replayed pp512, the new lengths eager and through their class graphs, their ratio, and
llama-bench's pp512 where it ran; a shape whose runs left nothing shows dashes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lengths_table(tmp_path):
    def write(stem, obj):
        (tmp_path / f"lengths-{stem}.json").write_text(json.dumps(obj))
    pp = {"tokens_per_s": 0.0, "stddev": 1.0, "depth": 0}
    write("replay-m", [{**pp, "test": "pp512", "tokens_per_s": 3000.0, "prompt_graph": True}])
    write("eager-m", [{**pp, "test": "pp480-544", "tokens_per_s": 1000.0, "prompt_graph": False,
                       "lengths": [500, 530, 490]}])
    write("class-m", [{**pp, "test": "pp480-544", "tokens_per_s": 2500.0, "prompt_graph": True,
                       "lengths": [500, 530, 490], "memory": {"graphs": 3 << 20}}])
    write("llama-m", [{"n_prompt": 512, "n_gen": 0, "avg_ts": 1250.0}])
    r = subprocess.run([sys.executable, "ci/lengths_table.py", str(tmp_path), "m,gone"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip().strip("|").split("|")[1:]]
            for ln in r.stdout.splitlines() if ln.startswith("| m ") or ln.startswith("| gone ")}
    assert rows["m"] == ["3,000 ± 1", "1,000 ± 1", "2,500 ± 1", "2.50x", "1,250", "2.00x"], r.stdout
    assert rows["gone"] == ["-"] * 6, r.stdout
    assert "m: lengths 500, 530, 490; every timed read replayed its class's graph: True; graphs held 3.0 MiB" in r.stdout
