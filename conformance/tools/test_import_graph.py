"""The layers point one way. Every .py file under engine/, kernels/, conformance/, ci/ and perf/
is parsed (ast, nothing is imported) and each of its imports mapped to the top-level package it
reaches (brass is engine/, brass.kernels is kernels/), which gives the graph between the five:

- it has no cycle;
- the engine imports none of the other four (it is what they all drive);
- the suite (its tests and conformance/harness/) imports neither ci/ nor perf/: a tool the suite
  checks either keeps its library in the harness or is run as a script;
- ci/ and perf/ reach into the suite only through conformance.harness;
- no module imports a test module (test_*.py, conftest.py): what tests share lives in the
  harness, shared fixtures in a conftest.py.

Imports inside functions count, and so does importlib.import_module / __import__ of a literal
name; a path handed to a subprocess does not (running a script is not importing it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "conformance", "ci", "perf")


def module_name(path: Path) -> str:
    """The dotted name a file is imported as (engine/ is brass, kernels/ brass.kernels)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "engine":
        parts[0] = "brass"
    elif parts[0] == "kernels":
        parts = ["brass", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str) -> str | None:
    """Which of the five a dotted name belongs to; None for the standard library and the
    third-party packages."""
    top = name.split(".")[0]
    if top == "brass":
        return "kernels" if name == "brass.kernels" or name.startswith("brass.kernels.") else "engine"
    return top if top in PACKAGES else None


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a file imports. `from a.b import c` gives a.b.c: c may
    be a module, and the rules below look at the leading parts only."""
    me = module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out += [(node.lineno, module if a.name == "*" else f"{module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")
                   or isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            out.append((node.lineno, node.args[0].value))
    return out


def python_files() -> list[Path]:
    return sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def is_test_module(name: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in name.split(".")[1:])


def graph(files: list[Path]) -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> where each such import is ("path:line name")."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in files:
        src = package_of(module_name(path))
        for line, name in imported_names(path):
            dst = package_of(name)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(ROOT)}:{line} {name}")
    return edges


def find_cycle(edges) -> list[str] | None:
    """A cycle of packages (the first repeated at the end), or None."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(succ.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None
    for start in sorted(succ):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


@pytest.fixture(scope="module")
def files():
    return python_files()


@pytest.fixture(scope="module")
def edges(files):
    return graph(files)


def test_the_graph_sees_what_it_judges(files, edges):
    # a parser that found no file or no import would pass every rule below
    assert {module_name(p).split(".")[0] for p in files} >= {"brass", "conformance", "ci", "perf"}
    assert {("conformance", "engine"), ("ci", "engine"), ("ci", "conformance"), ("perf", "conformance")} <= set(edges)
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a")}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None
    assert package_of("brass.kernels") == "kernels" and package_of("brass.backends.cuda") == "engine"
    assert package_of("numpy") is None and is_test_module("conformance.kernels.test_kernels.check")


def test_no_cycle_between_the_packages(edges):
    cycle = find_cycle(edges)
    assert cycle is None, "a cycle: " + "; ".join(f"{a} -> {b} ({edges[(a, b)][0]})"
                                                  for a, b in zip(cycle[:-1], cycle[1:], strict=True))


def test_the_engine_imports_none_of_the_others(edges):
    bad = {f"engine -> {b}": where[:3] for (a, b), where in edges.items() if a == "engine"}
    assert not bad, bad


def test_the_suite_imports_neither_ci_nor_perf(edges):
    bad = {f"conformance -> {b}": where[:5] for (a, b), where in edges.items()
           if a == "conformance" and b in ("ci", "perf")}
    assert not bad, (f"{bad}: move the library code the suite needs into conformance/harness/ (the ci/ or "
                     f"perf/ script keeps its command line and imports it), or run the script as a subprocess")


def test_ci_and_perf_reach_the_suite_only_through_the_harness(files):
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in files if package_of(module_name(p)) in ("ci", "perf")
           for line, name in imported_names(p)
           if package_of(name) == "conformance" and not (name + ".").startswith("conformance.harness.")]
    assert not bad, bad


def test_no_module_imports_a_test_module(files):
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in files for line, name in imported_names(p)
           if package_of(name) is not None and is_test_module(name)]
    assert not bad, (f"{bad}: what tests share goes into conformance/harness/, shared fixtures into a "
                     f"conftest.py")
