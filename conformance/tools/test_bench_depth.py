"""`brass bench --lengths`, `--depth` and the memory it reports, on the numpy backend with the
synthetic models: prompts of lengths not read before (each replaying the graph of its length
class, captured in the warm-up from other lengths of the class), each repetition started after D tokens already in the cache (filled untimed), and
the bytes the run holds (weights, f16 copies, KV cache, graphs)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.harness import goldens
from conformance.harness.cli import brass
from conformance.harness.fakes import ReplayingNumpy
from brass import bench
from brass.errors import BrassError
from brass.kv_cache import BLOCK_TOKENS, KVCache, blocks_for
from brass.model import Session, prompt_class

GRAPH_BYTES = 1000      # what each fake graph says it holds


def _graph_model(name="synth-qwen3"):
    """A synthetic model on the numpy backend with the CUDA backend's graph interface (a
    replay re-runs the captured function), prompt graphs on: the paths a GPU run takes."""
    m = goldens.load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    m.backend.graph_bytes = GRAPH_BYTES
    m.graphs = m.prompt_graphs = True
    return m


def _record(monkeypatch, m):
    """Events of a bench run: ("prefill", n_past, length, timed) for every prompt read,
    ("greedy", n_past, timed) for every generation, ("capture",) for every graph captured."""
    events, timing = [], [False]
    real_prefill, real_greedy, real_timed = Session.prefill, Session.greedy, bench._timed
    real_capture = m.backend.capture

    def prefill(self, ids, *a, **kw):
        events.append(("prefill", self.n_past, len(ids), timing[0]))
        return real_prefill(self, ids, *a, **kw)

    def greedy(self, token, n):
        events.append(("greedy", self.n_past, timing[0]))
        return real_greedy(self, token, n)

    def timed(b, fn):
        timing[0] = True
        try:
            return real_timed(b, fn)
        finally:
            timing[0] = False

    monkeypatch.setattr(Session, "prefill", prefill)
    monkeypatch.setattr(Session, "greedy", greedy)
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(m.backend, "capture", lambda fn, **kw: (events.append(("capture",)), real_capture(fn, **kw))[1])
    return events


def test_lengths_read_each_length_once(monkeypatch):
    """--lengths: the warm-up reads -p tokens, then twice one other length of each length class
    the timed lengths fall in (eager, then captured); each timed repetition reads a length
    nothing read before and replays its class's graph: no capture while timed, the tokens per
    second each length over its time."""
    m = _graph_model()
    events = _record(monkeypatch, m)
    (r,) = bench.bench(m, n_prompt=16, n_gen=0, reps=4, lengths="random:10-20", seed=3)
    reads = [e for e in events if e[0] == "prefill"]
    timed = [e[2] for e in reads if e[3]]
    warm = [e[2] for e in reads if not e[3]]
    assert timed == r.lengths and len(set(timed)) == 4 and 16 not in timed
    assert all(10 <= n <= 20 for n in timed)
    assert not set(warm) & set(timed), "a timed length was read before"
    classes = sorted({prompt_class(n) for n in timed})
    # the warm-up: 16 once, then for each class its longest length neither timed nor 16, twice
    extra = bench.class_warmups(timed, 16)
    assert sorted(prompt_class(n) for n in extra) == classes and warm == [16] + [n for n in extra for _ in (0, 1)]
    captured = [i for i, e in enumerate(events) if e == ("capture",)]
    first_timed = next(i for i, e in enumerate(events) if e[0] == "prefill" and e[3])
    assert len(captured) == len(classes) and max(captured) < first_timed, events
    assert r.test == "pp10-20" and r.prompt_graph is True and r.reps == 4 and len(r.samples) == 4
    assert r.n_tokens == round(np.mean(timed))
    assert r.memory["graphs"] == len(classes) * GRAPH_BYTES
    # seeded: the same lengths again, other ones for another seed
    assert bench.prompt_lengths("random:10-20", 16, 4, seed=3)[1] == timed
    assert bench.prompt_lengths("random:10-200", 16, 4, seed=4)[1] != bench.prompt_lengths("random:10-200", 16, 4, seed=3)[1]


def test_lengths_without_prompt_graphs_read_eagerly(monkeypatch):
    """BRASS_PROMPT_GRAPHS=0 (the "before" of a class graph): the warm-up reads -p tokens
    once, every timed read is eager, nothing is captured."""
    m = _graph_model()
    m.prompt_graphs = False
    events = _record(monkeypatch, m)
    (r,) = bench.bench(m, n_prompt=16, n_gen=0, reps=3, lengths="random:10-20", seed=3)
    assert [e[2] for e in events if e[0] == "prefill" and not e[3]] == [16]
    assert ("capture",) not in events and r.prompt_graph is False and r.memory["graphs"] == 0


def test_class_warmups_leave_the_timed_lengths_out():
    # the last length of a class unless timed or the warm-up's, then the one below it; a class
    # whose every length is timed is left out ([2, 4): 2 and 3)
    assert bench.class_warmups([500, 530, 490], 512) == [511, 575]
    assert bench.class_warmups([511, 500], 16) == [510]
    assert bench.class_warmups([2, 3, 9], 16) == [15]
    assert all(prompt_class(n) in {prompt_class(t) for t in (500, 530)} for n in bench.class_warmups([500, 530], 512))


def test_replayed_prompt_reads_one_length(monkeypatch):
    """Without --lengths the timed reads replay the graph captured in the warm-up: the
    contrast that shows --lengths' reads are the eager ones."""
    m = _graph_model()
    events = _record(monkeypatch, m)
    (r,) = bench.bench(m, n_prompt=16, n_gen=0, reps=3)
    assert r.test == "pp16" and r.lengths == [16, 16, 16] and r.prompt_graph is True
    assert events.count(("capture",)) == 1 and r.memory["graphs"] == GRAPH_BYTES


