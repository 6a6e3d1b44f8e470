#!/usr/bin/env bash
# Four GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends),
# for what the fourth session of 2026-12-01 left to measure:
#   - the suite on the defaults it turned on (F16 weights kept, MoE prompts on int8 tiles planned
#     on the device, tiled prompt attention, Gemma 4's experts fused), run once with them on
#     through the environment only;
#   - BRASS_PROMPT_GRAPHS=1 over the whole suite (its own tests passed; the rest not yet run
#     with it on), and how its replays time;
#   - BRASS_GEMMA4_FUSED_OPS=1 (Gemma 4 through rope_store on SWA layers and add_rms_norm before
#     the FFN): Gemma 4's checks with it, its tg128 with and without;
#   - issue 9's MoE free-running test 20 times with 20 seeds;
#   - the prompt figures' dependence on the repetitions (0.6B pp512: 16,924 at -r 3, 31,048 at
#     -r 12 on one machine): every repetition's figure, then the side by side (with the
#     Qwen3.6-35B-A3B shape, last measured a session before).
# Part 1: llama-bench builds and the shape-true files are written meanwhile (detached: part 2
#   and 3 find them); the suite with the defaults.
#   run(command="bash ci/gpu_levers_session.sh 1", carry=[".whl", ".stage"]); then at once
#   run(command="bash ci/gpu_levers_session.sh 2", carry=[".whl", ".stage"]); then at once
#   run(command="bash ci/gpu_levers_session.sh 3", carry=[".whl", ".stage"]); then at once
#   run(command="bash ci/gpu_levers_session.sh 4", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

if [ "${1:-1}" = 1 ]; then
    bash ci/gpu_llama_builds.sh start
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b gemma-4-26b-a4b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== 1. suite (defaults; llama.cpp builds meanwhile)"
    timeout 400 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    bash ci/gpu_llama_builds.sh status | head -1; tail -3 /tmp/brass-shapes.log
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== 2. suite with BRASS_PROMPT_GRAPHS=1"
    BRASS_PROMPT_GRAPHS=1 timeout 280 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite-prompt-graphs.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite-prompt-graphs.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    echo "== 3. pp512, every repetition (tok/s)"
    for s in qwen3-0.6b qwen3-8b; do
        for g in 0 1; do
            BRASS_PROMPT_GRAPHS=$g timeout 45 python3 -m engine bench "$dir/$s.gguf" --backend cuda -r 8 \
                -p 512 -n 0 --json > "$out/pp-$s-$g.json" 2>/dev/null
            echo "$s prompt graphs $g: $(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))[0]; print(" ".join(f"{x:.0f}" for x in r["samples"]))' "$out/pp-$s-$g.json" 2>&1)"
        done
    done
    echo "== 4. issue 9: the MoE free-running test 20 times, each with a seed of its own"
    seq 1 20 | xargs -P 10 -I{} bash -c 'BRASS_TEST_SEED=$((1000003 * {})) timeout 120 python3 -m pytest \
        "conformance/test_kernels_model.py::test_model_free_running_logits[synth-qwen3moe]" -q -p no:cacheprovider \
        > /tmp/moe-repeat-{}.log 2>&1; echo "run {} (seed $((1000003 * {}))): exit $?"' | sort -t' ' -k2 -n
    grep -h "^E " /tmp/moe-repeat-*.log | head -10
    bash ci/gpu_llama_builds.sh status | head -1
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    echo "== 3c. BRASS_GEMMA4_FUSED_OPS=1: Gemma 4's whole-model checks, then its tg128 against the composition"
    BRASS_GEMMA4_FUSED_OPS=1 timeout 100 python3 -m pytest conformance/test_kernels_model.py conformance/test_decode_graph.py \
        conformance/test_batch.py conformance/test_gemma4.py -k gemma4 -q -rfE -n 12 -p no:cacheprovider > "$out/rope-store.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/rope-store.log" | head -10; tail -1 "$out/rope-store.log"
    for r in 0 1 0 1; do
        echo "gemma-4-26b-a4b tg128 BRASS_GEMMA4_FUSED_OPS=$r: $(BRASS_GEMMA4_FUSED_OPS=$r timeout 60 python3 -m engine bench \
            "$dir/gemma-4-26b-a4b.gguf" --backend cuda -r 3 -p 0 -n 128 2>/dev/null | grep -oE "tg128 .*")"
    done
    bash ci/gpu_llama_builds.sh status | head -1
    exit 0
fi

if [ "${1:-1}" = 4 ]; then
    echo "== 5b. issue 8's Q4_K mat-vec bar (>= 75 % of the copy bandwidth): the mat-vec kernels alone"
    timeout 60 python3 ci/gpu_speed.py 2>&1 | tail -12
    echo "== 5a. where the 30B-A3B's prompt goes (0.67x llama.cpp): GPU time by kernel (CUPTI)"
    timeout 70 python3 ci/gpu_profile.py torch prefill "$dir/qwen3-30b-a3b.gguf" 512 2>&1 | head -30
    echo "== 5. side by side, REPS=3 (the defaults), each repetition's figure in the JSON files"
    bash ci/gpu_llama_builds.sh wait 120 > /dev/null; bash ci/gpu_llama_builds.sh status | head -1
    # DROP=1: each file goes once both engines have read it, so that the 35B-A3B's fits the disk
    LLAMA_BENCH=/tmp/llama-bench-11434/llama.cpp/build/bin/llama-bench REPS=3 DROP=1 timeout 420 \
        bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b,gemma-4-26b-a4b,qwen3.6-35b-a3b 2>&1 | grep -v "^WARNING"
    for f in "$out"/brass-*.json; do
        echo "$f: $(python3 -c 'import json, sys; print([[round(x) for x in r["samples"]] for r in json.load(open(sys.argv[1]))])' "$f" 2>&1)"
    done
fi
