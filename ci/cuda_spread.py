"""llama.cpp's own CUDA-vs-CPU spread per model, the bounds conformance/models/test_models.py derives
from it for Brass's CUDA backend against llama.cpp's CUDA goldens (tolerances.py,
SPREAD_ARGMAX_FACTOR), and, on the CPU, test_models' own CUDA tests run with the numpy backend
in q8_1 mode in CUDA's place (the CUDA kernels' oracle, kernels/cases.py cuda_reference, whose
figures against the CUDA goldens are the H200's), with a planted bug if asked:

    python ci/cuda_spread.py                    # spread and bounds, every model of the CUDA set
    python ci/cuda_spread.py --standin          # + test_activations, test_teacher_forced and
                                                #   test_greedy_stream[MODEL-cuda] on the stand-in
    python ci/cuda_spread.py --plant all        # + each planted bug in turn (exit 1 if one survives)
    python ci/cuda_spread.py --plant delta_decay:1.1,norm_eps:1000 --numpy synth-qwen35
                                                # bugs of a chosen size; --numpy: also the numpy
                                                # backend's tests against the CPU goldens

Models default to those the spread rule applies to (harness.llama_spread.spread_rule). Each stand-in run
is a pytest process of its own (the stand-in and the bug are patched into it, nothing on disk
changes); a model's three tests take 5-15 s on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TESTS = ("test_activations", "test_teacher_forced", "test_greedy_stream")


# --- planted bugs: patched into the stand-in's process, one at a time -------------------------

def _config(attr: str, change):
    """Every model loaded afterwards computes with `attr` of its config changed."""
    from brass.model import Model
    init = Model.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        setattr(self.config, attr, change(getattr(self.config, attr)))
    Model.__init__ = patched


def _decay(factor: float):
    """The delta-net's log-decay g (S <- exp(g) S) multiplied by `factor`."""
    from brass.backends.numpy_backend import NumpyBackend
    op = NumpyBackend.gated_delta_net
    NumpyBackend.gated_delta_net = lambda self, q, k, v, g, beta, state: op(self, q, k, v, g * factor, beta, state)


def _expert(expert: int, factor: float):
    """Expert `expert`'s output multiplied by `factor` wherever it is chosen (its routing weight)."""
    import numpy as np

    from brass.backends.numpy_backend import NumpyBackend
    op = NumpyBackend.moe_ffn

    def moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, *a, **kw):
        weights = weights * np.where(np.asarray(ids) == expert, np.float32(factor), np.float32(1))
        return op(self, x, w_gate, w_up, w_down, ids, weights.astype(np.float32), *a, **kw)
    NumpyBackend.moe_ffn = moe_ffn


HYBRIDS = ("synth-qwen35", "synth-qwen35moe")
MOE = ("synth-qwen35moe", "synth-gemma4moe")
# name: (what, with {x} for the size; patch(x); the size `--plant all` plants; models it
# applies to, None: every model). `--plant NAME:X` plants it at size X.
PLANTS = {
    "rope_base": ("rope base {x:g} instead of the model's, on its full-attention layers",
                  lambda x: _config("rope_base", lambda b: x), 10000.0, None),
    "norm_eps": ("RMS norm epsilon times {x:g}", lambda x: _config("norm_eps", lambda e: e * x), 10.0, None),
    "delta_decay": ("delta-net log-decay g times {x:g}", _decay, 1.3, HYBRIDS),
    "expert_weight": ("expert 1's output times {x:g}", lambda x: _expert(1, x), 1.25, MOE),
}


def parse_plant(text: str) -> tuple[str, float]:
    name, _, size = text.partition(":")
    if name not in PLANTS:
        raise SystemExit(f"no planted bug {name!r}; known: {', '.join(PLANTS)}")
    return name, float(size) if size else PLANTS[name][2]


def describe(plant: str) -> str:
    name, x = parse_plant(plant)
    return f"{plant} ({PLANTS[name][0].format(x=x)})"


# --- the stand-in run (a child process) -------------------------------------------------------

class _Outcomes:
    """pytest plugin: each test's outcome, the first line of why, and its recorded figures."""

    def __init__(self):
        self.rows = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            why = ""
            if report.failed:
                crash = getattr(report.longrepr, "reprcrash", None)
                why = (crash.message if crash else str(report.longrepr)).splitlines()[0]
            elif report.skipped:
                why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.rows.append({"test": report.nodeid.split("::")[-1], "outcome": report.outcome,
                              "why": why, "figures": dict(report.user_properties)})


def _child(plant: str | None, models: list[str], out: str, verbose: bool, backends: list[str]) -> int:
    import brass.backends
    import brass.model
    brass.backends.cuda_available = lambda: True          # before test_models is imported
    get_backend = brass.model.get_backend
    brass.model.get_backend = lambda name=None, **kw: (
        get_backend("numpy", act_mode="q8_1") if name == "cuda" else get_backend(name, **kw))
    if plant:
        name, x = parse_plant(plant)
        PLANTS[name][1](x)
    import pytest
    ids = [f"conformance/models/test_models.py::{t}[{m}-{b}]" for b in backends for m in models for t in TESTS]
    plugin = _Outcomes()
    os.chdir(ROOT)
    code = pytest.main([*ids, "-p", "no:cacheprovider", "-q", *(["-s"] if verbose else [])], plugins=[plugin])
    Path(out).write_text(json.dumps(plugin.rows))
    return int(code)