def test_lengths_list_in_order(monkeypatch):
    m = _graph_model()
    events = _record(monkeypatch, m)
    (r,) = bench.bench(m, n_prompt=16, n_gen=0, reps=3, lengths="9,21,13")
    assert [e[2] for e in events if e[0] == "prefill" and e[3]] == [9, 21, 13] == r.lengths
    assert r.test == "pp9-21" and r.prompt_graph is True      # each class captured in the warm-up


@pytest.mark.parametrize("name", ["synth-qwen3", "synth-qwen35"])
def test_depth_fills_untimed_then_times_the_test(monkeypatch, name):
    """--depth D: every repetition (the warm-ups too) starts from an emptied cache filled with
    D tokens in prompts of DEPTH_CHUNK, read eagerly and untimed; the timed prompt and the
    timed generation start at position D. A hybrid (synth-qwen35) too: its recurrent state is
    refilled, not carried over."""
    monkeypatch.setattr(bench, "DEPTH_CHUNK", 8)
    m = _graph_model(name)
    events = _record(monkeypatch, m)
    pp, tg = bench.bench(m, n_prompt=6, n_gen=3, reps=2, depth=20)
    assert (pp.test, tg.test, pp.depth, tg.depth) == ("pp6 @ d20", "tg3 @ d20", 20, 20)
    fill = [("prefill", 0, 8, False), ("prefill", 8, 8, False), ("prefill", 16, 4, False)]
    end_pp = max(i for i, e in enumerate(events) if e[:3] == ("prefill", 20, 6)) + 1
    pp_events, tg_events = events[:end_pp], events[end_pp:]
    # two warm-ups (eager, capture), two timed reads, each after its own fill
    read = [("prefill", 20, 6, False)]
    assert pp_events == fill + read + fill + read + [("capture",)] + 2 * (fill + [("prefill", 20, 6, True)]), events
    # the generation: a fill before each, the first step eager, then the decode graph's
    greedy = [e for e in tg_events if e[0] == "greedy"]
    assert greedy == [("greedy", 20, False)] + 2 * [("greedy", 20, True)]
    assert [e for e in tg_events if e[0] == "prefill" and e[2] != 1] == 3 * fill
    # the fill captures nothing and marks no length read: the one graph is the prompt's, then
    # the decode step's
    assert m.prompt_classes_read == {prompt_class(6)} and pp.prompt_graph is True
    assert (pp.memory["graphs"], tg.memory["graphs"]) == (GRAPH_BYTES, 2 * GRAPH_BYTES)
    # the cache holds depth + the test, in whole blocks of the paged cache (numpy's)
    slots = blocks_for(20 + max(prompt_class(6), 3 + 1)) * BLOCK_TOKENS
    assert pp.memory["kv_cache"] == tg.memory["kv_cache"] == KVCache(m.backend, m.config, slots).nbytes


def test_ctx_sizes_the_sessions(monkeypatch):
    """--ctx N: the sessions hold N positions (the single session and the batched rows), where
    by default they hold what the test needs; fewer than the test needs is refused."""
    m = _graph_model()
    sizes = []
    real = type(m).new_session
    monkeypatch.setattr(type(m), "new_session", lambda self, n_ctx=None, pool=None:
                        (sizes.append(n_ctx), real(self, n_ctx, pool))[1])
    pp, tg = bench.bench(m, n_prompt=6, n_gen=3, reps=1, depth=20, n_ctx=400)
    assert sizes == [400] and pp.memory["kv_cache"] == KVCache(m.backend, m.config, 400).nbytes
    sizes.clear()
    bench.bench(m, n_prompt=0, n_gen=3, reps=1, parallel=2, n_ctx=64)
    assert sizes == [64, 64, 64], sizes          # the single session, then the two rows
    sizes.clear()
    bench.bench(m, n_prompt=0, n_gen=3, reps=1, parallel=2)
    assert sizes == [4, 4, 4], sizes
    with pytest.raises(BrassError, match="--ctx 25 is less than the 26 positions the test needs"):
        bench.bench(m, n_prompt=6, n_gen=3, reps=1, depth=20, n_ctx=25)


