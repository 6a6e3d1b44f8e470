#!/usr/bin/env bash
# The next session's GPU calls (written 2026-12-03, fifteenth session; carry [".whl"]):
#   coop: the 0.6B output head's kernel: ci/gpu_tune_coop.py (MV_COOP_ROWS 1 and 2, warps,
#      blocks per SM; every variant's bits against the default's), then ncu's stall reasons and
#      occupancy for matvec_coop_q6_k on 151936 x 1024 (ci/gpu_profile.sh NCU_CASES).
#   suite: the whole GPU suite alone (until t = 580); the environment passes through.
#   part1: the first half of llama.cpp's prebuilt binaries, carry [".stage/llama-sm90-1"]; a
#      call right after it that carries ".stage/llama-sm90-2" too finds llama-bench ready
#      (llama_ready in ci/gpu_lib.sh; it worked in the fifteenth session).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-coop}" in
coop)
    guarded 300 python3 ci/gpu_tune_coop.py 2>&1 | grep -v "^WARNING" | tee "$out/tune-coop.txt" | tail -30
    MODES="${MODES- }" NCU_CASES="Q6_K 151936 1024" guarded 420 bash ci/gpu_profile.sh
    ;;
mmqncu)
    # the 30B-A3B prompt's expert mat-mul under ncu's full set (where its time goes: the
    # fifth session found L1/TEX at 78 % and 7.9 cycles per issued instruction)
    guarded 300 ncu --clock-control none --set full --import-source yes -k regex:mmq_id_q4_k -c 1 \
        python3 ci/gpu_tune_mmq.py --only default > "$out/ncu-mmq-id.txt" 2>&1
    grep -E "Duration|Throughput|Occupancy|Registers Per|Warp Cycles Per Issued|Stall|Bank|Issue Slots|Eligible|Shared|Executed Ipc" "$out/ncu-mmq-id.txt" | head -60
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
part1)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ && ls -la /tmp/llama-parts
    ;;
esac
echo "done at t=$(t) s"
