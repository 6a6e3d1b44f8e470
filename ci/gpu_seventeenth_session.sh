#!/usr/bin/env bash
# The seventeenth session's GPU calls (2026-12-03).
#   a: the first half of llama.cpp's binaries copied out of the working tree (carry
#      [".whl", ".stage/llama-sm90-1"]), MMQ_VEC_LOADS timed against the default (the
#      sixteenth session's `vec`, now Q6_K's unpack as well), then ncu on the Q4_K mat-vec of
#      issue 8's bar (4096 x 12288) and three kernel-side variants of it (ci/gpu_preload.py).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-a}" in
a)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ 2> /dev/null
    bash ci/gpu_sixteenth_session.sh vec
    MODES=" " NCU_CASES="Q4_K 4096 12288" guarded 400 bash ci/gpu_profile.sh
    # kernel-side knobs of the decode mat-vec (the backend's grid unchanged): all three of a
    # lane's items of the bar's rows loaded before PDL_ENTRY, the L2 prefetch on every size,
    # the activations read from global memory instead of staged at K = 12288
    guarded 590 python3 ci/gpu_preload.py \
        --variants ";MV_PRELOAD=3;MV_PREFETCH_MAX_BYTES=67108864;MV_STAGE_MAX_K=8192" 2>&1 \
        | grep -v "^WARNING" | tail -14
    ;;
esac
echo "done at t=$(t) s"
