"""Run-time compilation of the CUDA sources under kernels/ with NVRTC, with an on-disk cache.

We drive NVRTC through CuPy's low-level binding instead of `cupy.RawModule`: it runs on a
machine without a GPU or driver (CI compiles every kernel for several architectures that
way), and it gives us the compiler log to turn into an error that names the kernel and line.

The cache key is the source, every header under kernels/, the options, the target and the
NVRTC version: change any of them and the kernel is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from importlib import resources
from functools import lru_cache
from pathlib import Path

from ...catalog import cache_dir
from .errors import KernelCompileError

# The CUDA sources ship as the package data of brass.kernels (the repository's kernels/ folder).
KERNEL_DIR = Path(str(resources.files("brass.kernels")))
BASE_OPTIONS = ("-std=c++17",)


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def kernel_sources() -> list[str]:
    """Every kernel source file (the *.cu under kernels/), by name."""
    return sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def _headers() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in sorted(KERNEL_DIR.glob("*.cuh"))]


def target_for(cc: int) -> str:
    """NVRTC target for compute capability `cc` (90 for 9.0): machine code when this NVRTC
    knows the architecture, else PTX for the newest one it knows, which the driver JIT-compiles."""
    archs = _nvrtc().getSupportedArchs()
    if cc in archs:
        return f"sm_{cc}"
    older = [a for a in archs if a <= cc]
    if not older:
        raise KernelCompileError(f"this NVRTC {nvrtc_version()} cannot target compute capability "
                                 f"{cc // 10}.{cc % 10} (it knows {', '.join(map(str, archs))})")
    return f"compute_{max(older)}"


def compile_source(name: str, target: str, options: tuple[str, ...] = (), *, use_cache: bool = True) -> bytes:
    """Compile kernels/<name> for `target` (sm_90: cubin; compute_90: PTX) and return the image."""
    path = KERNEL_DIR / name
    try:
        source = path.read_text()
    except FileNotFoundError:
        raise KernelCompileError(f"no kernel source {path}") from None
    return compile_text(name, source, target, options, use_cache=use_cache)


def compile_text(name: str, source: str, target: str, options: tuple[str, ...] = (), *,
                 use_cache: bool = True) -> bytes:
    """Compile `source` (known as kernels/<name>, with the headers under kernels/)."""
    path = KERNEL_DIR / name
    headers = _headers()
    opts = BASE_OPTIONS + tuple(options) + (f"-arch={target}",)
    key = hashlib.sha256()
    for part in (source, *(f"{n}\0{t}" for n, t in headers), *opts, repr(nvrtc_version())):
        key.update(part.encode())
        key.update(b"\0")
    ext = "cubin" if target.startswith("sm_") else "ptx"
    cached = cache_dir() / "kernels" / f"{path.stem}-{target}-{key.hexdigest()[:24]}.{ext}"
    if use_cache and cached.exists():
        return cached.read_bytes()

    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, name, [t.encode() for _, t in headers],
                               [n.encode() for n, _ in headers])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError:
            raise KernelCompileError(describe_compile_log(name, source, nvrtc.getProgramLog(prog), target)) from None
        image = nvrtc.getCUBIN(prog) if ext == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(image, str):
        image = image.encode()
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so that a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, cached)
    return image


_LOG_LINE = re.compile(r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?P<kind>error|catastrophic error|warning)[^:]*: (?P<msg>.*)$")
_FUNC_START = re.compile(r"(\w+)\s*\(")


def _enclosing_function(source: str, line: int) -> str | None:
    """The function whose definition surrounds `line` (1-based): the nearest line above it that
    starts in column 0 and opens a parameter list; None at file scope."""
    lines = source.splitlines()
    for text in reversed(lines[:line]):
        if not text or text[0].isspace() or text.startswith(("//", "#")):
            continue
        if text.startswith("}"):
            return None
        m = _FUNC_START.search(text)
        if m and not text.startswith(("struct", "enum", "static_assert", "typedef")):
            return m.group(1)
    return None


def describe_compile_log(name: str, source: str, log: str, target: str) -> str:
    """Turn an NVRTC log into a message that names the source, the kernel or function, and the
    line of each error."""
    found = []
    for raw in log.splitlines():
        m = _LOG_LINE.match(raw.strip())
        if not m or m.group("kind") == "warning":
            continue
        line = int(m.group("line"))
        where = f"kernels/{m.group('file')} line {line}"
        if m.group("file") == name:
            func = _enclosing_function(source, line)
            if func:
                where += f", in {func}"
        found.append(f"  {where}: {m.group('msg')}")
    head = f"CUDA kernel source kernels/{name} does not compile for {target}"
    if not found:
        return f"{head}:\n{log.strip()}"
    return head + ":\n" + "\n".join(found)
