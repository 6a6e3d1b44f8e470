#!/usr/bin/env bash
# The next session's GPU calls (written 2026-12-02 by the eleventh, after its device time was
# spent), back to back on a warm machine (it goes back ~30 s after a call ends: start the next
# call at once; processes started with setsid and /tmp survive between calls):
#   1. llama-server and llama-bench building (detached), the 8B shape written; the GPU checks of
#      the batched paths (test_batch, test_serving, the batched kernels) with
#      BRASS_BATCH_KEEP_AHEAD=1 (the step run ahead kept when the batch changes: CPU-tested
#      only); the batched step at 16 / 8 / 4 sequences with 3 rows at once and 2 rounds of rows
#      (they gained 2-6 % at 16 and lost at 4 in the eleventh session: a rule by batch size?);
#      ("MV_COLS_ROWS_MANY 3": 3 rows a warp for two groups of tokens or more, the rule on);
#   2. the load test with BRASS_BATCH_KEEP_AHEAD=0 and =1, alternated, twice, each printing the
#      worker's time split and its runs ended (issue 11's 16-client bar: 0.88-0.96x in the
#      eleventh session, brass serving at ~79 % of its own batched bench).
#   3. the whole suite on the tree as committed (after whichever of the above became defaults),
#      then the side by side on the three qwen3 shapes (REPS=2; the 30B-A3B unmeasured since the
#      eighth session) in what is left.
#   Here first: bash ci/stage_llama_src.sh; the wheels of ci/gpu_conformance.sh's header into
#   .whl/; run(command="bash ci/gpu_twelfth_session.sh 1", carry=[".whl", ".stage"]); then 2.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
cp kernels/matvec.cuh /tmp/matvec.cuh.committed   # (the runner's git HEAD is not this tree's)

batched() {        # $1 sequences: "tg64xP | tok/s" of brass bench --parallel P on the 8B shape
    timeout 120 python3 -m engine bench "$dir/qwen3-8b.gguf" --backend cuda --parallel "$1" -r 2 -p 0 -n 64 \
        2> /dev/null | grep -oE "tg64x[^|]*\| *[0-9.]+" | head -1
}

if [ "${1:-1}" = 1 ]; then
    llama_build_detached
    [ -f "$dir/qwen3-8b.gguf" ] || python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null
    echo "== GPU checks of the batched paths, BRASS_BATCH_KEEP_AHEAD=1 (t=$(t) s)"
    BRASS_BATCH_KEEP_AHEAD=1 guarded 300 python3 -m pytest -q -p no:cacheprovider -n 12 conformance/test_batch.py \
        conformance/test_serving.py conformance/test_server_cuda.py conformance/test_kernels.py -k "batch or serv or cols or glu" \
        2>&1 | tail -4
    echo "== the batched step: default, the 3-row rule on, 2 rounds of rows, alternated (t=$(t) s)"
    for round in 1 2; do
        for v in "base" "MV_COLS_ROWS_MANY 3" "MV_COLS_ROW_ITERS 2"; do
            [ "$(left 590)" -ge 60 ] || break 2
            cp /tmp/matvec.cuh.committed kernels/matvec.cuh
            [ "$v" = base ] || matvec_define $v
            echo "round $round, $v: $(batched 4) / $(batched 8) / $(batched 16)"
        done
    done
    cp /tmp/matvec.cuh.committed kernels/matvec.cuh
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-server" ] && [ "$(left 200)" -gt 0 ]; do sleep 5; done
    for round in 1 2; do
        for keep in 0 1; do
            [ "$(left 590)" -ge 75 ] || break 2
            echo "== load test, BRASS_BATCH_KEEP_AHEAD=$keep, round $round (t=$(t) s)"
            BRASS_BATCH_KEEP_AHEAD=$keep REQUESTS=6 timeout 120 bash ci/gpu_serving.sh 2>&1 \
                | grep -E "^(brass after|\|)" | grep -vE "^\|-"
            rm -f "$out"/load-*.err "$out"/load-*.json "$out"/llama-server.log "$out"/brass-serve.log
        done
    done
    echo "done at t=$(t) s"
fi

if [ "${1:-1}" = 3 ]; then
    brass_suite 330 -n 14 -q
    echo "== side by side (t=$(t) s)"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/llama-*.json "$out"/brass-*.json "$out"/bytes-*
    echo "done at t=$(t) s"
fi
