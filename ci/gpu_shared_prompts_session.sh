#!/usr/bin/env bash
# Three GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends),
# for what the seventh session (2026-12-02) wrote after its GPU time was spent:
#   1. the whole suite with BRASS_SHARED_PROMPT_GRAPHS=1 (the model's shared prompt graphs,
#      StartStep, engine/model.py, off by default until this passes; its GPU test
#      test_cuda_start_graph_equals_eager; the kernels' CPU builds now failing instead of
#      skipping when they break), llama-server and llama-bench building meanwhile, the qwen3
#      shapes written;
#   2. issue 11's load test (ci/gpu_serving.sh: 1 / 4 / 16 streaming clients, llama-server
#      --parallel 16 beside brass serve on the 8B shape) with the shared prompt graphs on, then
#      off, then the batched step at 16 sequences
#      with the rows of K >= 8192 split (the default) and never split, alternated: whether the
#      split costs the batched step; the gated kernel's knobs (kernels/matvec.cuh: GLU_PAIRED,
#      gate and up in one loop, 105 registers against 60 on Q4_K; GLU_WARPS x GLU_ROWS 16 x 2,
#      twice the warps on the 0.6B's 96 blocks), their checks and tg128 alternated;
#   3. side by side with llama.cpp (REPS=3) on the qwen3 shapes, then where the 0.6B's decode
#      token goes (ci/gpu_profile.sh, CUPTI: kernel time by name), for issue 8's last 0.6B bar.
#   4. (if ~7 minutes are left) issue 9's CUDA goldens of the models that have none yet
#      (synth-qwen35, synth-qwen35moe, synth-gemma4, synth-gemma4moe): llama.cpp b11312 with
#      CUDA (ci/build_llamacpp_cuda.sh, from .stage/llama-b11312-src.tar.xz, ~4.5 min), then
#      ci/record_goldens.py --device cuda --only ...; golden/cuda comes back packed as
#      cuda-goldens.tar.xz (unpack it over golden/ here, check `git diff --stat`, run the suite).
#   First, here (a fresh checkout has neither): bash ci/stage_llama_src.sh; bash
#   ci/stage_llama_b11312_src.sh; the wheels of ci/gpu_conformance.sh's header into .whl/.
#   run(command="bash ci/gpu_shared_prompts_session.sh 1", carry=[".whl", ".stage"]); then at once 2, 3 (, 4).
set -uo pipefail
t0=$SECONDS
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

if [ "${1:-1}" = 1 ]; then
    (setsid nohup bash -c ". ci/gpu_lib.sh; llama_build /tmp/llama-build.log $(( $(nproc) / 2 )) llama-server llama-bench; wait" \
        > /dev/null 2>&1 < /dev/null &)
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== the whole suite with BRASS_SHARED_PROMPT_GRAPHS=1 (t=$((SECONDS - t0)) s)"
    BRASS_SHARED_PROMPT_GRAPHS=1 timeout 420 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    # the skips, most frequent first: none may be a build or a plumbing failure
    grep "^SKIPPED" "$out/suite.log" | sort -t[ -k2 -rn | head -12 | cut -c1-200
    rm -f "$out/gpu-conformance.xml"             # the files that come back are counted
    echo "shapes: $(tail -1 /tmp/brass-shapes.log); llama.cpp build: $(tail -1 /tmp/llama-build.log)"
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    # every step below ends by t = 585 s (the call's limit is 600): each is guarded by the time
    # it may take, the most wanted first
    t() { echo $((SECONDS - t0)); }
    echo "== issue 11's load test (t=$(t) s)"
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-server" ] && [ "$(t)" -lt 150 ]; do sleep 5; done
    if [ -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-server" ]; then     # else gpu_serving.sh would build it again
        for v in 1 0; do
            [ "$(t)" -lt 260 ] || break
            echo "-- BRASS_SHARED_PROMPT_GRAPHS=$v"
            BRASS_SHARED_PROMPT_GRAPHS=$v timeout 150 bash ci/gpu_serving.sh 2>&1 | tail -8
            rm -f "$out"/load-*.err "$out"/load-*.json
        done
    else
        echo "llama-server not built by t=$(t) s: $(tail -1 /tmp/llama-build.log)"
    fi
    echo "== the gated kernel's knobs (GLU_WARPS x GLU_ROWS, GLU_PAIRED): the checks at 16 x 2 paired, then tg128 alternated (t=$(t) s)"
    glu() { matvec_define GLU_WARPS $1; matvec_define GLU_ROWS $2; matvec_define GLU_PAIRED $3; }
    if [ "$(t)" -lt 400 ]; then
        glu 16 2 1
        timeout 90 python3 -m pytest conformance/test_kernels.py conformance/test_batch.py conformance/test_kernels_model.py \
            -k "glu or ffn or batched or moe or model" -q -n 12 -p no:cacheprovider > "$out/glu.log" 2>&1
        echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/glu.log" | head -8; tail -1 "$out/glu.log"
    fi
    for r in 1 2; do
        for v in "8 4 0" "16 2 0" "8 4 1" "16 2 1"; do
            glu $v
            for m in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
                [ "$(t)" -lt 530 ] || break 3
                echo "glu $v $m: $(brass_tg "$dir/$m.gguf" 45)"
            done
        done
    done
    glu 8 4 0
    echo "== 16 sequences (brass bench --parallel 16 -p 0 -n 64 -r 2, Qwen3-8B), MV_SPLIT_MIN_K 8192 / never (t=$(t) s)"
    for k in 8192 1000000; do
        [ "$(t)" -lt 540 ] || break
        matvec_define MV_SPLIT_MIN_K $k
        echo "min_k $k: $(timeout 40 python3 -m engine bench "$dir/qwen3-8b.gguf" --backend cuda -r 2 -p 0 -n 64 \
            --parallel 16 2>/dev/null | grep -oE "tg64x16 .*")"
    done
    matvec_define MV_SPLIT_MIN_K 8192
    echo "done at t=$(t) s"
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    echo "== side by side (t=$((SECONDS - t0)) s)"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=3 \
        timeout 330 bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    rm -f "$out"/llama-*.log "$out"/brass-*.log
    echo "== where the 0.6B's decode token goes (t=$((SECONDS - t0)) s)"
    MODES=decode timeout $(( 585 - (SECONDS - t0) )) bash ci/gpu_profile.sh qwen3-0.6b 2>&1 | tail -30
    echo "done at t=$((SECONDS - t0)) s"
fi

if [ "${1:-1}" = 4 ]; then
    echo "== llama.cpp b11312 with CUDA (t=$((SECONDS - t0)) s)"
    timeout 360 bash ci/build_llamacpp_cuda.sh > "$out/b11312-build.log" 2>&1 || { echo "build failed:"; tail -5 "$out/b11312-build.log"; exit 1; }
    echo "== CUDA goldens of the hybrids and Gemma 4 (t=$((SECONDS - t0)) s)"
    LLAMA_CPP_LIB_PATH=/tmp/llama-b11312-cuda/lib PYTHONPATH="/tmp/llama-b11312-cuda/py:$PYTHONPATH" \
        timeout $(( 570 - (SECONDS - t0) )) python3 ci/record_goldens.py --device cuda \
        --only synth-qwen35,synth-qwen35moe,synth-gemma4,synth-gemma4moe 2>&1 | tail -15
    tar cJf "$out/cuda-goldens.tar.xz" golden/cuda && ls -la "$out/cuda-goldens.tar.xz"
    find golden/cuda -type f -newer ci/gpu_lib.sh | head -12    # the files written
    echo "done at t=$((SECONDS - t0)) s"
fi
