#!/usr/bin/env bash
# The seventeenth session's GPU calls (2026-12-03).
#   a: the first half of llama.cpp's binaries copied out of the working tree (carry
#      [".whl", ".stage/llama-sm90-1"]), MMQ_VEC_LOADS timed against the default (the
#      sixteenth session's `vec`), then ncu on the Q4_K mat-vec of issue 8's bar (4096 x 12288).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-a}" in
a)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ 2> /dev/null
    bash ci/gpu_sixteenth_session.sh vec
    MODES=" " NCU_CASES="Q4_K 4096 12288" guarded 560 bash ci/gpu_profile.sh
    ;;
esac
echo "done at t=$(t) s"
