"""Shared-memory wavefronts of kernels/mmq.cu's mmq_tile, counted from its index arithmetic.

A model, not a measurement: 32 banks of 4 bytes; a warp's 32-bit access is one phase, a
64-bit access two (half warps), a 128-bit access four (quarter warps); a phase costs as many
wavefronts as the most distinct words any one bank holds among its lanes (equal words are one
broadcast). The lanes' (row, block) items are mmq_tile's unpack: item it = threadIdx.x + j *
MMQ_THREADS, row it / MMQ_KB, block it % MMQ_KB (a row's blocks on adjacent threads). It is
how MMQ_BANKS's padding and store order were chosen; ncu's
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st on the GPU is the check.

    python3 ci/mmq_banks.py [MMQ_KB]
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
    if banks:
        quants = sum(wavefronts([r * stride + kb * 8 + 4 * (h ^ ((kb >> 2) & 1)) for r, kb in item], 4)
                     for h in range(2))
    else:
        quants = sum(wavefronts([r * stride + kb * 8 + i for r, kb in item], 1) for i in range(8))
    pair = wavefronts([2 * (kb * (rows + fpad) + r) for r, kb in item], 2)
    word = wavefronts([kb * (rows + ipad) + r for r, kb in item], 1)
    return {"quants": quants, "float2 factor": pair, "32-bit factor": word}


def main() -> int:
    kb = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for banks in (False, True):
        s = stores(kb, banks)
        # Q4_K: weights store quants + (a, b) [+ Q6_K's scales]; activations quants + d8 +
        # (s or the quants' sum) [+ both without MMQ_BANKS]
        w = s["quants"] + s["float2 factor"] + (0 if banks else s["32-bit factor"])
        x = s["quants"] + s["32-bit factor"] * (2 if banks else 3)
        print(f"MMQ_KB={kb} MMQ_BANKS={int(banks)}: per 32 items {s}; Q4_K weights {w}, activations {x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
