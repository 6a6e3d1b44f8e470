"""Per-sequence caches on the backend's device.

`KVCache` (contiguous; a backend without paged_kv): per attention layer a float16 `[n_ctx, H_kv, Dh]` array for keys and one for values
(H_kv and Dh of that layer: gemma4's sliding-window and full layers differ); the slot of a
token is its position.

`RecurrentState`: per recurrent (gated delta-net) layer of a hybrid model, the state that
replaces a KV cache there: the conv1d's last K-1 inputs `[K-1, C]` and the delta rule's matrix
per value head `[Hv, D, D]`, both float32 as llama.cpp keeps them (its `cache_r_l*` /
`cache_s_l*`, same layouts). It does not grow with the context, and it cannot be rewound: going
back to position 0 (`reset`) zeroes it, and there is no going back to any other position.
Every array has a leading sequence axis, so a batched decode can hold one state per sequence in
the same arrays; a session uses sequence 0.

`BlockPool` and `PagedKVCache` (the numpy and CUDA backends', and a server's shared pool): keys
and values in blocks of BLOCK_TOKENS positions, a block table per sequence, reference counts,
and cached prompt blocks found by the chain hash of their tokens (docs/design.md, "The paged KV
cache"; engine/prefix_cache.py uses them for prefix caching). On a backend that keeps block
tables on its device (`block_table`: CUDA, whose kernels read keys and values through them,
kernels/common.cuh kv_row) each sequence's table has a device copy of fixed size and address,
rewritten in place whenever the table changes: a captured graph that reads it follows the
sequence's blocks.
"""

import hashlib
from collections import OrderedDict

import numpy as np

from .errors import BrassError


class RecurrentState:
    def __init__(self, backend, cfg, n_seq: int = 1):
        self.layers = [il for il in range(cfg.n_layer) if cfg.is_recurrent(il)]
        K1, C = cfg.ssm_d_conv - 1, cfg.ssm_conv_channels
        Hv, D = cfg.ssm_dt_rank, cfg.ssm_d_state
        self.conv = {il: backend.zeros((n_seq, K1, C), np.float32) for il in self.layers}
        self.ssm = {il: backend.zeros((n_seq, Hv, D, D), np.float32) for il in self.layers}

    def layer(self, il: int, seq: int = 0):
        """(conv state `[K-1, C]`, delta state `[Hv, D, D]`) of layer `il`: views the ops
        update in place."""
        return self.conv[il][seq], self.ssm[il][seq]

    def reset(self, seq: int | None = None):
        """Zero the state of one sequence (None: all), as llama.cpp starts a new sequence."""
        for a in list(self.conv.values()) + list(self.ssm.values()):
            if seq is None:
                a[...] = 0
            else:
                a[seq] = 0

    def copy_from(self, src: "RecurrentState"):
        """Every sequence's state from `src` (of the same model and sequence count)."""
        for il in self.layers:
            self.conv[il][...] = src.conv[il]
            self.ssm[il][...] = src.ssm[il]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in list(self.conv.values()) + list(self.ssm.values()))


