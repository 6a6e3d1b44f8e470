"""Two orders llama.cpp's results inherit from libstdc++ (GCC 12, which built the reference
llama.cpp): how a `std::unordered_map` lists its keys, and how `std::sort` leaves equal keys.

Hash-map order. llama.cpp finds the end-of-turn and fill-in-the-middle tokens by walking its token map and
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


def sort(items: list, key) -> list:
    """std::sort(first, last, comp) with comp(a, b) = key(a) < key(b), step by step as libstdc++
    does it (introsort: median-of-three quicksort down to runs of 16, heapsort past a depth of
    2 log2 n, then insertion sort). The sort is not stable, and llama.cpp's special tokens of
    equal length come out in the order it leaves them, which decides which of two overlapping
    ones is cut out of a text first."""
    a = list(items)
    k = [key(x) for x in a]

    def swap(i, j):
        a[i], a[j] = a[j], a[i]
        k[i], k[j] = k[j], k[i]

    def unguarded_linear_insert(last):
        val, kv = a[last], k[last]
        nxt = last - 1
        while kv < k[nxt]:
            a[last], k[last] = a[nxt], k[nxt]
            last = nxt
            nxt -= 1
        a[last], k[last] = val, kv

    def insertion_sort(first, last):
        for i in range(first + 1, last):
            if k[i] < k[first]:
                val, kv = a[i], k[i]
                a[first + 1:i + 1], k[first + 1:i + 1] = a[first:i], k[first:i]
                a[first], k[first] = val, kv
            else:
                unguarded_linear_insert(i)

    def adjust_heap(first, hole, length, val, kv):
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if k[first + child] < k[first + child - 1]:
                child -= 1
            a[first + hole], k[first + hole] = a[first + child], k[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            a[first + hole], k[first + hole] = a[first + child - 1], k[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and k[first + parent] < kv:
            a[first + hole], k[first + hole] = a[first + parent], k[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        a[first + hole], k[first + hole] = val, kv

    def heap_sort(first, last):
        length = last - first
        if length >= 2:
            for parent in range((length - 2) // 2, -1, -1):
                adjust_heap(first, parent, length, a[first + parent], k[first + parent])
        while last - first > 1:
            last -= 1
            val, kv = a[last], k[last]
            a[last], k[last] = a[first], k[first]
            adjust_heap(first, 0, last - first, val, kv)

    def introsort_loop(first, last, depth):
        while last - first > 16:
            if depth == 0:
                heap_sort(first, last)
                return
            depth -= 1
            mid = first + (last - first) // 2
            x, y, z = first + 1, mid, last - 1      # median of three to `first`
            if k[x] < k[y]:
                swap(first, y if k[y] < k[z] else z if k[x] < k[z] else x)
            else:
                swap(first, x if k[x] < k[z] else z if k[y] < k[z] else y)
            lo, hi = first + 1, last                # unguarded partition around `first`
            while True:
                while k[lo] < k[first]:
                    lo += 1
                hi -= 1
                while k[first] < k[hi]:
                    hi -= 1
                if not lo < hi:
                    break
                swap(lo, hi)
                lo += 1
            introsort_loop(lo, last, depth)
            last = lo

    n = len(a)
    if n:
        introsort_loop(0, n, 2 * (n.bit_length() - 1))
        if n > 16:
            insertion_sort(0, 16)
            for i in range(16, n):
                unguarded_linear_insert(i)
        else:
            insertion_sort(0, n)
    return a
