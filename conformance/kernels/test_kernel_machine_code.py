"""The machine code of every kernel source's default build is what was recorded: a baseline for
changes that must not change any kernel (moving host code around, deleting kernel variants that
are compiled out by default, renaming switches).

Each kernels/*.cu is compiled as the CUDA backend compiles it on an H100 with no switch set
(compiler.compile_source with no options beyond its BASE_OPTIONS: the backend adds -lineinfo
only under BRASS_CUDA_DEBUG) to an sm_90 cubin, and each section that holds code or what the
code reads is hashed (sha256), read from the ELF here without nvdisasm:

- `.text.<kernel>`: the kernel's machine code;
- `.nv.shared.<kernel>`: its static shared memory (no bytes in the file: its size is hashed);
- `.nv.constant0.<kernel>`: its parameter bank; other `.nv.constant<N>` banks of the module;
- `.nv.global`, `.nv.global.init`: the module's device globals (size) and their initial values
  (tables the kernels read), which two sources have.

Only section contents (or sizes) go into a hash, never section headers: a header's sh_link and
sh_info hold section and symbol indices, which move when another kernel of the file is added or
deleted. Nothing here depends on paths or line numbers (no -lineinfo, no -G, no device assert()):
checked when this was written by compiling norm.cu, attention.cu, mmq.cu and matvec_f.cu twice,
with a comment line added at the top, and under another program name with three lines added
(every hash the same each time), and matvec_f.cu with two lines added at the top of common.cuh
and matvec.cuh in a scratch copy of kernels/ (the same).

The recording is conformance/data/kernel_machine_code.json, written by

    python3 -m conformance.kernels.test_kernel_machine_code --record

Machine code is the compiler's: the recording holds the NVRTC version it was made with, and the
test skips, saying so, under another (the GPU runner's 13.0); re-record there to compare there.
Deleting or changing a kernel on purpose means re-recording, and the commit says why.

Compiling everything takes ~60 s of CPU (matvec_q.cu alone ~46 s), so the sources are
compiled on a process per core (at most 4), the largest first, through the backend's on-disk
cache of cubins (keyed by the source, every header, the options and the NVRTC version: a cached
cubin is the one NVRTC builds, and NVRTC built the same bytes twice for each source tried): with
a warm cache the file takes ~2 s; cold, matvec_q.cu's compile bounds it. The recorder compiles
without the cache.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "conformance" / "data" / "kernel_machine_code.json"
TARGET = "sm_90"
KEPT = (".text.", ".nv.shared.", ".nv.constant", ".nv.global")
SHT_NOBITS = 8
RECORD_CMD = "python3 -m conformance.kernels.test_kernel_machine_code --record"


def elf_sections(img: bytes) -> list[tuple[str, int, bytes | None, int]]:
    """(name, sh_type, contents or None for NOBITS, size) of every section of a 64-bit
    little-endian ELF image (a cubin)."""
    if img[:4] != b"\x7fELF" or img[4] != 2 or img[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff, = struct.unpack_from("<Q", img, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", img, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx][4]
    out = []
    for name_off, sh_type, _flags, _addr, offset, size, _link, _info, _align, _entsize in hdrs:
        name = img[strtab + name_off:img.index(b"\0", strtab + name_off)].decode()
        out.append((name, sh_type, None if sh_type == SHT_NOBITS else img[offset:offset + size], size))
    return out


def section_hashes(img: bytes) -> dict[str, str]:
    """{section name: sha256} of the sections KEPT: the contents, or for a section without
    bytes in the file (NOBITS: shared memory, uninitialised globals) its size."""
    out = {}
    for name, _type, data, size in elf_sections(img):
        if not name.startswith(KEPT):
            continue
        if name in out:
            raise ValueError(f"two sections named {name}")
        out[name] = hashlib.sha256(data if data is not None else f"NOBITS {size}".encode()).hexdigest()
    return out


def _hashes_of(source: str, use_cache: bool) -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    from brass.backends.cuda.compiler import compile_source
    return section_hashes(compile_source(source, TARGET, use_cache=use_cache))


def build_hashes(sources: list[str], use_cache: bool = True) -> dict[str, dict[str, str]]:
    """{source: section hashes} of each source's default sm_90 build, the largest sources
    first over a process per core (at most 4)."""
    from brass.backends.cuda.compiler import KERNEL_DIR
    order = sorted(sources, key=lambda s: -(KERNEL_DIR / s).stat().st_size)
    workers = max(1, min(4, os.cpu_count() or 1, len(order)))
    # From a fork server, not forked from this process: a test worker may hold loaded models
    # (gigabytes), which forked children would map again (the suite's memory is measured as the
    # sum of its processes' resident sets). The workers call NVRTC alone, never the driver.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else None)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        results = dict(zip(order, ex.map(_hashes_of, order, [use_cache] * len(order))))
    return {s: results[s] for s in sorted(sources)}


def sources_digest() -> str:
    """sha256 over every kernels/*.cu and *.cuh, by name: whether the sources are the ones
    recorded (a changed hash with identical sources is the compiler's doing)."""
    from brass.backends.cuda.compiler import KERNEL_DIR
    h = hashlib.sha256()
    for p in sorted(list(KERNEL_DIR.glob("*.cu")) + list(KERNEL_DIR.glob("*.cuh"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def record(path: Path = DATA) -> dict:
    from brass.backends.cuda.compiler import BASE_OPTIONS, kernel_sources, nvrtc_version
    doc = {
        "about": "sha256 of the code sections of each kernels/*.cu's default sm_90 build; "
                 f"written by `{RECORD_CMD}`, read by conformance/kernels/test_kernel_machine_code.py",
        "nvrtc": list(nvrtc_version()),
        "target": TARGET,
        "options": [*BASE_OPTIONS, f"-arch={TARGET}"],
        "kernel_sources_sha256": sources_digest(),
        "sources": build_hashes(kernel_sources(), use_cache=False),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def _kernel_of(section: str) -> str:
    for prefix in (".text.", ".nv.shared.", ".nv.constant0."):
        if section.startswith(prefix):
            return section[len(prefix):]
    return "(module)"


def describe_difference(source: str, want: dict[str, str], got: dict[str, str]) -> str:
    """What differs, by kernel: sections changed, new, gone."""
    by_kernel: dict[str, list[str]] = {}
    for name in sorted(set(want) | set(got)):
        if name not in got:
            what = "gone"
        elif name not in want:
            what = "new"
        elif want[name] != got[name]:
            what = "changed"
        else:
            continue
        by_kernel.setdefault(_kernel_of(name), []).append(f"{name} {what}")
    lines = [f"kernels/{source}: the {TARGET} machine code differs from the recording "
             f"({DATA.relative_to(ROOT)}) in {len(by_kernel)} kernel(s):"]
    for kernel, items in sorted(by_kernel.items()):
        lines.append(f"  {kernel}: " + ", ".join(items))
    lines.append(f"If this change is deliberate, re-record ({RECORD_CMD}) and say why in the commit.")
    return "\n".join(lines)


# -- the test ------------------------------------------------------------------------------

def _recording() -> dict:
    if not DATA.exists():
        pytest.fail(f"no recording {DATA.relative_to(ROOT)}: write it with {RECORD_CMD}", pytrace=False)
    return json.loads(DATA.read_text())


def _all_sources() -> list[str]:
    from brass.backends.cuda.compiler import kernel_sources
    recorded = json.loads(DATA.read_text())["sources"] if DATA.exists() else {}
    return sorted(set(kernel_sources()) | set(recorded))


@pytest.fixture(scope="module")
def built():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                                reason="CuPy's NVRTC binding is not installed (pip install -e '.[cuda]')")
    from brass.backends.cuda.compiler import kernel_sources, target_for
    rec = _recording()
    have = tuple(nvrtc.getVersion())
    if list(have) != rec["nvrtc"]:
        pytest.skip(f"the machine code was recorded with NVRTC {'.'.join(map(str, rec['nvrtc']))}; this NVRTC "
                    f"is {'.'.join(map(str, have))}, whose code may differ: re-record with it ({RECORD_CMD}) "
                    f"at the baseline commit to compare here")
    # what the backend builds for a compute capability 9.0 GPU with this NVRTC
    assert target_for(90) == rec["target"] == TARGET
    return build_hashes(kernel_sources())


@pytest.mark.parametrize("source", _all_sources())
def test_machine_code_is_the_recorded(source, built):
    rec = _recording()
    assert source in rec["sources"], (f"kernels/{source} is not in the recording: re-record "
                                      f"({RECORD_CMD}) and say why in the commit")
    assert source in built, (f"kernels/{source} is in the recording but no longer exists: re-record "
                             f"({RECORD_CMD}) and say why in the commit")
    want, got = rec["sources"][source], built[source]
    if want != got:
        same_sources = sources_digest() == rec["kernel_sources_sha256"]
        msg = describe_difference(source, want, got)
        if same_sources:
            msg += ("\n(every kernels/*.cu and *.cuh is byte for byte the recorded: the compiler "
                    "built other code from the same sources)")
        pytest.fail(msg, pytrace=False)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        print(f"usage: {RECORD_CMD}")
        sys.exit(2)
    doc = record()
    n = sum(len(v) for v in doc["sources"].values())
    print(f"recorded {n} sections of {len(doc['sources'])} sources (NVRTC "
          f"{'.'.join(map(str, doc['nvrtc']))}, {TARGET}) in {DATA}")
