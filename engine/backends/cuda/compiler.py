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
from ...errors import UnsupportedError
from .errors import KernelCompileError

# The CUDA sources ship as the package data of brass.kernels (the repository's kernels/ folder).
KERNEL_DIR = Path(str(resources.files("brass.kernels")))
BASE_OPTIONS = ("-std=c++17",)
DEFAULT_SMEM = 48 << 10     # shared memory a kernel may use without opting in


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """The text of kernels/<name> (a .cu source or a .cuh header)."""
    return (KERNEL_DIR / name).read_text()


def define(source: str, name: str) -> int:
    """The integer of `#define <name> <integer>` in kernels/<source> (its first such line): the
    sizes a launch depends on are read from the source, so that the launch matches what the
    kernel was built with."""
    m = re.search(rf"#define {name} (\d+)", source_text(source))
    if m is None:
        raise KernelCompileError(f"kernels/{source} has no `#define {name} <integer>`")
    return int(m.group(1))


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


class Kernels:
    """A backend's kernel functions by (source, name), compiled (compile_source) and loaded on
    first use, and what the driver says of them (their block size, their shared memory)."""

    def __init__(self, cc: int, debug: bool):
        self.target = target_for(cc)
        self.options = ("-lineinfo",) if debug else ()
        self._modules: dict = {}        # source -> cupy.cuda.function.Module
        self._functions: dict = {}      # (source, name) -> cupy.cuda.function.Function
        self._smem_optin: dict[tuple[str, str], int] = {}
        self._threads: dict[tuple[str, str], int] = {}

    def get(self, source: str, name: str):
        key = (source, name)
        fn = self._functions.get(key)
        if fn is None:
            module = self._modules.get(source)
            if module is None:
                import cupy
                module = cupy.cuda.function.Module()
                module.load(compile_source(source, self.target, self.options))
                self._modules[source] = module
            fn = self._functions[key] = module.get_function(name)
        return fn

    def block_threads(self, source: str, name: str) -> int:
        """The threads a block of the kernel was built for: its __launch_bounds__ (the most it
        can be launched with). matvec_split_<type> is launched with these, so that a build with
        another MV_SPLIT_WARPS (kernels/matvec.cuh) is launched as it expects."""
        key = (source, name)
        n = self._threads.get(key)
        if n is None:
            from cupy_backends.cuda.api import driver
            CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
            n = self._threads[key] = int(driver.funcGetAttribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                                                                 self.get(source, name).ptr))
        return n

    def allow_smem(self, source: str, name: str, nbytes: int, limit: int):
        """Opt the kernel in to `nbytes` of dynamic shared memory when that and its static
        shared memory exceed the 48 KiB every kernel may use."""
        key = (source, name)
        if self._smem_optin.get(key, 0) >= nbytes:
            return
        from cupy_backends.cuda.api import driver
        CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 1, 8
        static = driver.funcGetAttribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.get(source, name).ptr)
        if nbytes + static > limit:
            raise UnsupportedError(f"kernel {name} would need {nbytes + static} bytes of shared memory; "
                                   f"this GPU allows {limit}")
        if nbytes + static > DEFAULT_SMEM:
            driver.funcSetAttribute(self.get(source, name).ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    nbytes)
        self._smem_optin[key] = nbytes
