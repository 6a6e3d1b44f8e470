#!/usr/bin/env bash
# The next session's GPU calls (written 2026-12-02 by the tenth, after its device time was spent),
# back to back on a warm machine (it goes back ~30 s after a call ends: start the next call at
# once; processes started with setsid and /tmp survive between calls):
#   1. llama-server and llama-bench building (detached); the soak as issue 11 asks it (16
#      streaming clients for 10 minutes, 8B shape) started, detached; the whole suite beside it
#      (the CPU harnesses' -fno-gnu-unique fix has not run on a GPU yet);
#   2. the soak's result; the side by side on the three qwen3 shapes (REPS=3) with the preloads
#      on (issue 8: the 0.6B's tg128 was 1.22x without them; the 30B-A3B not measured since the
#      eighth session);
#   3. the load test three times (REQUESTS=6; issue 11's 16-client bar: 1.06 / 0.97 / 1.25x in
#      the eighth session).
#   First, here: bash ci/stage_llama_src.sh; the wheels of ci/gpu_conformance.sh's header into
#   .whl/; run(command="bash ci/gpu_eleventh_session.sh 1", carry=[".whl", ".stage"]); then 2, 3.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

if [ "${1:-1}" = 1 ]; then
    llama_build_detached
    echo "== the soak started, 600 s (t=$(t) s)"
    SOAK_SECONDS=600 bash ci/gpu_soak.sh start
    echo "== the whole suite, the soak beside it (t=$(t) s)"
    brass_suite 560 -n 12 -q
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== the soak's result (t=$(t) s)"
    WAIT=$(left 200) bash ci/gpu_soak.sh result
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" ] && [ "$(left 200)" -gt 0 ]; do sleep 5; done
    echo "== side by side (t=$(t) s)"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=3 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/llama-*.json "$out"/brass-*.json "$out"/bytes-*
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    for r in 1 2 3; do
        [ "$(left 590)" -ge 170 ] || break
        echo "== load test $r (REQUESTS=6, t=$(t) s)"
        REQUESTS=6 timeout 165 bash ci/gpu_serving.sh 2>&1 | tail -6
        rm -f "$out"/load-*.err "$out"/load-*.json "$out"/llama-server.log "$out"/brass-serve.log
    done
    echo "done at t=$(t) s"
fi
