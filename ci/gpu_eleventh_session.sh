#!/usr/bin/env bash
# The eleventh session's GPU calls, back to back on a warm machine (it goes back ~30 s after a
# call ends: start the next call at once; processes started with setsid and /tmp survive):
#   1. llama-server and llama-bench building (detached); the shapes written; the soak as issue
#      11 asks it (16 streaming clients for 10 minutes, 8B shape) started, detached; the whole
#      suite beside it (the batched kernels' rows at once, and the CPU harnesses'
#      -fno-gnu-unique, have not run on a GPU yet);
#   2. the soak's result; the batched step at 16 and 4 sequences with the batched kernels'
#      rows at once (MV_COLS_ROWS 2, GLU_COLS_PAIRED 1) and without (1, 0), alternated; the side
#      by side on the 0.6B and 8B shapes (REPS=2, the preloads on: the 0.6B's tg128 was 1.22x
#      without them);
#   3. the load test (REQUESTS=6), as many times as fit (issue 11's 16-client bar: 1.06 / 0.97
#      / 1.25x in the eighth session); VARIANT="1 0" runs it with the kernels' old layout.
#   Here first: bash ci/stage_llama_src.sh; the wheels of ci/gpu_conformance.sh's header into
#   .whl/; run(command="bash ci/gpu_eleventh_session.sh 1", carry=[".whl", ".stage"]); then 2, 3.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

if [ "${1:-1}" = 1 ]; then
    llama_build_detached
    (setsid nohup bash -c "python3 ci/shape_models.py qwen3-0.6b $dir" > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== the soak started, 600 s (t=$(t) s)"
    SOAK_SECONDS=600 bash ci/gpu_soak.sh start
    echo "== the whole suite, the soak beside it (t=$(t) s)"
    brass_suite 585 -n 12 -q
    echo "done at t=$(t) s"
    exit 0
fi

batched() {        # $1 sequences: "tg64xP | tok/s" of brass bench --parallel P on the 8B shape
    timeout 120 python3 -m engine bench "$dir/qwen3-8b.gguf" --backend cuda --parallel "$1" -r 2 -p 0 -n 64 \
        2> /dev/null | grep -oE "tg64x.*" | head -1
}

if [ "${1:-1}" = 2 ]; then
    if [ -z "${SKIP_SOAK:-}" ]; then
        echo "== the soak's result (t=$(t) s)"
        WAIT=$(left 300) bash ci/gpu_soak.sh result
    fi
    cp kernels/matvec.cuh /tmp/matvec.cuh.committed   # (the runner's git HEAD is not this tree's)
    echo "== the batched step, rows at once (2 1) or not (1 0), alternated (t=$(t) s)"
    for round in 1 2; do
        for v in "2 1" "1 0"; do
            [ "$(left "${AB_UNTIL:-330}")" -ge 60 ] || break 2
            set -- $v
            matvec_define MV_COLS_ROWS "$1"; matvec_define GLU_COLS_PAIRED "$2"
            for p in ${AB_P:-16 4}; do echo "round $round, MV_COLS_ROWS $1 GLU_COLS_PAIRED $2, P=$p: $(batched $p)"; done
        done
    done
    cp /tmp/matvec.cuh.committed kernels/matvec.cuh
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" ] && [ "$(left 400)" -gt 0 ]; do sleep 5; done
    echo "== side by side (t=$(t) s)"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/llama-*.json "$out"/brass-*.json "$out"/bytes-*
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    cp kernels/matvec.cuh /tmp/matvec.cuh.committed
    if [ -n "${VARIANT:-}" ]; then
        set -- $VARIANT
        matvec_define MV_COLS_ROWS "$1"; matvec_define GLU_COLS_PAIRED "$2"
        echo "MV_COLS_ROWS $1, GLU_COLS_PAIRED $2"
    fi
    for r in 1 2 3; do
        [ "$(left "${UNTIL:-590}")" -ge 170 ] || break
        echo "== load test $r (REQUESTS=6, t=$(t) s)"
        REQUESTS=6 timeout 165 bash ci/gpu_serving.sh 2>&1 | tail -6
        rm -f "$out"/load-*.err "$out"/load-*.json "$out"/llama-server.log "$out"/brass-serve.log
    done
    cp /tmp/matvec.cuh.committed kernels/matvec.cuh
    echo "done at t=$(t) s"
fi
