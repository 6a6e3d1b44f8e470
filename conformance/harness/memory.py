"""Handing memory back to the system after a test lets go of a model.

A numpy model's weights are float32 arrays of a few MiB to 0.5 GiB. Once glibc's malloc has
freed one array that it had mapped on its own, it raises its mmap threshold (up to 32 MiB), and
the arrays below that land on the heap afterwards; freed, their pages stay in the process
(qwen2.5-coder-0.5b, loaded, run and let go: 827 MiB still resident, 50 MiB after malloc_trim).
An xdist worker that had run the big models then held 2 GiB it did not use beside the next
file's model, which set the suite's peak.

FastAPI keeps the endpoints it has classified (generator or not) in module-level lru_caches
(fastapi.dependencies.models, 0.165), strongly: brass.server.App's routes are closures over its
model, so a test that started an in-process server held that model to the end of the process
(a worker kept 0.7 GiB of smollm2-135m after test_conform.py's server had stopped).
`release_memory` empties those caches: they only save FastAPI a look at each endpoint."""

from __future__ import annotations

import ctypes
import functools
import gc
import sys

_libc = None


def release_memory(collect: bool = True) -> None:
    """Collect the cycles the models and their sessions hold (the forward's closures), then
    return the C heap's free pages to the system (glibc malloc_trim; a no-op elsewhere)."""
    global _libc
    _forget_fastapi_endpoints()
    if collect:
        gc.collect()
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None)
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):      # not glibc: no malloc_trim
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def _forget_fastapi_endpoints() -> None:
    """Empty FastAPI's caches of classified endpoints, where FastAPI is loaded (see above)."""
    models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(models).values() if models is not None else ():
        if isinstance(value, functools._lru_cache_wrapper):
            value.cache_clear()
