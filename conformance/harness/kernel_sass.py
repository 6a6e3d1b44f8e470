"""A kernel's machine code without a GPU: where its global loads, shared stores and barriers sit,
to see whether its loads are in flight together or waited out one by one (how the MoE prompt
tile's unpack was found issuing one item's loads at a time, 2026-12-03).

NVRTC's PTX of kernels/SOURCE for sm_90 is assembled by a CUDA toolkit's ptxas and the cubin
disassembled by nvdisasm (NVRTC's own cubin is not one this nvdisasm reads). ptxas: on PATH, in
$CUDA_HOME/bin or /usr/local/cuda*/bin; nvdisasm: the same places or the `nvidia-cuda-nvdisasm`
wheel (`pip install nvidia-cuda-nvdisasm`). PTX of an ISA newer than the ptxas reads is
declared as the one it names (what these kernels use is older than both). ptxas may not be the
one the runner's driver uses: the schedule is a sample of the compiler's habits, not the runner's code.

ci/kernel_sass.py prints it; conformance/kernels/test_kernel_sass.py checks what the kernels'
switches do to it.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


class NoToolkit(RuntimeError):
    """No ptxas or no nvdisasm here: say which and where they were looked for."""


def find_tool(name: str) -> str:
    roots = [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"), reverse=True)]
    found = shutil.which(name) or next((p for r in roots if r and os.access(p := f"{r}/bin/{name}", os.X_OK)), None)
    if not found and name == "nvdisasm":
        try:
            import nvidia
            found = next((p for d in nvidia.__path__ for p in glob.glob(f"{d}/cu*/bin/nvdisasm")), None)
        except ImportError:
            pass
    if not found:
        raise NoToolkit(f"no {name}: looked on PATH, in $CUDA_HOME/bin and /usr/local/cuda*/bin"
                        + (" and the nvidia-cuda-nvdisasm wheel" if name == "nvdisasm" else ""))
    return found


def sass(source: str, kernel: str, defines: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """(ptxas's report for `kernel`, its SASS lines without addresses or encodings)."""
    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    ptxas, nvdisasm = find_tool("ptxas"), find_tool("nvdisasm")
    ptx = compile_text(source, (KERNEL_DIR / source).read_text(), "compute_90", defines, use_cache=False).decode()
    with tempfile.TemporaryDirectory() as tmp:
        p, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        for _ in range(2):
            p.write_text(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", str(p), "-o", str(cubin)], capture_output=True, text=True)
            # an older ptxas names the ISA it reads: declared as that once
            m = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", r.stderr)
            if r.returncode == 0 or not m:
                break
            ptx = re.sub(r"^\.version \d+\.\d+", f".version {m.group(1)}", ptx, count=1, flags=re.M)
        if r.returncode:
            raise RuntimeError(f"ptxas failed: {r.stderr.strip()[:2000]}")
        dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    report, cur = [], None
    for line in (r.stdout + r.stderr).splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        elif cur == kernel and "Compile time" not in line:
            report.append(line.split("ptxas info    :")[-1].strip())
    start = dis.find(f".text.{kernel}:")
    if start < 0:
        raise KeyError(f"no kernel {kernel!r} in {source} (its entry names are its extern \"C\" functions)")
    end = dis.find("//----", start)
    lines = []
    for line in dis[start:end if end > 0 else None].splitlines()[1:]:
        line = re.sub(r"/\*[0-9a-f]{4}\*/", "", line).strip().rstrip(" ;")
        if line and not line.startswith(("/*", "//", ".")) or line.startswith(".L"):
            lines.append(line)
    return "\n".join(report), lines
