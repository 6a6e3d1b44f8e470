"""Brass: GGUF LLM inference, numpy reference backend and CUDA backend."""

__version__ = "0.1.0"

from .errors import BrassError  # noqa: E402
from .model import Model, load  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["BrassError", "Model", "SamplingParams", "load"]
