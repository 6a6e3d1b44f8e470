"""Perf runs only after conformance passes for the same model and backend: the first benchmark
of a (model, backend) pair runs its whole-model conformance tests in a subprocess and skips the
pair's benchmarks (reason shown) when they fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_gate: dict = {}


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true",
                     help="run the benchmarks only (pytest-benchmark's --benchmark-only) and "
                          "print each benchmark's figures as a table at the end")


# where each run keeps its figures; BRASS_TEST_PERF_RESULTS names another folder
RESULTS = Path(os.environ.get("BRASS_TEST_PERF_RESULTS", ROOT / "perf" / ".results"))


def pytest_configure(config):
    if config.getoption("--benchmark", default=False):
        # pytest-benchmark turns itself off under xdist (timings of tests sharing the machine
        # mean nothing) and then refuses --benchmark-only with a message about its own options
        if config.getoption("numprocesses", default=None) or os.environ.get("PYTEST_XDIST_WORKER"):
            raise pytest.UsageError("pytest perf/ --benchmark times one benchmark at a time: "
                                    "run it without -n (pytest-xdist)")
        config.option.benchmark_only = True
        # Every run keeps its figures (regression tracking): perf/.results/<device>.json
        # unless --benchmark-json names another file.
        if not getattr(config.option, "benchmark_json", None):
            from conformance.harness.perf_baseline import baseline_path, device_name
            RESULTS.mkdir(parents=True, exist_ok=True)
            config.option.benchmark_json = _json_option(RESULTS / baseline_path(device_name()).name)


def _json_option(path: Path):
    """--benchmark-json's value as the installed pytest-benchmark takes it: up to 5.2 the option
    is an argparse.FileType('wb') and the plugin writes through the open file it is given; from
    5.3 it is a Path and the plugin opens the file itself (an open file there is a TypeError at
    the end of the run). The installed version's own major.minor decides."""
    from importlib.metadata import version
    major, minor = (int(x) for x in version("pytest-benchmark").split(".")[:2])
    return path if (major, minor) >= (5, 3) else open(path, "wb")


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--benchmark", default=False):
        return
    bs = getattr(config, "_benchmarksession", None)
    rows = [(b.name, f"{b.stats.median * 1e3:.3f}", ", ".join(f"{k}={v}" for k, v in b.extra_info.items()))
            for b in (bs.benchmarks if bs else []) if getattr(b, "stats", None) is not None]
    if rows:
        from tabulate import tabulate
        terminalreporter.write_line(tabulate(rows, headers=["benchmark", "median ms", "figures"]))
        # Against the committed baseline of this device, when there is one.
        import json
        from conformance.harness.perf_baseline import baseline_path, compare, device_name
        path = baseline_path(device_name())
        results = {"benchmarks": [{"fullname": b.fullname, "name": b.name, "extra_info": b.extra_info,
                                   "stats": {"median": b.stats.median}}
                                  for b in bs.benchmarks if getattr(b, "stats", None) is not None]}
        base = json.loads(path.read_text()) if path.exists() else None
        where = f"baseline {path.relative_to(ROOT)} ({base['commit']}, {base['date']})" if base else \
            f"no baseline for this device ({path.relative_to(ROOT)}; python -m perf.baseline RESULTS.json writes one)"
        terminalreporter.write_line(where)
        terminalreporter.write_line(tabulate(compare(results, base),
                                             headers=["benchmark", "now", "baseline", "change (+ better)"]))


@pytest.fixture(scope="session")
def conformance_gate():
    def check(model: str, backend: str):
        key = (model, backend)
        if key not in _gate:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "conformance/models/test_models.py", "-k", f"{model} and {backend}"]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
            _gate[key] = (r.returncode == 0, r.stdout.strip().splitlines()[-1:] or ["no output"])
        ok, tail = _gate[key]
        if not ok:
            pytest.skip(f"conformance of {model} on {backend} did not pass ({tail[0]}): no perf figures")
    return check
