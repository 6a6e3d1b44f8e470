#!/usr/bin/env bash
# The twenty-first session's GPU calls (carry [".whl"]).
#   probe: issue 8's Q4_K bar kernel (matvec_split_q4_k, 4096 x 12288) under ncu (speed of
#          light with SM active against elapsed cycles, occupancy, warp states, memory), then
#          ci/gpu_preload.py's variants of matvec_q.cu timed against the defaults with every
#          output compared bit for bit (VARIANTS overrides the list; MV_WARPS cannot be one: the
#          backend launches MV_WARPS' threads from the header, and a build of fewer is refused
#          at launch; MV_SPLIT=4 reorders each row's sums, so its outputs differ by design).
#   suite: the whole suite.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

case "${1:-probe}" in
probe)
    echo "== ncu, matvec_split_q4_k 4096 x 12288 (t=$(t) s)"
    guarded 200 ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:matvec_split_q4_k -c 1 \
        python3 ci/gpu_speed.py --types Q4_K --no-floor > "$out/ncu-q4k.txt" 2>&1
    grep -E "Duration|Elapsed Cycles|SM Active Cycles|DRAM Throughput|Memory Throughput|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Issue Slots Busy|Eligible Warps|No Eligible|Warp Cycles Per Issued" "$out/ncu-q4k.txt"
    echo "== variants (t=$(t) s)"
    guarded 590 python3 ci/gpu_preload.py --variants "${VARIANTS:-;MV_STAGE_BATCH=2;MV_STAGE_BATCH=3;MV_PRELOAD_EARLY=0;MV_SPLIT=4}" \
        --json "$out/variants.json" 2>&1 | grep -v "^WARNING"
    ;;
suite)
    brass_suite 590 -n 14 -q
    ;;
esac
echo "done at t=$(t) s"
