"""Brass: GGUF LLM inference, numpy reference backend and CUDA backend.

`engine.load(model, backend=...)` opens a model; see engine/model.py. Submodules import lazily
so that `import engine.gguf` (or the catalog) stays light.
"""

__version__ = "0.1.0"
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
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
