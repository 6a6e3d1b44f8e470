"""Brass: GGUF LLM inference, numpy reference backend and CUDA backend."""

__version__ = "0.1.0"
