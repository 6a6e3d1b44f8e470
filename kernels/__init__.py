"""CUDA C kernel sources (*.cu, *.cuh): package data of brass.kernels, compiled at run time
by brass.backends.cuda.compiler (NVRTC)."""
