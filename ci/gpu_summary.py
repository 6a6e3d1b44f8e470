"""Summarise a pytest junit XML: one line of counts (passed / skipped / failed / errors), and
with --table what each kernel case recorded (its `nmse` or `measured` junit property)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    path, table = argv[0], "--table" in argv[1:]
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "skipped": 0, "failed": 0, "errors": 0}
    rows = []
    for c in cases:
        if c.find("failure") is not None:
            status = "failed"
        elif c.find("error") is not None:
            status = "errors"
        elif c.find("skipped") is not None:
            status = "skipped"
        else:
            status = "passed"
        counts[status] += 1
        props = {p.get("name"): p.get("value") for p in c.iter("property")}
        value = props.get("nmse", props.get("measured"))
        if value is not None or status in ("failed", "errors"):
            rows.append((c.get("name"), status, value or ""))
    if table and rows:
        width = max(len(r[0]) for r in rows)
        for name, status, err in rows:
            print(f"{name:<{width}}  {status:<7}  {err}")
    print(f"conformance on GPU: {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed, {counts['errors']} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
