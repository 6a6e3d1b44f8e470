"""The README's two commands stay true: CI (.ci/run) runs exactly the test command the README
gives, and the install command installs the package and runs `brass run` on the default."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    readme = _commands((ROOT / "README.md").read_text())
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_cmd = "python3 -m pytest conformance/ -q -n auto"
    assert test_cmd in readme, "README lost its test command"
    assert test_cmd in [line.strip() for line in ci], ".ci/run does not run the README's test command"


def test_readme_install_command_runs_the_default():
    readme = _commands((ROOT / "README.md").read_text())
    assert "pip install -e '.[cuda,test]' && brass run" in readme
    assert "pip install -q -e '.[cuda,test]'" in (ROOT / ".ci" / "run").read_text()


def test_readme_stays_short():
    # what Brass is, the two commands, using it, models, one speed table, links: the history
    # of measurements lives in perf/NOTES.md and git, not here
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 150, f"README.md has {n} lines; keep it at most 150"
