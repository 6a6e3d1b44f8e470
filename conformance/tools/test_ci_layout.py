"""ci/ stays a toolbox a maintainer can read: files named for what they do (never for the
session, the plan or the day that wrote them), every one of them called or documented from
somewhere, its shell scripts parsing, and one GPU-runner entry (ci/gpu.sh) whose `help` lists
every subcommand it has. The ci/ files and the suite's files that CI, perf/ and the docs name
exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"

# Files no other file names, each with the reason it stays.
UNREFERENCED = {
    "rounding_noise.py": "a manual numerics tool (how far Q8_1 rounding alone moves a model's "
                         "teacher-forced logits); its docstring is its usage",
}

# Where a reference counts: code, tests, CI, the GPU entry, and the docs. Not perf/NOTES.md (a
# record of what was measured with which script, not a place a tool is called from) nor the
# recorded data (manifests, baselines), whose provenance may name scripts since folded away.
SOURCES = ("ci", "conformance", "perf", "engine", "kernels", "docs", ".ci")
SOURCE_FILES = ("README.md", "golden/README.md")
NOT_SOURCES = ("perf/NOTES.md", "perf/baselines")
TEXT = {".py", ".sh", ".md", ".cu", ".cuh", ".toml", ".txt", ""}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
            "twentieth|thirtieth|fortieth|fiftieth|hundredth")
CARDINALS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|"
             "fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|hundred")
TENS = "twenty|thirty|forty|fifty"
MONTHS = ("january|february|march|april|june|july|august|september|october|november|december|"
          "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec")
NUMBER_WORD = re.compile(rf"^(?:(?:{TENS})[-_]?)?(?:{ORDINALS}|{CARDINALS})$|^\d+(?:st|nd|rd|th)$|^(?:{MONTHS})$")
DATE = re.compile(r"(?<!\d)(?:\d{4}[-_]?(?:0[1-9]|1[0-2])[-_]?(?:[0-2]\d|3[01])|(?:0[1-9]|1[0-2])[-_](?:[0-2]\d|3[01]))(?!\d)")


def ci_files() -> list[Path]:
    return sorted(p for p in CI.iterdir() if p.is_file() and p.suffix != ".pyc")


def name_problem(name: str) -> str | None:
    """Why a ci/ file name says when or in which session it was written, or None."""
    stem = name.lower().split(".", 1)[0]
    if "session" in stem:
        return "names a session"
    if DATE.search(stem):
        return "carries a date"
    words = [w for w in re.split(r"[-_.\s]+", stem) if w]
    bad = [w for w in words if NUMBER_WORD.match(w)]
    return f"carries the number word {bad[0]!r}" if bad else None


def test_name_rule_has_teeth():
    for bad in ("gpu_twentysecond_session.sh", "gpu_thirtieth_run.sh", "gpu_twenty_second.sh",
                "levers_2026-12-04.py", "stage_20261204.sh", "probe_12-04.sh", "gpu_3rd.sh",
                "notes_dec.sh", "gpu_next_session.sh"):
        assert name_problem(bad), bad
    for good in ("gpu.sh", "q8_1_oracle.py", "build_llamacpp_cuda.sh", "tokenizer_corpus.json",
                 "mmq_host.py", "fuzz_load.py", "gpu_tune_mmq.py", "gpu_lib.sh"):
        assert name_problem(good) is None, good


def test_no_ci_file_is_named_for_a_session_a_number_or_a_date():
    bad = {p.name: why for p in ci_files() if (why := name_problem(p.name))}
    assert not bad, f"name ci/ files for what they do (git keeps the history): {bad}"


def _sources() -> dict[Path, str]:
    files = [ROOT / f for f in SOURCE_FILES]
    for d in SOURCES:
        files += [p for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in TEXT
                  and "__pycache__" not in p.parts]
    skip = [ROOT / s for s in NOT_SOURCES]
    return {p: p.read_text(errors="replace") for p in files
            if p.exists() and not any(p == s or s in p.parents for s in skip)}


def _referenced(path: Path, sources: dict[Path, str]) -> bool:
    stem = re.escape(path.stem)
    pattern = re.compile(rf"\b{re.escape(path.name)}\b|\bci\.{stem}\b|\bfrom ci import [\w, ]*\b{stem}\b")
    return any(pattern.search(text) for p, text in sources.items() if p != path)


def test_every_ci_file_is_called_or_documented():
    sources = _sources()
    orphans = [p.name for p in ci_files() if p.name not in UNREFERENCED and not _referenced(p, sources)]
    assert not orphans, (f"ci/ files that nothing calls or documents: {orphans}; delete them (git keeps "
                         "them), call them from ci/gpu.sh, or list them in UNREFERENCED with the reason")
    stale = [n for n in UNREFERENCED if not (CI / n).is_file()]
    assert not stale, f"UNREFERENCED names files that are gone: {stale}"


def test_references_from_tests_ci_and_the_golden_readme_exist():
    # the suite, CI, the GPU entry and the goldens' recipe name only ci/ files that exist
    texts = [ROOT / ".ci" / "run", ROOT / "golden" / "README.md", CI / "gpu.sh", *gpu_sourced(),
             *(ROOT / "conformance").rglob("*.py"), *(ROOT / "perf").glob("*.py")]
    missing = sorted({f"{p.relative_to(ROOT)}: ci/{m}" for p in texts
                      for m in re.findall(r"(?<![\w./])ci/([\w.-]+\.(?:py|sh|txt|json))", p.read_text())
                      if not (CI / m).is_file()})
    assert not missing, missing


def test_suite_paths_named_by_ci_and_the_docs_exist():
    # the test files and harness modules that CI runs (gpu.sh's pytest commands, mutations.py's
    # test ids), perf's gate and the docs name are where the suite keeps them: a path left
    # behind by a move would otherwise show only on the GPU runner
    texts = [ROOT / ".ci" / "run", ROOT / "README.md", ROOT / "golden" / "README.md",
             *(p for p in CI.iterdir() if p.suffix in (".py", ".sh")), *(ROOT / "perf").glob("*.py"),
             *(ROOT / "conformance").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    named = {(p, m) for p in texts
             for m in re.findall(r"(?<![\w./])(conformance/[\w/]*\.py)(?![\w/])", p.read_text())}
    assert len(named) > 20, "the pattern no longer finds the suite's paths"
    missing = sorted(f"{p.relative_to(ROOT)}: {m}" for p, m in named if not (ROOT / m).is_file())
    assert not missing, missing


def gpu_sourced() -> list[Path]:
    """The files ci/gpu.sh sources (its shared functions, subcommands kept apart), in order."""
    return [ROOT / m for m in re.findall(r"^\. (ci/[\w.-]+\.sh)$", (CI / "gpu.sh").read_text(), re.M)]


def test_gpu_sources_exist_and_travel_in_a_slim_tree():
    # `stage slim` commits only the files its staging calls need: gpu.sh stops at its first
    # line on the runner where a file it sources was left out
    sourced = gpu_sourced()
    assert CI / "gpu_lib.sh" in sourced, sourced
    assert all(p.is_file() for p in sourced), sourced
    slim = re.search(r"local paths=\(([^$]*)", (CI / "gpu.sh").read_text())
    assert slim, "stage slim's paths not found in ci/gpu.sh"
    left_out = [name for p in [CI / "gpu.sh", *sourced]
                if (name := str(p.relative_to(ROOT))) not in slim[1].split()]
    assert not left_out, f"stage slim leaves out {left_out}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_shell_scripts_parse():
    scripts = sorted(CI.glob("*.sh"))
    assert scripts
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s.name}: {r.stderr}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_gpu_help_lists_every_subcommand():
    subcommands = [n.replace("_", "-") for p in [CI / "gpu.sh", *gpu_sourced()]
                   for n in re.findall(r"^sub_(\w+)\(\)", p.read_text(), re.M)]
    assert {"suite", "side-by-side", "serving", "soak", "profile", "stage", "tune", "bar", "help"} <= set(subcommands)
    r = subprocess.run(["bash", str(CI / "gpu.sh"), "help"], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    listed = re.findall(r"^  ([a-z][a-z-]*)\b", r.stdout, re.M)
    assert sorted(listed) == sorted(subcommands), (listed, subcommands)
    bare = subprocess.run(["bash", str(CI / "gpu.sh")], capture_output=True, text=True, cwd="/")
    assert bare.returncode == 0 and bare.stdout == r.stdout
    unknown = subprocess.run(["bash", str(CI / "gpu.sh"), "no-such-thing"], capture_output=True, text=True, cwd="/")
    assert unknown.returncode == 2 and "no subcommand" in unknown.stdout
