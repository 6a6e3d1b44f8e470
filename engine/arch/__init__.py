"""Architecture registry: GGUF `general.architecture` → the module that builds its forward pass.

Adding an architecture means adding one file here with `configure(cfg, gf)` and
`forward(f, ids, out_rows)`, and one line below. A module that runs only on some backends says
which in `BACKENDS` (default: all)."""

import importlib

from ..errors import UnsupportedError

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "gemma3": "gemma3",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35moe",
    "gemma4": "gemma4",
}


def get(arch: str):
    mod = ARCHITECTURES.get(arch)
    if mod is None:
        raise UnsupportedError(f"architecture {arch!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return importlib.import_module(f"{__name__}.{mod}")


def backends(arch: str) -> tuple[str, ...]:
    """The backends that run architecture `arch`."""
    from ..backends import BACKENDS
    return getattr(get(arch), "BACKENDS", BACKENDS)
