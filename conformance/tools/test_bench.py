"""`brass bench` and the speed tooling around it, on the CPU: the same command the GPU runner
uses beside llama-bench (ci/gpu.sh side-by-side), its JSON (a snapshot: ours to define), its
one-line errors, the shape-true model generator (conformance/harness/shape_models.py) whose files both engines
read, and the side-by-side table."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.harness import goldens
from conformance.harness.cli import brass, json_shape as _shape

ROOT = Path(__file__).resolve().parents[2]


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


def test_bench_times_replayed_prompts_with_prompt_graphs(monkeypatch):
    """With prompt graphs every timed prefill replays: the capture is part of the warm-up,
    as the kernels' loading is (llama-bench warms up the same way)."""
    from conformance.harness.fakes import ReplayingNumpy
    from brass import bench
    m = goldens.load_synthetic("synth-qwen3", "numpy")
    m.backend = ReplayingNumpy()
    m.graphs = m.prompt_graphs = True
    events = []
    real_capture, real_timed = m.backend.capture, bench._timed
    monkeypatch.setattr(m.backend, "capture", lambda fn, **kw: (events.append("capture"), real_capture(fn, **kw))[1])
    monkeypatch.setattr(bench, "_timed", lambda b, fn: (events.append("timed"), real_timed(b, fn))[1])
    (r,) = bench.bench(m, n_prompt=8, n_gen=0, reps=3)
    assert events == ["capture", "timed", "timed", "timed"], events
    assert r.test == "pp8" and len(r.samples) == 3
    assert r.prompt_graph is True, "the result says its reads were replays"
    assert "replayed a prompt graph" in bench.table([r])
    m = goldens.load_synthetic("synth-qwen3", "numpy")
    m.backend = ReplayingNumpy()
    m.prompt_graphs = False
    (r,) = bench.bench(m, n_prompt=8, n_gen=0, reps=1)
    assert r.prompt_graph is False and "replayed" not in bench.table([r])


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


# (shape, shrink): one layer (qwen3) or one period's worth of a hybrid's layer kinds (two
# layers: a delta-net / sliding-window layer and a full-attention one), the real vocabulary
# where it is cheap (qwen3-0.6b: the 151,936-token tokenizer, triples and all), 4096 tokens and
# 8 or 16 experts where the real ones would take gigabytes of numpy dequantization (the
# 30B-A3B's 128 experts and its head: 3.6 GB of float32 for one layer; 16 experts keep the
# top-8 routing a choice). The dense Qwen3.5-9B / Gemma-4-31B shapes share these code paths at
# FFN widths the test cannot shrink (2-4 GB of float32), so they are checked by hand
# (perf/NOTES.md).
SHAPE_CASES = [
    ("qwen3-0.6b", dict(layers=1)),
    ("qwen3-30b-a3b", dict(layers=1, vocab=4096, experts=16)),
    ("qwen3.6-35b-a3b", dict(layers=2, vocab=4096, experts=8)),
    ("gemma-4-26b-a4b", dict(layers=2, vocab=4096, experts=8)),
]


