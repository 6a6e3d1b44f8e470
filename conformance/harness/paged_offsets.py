"""Block tables that name blocks past 2^31 elements of a layer's pool: the kernels that reach a
cache through its table (attention.cu's kv_store, attention and split-K kernels,
attention_tiled.cu, fused.cu's rope_store) run on the CPU builds of the kernel harnesses
(attn_host.py, fused_host.py) over a pool whose sequence sits in its top blocks, and must
write and read exactly what they do over a small pool holding the same values in its low
blocks.

Why: a server's block pool holds every sequence's keys of a layer in one array, [n_blocks,
KV_BLOCK, H_kv, D] halves. 128 sequences of 4,096 tokens of a model with 32 KV heads of 128
(Llama-2-7B's) are 2^31 halves a layer: a slot's offset computed in 32 bits there wraps to a
negative or a small index, a write lands outside the pool or in another sequence's block.
The kernels compute the offsets in 64 bits (common.cuh kv_row and its callers); this keeps
them so.

The big pools are np.zeros of 4 GiB each: the system hands their pages out only when touched,
so the process holds the few blocks used, not the pools. A 32-bit offset shows as a wrong
value, a write into the pool's low blocks, or a crash (a wrapped negative offset): the test
runs this module in a process of its own (`python3 -m conformance.harness.paged_offsets`),
which prints one line per kernel and `ok` at the end, and dies of the signal otherwise.
"""

from __future__ import annotations

import sys

import numpy as np

KV_BLOCK = 16                   # common.cuh KV_BLOCK
H, HKV, D = 2, 1, 64            # a synthetic model's head shape (attention_tiled_64_64 exists)
ROW = HKV * D                   # halves a slot
HIGH = 2**31 // (KV_BLOCK * ROW)     # the first block whose first half is at offset 2^31
TABLES = np.array([[5, 1, 3], [2, 6, 0]], np.int32)     # two sequences' blocks, out of order
CAP = TABLES.shape[1] * KV_BLOCK    # each sequence's slots


def pools(rng):
    """(small k, small v, big k, big v): the small pools hold TABLES' blocks, the big ones the
    same values at HIGH + TABLES (every other block zero, its pages never touched)."""
    n = int(TABLES.max()) + 1
    small = [rng.uniform(-1, 1, (n, KV_BLOCK, HKV, D)).astype(np.float16) for _ in range(2)]
    big = [np.zeros((HIGH + n, KV_BLOCK, HKV, D), np.float16) for _ in range(2)]
    for s, b in zip(small, big):
        b[HIGH + TABLES.reshape(-1)] = s[TABLES.reshape(-1)]
    return small[0], small[1], big[0], big[1]


def same_blocks(small, big, what: str) -> list[str]:
    """Differences between the small pool's TABLES blocks and the big pool's HIGH + TABLES,
    and anything written into the big pool's low blocks (a wrapped offset's landing place)."""
    out = []
    if not np.array_equal(small[TABLES].view(np.uint16), big[HIGH + TABLES].view(np.uint16)):
        out.append(f"{what}: the top blocks differ from the low blocks' run")
    if big[:int(TABLES.max()) + 1].any():
        out.append(f"{what}: something was written into the big pool's low blocks")
    return out


