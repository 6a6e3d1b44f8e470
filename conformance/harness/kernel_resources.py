"""Registers and static shared memory of kernels/ as NVRTC builds them, and what that allows
an SM: no GPU needed (the cubin NVRTC writes for sm_90 is read as an ELF file). ci/kernel_resources.py
prints them for a kernel source.

Per kernel: registers a thread (the .nv.info REGCOUNT attribute), the static shared memory
(the .nv.shared.<kernel> section, which on sm_90 holds the 1 KiB the system reserves per
block), and resident blocks an SM by registers (65,536, allocated 256 a warp), shared memory
(228 KiB) and threads (2,048), the least of them the occupancy's bound. How the MMQ tile's
padded layout was found to fit 5 blocks an SM where the one before fit 4; the GPU (ncu's
Occupancy section) is the check.
"""

from __future__ import annotations

import struct

REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM, BLOCKS_PER_SM = 65536, 233472, 2048, 32
EIATTR_REGCOUNT, EIFMT_SVAL = 0x2F, 0x04


def _sections(img: bytes) -> list[tuple[str, tuple]]:
    shoff, = struct.unpack_from("<Q", img, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", img, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]

    def name(o: int) -> str:
        return img[names + o:img.index(b"\0", names + o)].decode()
    return [(name(h[0]), h) for h in hdrs]


def resources(img: bytes) -> dict[str, dict[str, int]]:
    """{kernel: {"registers": n, "shared": bytes}} from a cubin."""
    secs = dict(_sections(img))
    symtab, strtab = secs[".symtab"], secs[".strtab"]

    def symbol(i: int) -> str:
        o, = struct.unpack_from("<I", img, symtab[4] + 24 * i)
        return img[strtab[4] + o:img.index(b"\0", strtab[4] + o)].decode()
    out: dict[str, dict[str, int]] = {}
    info = secs[".nv.info"]
    i, end = info[4], info[4] + info[5]
    while i < end:
        fmt, attr = img[i], img[i + 1]
        if fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", img, i + 2)
            if attr == EIATTR_REGCOUNT:
                sym, regs = struct.unpack_from("<II", img, i + 4)
                out.setdefault(symbol(sym), {})["registers"] = regs
            i += 4 + size
        else:
            i += 4
    for k, v in out.items():
        v["shared"] = secs[".nv.shared." + k][5] if ".nv.shared." + k in secs else 0
    return out


def blocks_per_sm(registers: int, shared: int, threads: int) -> dict[str, int]:
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    return {"registers": REGS_PER_SM // (per_warp * warps) if registers else BLOCKS_PER_SM,
            "shared": SMEM_PER_SM // shared if shared else BLOCKS_PER_SM,
            "threads": THREADS_PER_SM // threads}
