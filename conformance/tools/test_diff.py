"""`brass diff`: llama.cpp and Brass on the same prompt, node by node.

It needs llama.cpp's Python binding (the `record` extra, which .ci/run installs); without it
these tests skip with that reason. The comparison must pass on every synthetic model and a
real one, and a planted bug must be named at the node where it first shows: a wrong RoPE base
at layer 0's q (the first roped node), a perturbed FFN weight of the last layer at that
layer's FFN output and not before.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from conformance.harness import goldens
from brass import arch as arch_registry
from brass.backends import cuda_available
from brass.model import Model

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama.cpp's Python binding is not installed (pip install -e '.[record]'): brass diff has nothing to run")

SYNTH = [m.name for m in goldens.models(kind="synthetic")]
BACKENDS = ["numpy", pytest.param("cuda", marks=pytest.mark.skipif(
    not cuda_available(), reason="CUDA backend: no GPU on this machine"))]


def _diff(m, **kw):
    from brass.diff import diff
    return diff(m, **kw)


@needs_llama_cpp
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SYNTH)
def test_diff_passes_on_synthetic_models(name, backend):
    # Brass's CUDA backend is compared with llama.cpp's CUDA backend: against the CPU one a
    # mixture-of-experts model may pick another expert at a router near-tie (which
    # test_models bounds), and brass diff reports every such pick as a divergence.
    reference = "cpu"
    arch = goldens.model(name).arch
    if backend not in arch_registry.backends(arch):
        pytest.skip(f"{arch} is not yet supported on the {backend} backend")
    if backend == "cuda":
        from brass import llamacpp
        if not llamacpp.has_cuda():
            pytest.skip("llama.cpp's binding here is a CPU build; brass diff --reference cuda needs "
                        "a CUDA build (ci/build_llamacpp_cuda.sh, LLAMA_CPP_LIB_PATH)")
        reference = "cuda"
    m = Model(goldens.model(name).path(), backend=backend, quiet=True)
    r = _diff(m, reference=reference)
    print(r.table())
    assert r.passed, r.table()
    assert r.first_divergence is None and not r.untraced
    # every layer's nodes were compared, and the argmax check saw clear positions
    assert {n.layer for n in r.nodes if n.layer is not None} == set(range(m.config.n_layer))
    assert r.positions >= 8, f"only {r.positions} positions with a clear margin"


@needs_llama_cpp
def test_diff_cli_real_model(real_model_path):
    """The command as a user runs it: table, PASS, exit status 0; --json parses."""
    path = real_model_path("smollm2-135m")
    cmd = [sys.executable, "-m", "brass", "diff", path, "--backend", "numpy", "--n-gen", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first divergence" not in r.stdout and r.stdout.rstrip().endswith("PASS")
    assert "l_out-29" in r.stdout and "result_output" in r.stdout      # the last layer, the logits
    r = subprocess.run(cmd + ["--json", "--prompt", "Hello"], capture_output=True, text=True, timeout=900)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["passed"] and doc["first_divergence"] is None
    assert doc["prompt_tokens"] >= 1 and 1 <= doc["generated_by_llama_cpp"] <= 8
    assert {"node", "nmse", "max_abs", "bound", "ok"} <= set(doc["nodes"][0])


@needs_llama_cpp
def test_diff_names_a_wrong_rope_base():
    m = Model(goldens.model("synth-qwen3").path(), backend="numpy", quiet=True)
    m.config = dataclasses.replace(m.config, rope_base=m.config.rope_base * 2)
    r = _diff(m)
    assert not r.passed
    first = r.first_divergence
    assert (first.role, first.layer) == ("q_rope", 0), r.table()
    assert "first divergence" in r.table() and r.table().endswith("FAIL")


@needs_llama_cpp
def test_diff_names_the_layer_of_a_perturbed_weight():
    m = Model(goldens.model("synth-llama").path(), backend="numpy", quiet=True)
    last = m.config.n_layer - 1
    target = f"blk.{last}.ffn_down.weight"
    matmul = m.backend.matmul

    def planted(x, w, *a, **k):
        # 25 % too large, as a wrong block scale in one dequantizer would make it
        y = matmul(x, w, *a, **k)
        return y * np.float32(1.25) if getattr(w, "name", None) == target else y
    m.backend.matmul = planted
    r = _diff(m)
    first = r.first_divergence
    assert first is not None and (first.role, first.layer) == ("ffn_out", last), r.table()
    assert all(n.ok for n in r.nodes if n.layer is not None and n.layer < last)


def test_diff_without_the_binding_is_one_clear_line(tmp_path):
    """A user without the record extra gets one line saying what to install."""
    code = ("import sys, builtins; real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name.startswith('llama_cpp'): raise ImportError(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "from brass.cli import main; sys.exit(main(sys.argv[1:]))\n")
    path = goldens.model("synth-llama").path()
    r = subprocess.run([sys.executable, "-c", code, "diff", str(path), "--backend", "numpy"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "pip install -e '.[record]'" in r.stderr
    assert "Traceback" not in r.stderr


@needs_llama_cpp
def test_diff_bad_arguments_are_one_clear_line():
    """A negative --n-gen, or --reference cuda on a CPU build of llama.cpp (which would run on
    the CPU and be reported as CUDA), stop with one line and status 2."""
    from brass import llamacpp
    path = str(goldens.model("synth-llama").path())
    cases = [["--n-gen", "-1"]]
    if not llamacpp.has_cuda():
        cases.append(["--reference", "cuda"])
    for extra in cases:
        r = subprocess.run([sys.executable, "-m", "brass", "diff", path, "--backend", "numpy", *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.startswith("brass: error: diff:"), (extra, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""