@pytest.mark.parametrize("shape,shrink", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_shape_model_loads_and_runs(shape, shrink, shape_model):
    """A shape-true file (shrunk) has the real hyper-parameters and vocabulary, a tokenizer
    that round-trips text, and runs (random weights: noise, but every tensor is read)."""
    from conformance.harness import shape_models
    import brass
    path = shape_model(shape, **shrink)
    m = brass.load(str(path), backend="numpy", quiet=True)
    c = shape_models.shape_config(shape, **shrink)
    cfg = m.config
    assert (cfg.arch, cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_head) == \
        (c["arch"], c["vocab"], c["hidden"], shrink["layers"], c["n_head"])
    assert cfg.n_expert == c.get("n_expert", 0) and cfg.n_expert_used == c.get("n_expert_used", 0)
    if c["arch"] == "qwen35moe":
        assert cfg.recurrent_layers[:2] == [True, False]          # delta-net, then full attention
        assert (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_conv) == (16, 32, 128, 4)
        assert (cfg.head_dim, cfg.n_head_kv, cfg.n_rot, cfg.n_ff_exp, cfg.n_ff_shexp) == (256, 2, 64, 512, 512)
    if c["arch"] == "gemma4":
        assert cfg.swa_layers == [True, False] and cfg.sliding_window == 1024
        assert (cfg.head_dim_swa, cfg.head_dim, cfg.n_head_kv_arr) == (256, 512, [8, 2])
        assert "blk.1.attn_v.weight" not in m.gguf.tensors           # full layers: V = K
        assert shape_models.is_real(path, shape) is False
    text = "Shape-true: the sea, 42 ≠ 43 — ok?"
    ids = m.tokenizer.encode(text, add_special=False, parse_special=False)
    assert m.tokenizer.decode(ids) == text
    assert len(list(m.generate(ids, max_tokens=2, stop_at_eog=False))) == 2
    del m           # its float32 weights go before the second file is written
    # Seeded: the same file twice (compared a block at a time: not two files' worth of memory).
    again = shape_model(shape, "again", **shrink)
    assert filecmp.cmp(again, path, shallow=False)


def test_shape_model_files_are_deleted(tmp_path):
    """The shape_model fixture's files go at the test's end, passed or failed (pytest keeps a
    failed test's folder, and the last runs' folders: a one-layer qwen3-0.6b is 0.4 GB)."""
    sys.path.insert(0, str(ROOT))
    from conformance.harness.shape_models import ShapeFiles
    with ShapeFiles(tmp_path) as write:
        a = write("qwen3-0.6b", layers=1, vocab=1024)
        b = write("qwen3-0.6b", "again", layers=1, vocab=1024)
        assert a.stat().st_size > 1 << 20 and b.parent == tmp_path / "again"
    assert not a.exists() and not b.exists()
    with pytest.raises(AssertionError), ShapeFiles(tmp_path) as write:
        c = write("qwen3-0.6b", layers=1, vocab=1024)
        raise AssertionError("a failing test")
    assert not c.exists()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_shape_recipes():
    """The Qwen3.5/3.6 and Gemma 4 shapes' weight types follow llama-quantize's Q4_K_M (and
    MXFP4_MOE) choices; the full-size files' tensor counts and sizes (nothing written)."""
    sys.path.insert(0, str(ROOT))
    from conformance.harness import shape_models as sm
    from brass.gguf import GGMLType as T
    specs = sm.tensor_specs(sm.shape_config("qwen3.6-35b-a3b"))
    types = {n: t for n, (t, _) in specs.items()}
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert types["blk.0.ffn_down_exps.weight"] == T.Q6_K        # use_more_bits: first eighth
    assert types["blk.5.ffn_down_exps.weight"] == T.Q4_K
    assert types["blk.0.attn_qkv.weight"] == T.Q6_K and types["blk.3.attn_v.weight"] == T.Q6_K
    assert types["blk.6.attn_qkv.weight"] == T.Q4_K and types["blk.7.attn_v.weight"] == T.Q6_K
    assert types["blk.0.ssm_conv1d.weight"] == T.F32 and types["blk.0.ffn_gate_inp.weight"] == T.F32
    assert specs["blk.0.ffn_gate_exps.weight"][1] == (256, 512, 2048)
    assert specs["blk.3.attn_q.weight"][1] == (2 * 16 * 256, 2048)    # q and its output gate
    assert specs["blk.0.attn_qkv.weight"][1] == ((2 * 16 + 32) * 128, 2048)
    g = sm.tensor_specs(sm.shape_config("gemma-4-26b-a4b"))
    gt = {n: t for n, (t, _) in g.items()}
    assert "output.weight" not in g and gt["token_embd.weight"] == T.Q6_K    # tied
    assert gt["blk.0.ffn_down.weight"] == T.Q8_0 and gt["blk.4.ffn_down.weight"] == T.Q5_0   # 2112: no K-quant
    assert gt["blk.4.ffn_down_exps.weight"] == T.Q5_0 and gt["blk.5.ffn_down_exps.weight"] == T.Q8_0
    assert gt["blk.5.ffn_gate_up_exps.weight"] == T.Q4_K
    assert g["blk.5.attn_q.weight"][1] == (16 * 512, 2816) and g["blk.4.attn_k.weight"][1] == (8 * 256, 2816)
    assert "blk.5.attn_v.weight" not in g and "blk.4.attn_v.weight" in g
    assert g["rope_freqs.weight"][1] == (256,) and g["blk.0.ffn_down_exps.scale"][1] == (128,)
    mx = sm.tensor_specs(sm.shape_config("gemma-4-26b-a4b"), "mxfp4-moe")
    assert {t for n, (t, s) in mx.items() if len(s) == 3} == {T.MXFP4}
    assert {t for n, (t, s) in mx.items() if len(s) == 2 and t != T.F32} == {T.Q8_0}
    sizes = {name: sum(sm._nbytes(t, s) for t, s in sm.tensor_specs(sm.shape_config(name)).values()) / 2**30
             for name in ("qwen3.6-35b-a3b", "qwen3.5-9b", "gemma-4-26b-a4b", "gemma-4-31b")}
    assert {k: round(v, 1) for k, v in sizes.items()} == \
        {"qwen3.6-35b-a3b": 19.7, "qwen3.5-9b": 5.2, "gemma-4-26b-a4b": 15.6, "gemma-4-31b": 17.4}


def test_side_by_side_table(tmp_path):
    """ci/gpu.sh side-by-side's tables from the files its runs leave: each of issue 48's bars a
    row (mean against mean, best against best), the lengths run against llama.cpp's pp512, the
    depth rows from the depth runs, both engines' sampled memory and what Brass holds, and the
    decode rate in GB/s of the weights a token reads."""
    def write(stem, obj):
        (tmp_path / f"{stem}-m.json").write_text(json.dumps(obj))
    write("llama", [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0, "samples_ts": [990.0, 1010.0]},
                    {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 100.0}])
    write("llama-depth", [{"n_prompt": 512, "n_gen": 0, "n_depth": 16384, "avg_ts": 500.0},
                          {"n_prompt": 0, "n_gen": 128, "n_depth": 16384, "avg_ts": 50.0}])
    held = {"weights": 3 << 20, "f16_weights": 2 << 20, "kv_cache": 1 << 20, "graphs": 5 << 20}
    write("brass", [{"test": "pp512", "tokens_per_s": 2500.0, "samples": [2400.0, 2600.0], "depth": 0,
                     "prompt_graph": True},
                    {"test": "tg128", "tokens_per_s": 150.0, "kernels_per_token": 9, "depth": 0, "memory": held}])
    write("brass-lengths", [{"test": "pp480-544", "tokens_per_s": 1400.0, "depth": 0}])
    write("brass-depth", [{"test": "pp512 @ d16384", "tokens_per_s": 800.0, "depth": 16384},
                          {"test": "tg128 @ d16384", "tokens_per_s": 80.0, "depth": 16384}])
    for stem, mib in (("llama", "700 apps"), ("brass", "900 apps"), ("llama-depth", "1700 card")):
        (tmp_path / f"mem-{stem}-m.txt").write_text(f"{mib}\n")
    (tmp_path / "bytes-m.txt").write_text("2000000000\n")
    (tmp_path / "copy-gbs.txt").write_text("3000\n")      # the card's copy rate, as given to the table
    r = subprocess.run([sys.executable, "ci/side_by_side_table.py", str(tmp_path), "m"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in r.stdout.splitlines() if ln.startswith("| m ")]
    speed = {row[1]: row[2:] for row in rows if row[-1].startswith(">=")}
    assert speed == {
        "tg128": ["100", "150", "1.50", "1.50", ">= 2.0x: not met"],
        "pp512 (replay)": ["1,000", "2,500", "2.50", "2.57", ">= 2.0x: met"],
        "pp480-544 vs llama.cpp pp512": ["1,000", "1,400", "1.40", "1.39", ">= 1.5x: not met"],
        "tg128 @ d16384": ["50", "80", "1.60", "1.60", ">= 1.5x: met"],
        "pp512 @ d16384": ["500", "800", "1.60", "1.60", ">= 1.5x: met"],
    }, r.stdout
    memory = next(row for row in rows if row[1] == "700")
    assert memory[2:] == ["900", "-", "1,700 (card)", "-", "3 / 2 / 1 / 5"], r.stdout
    # 2 GB a token: 100 and 150 tokens a second read 200 and 300 GB/s, 7 % and 10 % of 3,000
    decode = next(row for row in rows if row[1] == "2.00 GB")
    assert decode[2:] == ["200 GB/s (7 %)", "300 GB/s (10 %)", "9"], r.stdout


def test_shape_qwen36_27b(shape_model):
    """Qwen3.6-27B, the dense qwen35 with 48 value heads a delta-net layer (Qwen3.5-9B's 32):
    llama-quantize's Q4_K_M types tensor by tensor, the full file's size (nothing written at
    full size), and a two-layer file (a delta-net layer, then a full-attention one) whose
    metadata the engine reads back as the real hyper-parameters. No forward: its FFN in
    float32 is 1 GB a layer (the loads-and-runs cases above cover the qwen35 code paths)."""
    sys.path.insert(0, str(ROOT))
    from conformance.harness import shape_models as sm
    from brass.gguf import GGMLType as T
    import brass
    specs = sm.tensor_specs(sm.shape_config("qwen3.6-27b"))
    types = {n: t for n, (t, _) in specs.items()}
    assert len(specs) == 851 and round(sum(sm._nbytes(t, s) for t, s in specs.values()) / 2**30, 1) == 15.4
    assert specs["blk.0.attn_qkv.weight"] == (T.Q6_K, ((2 * 16 + 48) * 128, 5120))   # use_more_bits: first
    assert specs["blk.0.attn_gate.weight"] == (T.Q4_K, (48 * 128, 5120))
    assert specs["blk.0.ssm_out.weight"] == (T.Q4_K, (5120, 48 * 128))
    assert specs["blk.0.ssm_a"] == (T.F32, (48,)) and specs["blk.0.ssm_conv1d.weight"] == (T.F32, (10240, 4))
    assert specs["blk.3.attn_q.weight"] == (T.Q4_K, (2 * 24 * 256, 5120))          # q and its output gate
    assert specs["blk.3.attn_k.weight"] == (T.Q4_K, (4 * 256, 5120)) and specs["blk.3.attn_output.weight"][1] == (5120, 6144)
    assert types["blk.3.attn_v.weight"] == T.Q6_K and types["blk.11.attn_v.weight"] == T.Q4_K
    assert specs["blk.0.ffn_down.weight"] == (T.Q6_K, (5120, 17408)) and types["blk.8.ffn_down.weight"] == T.Q4_K
    assert types["blk.63.ffn_down.weight"] == T.Q6_K                                # last eighth
    assert specs["output.weight"] == (T.Q6_K, (248320, 5120)) and types["token_embd.weight"] == T.Q4_K
    path = shape_model("qwen3.6-27b", layers=2, vocab=4096)
    m = brass.load(str(path), backend="numpy", quiet=True)
    cfg = m.config
    assert (cfg.arch, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot) == \
        ("qwen35", 5120, 17408, 24, 4, 256, 64)
    assert (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_conv) == (16, 48, 128, 4)
    assert cfg.recurrent_layers == [True, False] and cfg.n_vocab == 4096
    assert sm.is_real(path, "qwen3.6-27b") is False
