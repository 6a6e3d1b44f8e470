#!/usr/bin/env bash
# Where a decode token's time goes on the GPU runner: nsys over decode-graph replays of a
# shape-true model (time per kernel, summed by name), then ncu on the Q4_K and Q6_K decode
# mat-vecs (achieved bandwidth, occupancy, stall reasons). Output under $OUT.
# Usage: ci/gpu_profile.sh [SHAPE (ci/shape_models.py)]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
shape="${1:-qwen3-0.6b}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dir=/tmp/brass-shapes
[ -f "$dir/$shape.gguf" ] || python3 ci/shape_models.py "$shape" "$dir" > /dev/null
NSYS=$(command -v nsys || find /usr /opt -name nsys -type f -perm -u+x 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "nsys not found"; }
for mode in ${MODES:-decode prefill}; do
    [ -n "$NSYS" ] || break
    "$NSYS" profile --cuda-graph-trace=node -t cuda -o "$out/$mode-$shape" -f true \
        python3 ci/gpu_profile.py $mode "$dir/$shape.gguf" > "$out/nsys-$mode.log" 2>&1
    "$NSYS" stats --report cuda_gpu_kern_sum --format csv "$out/$mode-$shape.nsys-rep" > "$out/kern_sum-$mode.csv" 2>>"$out/nsys-$mode.log"
    echo "== $mode ($shape)"
    python3 - "$out/kern_sum-$mode.csv" <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.strip()]
start = next((i for i, l in enumerate(lines) if l.startswith('"Time') or l.startswith("Time")), None)
if start is None:
    print("".join(lines[:5])); sys.exit()
rows = list(csv.DictReader(lines[start:]))
tot = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"GPU kernel time: {tot / 1e6:.2f} ms")
for r in rows[:14]:
    print(f'{float(r["Time (%)"]):5.1f} %  {int(r["Instances"]):6d} x {float(r["Avg (ns)"]) / 1e3:8.2f} us  {r["Name"][:70]}')
PY
done
for case in "Q4_K 12288 4096" "Q6_K 12288 4096"; do
    set -- $case
    ncu --clock-control none -k "regex:^matvec_$(echo $1 | tr A-Z a-z)\$" -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 ci/gpu_profile.py matvec $1 $2 $3 > "$out/ncu-$1.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$out/ncu-$1.txt" | head -24
done
