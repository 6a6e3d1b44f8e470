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


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
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
