"""Write a baseline for `pytest perf/ --benchmark`'s regression tracking
(conformance/harness/perf_baseline.py says what a figure is and how runs are compared):

    python -m perf.baseline RESULTS.json [DEVICE]

writes RESULTS.json's figures as the baseline of the device they were measured on,
perf/baselines/<device>.json (do that only from a run whose conformance passed, and commit it
with the commit it measured named in it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.harness.perf_baseline import write_baseline

if __name__ == "__main__":
    print(write_baseline(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
