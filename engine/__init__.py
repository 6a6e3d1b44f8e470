"""Brass: GGUF LLM inference, numpy reference backend and CUDA backend.

`brass.load(model, backend=...)` opens a model; see model.py. Submodules import lazily
so that `import brass.gguf` (or the catalog) stays light.
"""

__version__ = "0.2.0"
__all__ = ["BrassError", "Model", "SamplingParams", "load"]


def __getattr__(name):
    if name == "BrassError":
        from .errors import BrassError
        return BrassError
    if name in ("Model", "load"):
        from . import model
        return getattr(model, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'brass' has no attribute {name!r}")
