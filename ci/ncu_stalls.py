"""Where a kernel's warps wait, from ncu's report pages: the stall reasons' samples over the
whole kernel (`ncu -i REP --page raw --csv`) and the instructions with the most samples, each
with its leading reasons (`ncu -i REP --page source --csv --print-source sass`).

    python3 ci/ncu_stalls.py RAW.csv SASS.csv [TOP]

The source page starts with a "Kernel Name" line; its header is the line that starts with
"Address" (columns "Source", "Warp Stall Sampling (All Samples)", "stall_<reason>").
"""

from __future__ import annotations

import csv
import sys


def number(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip())
        return 2
    raw, sass = (list(csv.reader(open(p))) for p in sys.argv[1:3])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    if len(raw) >= 3:
        head, vals = raw[0], raw[2]
        st = sorted(((h, number(v)) for h, v in zip(head, vals)
                     if "pcsamp_warps_issue_stalled" in h and not h.endswith("not_issued")), key=lambda hv: -hv[1])
        print("stall samples:", ", ".join(f"{h.split('stalled_')[-1]} {v:.0f}" for h, v in st[:12] if v))
    hi = next((i for i, r in enumerate(sass) if r and r[0] == "Address"), None)
    if hi is None:
        print("no SASS table in", sys.argv[2])
        return 1
    head, body = sass[hi], sass[hi + 1:]
    key, src = head.index("Warp Stall Sampling (All Samples)"), head.index("Source")
    reasons = {h: i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h}
    total = sum(number(r[key]) for r in body if len(r) > key)
    print(f"{total:.0f} samples over {len(body)} instructions; the top {top}:")
    for r in sorted((r for r in body if len(r) > key), key=lambda r: -number(r[key]))[:top]:
        why = sorted(((h[6:], number(r[i])) for h, i in reasons.items()), key=lambda x: -x[1])[:3]
        print(f"{number(r[key]):5.0f} {r[0][-5:]} | {r[src].strip()[:64]:64} | "
              + ", ".join(f"{h} {v:.0f}" for h, v in why if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
