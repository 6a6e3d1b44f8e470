"""A kernel's machine code without a GPU (conformance/harness/kernel_sass.py says how it is
built and from which toolkit):

    python3 ci/kernel_sass.py SOURCE KERNEL [-DNAME=VALUE ...] [--all]

SOURCE is a file of the kernels folder of the brass that Python imports (attention.cu, or
kernels/attention.cu): a worktree's own kernels need that tree on the import path (ci/gpu_lib.sh
brass_import). Prints ptxas's register and spill report for KERNEL, then its SASS reduced to
labels, branches, global / shared memory instructions, barriers and mma (--all: every
instruction).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness.kernel_sass import NoToolkit, sass  # noqa: E402

KEEP = re.compile(r"^\.L|BRA|EXIT|LDG|STG|LDS|STS|LDGSTS|DEPBAR|BAR\.|IMMA|HMMA|ATOM|RED\.")


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("-")]
    if len(args) != 2:
        print(__doc__)
        return 2
    defines = tuple(a for a in argv if a.startswith("-D"))
    from brass.backends.cuda.compiler import KERNEL_DIR
    source = Path(args[0]).name
    if not (KERNEL_DIR / source).is_file():
        known = ", ".join(sorted(f.name for f in KERNEL_DIR.glob("*.cu")))
        print(f"kernel_sass: no {source} in {KERNEL_DIR} (its sources: {known})", file=sys.stderr)
        return 2
    try:
        report, lines = sass(source, args[1], defines)
    except (NoToolkit, KeyError) as e:
        print(f"kernel_sass: {e.args[0]}", file=sys.stderr)
        return 2
    print(report)
    for i, line in enumerate(lines):
        if "--all" in argv or KEEP.search(line):
            print(f"{i:5d}  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
