"""CUDA C kernel sources (*.cu, *.cuh), compiled at run time by engine.backends.cuda.compiler,
and the host-side description of their parameter structs (params.py)."""
