#!/usr/bin/env bash
# Two GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends), for
# the eighth session (2026-12-02; its first two calls were ci/gpu_shared_prompts_session.sh 1, 2):
#   1. llama-server and llama-bench building on every core meanwhile, the qwen3 shapes written:
#      the GPU checks of matvec_glu_wide_ (kernels/matvec.cuh: 16 warps x 2 rows, gate and up in
#      one loop, for gated launches of fewer than 2 blocks per SM), tg128 with it and without
#      (GLU_WIDE_MAX_BLOCKS_PER_SM 0) alternated on the 0.6B and 30B-A3B shapes, then issue 11's
#      load test (ci/gpu_serving.sh) with the shared prompt graphs on, then off;
#   2. side by side with llama.cpp (REPS=2) on the qwen3 shapes.
#   run(command="bash ci/gpu_eighth_session.sh 1", carry=[".whl", ".stage"]); then at once 2.
set -uo pipefail
t0=$SECONDS
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
t() { echo $((SECONDS - t0)); }

if [ "${1:-1}" = 1 ]; then
    llama_build /tmp/llama-build.log "$(nproc)" llama-server llama-bench
    (setsid nohup bash -c "for s in qwen3-8b qwen3-0.6b qwen3-30b-a3b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== matvec_glu_wide_'s GPU checks (t=$(t) s)"
    timeout 200 python3 -m pytest conformance/test_kernels.py conformance/test_batch.py conformance/test_kernels_model.py \
        -k "glu or ffn or batched or moe or model" -q -n 6 -p no:cacheprovider > "$out/glu.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/glu.log" | head -8; tail -1 "$out/glu.log"
    echo "== tg128, the wide gated kernel on (2) and off (0), alternated (t=$(t) s)"
    for v in 2 0 2 0; do
        matvec_define GLU_WIDE_MAX_BLOCKS_PER_SM $v
        for m in qwen3-0.6b qwen3-30b-a3b; do
            while [ ! -f "$dir/$m.gguf" ] && [ "$(t)" -lt 280 ]; do sleep 3; done
            [ "$(t)" -lt 280 ] || break 2
            echo "wide $v $m: $(brass_tg "$dir/$m.gguf" 40)"
        done
    done
    matvec_define GLU_WIDE_MAX_BLOCKS_PER_SM 2
    echo "== issue 11's load test (t=$(t) s)"
    wait "$LLAMA_BUILD_PID"
    echo "llama.cpp build done at t=$(t) s: $(tail -1 /tmp/llama-build.log)"
    if [ -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-server" ]; then
        for v in 1 0; do
            [ "$(t)" -lt 440 ] || break
            echo "-- BRASS_SHARED_PROMPT_GRAPHS=$v"
            BRASS_SHARED_PROMPT_GRAPHS=$v timeout $(( 585 - $(t) )) bash ci/gpu_serving.sh 2>&1 | tail -8
            rm -f "$out"/load-*.err "$out"/load-*.json "$out"/llama-server.log
        done
    fi
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== side by side (t=$(t) s)"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=${REPS:-2} \
        timeout $(( 590 - $(t) )) bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log
    echo "done at t=$(t) s"
fi
