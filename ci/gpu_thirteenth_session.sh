#!/usr/bin/env bash
# The next session's GPU calls (written 2026-12-03 by the twelfth). Every call starts what it
# needs itself: in the twelfth session the machine went back between calls (a fresh one each
# time), so a call that counted on the previous call's llama.cpp build waited on nothing and
# its load tests never ran.
#   1. llama-server and llama-bench building (detached, so a warm machine keeps the build for
#      the next call), the 8B shape written, the whole suite on the tree as committed
#      (MV_COLS_ROWS_MANY 3 since the twelfth session: its suite reached ~95 % with no failure
#      beside the build and ran out of time; this one has until t = 560).
#   2. the load test with BRASS_BATCH_KEEP_AHEAD=0 and =1, alternated (issue 11's 16-client
#      bar: 0.88-0.96x in the eleventh session, brass serving at ~79 % of its own bench).
#   3. the side by side on the three qwen3 shapes (REPS=2; the 30B-A3B unmeasured since the
#      eighth session).
#   Here first: bash ci/stage_llama_src.sh; the wheels of ci/gpu_conformance.sh's header into
#   .whl/; run(command="bash ci/gpu_thirteenth_session.sh 1", carry=[".whl", ".stage"]); then 2
#   and 3 at once after each other.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
server="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-server"

need_llama() {     # $1: until t = $1, wait for llama-server, starting its build if none was
    [ -f /tmp/llama-build.log ] || llama_build_detached
    while [ ! -x "$server" ] && [ "$(left "$1")" -gt 0 ]; do sleep 5; done
    [ -x "$server" ] || { echo "llama.cpp not built by t=$(t) s:"; tail -3 /tmp/llama-build.log; return 1; }
}

case "${1:-1}" in
1)
    [ -f /tmp/llama-build.log ] || llama_build_detached
    [ -f "$dir/qwen3-8b.gguf" ] || python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null
    brass_suite 560 -n 14 -q
    ;;
2)
    [ -f /tmp/llama-build.log ] || llama_build_detached
    [ -f "$dir/qwen3-8b.gguf" ] || python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null
    need_llama 330 || exit 1
    for round in 1 2; do
        for keep in 0 1; do
            [ "$(left 590)" -ge 75 ] || break 2
            echo "== load test, BRASS_BATCH_KEEP_AHEAD=$keep, round $round (t=$(t) s)"
            BRASS_BATCH_KEEP_AHEAD=$keep REQUESTS=6 timeout 120 bash ci/gpu_serving.sh 2>&1 \
                | grep -E "^(brass after|\|)" | grep -vE "^\|-"
            rm -f "$out"/load-*.err "$out"/load-*.json "$out"/llama-server.log "$out"/brass-serve.log
        done
    done
    ;;
3)
    need_llama 300 || exit 1
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/llama-*.json "$out"/brass-*.json "$out"/bytes-*
    ;;
esac
echo "done at t=$(t) s"