def written(pool, table, pos, rows, what: str) -> list[str]:
    """Whether the small pool holds `rows` (as float16) at positions `pos` through `table`."""
    at = pool[table[pos // KV_BLOCK], pos % KV_BLOCK]
    if not np.array_equal(at.view(np.uint16), np.asarray(rows, np.float16).reshape(at.shape).view(np.uint16)):
        return [f"{what}: the small pools' run did not write its slots"]
    return []


def same(a, b, what: str) -> list[str]:
    """a (over the small pools) and b (over the big ones) bit for bit, a all finite (a run
    that wrote nothing would leave the outputs' NaN poison on both sides)."""
    a, b = np.asarray(a), np.asarray(b)
    if not np.isfinite(a).all():
        return [f"{what}: the small pools' run left non-finite outputs"]
    if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        return [f"{what}: the top blocks' output differs from the low blocks' (max |diff| "
                f"{np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g})"]
    return []


def _aligned(a: np.ndarray) -> np.ndarray:
    """A copy of a with a 64-byte aligned base (the tiled kernel reads 16-byte vectors)."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def check_kv_store(rng) -> list[str]:
    from conformance.harness import attn_host
    lib = attn_host.build_rowwise()
    ks, _, kb, _ = pools(rng)
    x = rng.uniform(-1, 1, (4, HKV, D)).astype(np.float32)
    pos = np.array([40, 3, 47, 21], np.int32)
    attn_host.kv_store(lib, ks, x, pos, TABLES[0], CAP)
    attn_host.kv_store(lib, kb, x, pos, HIGH + TABLES[0], CAP)
    return written(ks, TABLES[0], pos, x, "kv_store") + same_blocks(ks, kb, "kv_store")


def check_rope_store(rng) -> list[str]:
    from brass.backends.cuda.params import pack
    from conformance.harness import fused_host
    lib = fused_host.build()
    out = []
    for per_row in (0, 1):
        ks, vs, kb, vb = pools(rng)
        T = 2
        q = rng.uniform(-1, 1, (T, H, D)).astype(np.float32)
        k = rng.uniform(-1, 1, (T, HKV, D)).astype(np.float32)
        v = rng.uniform(-1, 1, (T, HKV, D)).astype(np.float32)
        pos = np.array([45, 17], np.int32)
        params = pack("RopeStoreParams", n_tokens=T, n_heads=H, n_kv_heads=HKV, head_dim=D, head_dim_v=D,
                      n_rot=D, theta_scale=np.float32(10000.0 ** (-2.0 / D)), freq_scale=1.0, neox=1,
                      q_norm=0, k_norm=0, eps=1e-6, capacity=CAP, write_k=1, per_row=per_row,
                      table_stride=TABLES.shape[1])
        tables = TABLES if per_row else TABLES[:1]
        a = fused_host.rope_store_raw(lib, q, k, v, pos, ks, vs, tables, params)
        b = fused_host.rope_store_raw(lib, q, k, v, pos, kb, vb, HIGH + tables, params)
        what = f"rope_store (per_row {per_row})"
        for t in range(T):
            table = tables[t if per_row else 0]
            out += written(ks, table, pos[t:t + 1], a[1][t], what + " keys")
            out += written(vs, table, pos[t:t + 1], v[t], what + " values")
        out += same(a[1], b[1], what) + same_blocks(ks, kb, what + " keys") + same_blocks(vs, vb, what + " values")
    return out


def check_attention(rng) -> list[str]:
    """The one-block kernel (a decode step, a few queries, a batched step's rows) and the
    split-K kernels, both attention.cu's."""
    from conformance.harness import attn_host
    lib = attn_host.build_rowwise()
    ks, vs, kb, vb = pools(rng)
    out = []
    scale = float(1 / np.sqrt(D))
    for T, p0 in ((1, 45), (3, 40)):
        q = rng.uniform(-1, 1, (T, H, D)).astype(np.float32)
        pos = np.arange(p0, p0 + T, dtype=np.int32)
        a = attn_host._run_rowwise(lib, q, ks, vs, pos, TABLES[0], CAP, scale, 0, 0)
        b = attn_host._run_rowwise(lib, q, kb, vb, pos, HIGH + TABLES[0], CAP, scale, 0, 0)
        out += same(a[0], b[0], f"attention T={T}")
        a = attn_host._run_split(lib, q, ks, vs, pos, TABLES[0], CAP, scale, 0, 0, np.random.default_rng(1),
                                 None, None)
        b = attn_host._run_split(lib, q, kb, vb, pos, HIGH + TABLES[0], CAP, scale, 0, 0,
                                 np.random.default_rng(1), None, None)
        out += same(a[0], b[0], f"attention_split T={T}")
    q = rng.uniform(-1, 1, (2, H, D)).astype(np.float32)      # a batched step: a row a sequence
    pos = np.array([44, 30], np.int32)
    stride = TABLES.shape[1]
    a = attn_host._run_rowwise(lib, q, ks, vs, pos, TABLES, CAP, scale, 0, stride)
    b = attn_host._run_rowwise(lib, q, kb, vb, pos, HIGH + TABLES, CAP, scale, 0, stride)
    out += same(a[0], b[0], "attention per_row")
    a = attn_host._run_split(lib, q, ks, vs, pos, TABLES, CAP, scale, 0, stride, np.random.default_rng(1),
                             None, None)
    b = attn_host._run_split(lib, q, kb, vb, pos, HIGH + TABLES, CAP, scale, 0, stride,
                             np.random.default_rng(1), None, None)
    out += same(a[0], b[0], "attention_split per_row")
    return out


def check_attention_tiled(rng) -> list[str]:
    from conformance.harness import attn_host
    lib = attn_host.build()
    ks, vs, kb, vb = pools(rng)
    T = 5
    q = _aligned(rng.uniform(-1, 1, (T, H, D)).astype(np.float32))
    pos = np.arange(40, 40 + T, dtype=np.int32)
    scale = float(1 / np.sqrt(D))
    got = []
    for k, v, table in ((ks, vs, TABLES[0]), (kb, vb, HIGH + TABLES[0])):
        assert k.ctypes.data % 16 == 0 and v.ctypes.data % 16 == 0, "the pools' 16-byte loads"
        table = np.ascontiguousarray(table, np.int32)
        o = _aligned(np.full((T, H * D), np.nan, np.float32))
        oq = _aligned(np.full((T, H * D // 32, 36), 0xFF, np.uint8))
        if lib.run_attn(D, D, q.ctypes.data, k.ctypes.data, v.ctypes.data, pos.ctypes.data, table.ctypes.data,
                        o.ctypes.data, oq.ctypes.data, T, H, HKV, CAP, 0, scale, 1):
            raise RuntimeError(f"no tiled attention kernel for head dims {D}/{D}")
        got.append(o)
    return same(got[0], got[1], "attention_tiled")


CHECKS = {"kv_store": check_kv_store, "rope_store": check_rope_store, "attention": check_attention,
          "attention_tiled": check_attention_tiled}


def main(argv: list[str]) -> int:
    names = argv or list(CHECKS)
    failed = []
    for name in names:
        got = CHECKS[name](np.random.default_rng(0))
        print(f"{name}: {'; '.join(got) if got else 'same'}", flush=True)
        failed += got
    print("FAIL" if failed else "ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
