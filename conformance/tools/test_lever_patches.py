"""The levers waiting for a GPU timing (perf/levers/*.patch, timed by `ci/gpu.sh lever`) stay
usable: each applies to the tree as it is, each has its row in perf/NOTES.md, and each brings
a test of its own. A change to main that a patch no longer applies to fails here, so that the
patch is refreshed (or the lever deleted, its figure kept in the row) in the same change."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "perf" / "levers").glob("*.patch"))


def test_every_file_in_the_levers_folder_is_a_patch():
    # the folder is a queue of patches, not a place for notes or scratch (the rows say why)
    others = [p.name for p in (ROOT / "perf" / "levers").iterdir() if p.suffix != ".patch"] \
        if (ROOT / "perf" / "levers").is_dir() else []
    assert not others, f"perf/levers/ holds other files than patches: {others}"


# an empty queue says so by name (pytest's own skip of an empty parameter set names no reason)
@pytest.mark.parametrize("patch", PATCHES or [pytest.param(None, marks=pytest.mark.skip(
    reason="no lever waits in perf/levers/: nothing to check"))], ids=[p.stem for p in PATCHES] or ["none"])
def test_a_lever_patch_applies_and_is_documented(patch):
    if shutil.which("git") is None:
        pytest.skip("no git here: `git apply --check` cannot run")
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies to the tree: refresh it or delete the lever\n{r.stderr}"
    rel = f"perf/levers/{patch.name}"
    assert rel in (ROOT / "perf" / "NOTES.md").read_text(), f"perf/NOTES.md has no row naming {rel}"
    text = patch.read_text()
    assert "\n+++ b/kernels/" in text or "\n+++ b/engine/" in text, f"{patch.name} changes neither kernels nor engine"
    assert "\n+++ b/conformance/" in text, f"{patch.name} brings no test of its own"
    # the recordings are re-recorded when a lever goes into main: in a patch they would make
    # every two patches conflict (and this one 1.6 MB for the launch sequence)
    for data in ("conformance/data/kernel_machine_code.json", "conformance/data/launch_sequence.json"):
        assert f"\n+++ b/{data}" not in text, f"{patch.name} carries {data}"


def _lever_tree(tmp_path):
    """What `ci/gpu.sh lever` reads, copied (ci/, engine/, kernels/, pyproject.toml), and a patch
    that marks kernels/common.cuh and adds a test that passes only on the marked tree."""
    tree = tmp_path / "tree"
    for d in ("ci", "engine", "kernels"):
        shutil.copytree(ROOT / d, tree / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    head = (ROOT / "kernels" / "common.cuh").read_text().splitlines()[:3]
    patch = tmp_path / "probe.patch"
    patch.write_text(
        "--- a/kernels/common.cuh\n+++ b/kernels/common.cuh\n@@ -1,3 +1,4 @@\n+// lever probe\n"
        + "".join(f" {line}\n" for line in head)
        + "--- /dev/null\n+++ b/probe/test_probe.py\n@@ -0,0 +1,2 @@\n"
        + "+def test_the_patch_is_in():\n"
        + "+    assert open('kernels/common.cuh').read().startswith('// lever probe')\n")
    return tree, patch


def _lever(tree, *args):
    import os
    env = {**os.environ, "TESTS": "probe/test_probe.py", "SUITE_WORKERS": "1",
           "OUT": str(tree.parent / "out"), "BRASS_TEST_SHAPES": str(tree.parent / "shapes")}
    (tree.parent / "out").mkdir(exist_ok=True)
    return subprocess.run(["bash", "ci/gpu.sh", "lever", *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def test_gpu_sh_lever_applies_tests_and_takes_out(tmp_path):
    # the patches are in while their tests run, and out again when the call ends: here it ends
    # early, on a shape that does not exist, as a call cut short would
    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("no git or bash here")
    tree, patch = _lever_tree(tmp_path)
    before = (tree / "kernels" / "common.cuh").read_text()
    r = _lever(tree, str(patch), "no-such-shape")
    log = r.stdout + r.stderr
    assert f"{patch} applied" in log and "1 passed" in log, log
    assert f"{patch} taken out" in log and "LEVER TESTS FAILED" not in log, log
    assert (tree / "kernels" / "common.cuh").read_text() == before
    assert not (tree / "probe" / "test_probe.py").exists()
    # the test log is named for compare's archive (the shape's absence ended the call before it)
    assert "1 passed" in (tmp_path / "out" / "compare-lever-tests.log").read_text()


def test_gpu_sh_lever_refuses_a_patch_that_does_not_apply(tmp_path):
    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("no git or bash here")
    tree, patch = _lever_tree(tmp_path)
    text = patch.read_text().replace("+// lever probe\n ", "+// lever probe\n x", 1)
    assert text != patch.read_text()
    patch.write_text(text)                  # its first context line no longer matches the tree
    before = (tree / "kernels" / "common.cuh").read_text()
    r = _lever(tree, str(patch), "no-such-shape")
    assert r.returncode == 2 and "does not apply" in r.stdout, r.stdout + r.stderr
    assert (tree / "kernels" / "common.cuh").read_text() == before
    r = _lever(tree, str(tmp_path / "missing.patch"))
    assert r.returncode == 2 and "no such patch" in r.stdout


def test_gpu_sh_lever_says_when_the_patch_tests_fail(tmp_path):
    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("no git or bash here")
    tree, patch = _lever_tree(tmp_path)
    patch.write_text(patch.read_text().replace(".startswith('// lever probe')", ".startswith('// not the probe')"))
    r = _lever(tree, str(patch), "no-such-shape")
    log = r.stdout + r.stderr
    assert "1 failed" in log and "LEVER TESTS FAILED" in log, log
    assert f"{patch} taken out" in log, log
