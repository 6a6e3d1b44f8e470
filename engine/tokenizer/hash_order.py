"""The order in which llama.cpp's `std::unordered_map<std::string, llama_token>` lists tokens.

llama.cpp finds the end-of-turn and fill-in-the-middle tokens by walking its token map and
taking the first token whose text is on a list (`llama_vocab::impl::load`). When a vocabulary
holds two listed texts (Qwen has both `<|im_end|>` and `<|endoftext|>`), the winner is the one
the hash map lists first. That order is fixed by libstdc++ (GCC 12, which built the reference
llama.cpp): the hash `std::_Hash_bytes` (a MurmurHash2 variant, seed 0xc70f6907), the bucket
counts its prime rehash policy picks, and where a node goes in the map's single linked list.

The list order follows two rules. A node inserted into an empty bucket starts a new group at
the front of the list; a node inserted into a non-empty bucket goes to the front of that
bucket's group. A rehash walks the old list front to back and re-inserts each node by the same
rules. So after any sequence of inserts and rehashes the list is sorted by (time its bucket's
group was started, time the node was placed), both descending, where a rehash re-places every
node in old-list order. That is what `iteration_order` computes, one rehash phase at a time.
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedError

_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = np.uint64(0xC70F6907)
_47 = np.uint64(47)

# (number of the insert that triggers a rehash, bucket count after it), for a map that starts
# empty with max_load_factor 1. Read off libstdc++ 6.0.30 by inserting 20M keys one by one and
# printing bucket_count() whenever it changed.
_REHASHES = (
    (1, 13), (14, 29), (30, 59), (60, 127), (128, 257), (258, 541), (542, 1109), (1110, 2357),
    (2358, 5087), (5088, 10273), (10274, 20753), (20754, 42043), (42044, 85229),
    (85230, 172933), (172934, 351061), (351062, 712697), (712698, 1447153),
    (1447154, 2938679), (2938680, 5967347), (5967348, 12117689), (12117690, 24607243),
)


def hash_bytes(keys: list[bytes]) -> np.ndarray:
    """std::hash<std::string> of each key (std::_Hash_bytes on 64-bit libstdc++)."""
    n = len(keys)
    lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=n)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    flat = np.frombuffer(b"".join(keys) + bytes(8), dtype=np.uint8)
    byte = np.arange(8, dtype=np.int64)

    def load(rows: np.ndarray, offset: np.ndarray) -> np.ndarray:
        return flat[(starts[rows] + offset)[:, None] + byte].copy().view("<u8")[:, 0]

    with np.errstate(over="ignore"):
        h = _SEED ^ (lengths.astype(np.uint64) * _MUL)
        aligned = lengths & ~7
        for chunk in range(0, int(aligned.max(initial=0)), 8):
            rows = np.nonzero(aligned > chunk)[0]
            data = load(rows, np.full(len(rows), chunk)) * _MUL
            data = (data ^ (data >> _47)) * _MUL
            h[rows] = (h[rows] ^ data) * _MUL
        rows = np.nonzero(lengths & 7)[0]
        if len(rows):
            tail = (lengths[rows] & 7).astype(np.uint64)
            data = load(rows, aligned[rows]) & ((np.uint64(1) << (tail * np.uint64(8))) - np.uint64(1))
            h[rows] = (h[rows] ^ data) * _MUL
        h = (h ^ (h >> _47)) * _MUL
        return h ^ (h >> _47)


def iteration_order(keys: list[bytes]) -> np.ndarray:
    """Indices of `keys` (distinct, inserted in order into an empty std::unordered_map) in the
    order the map iterates them."""
    n = len(keys)
    if n > _REHASHES[-1][1]:
        raise UnsupportedError(f"{n} tokens: more than the libstdc++ rehash schedule recorded here")
    hashes = hash_bytes(keys)
    placed = np.empty(n, dtype=np.int64)     # time each node was (re)placed
    order = np.empty(0, dtype=np.int64)
    clock = 0
    for (first, buckets), (following, _) in zip(_REHASHES, _REHASHES[1:] + ((1 << 62, 0),)):
        size = first - 1                      # nodes in the map when this rehash happens
        if size >= n:
            break
        end = min(n, following - 1)           # nodes in the map when the next one happens
        placed[order] = clock + np.arange(size)
        placed[size:end] = clock + size + np.arange(end - size)
        clock += end
        bucket = (hashes[:end] % np.uint64(buckets)).astype(np.int64)
        group = np.full(buckets, np.iinfo(np.int64).max)
        np.minimum.at(group, bucket, placed[:end])
        order = np.lexsort((-placed[:end], -group[bucket]))
    return order
