#!/usr/bin/env bash
# Where a decode token's time goes on the GPU runner: kernel time by name over decode-graph
# replays and a prompt of a shape-true model (CUPTI through torch.profiler), then ncu on the Q4_K and Q6_K decode
# mat-vecs (achieved bandwidth, occupancy, stall reasons). Output under $OUT.
# Usage: ci/gpu_profile.sh [SHAPE (ci/shape_models.py)]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
shape="${1:-qwen3-0.6b}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dir=/tmp/brass-shapes
[ -f "$dir/$shape.gguf" ] || python3 ci/shape_models.py "$shape" "$dir" > /dev/null
# Time per kernel through CUPTI (torch.profiler; nsys on the runner records but cannot import
# its own report), for decode-graph replays and for one prompt.
for mode in ${MODES:-decode prefill}; do
    n=20; [ "$mode" = prefill ] && n=512
    echo "== $mode ($shape)"
    python3 ci/gpu_profile.py torch $mode "$dir/$shape.gguf" $n 2>&1 | grep -vi warn | head -24
done
for case in "Q4_K 12288 4096" "Q6_K 12288 4096"; do
    set -- $case
    ncu --clock-control none -k "regex:^matvec_$(echo $1 | tr A-Z a-z)\$" -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 ci/gpu_profile.py matvec $1 $2 $3 > "$out/ncu-$1.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$out/ncu-$1.txt" | head -24
done
