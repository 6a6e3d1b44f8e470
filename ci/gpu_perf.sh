#!/usr/bin/env bash
# Kernel benchmarks on the GPU runner (perf/test_kernels_*.py): a table of GPU time per call
# and weight bytes read per second; the pytest-benchmark JSON goes to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest perf/test_kernels_*.py -q -p no:cacheprovider --benchmark-columns=median \
    --benchmark-json="$out/perf.json" > "$out/perf.log" 2>&1 || tail -20 "$out/perf.log"
python3 - "$out/perf.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit("no benchmark results")
for b in data["benchmarks"]:
    e = b["extra_info"]
    print(f"{b['name']:<48} {e.get('gpu_us', 0):9.1f} us  {e.get('GB_per_s', 0):7.0f} GB/s")
PY
