"""Shared-memory wavefronts of kernels/mmq.cu's mmq_tile, counted from its index arithmetic.

A model, not a measurement: 32 banks of 4 bytes; a warp's 32-bit access is one phase, a
64-bit access two (half warps), a 128-bit access four (quarter warps); a phase costs as many
wavefronts as the most distinct words any one bank holds among its lanes (equal words are one
broadcast). The lanes' (row, block) items are mmq_tile's unpack: item it = threadIdx.x + j *
MMQ_THREADS, row it / MMQ_KB, block it % MMQ_KB (a row's blocks on adjacent threads). It is
how the tile's padding and store order (mmq.cu mmq_store_block, MMQ_IPAD, MMQ_FPAD) were
chosen, against the layout without them; ncu's
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st on the GPU is the check.

    python3 ci/mmq_banks.py [MMQ_KB]

It also counts the 128-byte lines the activation tile's global loads touch per chunk: a
(token, block) item per thread, against the tile's copies of the raw blocks (ncu:
l1tex__data_pipe_lsu_wavefronts_mem_lg).
"""

from __future__ import annotations

import sys
from collections import defaultdict


def wavefronts(addrs: list[int], width: int) -> int:
    """addrs: each lane's first 32-bit word; width: words per lane (1, 2 or 4)."""
    per = 32 // width
    total = 0
    for p in range(0, 32, per):
        banks: dict[int, set[int]] = defaultdict(set)
        for a in addrs[p:p + per]:
            for j in range(width):
                banks[(a + j) % 32].add(a + j)
        total += max(len(v) for v in banks.values())
    return total


def stores(kb_per_chunk: int, banks: bool) -> dict[str, int]:
    """Wavefronts of one warp's stores of 32 items, per array (the quants' words, the float2
    (a, b) factors, a 32-bit factor such as d8)."""
    stride = kb_per_chunk * 8 + 4
    ipad, fpad = (32 // kb_per_chunk, 16 // kb_per_chunk) if banks else (0, 0)
    rows = 64
    item = [(lane // kb_per_chunk, lane % kb_per_chunk) for lane in range(32)]
    # the quants as two 128-bit stores (eight 32-bit stores come out of nvcc so: st.shared.v4.u32
    # in its PTX), the tile's layout swapping the halves' order for blocks 4..7
    swap = (lambda kb: (kb >> 2) & 1) if banks else (lambda kb: 0)
    quants = sum(wavefronts([r * stride + kb * 8 + 4 * (h ^ swap(kb)) for r, kb in item], 4) for h in range(2))
    pair = wavefronts([2 * (kb * (rows + fpad) + r) for r, kb in item], 2)
    word = wavefronts([kb * (rows + ipad) + r for r, kb in item], 1)
    return {"quants": quants, "float2 factor": pair, "32-bit factor": word}


def lines(byte_addrs: list[int]) -> int:
    """128-byte lines one warp load touches (each costs L1 a wavefront, whatever it uses)."""
    return len({a // 128 for a in byte_addrs})


def activation_loads(kb_per_chunk: int, nb: int = 64) -> dict[str, int]:
    """Lines touched per chunk of one tile (64 tokens, kb_per_chunk blocks of 36 bytes each)
    by the activations' global loads: an item per thread (its 8 quant words by 32-bit loads and
    d, s by 16-bit ones, as the PTX had them) and the tile's (a token's chunk copied as
    consecutive 16-byte words by consecutive threads). Tokens 0..63 in order, nb blocks a row."""
    cols, words16 = 64, 9 * kb_per_chunk // 4
    base = lambda c, kb: (c * nb + kb) * 36          # noqa: E731
    default = 0
    for w0 in range(0, cols * kb_per_chunk, 32):      # a warp's 32 items
        item = [((w0 + lane) // kb_per_chunk, (w0 + lane) % kb_per_chunk) for lane in range(32)]
        default += 2 * lines([base(c, kb) for c, kb in item])                # d, s (16-bit loads)
        default += sum(lines([base(c, kb) + 4 + 4 * i for c, kb in item]) for i in range(8))
    raw = 0
    for w0 in range(0, cols * words16, 32):
        raw += lines([base((w0 + lane) // words16, 0) + 16 * ((w0 + lane) % words16) for lane in range(32)])
    return {"default": default, "raw": raw}


def main() -> int:
    kb = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for banks in (False, True):
        s = stores(kb, banks)
        # Q4_K: weights store quants + (a, b) [+ Q6_K's scales]; activations quants + d8 +
        # (s or the quants' sum) [+ both without the padded layout, which stores every factor]
        w = s["quants"] + s["float2 factor"] + (0 if banks else s["32-bit factor"])
        x = s["quants"] + s["32-bit factor"] * (2 if banks else 3)
        print(f"MMQ_KB={kb} {'padded' if banks else 'unpadded'}: per 32 items {s}; Q4_K weights {w}, activations {x}")
    # without conflicts: the quants 4 + 4, (a, b) 2, a 32-bit factor 1
    ideal_w, ideal_x = 4 + 4 + 2 + 1, 4 + 4 + 1 + 1 + 1
    d = stores(kb, False)
    total = 2 * d["quants"] + d["float2 factor"] + 4 * d["32-bit factor"]
    print(f"the unpadded layout's store wavefronts that are conflicts: {1 - (ideal_w + ideal_x) / total:.1%}")
    if kb % 4 == 0:
        a = activation_loads(kb)
        print(f"activation global loads, lines per chunk of a 64-token tile: an item per thread "
              f"{a['default']}, raw copies {a['raw']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