def test_memory_counts_what_the_run_holds():
    """held_memory: the weights' float32 arrays dequantized so far (numpy: the raw bytes stay
    in the file's memory map), the sessions' caches, the backend's f16 copies, the graphs."""
    m = _graph_model()
    m.backend.f16_weight_bytes = 12345          # as the CUDA backend counts its copies
    pp, tg = bench.bench(m, n_prompt=8, n_gen=2, reps=1)
    mem = tg.memory
    # every weight dequantized so far as float32 values; the Q4_1 / Q5_1 ones as d*q values
    # plus a min a 32-value block (the affine parts that replace the dense copy); the token
    # embedding, read a row at a time, holds nothing
    expect, held = 0, set()
    for name, w in m.weights._cache.items():
        n = int(np.prod(w.shape))
        if w._dense is not None:
            expect += 4 * n
        elif getattr(w, "_affine", None) is not None:
            expect += 4 * n + 4 * n // 32
        else:
            continue
        held.add(name)
    assert "token_embd.weight" not in held and "output.weight" in held
    assert expect > 0 and mem["weights"] == expect
    # one block of the paged cache (numpy's) holds the run's max(8, 2 + 1) positions: 16 x 2
    # layers x K, V x 2 heads x 64 x f16
    assert mem["kv_cache"] == KVCache.nbytes_for(m.config, BLOCK_TOKENS) == 16 * 1024
    assert mem["f16_weights"] == 12345 and mem["graphs"] == 2 * GRAPH_BYTES
    assert mem["total"] == mem["weights"] + mem["kv_cache"] + 12345 + 2 * GRAPH_BYTES
    assert mem["device_used"] is None
    assert pp.memory["graphs"] == GRAPH_BYTES          # the prompt graph alone, before the decode's
    t = bench.table([pp, tg])
    assert "memory held in host arrays after tg2: weights" in t and "KV cache" in t


def test_bench_json_has_depth_lengths_memory():
    r = brass("bench", goldens.model("synth-qwen3").path(), "--backend", "numpy", "-p", 12, "-n", 3,
              "-r", 3, "--lengths", "random:20-40", "--seed", 5, "--depth", 7, "--json")
    assert r.returncode == 0, r.stderr
    pp, tg = json.loads(r.stdout)
    assert pp["test"] == "pp20-40 @ d7" and tg["test"] == "tg3 @ d7"
    assert pp["depth"] == tg["depth"] == 7 and tg["lengths"] is None
    assert pp["lengths"] == bench.prompt_lengths("random:20-40", 12, 3, seed=5)[1]
    for x in (pp, tg):
        assert set(x["memory"]) == {"weights", "f16_weights", "kv_cache", "graphs", "total", "device_used"}
        assert x["memory"]["weights"] > 0 and x["memory"]["kv_cache"] > 0
    table = brass("bench", goldens.model("synth-qwen3").path(), "--backend", "numpy", "-p", 12, "-n", 0,
                  "-r", 2, "--lengths", "30,20")
    assert table.returncode == 0, table.stderr
    assert "| pp20-30 " in table.stdout and "a length not read before: 30, 20" in table.stdout
    assert "memory held in host arrays after pp20-30" in table.stdout


@pytest.mark.parametrize("args,msg", [
    (("--lengths", "x"), "comma list of prompt lengths or random:A-B, got 'x'"),
    (("--lengths", "random:5"), "comma list"),
    (("--lengths", "random:9-3"), "1 <= A <= B"),
    (("--lengths", "0,5,6"), "must be >= 1"),
    (("--lengths", "5,5,6"), "repeats 5"),
    (("--lengths", "5,6"), "2 lengths for 3 repetitions"),
    (("--lengths", "5,6,512"), "the warm-up's length"),
    (("--lengths", "random:511-513"), "2 lengths besides the warm-up's (-p 512) for 3"),
    (("-p", 0, "--lengths", "5,6,7"), "needs a prompt test"),
    (("--depth", -1), "--depth must be >= 0"),
    (("--depth", 4, "--parallel", 2), "leave out --parallel"),
    (("--depth", 5000, "-p", 8, "-n", 1), "(5000 of depth and 8 of the test) exceed the model's context"),
    (("--lengths", "8,9,5000", "-p", 4, "-n", 0), "5000 tokens exceed the model's context"),
    (("--ctx", 10, "--depth", 5, "-p", 8, "-n", 1), "--ctx 10 is less than the 13 positions the test needs"),
])
def test_bench_lengths_depth_bad_input_is_one_line(args, msg):
    r = brass("bench", goldens.model("synth-llama").path(), "--backend", "numpy", *args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("brass: error:")]
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_check_args_before_the_model():
    """The CLI checks the arguments before loading the model (an upload of gigabytes on the
    GPU): the same checks as bench()."""
    with pytest.raises(BrassError, match="repeats 4"):
        bench.check_args(8, 0, 2, lengths="4,4")


