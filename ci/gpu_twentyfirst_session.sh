#!/usr/bin/env bash
# The twenty-first session's GPU calls (carry [".whl"]).
#   probe: issue 8's Q4_K bar kernel (matvec_split_q4_k, 4096 x 12288) under ncu (speed of
#          light with SM active against elapsed cycles, occupancy, warp states, memory), then
#          ci/gpu_preload.py's variants of matvec_q.cu timed against the defaults with every
#          output compared bit for bit; by default the switches written after this session's
#          GPU calls (MV_Q4K_SEL, MV_STAGE_ASYNC, MV_Q4K_HDR_LATE; the session timed MV_STAGE_BATCH=2/3,
#          MV_PRELOAD_EARLY=0, MV_SPLIT=4 and a cp.async weight ring). VARIANTS overrides the
#          list, SHAPES (e.g. qwen3-0.6b,qwen3-8b) adds tg128 and greedy tokens; MV_WARPS cannot be one: the
#          backend launches MV_WARPS' threads from the header, and a build of fewer is refused
#          at launch; MV_SPLIT=4 reorders each row's sums, so its outputs differ by design.
#   stalls: the same kernel under ncu's full set: every stall reason's samples for the kernel
#          (the raw page) and per SASS instruction (the source page, as CSV) into $OUT, and the
#          top instructions by stall samples printed (ci/ncu_stalls.py; first run 2026-12-04 by
#          the twenty-second session, whose parser fix it now shares).
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
    guarded 590 python3 ci/gpu_preload.py --variants "${VARIANTS:-;MV_Q4K_SEL=1;MV_STAGE_ASYNC=1;MV_Q4K_HDR_LATE=1;MV_Q4K_HDR_LATE=1,MV_PRELOAD=2;MV_Q4K_HDR_LATE=1,MV_PRELOAD=2,MV_Q4K_SEL=1,MV_STAGE_ASYNC=1;MV_STAGE_BATCH=2}" \
        ${SHAPES:+--shapes "$SHAPES"} --json "$out/variants.json" 2>&1 | grep -v "^WARNING"
    ;;
stalls)
    guarded 230 ncu --set full --import-source no -k regex:matvec_split_q4_k -c 1 -o "$out/q4k" \
        python3 ci/gpu_speed.py --types Q4_K --no-floor > "$out/ncu-run.txt" 2>&1
    echo "ncu exit $? (t=$(t) s)"
    ncu -i "$out/q4k.ncu-rep" --page raw --csv > "$out/raw.csv" 2>&1
    ncu -i "$out/q4k.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
    python3 ci/ncu_stalls.py "$out/raw.csv" "$out/sass.csv" 25
    ;;
suite)
    brass_suite 590 -n 14 -q
    ;;
esac
echo "done at t=$(t) s"
