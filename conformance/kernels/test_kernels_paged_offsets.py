"""Pool offsets past 2^31 elements: the kernels that reach a cache through its block table write
and read a sequence in a pool's top blocks (past 2^31 halves of a layer's pool) as they do
in a small pool's low blocks, bit for bit, on the CPU builds of the kernels
(conformance/harness/paged_offsets.py says why and how); the GPU test does the same through the
CUDA backend with device pools of that size.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from brass.backends import cuda_available
from conformance.harness import paged_offsets as po
from conformance.harness.mmq_host import NoHostCompiler

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kernel", list(po.CHECKS))
def test_top_blocks_of_a_big_pool_on_the_cpu(kernel):
    try:
        from conformance.harness import attn_host, fused_host
        attn_host.build_rowwise(), attn_host.build(), fused_host.build()
    except (NoHostCompiler, RuntimeError) as e:
        pytest.skip(f"no CPU build of the kernels: {e}")
    # a process of its own: a wrapped negative offset crashes it, which must fail this test only
    r = subprocess.run([sys.executable, "-m", "conformance.harness.paged_offsets", kernel], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        f"{kernel} (exit {r.returncode}{', killed by signal %d' % -r.returncode if r.returncode < 0 else ''}):\n"
        f"{r.stdout}{r.stderr[-2000:]}")


# Device memory the GPU test needs: two pools of 2^31 halves (4 GiB each), and room beside them.
GPU_BYTES = 2 * (po.HIGH + 8) * po.KV_BLOCK * po.ROW * 2 + (1 << 30)


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device here: the GPU runner runs it "
                                                 "(ci/gpu.sh paged tests)")
def test_cuda_top_blocks_of_a_big_pool():
    """On the GPU: rope_store and kv_store (one sequence, a batched step's rows) and attention
    (tiled, one-block, split-K; one sequence and rows) over sequences in the top blocks of two
    4 GiB device pools give what they give over the same values in small pools' low blocks,
    bit for bit, and write nothing into the big pools' low blocks."""
    import cupy

    from brass.backends.cuda import CudaBackend
    from brass.kv_cache import BlockTable, PagedLayer
    b = CudaBackend()
    if b.free_memory() < GPU_BYTES:
        pytest.skip(f"{b.free_memory() >> 20} MiB free on the device, {GPU_BYTES >> 20} MiB needed")
    rng = np.random.default_rng(0)
    ks, vs, _, _ = po.pools(rng)            # the small pools (host); the big ones are made below
    n = ks.shape[0]
    T, scale = 5, float(1 / np.sqrt(po.D))
    q = rng.uniform(-1, 1, (T, po.H, po.D)).astype(np.float32)
    kx = rng.uniform(-1, 1, (T, po.HKV, po.D)).astype(np.float32)
    vx = rng.uniform(-1, 1, (T, po.HKV, po.D)).astype(np.float32)
    rope = dict(q_norm=None, k_norm=None, eps=1e-6, n_rot=po.D, base=10000.0, neox=True)

    def run(offset):
        """Every op's outputs, the sequences' blocks and the pools' low blocks, with the
        sequences' blocks at TABLES + offset of pools of offset + n blocks."""
        with b.activate():
            pools = []
            for host in (ks, vs):
                d = cupy.zeros((offset + n, po.KV_BLOCK, po.HKV, po.D), np.float16)
                d[offset:] = cupy.asarray(host)
                pools.append(d)
            seqs = []
            for row in po.TABLES:
                t = BlockTable(po.CAP)
                t.table = (row + offset).astype(np.int64)
                t.device = cupy.asarray(t.table.astype(np.int32))
                seqs.append((PagedLayer(pools[0], t), PagedLayer(pools[1], t)))
            (k0, v0), (k1, _) = seqs
            dq, dk, dv = b.asarray(q), b.asarray(kx), b.asarray(vx)
            pos, rows = b.asarray(np.arange(40, 40 + T, dtype=np.int32)), b.asarray(np.array([44, 30], np.int32))
            got = list(b.rope_store(dq, dk, dv, pos, k0, v0, **rope))
            got.append(b.attention(dq, k0, v0, pos, scale))                  # tiled (T >= 2)
            for split in (False, True):                                     # one-block, split-K
                b.options.attn_split = split
                got.append(b.attention(dq[-1:], k0, v0, pos[-1:], scale))   # a decode step
                # a batched step (its rows' tables are gathered per step: rows_independent)
                with b.rows_independent():
                    got += b.rope_store_rows(dq[:2], dk[:2], dv[:2], rows, seqs, **rope)
                    got.append(b.attention_rows(dq[:2], seqs, rows, scale))
            b.options.attn_split = None
            b.kv_store(k1, dk[:3], b.asarray(np.array([47, 3, 21], np.int32)))
            blocks = [b.to_numpy(p[cupy.asarray(po.TABLES.reshape(-1) + offset)]) for p in pools]
            low = [b.to_numpy(p[:n]) if offset else None for p in pools]
            return [b.to_numpy(x) for x in got], blocks, low

    try:
        small, big = run(0), run(po.HIGH)
    finally:    # the 8 GiB go back to the device, not to this process's pool (other workers share it)
        b.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
    for i, (x, y) in enumerate(zip(small[0], big[0])):
        assert np.isfinite(x).all() and np.array_equal(x, y), f"output {i}: the top blocks' run differs"
    for i, (x, y) in enumerate(zip(small[1], big[1])):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16)), f"pool {i}: the top blocks differ"
    assert not any(x.any() for x in big[2]), "a write landed in the big pools' low blocks"