def test_eager_prompt_host_counts():
    """perf/eager_prompt_host.py (an eager prompt's host side through the fake CuPy, for
    perf/NOTES.md): a dense qwen3 layer's calls, the same at 64 tokens as at 512 (the prompt
    GEMMs start at 32), and a time for the engine's share."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "perf/eager_prompt_host.py", "--layers", "1,2", "--tokens", "64",
                        "--reps", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {ln.split(None, 1)[1]: float(ln.split()[0]) for ln in r.stdout.splitlines()
            if ln.startswith("    ") and ln.split()[0].replace(".", "").isdigit()}
    assert rows == {"cublasGemmEx": 7.0, "kernel dequant.cu:to_f16": 4.0, "kernel fused.cu:add_rms_norm": 2.0,
                    "kernel fused.cu:rope_store": 1.0, "kernel attention_tiled.cu:attention_tiled_128_128": 1.0,
                    "kernel elementwise.cu:swiglu": 1.0}, r.stdout
    assert "16.0 launches and GEMMs" in r.stdout and "us a launch or GEMM" in r.stdout


def test_memory_on_the_cuda_backend_through_the_fake():
    """The CUDA backend's figures (through the fake CuPy, on the CPU): the weights' device bytes
    (matrices as their file bytes, 1-D tensors as float32), the f16 copies the prompt GEMMs
    made, the captured prompt graph and then the decode graph, the cache, and the driver's used
    memory."""
    from conformance.harness import fake_cupy, launch_recording
    import brass
    rec = fake_cupy.Recorder()
    with launch_recording.fake_cuda(rec):
        m = brass.load(str(goldens.model("synth-qwen3").path()), backend="cuda", quiet=True)
        pp, tg = bench.bench(m, n_prompt=48, n_gen=4, reps=2)
        f16, left = m.backend.f16_weight_bytes, sum(m.graph_bytes().values())
    expect = sum(t.nbytes if len(t.shape) > 1 else 4 * int(np.prod(t.shape)) for t in m.gguf.tensors.values())
    assert pp.memory["weights"] == tg.memory["weights"] == expect
    assert pp.memory["f16_weights"] == f16 > 0                      # 48 rows: the GEMM path
    # the prompt graph the timed reads replayed; the bench's session gone, the ledger holds none
    assert pp.memory["graphs"] > 0 and pp.prompt_graph is True and left == 0
    assert tg.memory["graphs"] > pp.memory["graphs"] and tg.kernels_per_token > 0   # + the decode graph
    # the class's padding too, in whole blocks of the paged cache
    assert pp.memory["kv_cache"] == KVCache.nbytes_for(m.config, blocks_for(prompt_class(48)) * BLOCK_TOKENS)
    free = fake_cupy.FREE_BYTES
    assert pp.memory["device_used"] == fake_cupy.DEVICE_PROPERTIES["totalGlobalMem"] - free
    assert "memory held on the device after tg4" in bench.table([pp, tg])


@pytest.mark.parametrize("apps,card,want", [("300\n200\n", "9999", "500 apps"), ("", "1234", "1234 card")])
def test_mem_peak_samples_nvidia_smi(tmp_path, apps, card, want):
    """ci/gpu_lib.sh mem_peak (ci/gpu.sh side-by-side's memory column) against a stand-in
    nvidia-smi: the compute processes' used memory summed, or the card's where the container
    sees no process."""
    import os
    import subprocess
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in --query-compute-apps*) printf '{apps}' ;; *) echo {card} ;; esac\n")
    smi.chmod(0o755)
    out = tmp_path / "mem.txt"
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    p = subprocess.Popen(["bash", "-c", f". ci/gpu_lib.sh; mem_peak {out}"], cwd=root, env=env,
                         start_new_session=True)
    try:
        for _ in range(100):            # the first sample comes within 0.2 s; 10 s at most
            if out.exists() and out.read_text().strip():
                break
            time.sleep(0.1)
    finally:
        os.killpg(p.pid, 15)
        p.wait(timeout=10)
    assert out.read_text().split() == want.split()