def standin(plant: str | None, models: list[str], verbose: bool, numpy: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.json")
        cmd = [sys.executable, __file__, "--child", out, *(["--plant", plant] if plant else []), *models]
        cmd += ["--verbose"] if verbose else []
        cmd += ["--numpy"] if numpy else []
        subprocess.run(cmd, cwd=ROOT, stdout=None if verbose else subprocess.DEVNULL, check=False)
        return json.loads(Path(out).read_text()) if os.path.exists(out) else []


# --- the spread and the bounds -----------------------------------------------------------------

def spread_table(models: list[str]) -> str:
    from tabulate import tabulate

    from conformance.harness import goldens, tolerances
    from conformance.harness.llama_spread import llama_spread, spread_rule
    rows = []
    for name in models:
        gm = goldens.model(name)
        s = llama_spread(name)
        rule = spread_rule(name, "cuda", "cuda")
        eps = tolerances.ARGMAX_EPS[("cuda", gm.kind)]
        dvb = next(m for m in goldens.manifest("cuda")["models"] if m["name"] == name)["prompts"][
            "decode_vs_batch_max_logit_diff"]
        if rule is None:
            bounds = ("fixed rule", "", "", "")
        else:
            f = tolerances.SPREAD_ARGMAX_FACTOR
            fixed = tolerances.LOGITS[("cuda", "cuda", gm.kind)]
            bounds = (f"{f * s.share:.1%}", f"{f * s.max_margin:.3f}",
                      f"{max(fixed, tolerances.SPREAD_LOGITS_FACTOR * s.top16):.1e}",
                      f"{max(tolerances.STREAM_EPS[gm.kind], s.max_margin):.3f}")
        rows.append((name, f"{s.disagree}/{s.clear} (> {eps})", f"{s.share:.1%}", f"{s.max_margin:.3f}",
                     f"{s.top16:.2e}", f"{sum(s.shared_tokens)} {list(s.shared_tokens)}", f"{dvb:.2f}", *bounds))
    return tabulate(rows, headers=[
        "model", "llama.cpp CPU vs CUDA: differ/clear", "share", "max margin", "top-16 NMSE",
        "greedy shared", "decode vs batch", "Brass may differ at", "no margin above", "top-16 NMSE <=",
        "greedy near-tie"])


def figures(row: dict) -> str:
    f = row["figures"]
    keys = ("argmax_agreement", "worst_top1_delta", "worst_top16_nmse", "worst_node")
    return "; ".join(f"{k} {f[k]}" for k in keys if k in f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="models of golden/cuda (default: those the spread rule applies to)")
    ap.add_argument("--standin", action="store_true", help="run test_models' CUDA tests on the numpy q8_1 stand-in")
    ap.add_argument("--plant", help=f"planted bugs in the stand-in, one run each: NAME[:SIZE],... "
                                    f"({', '.join(PLANTS)}) or all")
    ap.add_argument("--numpy", action="store_true", help="also the numpy backend's tests against the CPU "
                    "goldens (numpy in its CPU mode, the same bug planted): whether the CPU side catches it")
    ap.add_argument("--verbose", action="store_true", help="show the tests' own output")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.plant, args.models, args.child, args.verbose, ["cuda", "numpy"] if args.numpy else ["cuda"])

    from conformance.harness import goldens
    from conformance.harness.llama_spread import spread_rule
    cuda_set = [m["name"] for m in goldens.manifest("cuda")["models"]]
    print(spread_table(cuda_set))
    models = args.models or [n for n in cuda_set if spread_rule(n, "cuda", "cuda") is not None]
    runs = []
    if args.standin or args.plant:
        runs.append(None)
    if args.plant:
        runs += list(PLANTS) if args.plant == "all" else args.plant.split(",")
        for plant in runs[1:]:
            parse_plant(plant)
    survived, summary = [], []
    for plant in runs:
        only = None if plant is None else PLANTS[parse_plant(plant)[0]][3]
        targets = [m for m in models if only is None or m in only]
        title = "no planted bug" if plant is None else f"planted: {describe(plant)}"
        print(f"\n== numpy q8_1 in CUDA's place, {title}")
        for name in targets:
            rows = standin(plant, [name], args.verbose, args.numpy)
            failed = [r for r in rows if r["outcome"] == "failed" and r["test"].endswith("-cuda]")]
            for r in rows:
                print(f"  {r['test']:42s} {r['outcome'].upper() if r['outcome'] == 'failed' else r['outcome']:7s} "
                      f"{figures(r)}{' | ' + r['why'][:300] if r['why'] else ''}")
            if plant is not None:
                summary.append((plant, name, caught(rows, "cuda"), *([caught(rows, "numpy")] if args.numpy else [])))
                if not failed:
                    survived.append(f"{plant} on {name}")
            if not rows:
                survived.append(f"{plant} on {name}: no test ran")
    if summary:
        from tabulate import tabulate
        print("\n" + tabulate(summary, headers=["planted", "model", "failed on CUDA's stand-in vs CUDA goldens",
                                                *(["numpy vs CPU goldens"] if args.numpy else [])]))
    if survived:
        print("\nnot caught by the CUDA checks: " + "; ".join(survived))
    return 1 if survived else 0


def caught(rows: list[dict], backend: str) -> str:
    """Which of the three tests failed on `backend` (their names less test_), or "none"."""
    names = [r["test"].split("[")[0].removeprefix("test_") for r in rows
             if r["outcome"] == "failed" and r["test"].endswith(f"-{backend}]")]
    return ", ".join(names) or "none"


if __name__ == "__main__":
    sys.exit(main())
