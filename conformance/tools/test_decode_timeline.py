"""ci/decode_timeline.py: a decode token's time between kernels, from a CUPTI Chrome trace,
run as a command (the suite imports nothing of ci/). A trace built here with known intervals:
kernels that overlap (programmatic dependent launch), a copy between them, CPU events beside
them, and a last token whose end is not seen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a token every 100 µs: kernel a [0, 20), b [25, 55), c [50, 85) (5 µs under b), a copy
# [88, 90): busy 20 + 60 + 2 = 82 µs, idle 18, the kernels' sum 85; on the chain a 20, b 30,
# c 30 (its first 5 µs under b), the copy 2: 82 in all
TOKEN = [("kernel", "a", 0, 20), ("kernel", "b", 25, 30), ("kernel", "c", 50, 35), ("gpu_memcpy", "copy", 88, 2)]


def _trace(n_tokens: int) -> dict:
    ev = [{"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 1000}]      # not GPU work
    for i in range(n_tokens):
        ev += [{"ph": "X", "cat": cat, "name": name, "ts": 100 * i + ts, "dur": dur} for cat, name, ts, dur in TOKEN]
    ev.reverse()                                    # out of order, as a trace may be
    return {"traceEvents": ev}


def _run(tmp_path, trace, per_token: int = 3):
    """(the command's result, its figures or None)."""
    f, st = tmp_path / "trace.json", tmp_path / "st.json"
    f.write_text(trace if isinstance(trace, str) else json.dumps(trace))
    st.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "ci/decode_timeline.py", str(f), "--per-token", str(per_token),
                        "--json", str(st)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return r, (json.loads(st.read_text()) if st.exists() else None)


def test_a_tokens_time_between_kernels(tmp_path):
    r, st = _run(tmp_path, _trace(4))
    assert r.returncode == 0, r.stderr
    assert st["tokens"] == 3                        # the fourth token's end is not seen
    assert st["token_us"] == 100 and st["tok_per_s"] == pytest.approx(10_000)
    assert st["busy_us"] == 82 and st["idle_us"] == 18 and st["kernel_sum_us"] == 85
    assert st["idle_per_boundary_us"] == pytest.approx(6)
    assert st["no_idle_tok_per_s"] == pytest.approx(1e6 / 82)
    assert st["by_name"] == [["c", 1, 35, 35, 30], ["b", 1, 30, 30, 30], ["a", 1, 20, 20, 20]]
    assert "| c | 1 | 35.00 | 35.0 | 30.00 | 30.0 | 36.6 % |" in r.stdout
    assert st["kernel_median_us"] == 30 and st["short_share"] == 0
    assert "3 tokens, 3 kernels a token (+0 outside the graph): 100.0 µs a token (10000.0 tok/s" in r.stdout
    assert "idle between kernels 18.0 µs (18.0 %, 6.00 µs a boundary)" in r.stdout


def test_kernels_between_tokens_are_extra_and_a_repeated_first_kernel_cuts_by_count(tmp_path):
    # a run ahead's copy kernel between two tokens: counted as extra, the tokens still cut at
    # each launch of the first kernel; where the first kernel recurs within a token (a) the
    # cut falls back to K kernels a token
    tr = _trace(4)
    tr["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "copy_ids", "ts": 195, "dur": 3})
    r, st = _run(tmp_path, tr)
    assert r.returncode == 0, r.stderr
    assert st["tokens"] == 3 and st["extra_kernels"] == 0 and st["token_us"] == 100
    assert ["copy_ids", 1 / 3, 3, 1, 1] in st["by_name"] and st["busy_us"] == 82
    again = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a", "ts": 10 * i, "dur": 5} for i in range(9)]}
    r, st = _run(tmp_path, again)
    assert r.returncode == 0, r.stderr
    assert st["tokens"] == 2 and st["token_us"] == 30 and st["busy_us"] == 15


@pytest.mark.parametrize("trace, per_token, said", [(_trace(1), 3, "fewer than two tokens"),
                                                    (_trace(3), 0, "at least 1"),
                                                    ("{", 3, "Expecting")],
                         ids=["one-token", "no-kernels-a-token", "not-json"])
def test_bad_input_is_refused_in_a_line(tmp_path, trace, per_token, said):
    r, st = _run(tmp_path, trace, per_token)
    assert r.returncode == 2 and st is None
    assert "decode_timeline:" in r.stderr and said in r.stderr and "Traceback" not in r.stderr
