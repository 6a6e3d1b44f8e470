"""What the CUDA kernel tests (conformance/kernels/test_kernels*.py) share: the check of a CUDA
result against the reference (no NaN-poisoned element left unwritten, NMSE within the op's
bound), a recorder of the kernels a backend launches, random weights read as a model's are,
and the KV-store-then-attention case that test_kernels.py and test_kernels_gemma4.py run at
their head sizes. The `cuda` and `ref` backends they run on are fixtures
(conformance/kernels/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from brass.gguf import GGMLType, GGUFFile
from conformance.harness.cases import ATTENTION, nmse, random_weight_file

F16, F32 = np.float16, np.float32


def tname(t) -> str:
    return GGMLType(t).name


def check(got, want, bound: float, record_property, what: str = "output") -> float:
    """Compare a CUDA result with the reference: no unwritten (NaN-poisoned) element, NMSE
    within `bound`. Returns the NMSE."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    unwritten = np.isnan(got) & ~np.isnan(want)
    assert not unwritten.any(), (f"{what}: {int(unwritten.sum())} of {got.size} elements are NaN "
                                 f"(never written?), first at {np.argwhere(unwritten)[0].tolist()}")
    err = nmse(got, want)
    record_property("nmse", f"{err:.3e}")
    if not err <= bound:
        diff = np.abs(got.astype(np.float64) - want)
        i = np.unravel_index(int(np.nanargmax(diff)), diff.shape)
        where = ""
        if diff.ndim == 2:      # [token, row]: which rows and tokens are off (a tile edge?)
            off = diff > 1e-3 * np.abs(want).max()
            rows, toks = np.nonzero(off.any(axis=0))[0], np.nonzero(off.any(axis=1))[0]
            where = (f"; rows off: {rows[:16].tolist()} ({rows.size}), tokens off: "
                     f"{toks[:16].tolist()} ({toks.size})")
        pytest.fail(f"{what}: NMSE {err:.3e} exceeds {bound:.0e}; largest difference at {list(i)}: "
                    f"got {got[i]!r}, expected {want[i]!r}{where}")
    return err


def record_launches(cuda, monkeypatch) -> list[str]:
    """The names of the kernels `cuda` launches from now on (for the test's duration)."""
    launched = []
    real_launch = cuda.launch

    def counting(source, name, *args, **kw):
        launched.append(name)
        return real_launch(source, name, *args, **kw)

    monkeypatch.setattr(cuda, "launch", counting)
    return launched


def weights(tmp_path, rng, specs):
    return GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, specs))


def kv_store_and_attention(cuda, ref, rng, case, record_property):
    """One attention case (T queries, past tokens already cached, H, H_kv, head_dim, window,
    scale or None = 1/sqrt(Dh)): the new keys and values stored into F16 caches bit for bit as
    the reference stores them, then attention over the caches within the attention bound."""
    T, past, H, Hkv, Dh, window, scale = case
    scale = 1.0 / np.sqrt(Dh) if scale is None else scale
    cap = past + T + 5
    # The past is random; slots never written hold NaN, so a write or read outside the
    # visible range shows.
    caches = []
    for _ in range(2):
        c = np.full((cap, Hkv, Dh), np.nan, F16)
        c[:past] = rng.uniform(-1, 1, (past, Hkv, Dh)).astype(F16)
        caches.append(c)
    k_new, v_new = (rng.uniform(-1, 1, (T, Hkv, Dh)).astype(F32) for _ in range(2))
    pos = np.arange(past, past + T, dtype=np.int32)
    q = rng.uniform(-1, 1, (T, H, Dh)).astype(F32)

    ref_k, ref_v = caches[0].copy(), caches[1].copy()
    ref.kv_store(ref_k, k_new, pos)
    ref.kv_store(ref_v, v_new, pos)
    # the CUDA backend's caches are paged: the sequence's blocks out of order in a pool
    from conformance.harness.attn_host import device_sequence, read_back
    dev_k, dev_v = device_sequence(cuda, rng, caches[0], caches[1])
    dev_pos = cuda.asarray(pos)
    cuda.kv_store(dev_k, cuda.asarray(k_new), dev_pos)
    cuda.kv_store(dev_v, cuda.asarray(v_new), dev_pos)
    for got, want in ((dev_k, ref_k), (dev_v, ref_v)):
        assert np.array_equal(read_back(cuda, got).view(np.uint16), want.view(np.uint16)), \
            "the F16 cache differs (a wrong slot, a wrong rounding, or a write past the new slots)"

    got = cuda.to_numpy(cuda.attention(cuda.asarray(q), dev_k, dev_v, dev_pos, scale, window))
    want = ref.attention(q, ref_k, ref_v, pos, scale, window)
    check(got, want, ATTENTION, record_property)
