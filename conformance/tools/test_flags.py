"""The BRASS_* settings (engine/flags.py): one parsing rule, one warning for a variable this
version does not read, one place in the engine that reads the environment, and
docs/configuration.md as the table of engine/flags.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from brass import flags
from brass.flags import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
# a variable's name: BRASS_ and words, whole (the prefix BRASS_TEST_ alone is no name)
NAME = re.compile(r"\bBRASS_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
MAX_NAMES = 15


@pytest.mark.parametrize("text", ["1", "true", "yes", "on", "TRUE", "On", " yes "])
def test_a_switch_reads_on(text):
    assert flags.get("BRASS_GRAPH", {"BRASS_GRAPH": text}) is True


@pytest.mark.parametrize("text", ["0", "false", "no", "off", "FALSE", "Off"])
def test_a_switch_reads_off(text):
    assert flags.get("BRASS_GRAPH", {"BRASS_GRAPH": text}) is False


@pytest.mark.parametrize("name, text", [("BRASS_GRAPH", "2"), ("BRASS_CUDA_DEBUG", "maybe"),
                                        ("BRASS_KEEP_WHEELS", "y"), ("BRASS_DEVICE", "gpu0"),
                                        ("BRASS_DEVICE", "-1"), ("BRASS_DEVICE", "1.5"),
                                        ("BRASS_PROMPT_GRAPHS_MB", "lots"), ("BRASS_PROMPT_GRAPHS_MB", "-1"),
                                        ("BRASS_PROMPT_GRAPHS_MB", "nan"), ("BRASS_F16_WEIGHTS_GB", "inf")])
def test_a_bad_value_names_its_variable(name, text):
    with pytest.raises(ConfigError, match=name):
        flags.get(name, {name: text})


def test_numbers_paths_and_defaults():
    assert flags.get("BRASS_DEVICE", {"BRASS_DEVICE": "2"}) == 2
    assert flags.get("BRASS_PROMPT_GRAPHS_MB", {"BRASS_PROMPT_GRAPHS_MB": "0.5"}) == 0.5
    assert flags.get("BRASS_CACHE", {"BRASS_CACHE": "~/models"}) == Path.home() / "models"
    # unset and empty both give the default
    for env in ({}, {"BRASS_PROMPT_GRAPHS_MB": ""}):
        assert flags.get("BRASS_PROMPT_GRAPHS_MB", env) == 512.0
        assert flags.get("BRASS_GRAPH", env) is True
        assert flags.get("BRASS_DEVICE", env) is None


def test_an_unknown_variable_is_warned_about_once(monkeypatch, capsys):
    monkeypatch.setattr(flags, "_warned", set())
    monkeypatch.setenv("BRASS_MMQ", "1")                # a switch of an older version
    monkeypatch.setenv("BRASS_TEST_SEED", "7")          # the test suite's own
    flags.check()
    flags.check()
    lines = capsys.readouterr().err.splitlines()
    assert len([ln for ln in lines if "BRASS_MMQ" in ln]) == 1, lines
    assert not any("BRASS_TEST_SEED" in ln for ln in lines), lines


def test_building_a_backend_checks_the_settings(monkeypatch, capsys):
    from brass.backends import get_backend
    monkeypatch.setattr(flags, "_warned", set())
    monkeypatch.setenv("BRASS_NORM_MATVEC", "1")
    get_backend("numpy")
    assert "BRASS_NORM_MATVEC" in capsys.readouterr().err
    monkeypatch.setenv("BRASS_GRAPH", "maybe")
    with pytest.raises(ConfigError, match="BRASS_GRAPH"):
        get_backend("numpy")


def _engine_sources():
    return sorted(ENGINE.rglob("*.py"))


def _environment_reads(tree) -> list[tuple[int, str]]:
    """(line, name) of each read of a BRASS_* variable: os.environ.get/pop/setdefault,
    os.getenv, os.environ[...] and `in os.environ` with a string starting with BRASS_."""
    def environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
               (isinstance(node, ast.Name) and node.id == "environ")

    def brass(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("BRASS_")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and brass(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and environ(f.value)) \
                    or (isinstance(f, ast.Attribute) and f.attr == "getenv") \
                    or (isinstance(f, ast.Name) and f.id == "getenv"):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Subscript) and environ(node.value) and brass(node.slice):
            found.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Compare) and brass(node.left) and any(environ(c) for c in node.comparators):
            found.append((node.lineno, node.left.value))
    return found


def test_the_scan_finds_each_form_of_a_read():
    # the scan below must see each form of a read, or its silence would prove nothing
    src = ('import os\nfrom os import environ, getenv\na = os.environ.get("BRASS_A")\nb = os.getenv("BRASS_B")\n'
           'c = os.environ["BRASS_C"]\nd = "BRASS_D" in os.environ\ne = environ.get("BRASS_E", "1")\n'
           'f = getenv("BRASS_F")\ng = os.environ.get("HOME")\n')
    assert sorted(n for _, n in _environment_reads(ast.parse(src))) == [f"BRASS_{c}" for c in "ABCDEF"]


def test_only_flags_reads_the_environment():
    # every BRASS_* read of the engine goes through flags.get (one parsing rule, read when
    # something is built, the unknown ones warned about)
    reads = []
    for path in _engine_sources():
        if path == ENGINE / "flags.py":
            continue
        for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
            reads.append((str(path.relative_to(ROOT)), line, name))
    assert not reads, "BRASS_* variables read outside engine/flags.py:\n" + \
        "\n".join(f"{p}:{ln}: {n}" for p, ln, n in sorted(reads))


def test_few_names_in_the_engine():
    names: dict[str, list[str]] = {}
    for path in _engine_sources():
        for name in NAME.findall(path.read_text()):
            names.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert len(names) <= MAX_NAMES, \
        f"{len(names)} BRASS_* names in engine/ (at most {MAX_NAMES}): " + \
        ", ".join(f"{n} ({sorted(set(p))[0]})" for n, p in sorted(names.items()))
    # the names flags.get is asked for are the table's (a typo is a KeyError at run time)
    asked = set()
    for path in _engine_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "flags" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                asked.add(node.args[0].value)
    assert asked and asked <= set(flags.VARIABLES), asked - set(flags.VARIABLES)


def test_the_documentation_is_the_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = [ln for ln in doc.splitlines() if ln.startswith("|")]
    assert sum(ln.startswith("| Variable |") for ln in rows) == 1, "one table"
    listed = [tuple(c.strip() for c in ln.strip("|").split("|")[:2]) for ln in rows[2:]]
    want = [(f"`{v.name}`", flags.default_text(v)) for v in flags.VARIABLES.values()]
    assert listed == want, "docs/configuration.md's table is not engine/flags.py's (python -m brass.flags)"
    assert "\n".join(rows) == flags.table(), "a meaning differs: python -m brass.flags prints the table"
