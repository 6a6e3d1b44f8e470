#!/usr/bin/env bash
# Where a decode token's time goes on the GPU runner: kernel time by name over decode-graph
# replays and a prompt of a shape-true model (CUPTI through torch.profiler), then ncu on the Q4_K and Q6_K decode
# mat-vecs (achieved bandwidth, occupancy, stall reasons). Output under $OUT.
# Usage: ci/gpu_profile.sh [SHAPE (ci/shape_models.py)]
#   MODES=" " NCU_CASES="Q6_K 151936 1024" ci/gpu_profile.sh   # ncu on the 0.6B's output head only
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
# NCU_CASES: "TYPE N K" cases, ';'-separated (e.g. "Q6_K 151936 1024" for the 0.6B's output
# head, which takes matvec_coop_q6_k); the kernel profiled is the case's one-token mat-vec
IFS=';' read -ra cases <<< "${NCU_CASES:-Q4_K 12288 4096;Q6_K 12288 4096}"
for case in "${cases[@]}"; do
    set -- $case
    ncu --clock-control none -k "regex:^matvec_(coop_|split_)?$(echo $1 | tr A-Z a-z)\$" -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 ci/gpu_profile.py matvec $1 $2 $3 > "$out/ncu-$1-$2-$3.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issued Ipc|Eligible Warps|No Eligible|Issue Slots Busy" "$out/ncu-$1-$2-$3.txt" | head -32
done
