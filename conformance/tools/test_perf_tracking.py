"""Regression tracking of `pytest perf/ --benchmark` (conformance/harness/perf_baseline.py): figures from
pytest-benchmark's JSON, a baseline written from a results file and read back, the change
column (positive when better, for rates and for times), new benchmarks marked new."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conformance.harness import perf_baseline


def results(rate, seconds):
    return {"datetime": "2026-11-30T12:00:00", "benchmarks": [
        {"fullname": "perf/a.py::test_rate", "name": "test_rate", "extra_info": {"tokens_per_s": rate},
         "stats": {"median": 1.0}},
        {"fullname": "perf/a.py::test_time", "name": "test_time", "extra_info": {}, "stats": {"median": seconds}},
    ]}


def test_baseline_round_trip_and_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(perf_baseline, "BASELINES", tmp_path / "baselines")
    src = tmp_path / "run.json"
    src.write_text(json.dumps(results(100.0, 2.0)))
    path = perf_baseline.write_baseline(src, "NVIDIA H200 (test)")
    assert path.name == "NVIDIA-H200-test.json"
    base = json.loads(path.read_text())
    assert base["device"] == "NVIDIA H200 (test)" and base["date"] == "2026-11-30"
    rows = {r[0]: r for r in perf_baseline.compare(results(125.0, 1.0), base)}
    assert rows["perf/a.py::test_rate"][3] == "+25.0 %"        # faster rate: better
    assert rows["perf/a.py::test_time"][3] == "+100.0 %"       # half the time: better
    rows = {r[0]: r for r in perf_baseline.compare(results(80.0, 4.0), base)}
    assert rows["perf/a.py::test_rate"][3] == "-20.0 %" and rows["perf/a.py::test_time"][3] == "-50.0 %"
    new = results(1.0, 1.0)
    new["benchmarks"][0]["fullname"] = "perf/b.py::test_other"
    assert {r[0]: r[3] for r in perf_baseline.compare(new, base)}["perf/b.py::test_other"] == "new"


def test_committed_baselines_are_readable():
    for path in perf_baseline.BASELINES.glob("*.json"):
        b = json.loads(path.read_text())
        assert perf_baseline.baseline_path(b["device"]).name == path.name, path
        assert b["commit"] and b["figures"], path
        for name, (unit, value) in b["figures"].items():
            assert unit in (*perf_baseline.HIGHER_IS_BETTER, "median_s") and value > 0, (path, name)


def test_benchmark_run_saves_its_figures(tmp_path):
    # `pytest perf/ --benchmark` end to end on one CPU benchmark (no model needed): the run must
    # end cleanly and leave its figures in perf/.results/<device>.json (perf/conftest.py once
    # handed pytest-benchmark a path where it writes through a file object: every run crashed
    # at its end, the H200's of 2026-12-04 included). Into a folder of its own, so that a
    # user's own perf/.results are left alone. Without the xdist worker's environment: under
    # `-n`, pytest-benchmark would take the child for a worker and refuse --benchmark-only.
    root = Path(__file__).resolve().parents[2]
    saved = tmp_path / "results" / perf_baseline.baseline_path(perf_baseline.device_name()).name
    r = subprocess.run([sys.executable, "-m", "pytest", "perf/test_dequant_speed.py", "--benchmark", "-q",
                        "-p", "no:cacheprovider", "-k", "throughput and Q4_K"],
                       cwd=root, capture_output=True, text=True, timeout=600,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
                            "BRASS_TEST_PERF_RESULTS": str(tmp_path / "results")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = [b["fullname"] for b in json.loads(saved.read_text())["benchmarks"]]
    assert names == ["perf/test_dequant_speed.py::test_dequantize_throughput[Q4_K]"]
    assert "change (+ better)" in r.stdout        # the comparison with the device's baseline


def test_benchmark_run_under_xdist_says_why_it_refuses(tmp_path):
    # Under xdist pytest-benchmark disables itself; `--benchmark` must then stop with a line
    # that names the cause (-n), not pytest-benchmark's own option clash. A worker's
    # environment stands in for -n (xdist need not be installed).
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "perf/test_dequant_speed.py", "--benchmark", "-q",
                        "-p", "no:cacheprovider", "-k", "throughput and Q4_K"],
                       cwd=root, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTEST_XDIST_WORKER": "gw0",
                            "BRASS_TEST_PERF_RESULTS": str(tmp_path / "results")})
    assert r.returncode == 4 and "without -n" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