class KVCache:
    """One sequence's cache. Hybrid models (`cfg.recurrent_layers`) hold keys and values only
    for their attention layers, and a RecurrentState (`recurrent`) for the others."""

    def __init__(self, backend, cfg, n_ctx: int):
        self.n_ctx = n_ctx
        kv = [not cfg.is_recurrent(il) for il in range(cfg.n_layer)]
        # KV heads and head sizes per layer (gemma4's differ between its layer kinds)
        self.k = [backend.zeros((n_ctx, cfg.layer_n_head_kv(il), cfg.layer_head_dim(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.v = [backend.zeros((n_ctx, cfg.layer_n_head_kv(il), cfg.layer_head_dim_v(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.recurrent = RecurrentState(backend, cfg) if not all(kv) else None

    def layer(self, il: int):
        return self.k[il], self.v[il]

    @staticmethod
    def nbytes_for(cfg, n_ctx: int) -> int:
        """The device bytes of the keys and values of a cache of n_ctx slots (its recurrent
        state aside), without allocating it."""
        return sum(2 * n_ctx * cfg.layer_n_head_kv(il) * (cfg.layer_head_dim(il) + cfg.layer_head_dim_v(il))
                   for il in range(cfg.n_layer) if not cfg.is_recurrent(il))

    def reset(self):
        """Back to an empty sequence: the KV slots are rewritten as positions are reached
        again, the recurrent state must start from zero."""
        if self.recurrent is not None:
            self.recurrent.reset()

    def copy_prefix(self, src: "KVCache", n: int):
        """Slots 0 .. n - 1 of every layer's keys and values, and the recurrent state, from
        `src` (a cache of the same model and size): a sequence's first n positions as read
        there (engine/model.py StartStep)."""
        for dst_l, src_l in zip(self.k + self.v, src.k + src.v):
            if dst_l is not None:
                dst_l[:n] = src_l[:n]
        if self.recurrent is not None:
            self.recurrent.copy_from(src.recurrent)

    @property
    def nbytes(self) -> int:
        kv = sum(a.nbytes for a in self.k + self.v if a is not None)
        return kv + (self.recurrent.nbytes if self.recurrent is not None else 0)


# -- the paged cache ------------------------------------------------------------------------------
# Tokens per KV block. Small enough that sharing loses little (a sequence's reusable prefix is
# cut to a multiple of it, and its last block is on average half empty), large enough that a
# block table stays short (4,096 positions: 256 entries) and a gather moves runs of
# BLOCK_TOKENS rows at once. 16 is vLLM's default for the same trade-off.
BLOCK_TOKENS = 16


def blocks_for(n_tokens: int, block: int = BLOCK_TOKENS) -> int:
    """Blocks that hold n_tokens positions."""
    return -(-max(n_tokens, 0) // block)


class PoolExhausted(BrassError):
    """The block pool has fewer free or evictable blocks than asked for."""


class BlockPool:
    """One model's pool of KV blocks: per attention layer a float16 `[n_blocks, BLOCK_TOKENS,
    H_kv, Dh]` array for keys and one for values (the layer's own H_kv and Dh), shared by every
    sequence that holds a PagedKVCache over it.

    The allocator: each block has a reference count (the sequences whose tables hold it). A
    block nobody holds is either free or cached: a cached block keeps the keys and values of a
    prompt's full block, found by `lookup(key, tokens)` (key: block_key's chain hash), until
    `allocate` needs its room (least recently released first). A cached block may carry a
    recurrent-state snapshot (`snapshots`: a hybrid model's state after the block's last
    token); it goes when the block does."""

    def __init__(self, backend, cfg, n_blocks: int, block: int = BLOCK_TOKENS):
        if n_blocks < 1:
            raise BrassError(f"a KV block pool needs at least one block, not {n_blocks}")
        self.n_blocks, self.block = n_blocks, block
        self.backend, self.cfg = backend, cfg
        kv = [not cfg.is_recurrent(il) for il in range(cfg.n_layer)]
        self.k = [backend.zeros((n_blocks, block, cfg.layer_n_head_kv(il), cfg.layer_head_dim(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.v = [backend.zeros((n_blocks, block, cfg.layer_n_head_kv(il), cfg.layer_head_dim_v(il)),
                                np.float16) if has else None for il, has in enumerate(kv)]
        self.ref = np.zeros(n_blocks, np.int64)
        # free blocks, the last released taken first: a pool sized for many sequences touches
        # (and, on the host, commits the memory of) only as many blocks as were in use at once
        self._free: list[int] = list(range(n_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()     # ref 0, hashed; oldest first
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._tokens_of: dict[int, tuple] = {}
        self.snapshots: dict[int, tuple] = {}
        self.evictions = 0

    @staticmethod
    def block_bytes(cfg, block: int = BLOCK_TOKENS) -> int:
        """The bytes of one block over every attention layer (keys and values, float16)."""
        return sum(2 * block * cfg.layer_n_head_kv(il) * (cfg.layer_head_dim(il) + cfg.layer_head_dim_v(il))
                   for il in range(cfg.n_layer) if not cfg.is_recurrent(il))

    # -- counts ----------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """{"used": held by a sequence, "cached": free to take but holding a prompt's block,
        "free": holding nothing}; the three add up to n_blocks."""
        return {"used": int((self.ref > 0).sum()), "cached": len(self._cached), "free": len(self._free)}

    def available(self) -> int:
        return len(self._free) + len(self._cached)

    # -- the allocator ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for one sequence (reference count 1): free ones first, then cached ones,
        least recently released first (their hashes and snapshots are forgotten). Raises
        PoolExhausted, taking nothing, when fewer than n are free or cached."""
        if n > self.available():
            raise PoolExhausted(f"{n} KV blocks wanted, {self.available()} free of {self.n_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                self._forget(b)
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def share(self, b: int):
        """One more holder of block b (a cached block leaves the free-to-take list)."""
        if self.ref[b] == 0:
            if b not in self._cached:
                raise BrassError(f"KV block {b} is neither held nor cached")
            del self._cached[b]
        self.ref[b] += 1

    def release(self, blocks: list[int]):
        """One holder fewer of each block; a block nobody holds becomes cached (if a prompt's
        block was registered in it) or free."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise BrassError(f"KV block {b} released more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    # -- the prefix index ------------------------------------------------------------------------
    def register(self, b: int, key: bytes, tokens) -> bool:
        """Make block b (held, full) findable by `key`. False when the key already names
        another block (two sequences read the same prefix at once: the first one's block
        stays the cached one) or b is registered already."""
        if key in self._by_key or b in self._key_of:
            return False
        self._by_key[key], self._key_of[b], self._tokens_of[b] = b, key, tuple(tokens)
        return True

    def lookup(self, key: bytes, tokens) -> int | None:
        """The block registered under `key` whose tokens are `tokens` (a hash collision finds
        none), cached or held; None if there is none."""
        b = self._by_key.get(key)
        if b is None or self._tokens_of[b] != tuple(tokens):
            return None
        return b

    def registered(self, b: int) -> bool:
        return b in self._key_of

    def _forget(self, b: int):
        key = self._key_of.pop(b, None)
        if key is not None:
            del self._by_key[key]
            del self._tokens_of[b]
        self.snapshots.pop(b, None)

    def clear_cache(self):
        """Forget every cached block (they become free); held blocks keep their hashes."""
        while self._cached:
            b, _ = self._cached.popitem()
            self._forget(b)
            self._free.append(b)


def _on(array, index: np.ndarray):
    """`index` (host integers) where `array` is: a device array is indexed by a device array."""
    if isinstance(array, np.ndarray):
        return index
    import cupy
    return cupy.asarray(index)


def block_key(prev: bytes, tokens) -> bytes:
    """The chain hash of a full block: its tokens and the key of the block before it (b"" for
    the first), so a key names the whole prefix up to the block's end."""
    return hashlib.blake2b(prev + np.asarray(tokens, "<i4").tobytes(), digest_size=16).digest()


class BlockTable:
    """A sequence's block ids in position order, and its n_ctx: what its PagedKVCache and the
    cache's layers share (the layers hold this, not the cache: no reference cycle, so a cache
    is freed as soon as it is dropped)."""

    __slots__ = ("table", "n_ctx", "device")

    def __init__(self, n_ctx: int):
        self.table, self.n_ctx = np.zeros(0, np.int64), n_ctx
        self.device = None      # the device copy (int32, a block of room at least; -1 past the table)


class PagedLayer:
    """One layer's keys (or values) of a sequence in a block pool: the pool's array for the
    layer and the sequence's block table (read when an op runs, so a captured step follows a
    table that changes)."""

    def __init__(self, pool_array, cache: BlockTable):
        self.pool, self.cache = pool_array, cache

    @property
    def table(self) -> np.ndarray:
        return self.cache.table

    @property
    def block(self) -> int:
        return self.pool.shape[1]

    @property
    def shape(self) -> tuple:
        """As a contiguous cache of the sequence's n_ctx slots would be."""
        return (self.cache.n_ctx, *self.pool.shape[2:])

    def slots(self, pos):
        """(blocks, offsets) of positions `pos`; a position past the table is an error."""
        pos = np.asarray(pos)
        nb = pos // self.block
        if pos.size and int(nb.max()) >= len(self.table):
            raise BrassError(f"position {int(pos.max())} is past the {len(self.table)} KV blocks "
                             f"this sequence holds")
        return self.table[nb], pos % self.block

    def gather(self, n: int):
        """Slots 0 .. n - 1 as one contiguous `[n, H_kv, Dh]` array (a copy)."""
        nb = blocks_for(n, self.block)
        if nb > len(self.table):
            raise BrassError(f"{n} positions are past the {len(self.table)} KV blocks this "
                             f"sequence holds")
        return self.pool[_on(self.pool, self.table[:nb])].reshape(nb * self.block, *self.pool.shape[2:])[:n]

    def __getitem__(self, index):
        """`[:n]` as a contiguous cache's slice reads (a copy)."""
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            return self.gather(self.cache.n_ctx if index.stop is None else index.stop)
        raise TypeError("a paged layer reads slices [:n] only")


class PagedKVCache:
    """One sequence's cache in a BlockPool: its block table (`table`, block ids in position
    order: position p is slot p % BLOCK_TOKENS of block table[p // BLOCK_TOKENS]) and, for a
    hybrid model, its own RecurrentState (`recurrent`: not per token, so not in blocks).
    `n_ctx` bounds its positions as a contiguous cache's size does. A cache made by `private`
    owns a pool of just its blocks (a session of its own, `Model.new_session`); one over a
    shared pool (a server's) holds the blocks `assign` gives it until `release`."""

    def __init__(self, pool: BlockPool, n_ctx: int):
        self.pool = pool
        self._t = BlockTable(n_ctx)
        make = getattr(pool.backend, "block_table", None)
        if make is not None:
            self._t.device = make(max(1, blocks_for(n_ctx)))
        self.keys: list[bytes] = []     # chain keys of the prompt's full blocks (prefix_cache)
        cfg = pool.cfg
        self.recurrent = (RecurrentState(pool.backend, cfg)
                          if any(cfg.is_recurrent(il) for il in range(cfg.n_layer)) else None)
        self._layers = [(PagedLayer(k, self._t), PagedLayer(v, self._t)) if k is not None
                        else (None, None) for k, v in zip(pool.k, pool.v)]

    @property
    def table(self) -> np.ndarray:
        return self._t.table

    @table.setter
    def table(self, value):
        self._check_fits(value)
        self._t.table = value
        if self._t.device is not None:
            self.pool.backend.write_block_table(self._t.device, value)

    @property
    def n_ctx(self) -> int:
        return self._t.n_ctx

    def follow(self, other: "PagedKVCache", staging: np.ndarray | None = None):
        """Take `other`'s block table as this cache's, its blocks not counted as held here (a
        graph's cache replayed for a session: model.ContinueStep). The device copy goes
        through `staging` (pinned, the device table's length) by the backend's upload_async,
        as a copy from pageable memory may wait for the stream; returns the function that waits
        until the copy has read `staging` (call it before rewriting it)."""
        self._check_fits(other.table)
        self._t.table = other.table
        if self._t.device is None:
            return lambda: None
        staging[:] = -1
        staging[:len(other.table)] = other.table
        return self.pool.backend.upload_async(self._t.device, staging)

    def _check_fits(self, table):
        if len(table) > max(1, blocks_for(self.n_ctx)):
            raise BrassError(f"{len(table)} KV blocks for a sequence of {self.n_ctx} positions")

    @property
    def device_table(self):
        """The device copy of the block table (None on a backend without one)."""
        return self._t.device

    @classmethod
    def private(cls, backend, cfg, n_ctx: int) -> "PagedKVCache":
        pool = BlockPool(backend, cfg, max(1, blocks_for(n_ctx)))
        c = cls(pool, n_ctx)
        c.assign(pool.allocate(pool.n_blocks))
        return c

    @property
    def k(self) -> list:
        return [kv[0] for kv in self._layers]

    @property
    def v(self) -> list:
        return [kv[1] for kv in self._layers]

    def layer(self, il: int):
        return self._layers[il]

    def check_room(self, n: int):
        """Raise unless positions 0 .. n - 1 have blocks (checked on the host before a step: a
        device kernel cannot raise, and CUDA's cache writes skip a position without one)."""
        if n > len(self.table) * self.pool.block:
            raise BrassError(f"position {n - 1} is past the {len(self.table)} KV blocks this "
                             f"sequence holds")

    def assign(self, blocks: list[int]):
        """Take these blocks (already counted as held by this cache) as the table."""
        self.table = np.asarray(blocks, np.int64)

    def release(self):
        """Give the table's blocks back to the pool (the table is then empty)."""
        blocks, self.table = [int(b) for b in self.table], np.zeros(0, np.int64)
        self.pool.release(blocks)

    def reset(self):
        """Back to an empty sequence (the blocks stay; a recurrent state is zeroed)."""
        if self.recurrent is not None:
            self.recurrent.reset()

    def copy_prefix(self, src, n: int):
        """Positions 0 .. n - 1 of every layer, and the recurrent state, from `src` (a cache of
        the same model: paged or contiguous)."""
        pos = np.arange(n)
        for (dk, dv), il in zip(self._layers, range(len(self._layers))):
            if dk is None:
                continue
            sk, sv = src.layer(il)
            for d, s in ((dk, sk), (dv, sv)):
                blocks, off = d.slots(pos)
                d.pool[_on(d.pool, blocks), _on(d.pool, off)] = s[:n]
        if self.recurrent is not None:
            self.recurrent.copy_from(src.recurrent)

    @property
    def nbytes(self) -> int:
        """The device bytes of this sequence's blocks (and its recurrent state)."""
        per_block = sum(a.nbytes // a.shape[0] for a in self.pool.k + self.pool.v if a is not None)
        return per_block * len(self.table) + (self.recurrent.nbytes if self.recurrent is not None else 0)
