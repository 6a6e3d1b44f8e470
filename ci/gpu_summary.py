"""Summarise a pytest junit XML: one line of counts (passed / skipped / failed / errors), with
--table what each kernel case recorded (its `nmse` or `measured` junit property), and with
--models the whole models against llama.cpp's goldens (conformance/models/test_models.py: teacher-forced
argmax agreement, worst top-1 logit difference and top-16 NMSE, the worst activation node)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    path, table, models = argv[0], "--table" in argv[1:], "--models" in argv[1:]
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "skipped": 0, "failed": 0, "errors": 0}
    rows = []
    per_model: dict = {}
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
        test, _, param = (c.get("name") or "").partition("[")
        if test in ("test_teacher_forced", "test_activations") and "reference" in props:
            row = per_model.setdefault(param.rstrip("]"), {"status": set()})
            row.update(props)
            row["status"].add(status)
        value = props.get("nmse", props.get("measured"))
        if value is not None or status in ("failed", "errors"):
            rows.append((c.get("name"), status, value or ""))
    if table and rows:
        width = max(len(r[0]) for r in rows)
        for name, status, err in rows:
            print(f"{name:<{width}}  {status:<7}  {err}")
    if models and per_model:
        from tabulate import tabulate
        print(tabulate([(k, r.get("reference", ""), r.get("argmax_agreement", ""), r.get("worst_top1_delta", ""),
                         r.get("worst_top16_nmse", ""), r.get("worst_node", ""), "/".join(sorted(r["status"])))
                        for k, r in sorted(per_model.items())],
                       headers=["model-backend", "goldens", "argmax agrees", "worst top-1 |Δ|", "top-16 NMSE",
                                "node nearest its bound (NMSE)", "tests"], tablefmt="github"))
    print(f"conformance on GPU: {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed, {counts['errors']} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
