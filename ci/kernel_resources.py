"""Registers and static shared memory of a kernel source as NVRTC builds it for sm_90, and the
blocks an SM that allows, per kernel, without a GPU (conformance/harness/kernel_resources.py
reads them and says how):

    python3 ci/kernel_resources.py mmq.cu [--threads 128] [--match REGEX] [-DNAME=VALUE ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness.kernel_resources import blocks_per_sm, resources  # noqa: E402


def main(argv: list[str]) -> int:
    from tabulate import tabulate

    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    source, rest = argv[0], argv[1:]
    threads = int(rest[rest.index("--threads") + 1]) if "--threads" in rest else 128
    match = re.compile(rest[rest.index("--match") + 1] if "--match" in rest else ".")
    defines = tuple(a for a in rest if a.startswith("-D"))
    img = compile_text(source, (KERNEL_DIR / source).read_text(), "sm_90", defines, use_cache=False)
    rows = []
    for k, v in sorted(resources(img).items()):
        if match.search(k):
            b = blocks_per_sm(v["registers"], v["shared"], threads)
            rows.append((k, v["registers"], v["shared"], b["registers"], b["shared"], b["threads"], min(b.values())))
    print(f"{source} {' '.join(defines)} (sm_90, {threads} threads a block)")
    print(tabulate(rows, headers=["kernel", "registers", "shared bytes", "blocks/SM by registers", "by shared",
                                  "by threads", "blocks/SM"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
