"""`brass bench` and the speed tooling around it, on the CPU: the same command the GPU runner
uses beside llama-bench (ci/gpu_side_by_side.sh), its JSON (a snapshot: ours to define), its
one-line errors, the shape-true model generator (ci/shape_models.py) whose files both engines
read, and the side-by-side table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import goldens
from conformance.test_cli import _shape, brass

ROOT = Path(__file__).resolve().parents[1]


def test_bench_json(snapshot):
    r = brass("bench", goldens.model("synth-qwen3moe").path(), "--backend", "numpy",
              "-p", 24, "-n", 5, "-r", 2, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["test"] for x in out] == ["pp24", "tg5"]
    for x in out:
        assert x["backend"] == "numpy" and x["reps"] == 2 and len(x["samples"]) == 2
        assert x["tokens_per_s"] > 0 and all(s > 0 for s in x["samples"])
    assert _shape(out) == snapshot


def test_bench_table_and_skips():
    r = brass("bench", goldens.model("synth-llama").path(), "--backend", "numpy", "-p", 0, "-n", 3, "-r", 1)
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in r.stdout.splitlines() if ln.startswith("|")]
    tests = [row[3] for row in rows if not row[3].startswith("-")]
    assert tests == ["test", "tg3"], r.stdout          # the header, then only the generation test


def test_bench_parallel_counts_every_sequence():
    """--parallel P: the generation test is P sequences in batched steps, named tgNxP, its
    tokens those of all P sequences (n_tokens = N * P)."""
    r = brass("bench", goldens.model("synth-qwen3").path(), "--backend", "numpy",
              "-p", 0, "-n", 4, "-r", 1, "--parallel", 3, "--json")
    assert r.returncode == 0, r.stderr
    (x,) = json.loads(r.stdout)
    assert x["test"] == "tg4x3" and x["n_tokens"] == 12 and x["tokens_per_s"] > 0


@pytest.mark.parametrize("args,msg", [
    (("-p", 0, "-n", 0), "positive prompt"),
    (("-p", -5), "positive prompt"),
    (("-r", 0), "repetitions"),
    (("-p", 100000, "-n", 1), "exceed the model's context"),
    (("--parallel", 0), "parallel sequences"),
])
def test_bench_bad_input_is_one_line(args, msg):
    r = brass("bench", goldens.model("synth-llama").path(), "--backend", "numpy", *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("brass: error:")]
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_shape_model_loads_and_runs(shape, tmp_path):
    """A shape-true file (one layer) has the real hyper-parameters and vocabulary, a
    tokenizer that round-trips text, and runs (random weights: noise, but every tensor is
    read)."""
    sys.path.insert(0, str(ROOT))
    from ci import shape_models
    import engine
    path = shape_models.write(shape, tmp_path, layers=1)
    m = engine.load(str(path), backend="numpy", quiet=True)
    c = shape_models.SHAPES[shape]
    assert m.config.n_vocab == c["vocab"] and m.config.n_embd == c["hidden"] and m.config.n_layer == 1
    text = "Shape-true: the sea, 42 ≠ 43 — ok?"
    ids = m.tokenizer.encode(text, add_special=False, parse_special=False)
    assert m.tokenizer.decode(ids) == text
    assert len(list(m.generate(ids, max_tokens=2, stop_at_eog=False))) == 2
    # Seeded: the same file twice.
    again = shape_models.write(shape, tmp_path / "again", layers=1)
    assert again.read_bytes() == path.read_bytes()


def test_side_by_side_table(tmp_path):
    (tmp_path / "llama-m.json").write_text(json.dumps([
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 1000.0}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0}]))
    (tmp_path / "brass-m.json").write_text(json.dumps([
        {"test": "pp512", "tokens_per_s": 800.0}, {"test": "tg128", "tokens_per_s": 125.0, "kernels_per_token": 9}]))
    r = subprocess.run([sys.executable, "ci/side_by_side_table.py", str(tmp_path), "m"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    row = [ln for ln in r.stdout.splitlines() if ln.startswith("| m ")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:7] == ["1,000", "800", "0.80", "100", "125", "1.25"]
