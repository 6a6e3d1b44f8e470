#!/usr/bin/env bash
# Run by the sixth session (2026-12-02; results in perf/NOTES.md): since then a slot per thread
# and Gemma 4's fused ops are the defaults, and the fused router is gone.
# Three GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends),
# for what the fifth session of 2026-12-01 left to measure:
#   - the MoE prompt's expert mat-muls with mmq_tile_packed (MMQ_PACKED, written after ncu put
#     the tile at 78 % of L1/TEX and 3.5 % of DRAM; bit for bit the default on the CPU, never run
#     on a GPU): ci/gpu_tune_mmq.py --apply keeps the fastest variant equal to the default that
#     is >= 5 % faster per layer (the chosen mmq.cu is kept in /tmp for the later calls);
#   - BRASS_GEMMA4_FUSED_OPS=1 through the whole suite (its first half measured +3.3 % tg on
#     Gemma-4-26B-A4B; add_rms_norm with layer_output_scale and moe_norms added since, ~7 kernels
#     fewer per layer, unmeasured), then its tg128 against the defaults, alternated;
#   - the lockstep's unfused moe_ffn op by op and the delta-net hybrids' free-running bounds from
#     ci/free_running_spread.py (both changed without a GPU);
#   - a batched step's mat-vec columns per block (MV_COLS, the staging cap): tg128 x16 on the 8B
#     shape, the lever for issue 11's 16 clients;
#   - decode attention with a slot per thread (ATTN_SLOT_LANES, CPU-checked only): its GPU
#     checks and tg128 of the 0.6B and 30B-A3B shapes against the default, alternated;
#   - side by side with llama.cpp with whatever passed.
#   run(command="bash ci/gpu_next_session.sh 1", carry=[".whl", ".stage"]); then at once 2, then 3.
# Part 4 (a fresh machine, the sixth session's last ~490 s): the whole suite on the tree with
# what 1-3 chose turned on (decode attention with a slot per thread, Gemma 4's fused ops), then
# tg128 of the shapes they changed (Brass alone: no llama.cpp build fits).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
t0=$SECONDS
# a tile variant chosen by part 1 (this call's tree is a fresh copy of the checkout)
[ -f /tmp/mmq-chosen.cu ] && cp /tmp/mmq-chosen.cu kernels/mmq.cu

if [ "${1:-1}" = 1 ]; then
    bash ci/gpu_llama_builds.sh start > /dev/null
    (setsid nohup bash -c "for s in qwen3-30b-a3b gemma-4-26b-a4b qwen3-0.6b qwen3-8b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    cp kernels/mmq.cu /tmp/mmq-default.cu
    echo "== 1. MoE prompt tiles, packed variants among them (t=$((SECONDS - t0)) s)"
    timeout 150 python3 ci/gpu_tune_mmq.py --apply 2>&1 | tee "$out/tune-mmq.txt" | tail -22
    diff /tmp/mmq-default.cu kernels/mmq.cu > "$out/mmq-applied.diff" && echo "(tiles unchanged)" || cat "$out/mmq-applied.diff"
    cp kernels/mmq.cu /tmp/mmq-chosen.cu
    echo "== 2. suite with BRASS_GEMMA4_FUSED_OPS=1 and those tiles (llama.cpp builds meanwhile; t=$((SECONDS - t0)) s)"
    BRASS_GEMMA4_FUSED_OPS=1 timeout 420 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite-gemma4-fused.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite-gemma4-fused.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    bash ci/gpu_llama_builds.sh status | head -1; tail -2 /tmp/brass-shapes.log
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== 3. suite on the defaults with the chosen tiles (t=$((SECONDS - t0)) s)"
    timeout 300 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    grep -E "cuda" "$out/gpu-models.txt" 2>/dev/null | head -20     # issue 9's table: Brass CUDA against llama.cpp's goldens
    echo "== 4. gemma-4-26b-a4b tg128, BRASS_GEMMA4_FUSED_OPS alternated (t=$((SECONDS - t0)) s)"
    for r in 0 1 0 1; do
        echo "fused ops $r: $(BRASS_GEMMA4_FUSED_OPS=$r timeout 60 python3 -m engine bench "$dir/gemma-4-26b-a4b.gguf" \
            --backend cuda -r 3 -p 0 -n 128 2>/dev/null | grep -oE "tg128 .*")"
    done
    echo "== 5. qwen3-30b-a3b pp512, default tiles and chosen, alternated (t=$((SECONDS - t0)) s)"
    if cmp -s /tmp/mmq-default.cu /tmp/mmq-chosen.cu; then echo "(the default was kept)"; else
        for i in 1 2; do
            for v in default chosen; do
                cp /tmp/mmq-$v.cu kernels/mmq.cu
                echo "$v: $(timeout 60 python3 -m engine bench "$dir/qwen3-30b-a3b.gguf" --backend cuda -r 3 -p 512 -n 0 \
                    2>/dev/null | grep -oE "pp512 .*")"
            done
        done
        cp /tmp/mmq-chosen.cu kernels/mmq.cu
    fi
    if [ $((SECONDS - t0)) -lt 420 ]; then
        # A batched step's mat-vecs take at most MV_COLS tokens per block, and staged ones only as
        # many as fit MV_COLS_STAGE_MAX_K values (K = 12288, the 8B's down: 4): at 16 rows every
        # weight is read 2 to 4 times. Each token's sum is the one-token kernel's whatever the
        # block (test_batched_mat_vecs_equal_one_token_each), so only the time changes.
        echo "== 5b. qwen3-8b tg128 x16 sequences, batched mat-vec columns (MV_COLS, staging cap) (t=$((SECONDS - t0)) s)"
        cp kernels/matvec.cuh /tmp/matvec-default.cuh
        for v in "8 49152" "8 98304" "16 98304" "8 49152" "8 98304" "16 98304"; do
            set -- $v
            sed -e "s/^#define MV_COLS [0-9]*/#define MV_COLS $1/" \
                -e "s/^#define MV_COLS_STAGE_MAX_K [0-9]*/#define MV_COLS_STAGE_MAX_K $2/" /tmp/matvec-default.cuh > kernels/matvec.cuh
            echo "cols $1, staging cap $2: $(timeout 50 python3 -m engine bench "$dir/qwen3-8b.gguf" --backend cuda -r 2 -p 0 \
                -n 128 --parallel 16 2>/dev/null | grep -oE "tg128x16 .*")"
        done
        cp /tmp/matvec-default.cuh kernels/matvec.cuh
    fi
    bash ci/gpu_llama_builds.sh status | head -1
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    echo "== 6. decode attention with a slot per thread (ATTN_SLOT_LANES=1): its GPU checks, then tg128 alternated (t=$((SECONDS - t0)) s)"
    cp kernels/attention.cu /tmp/attention-file.cu
    # (a slot per warp, "default" here, against a slot per thread, whatever the file's default)
    sed 's/^#define ATTN_SLOT_LANES [0-9]*/#define ATTN_SLOT_LANES 0/' kernels/attention.cu > /tmp/attention-default.cu
    sed 's/^#define ATTN_SLOT_LANES [0-9]*/#define ATTN_SLOT_LANES 1/' kernels/attention.cu > /tmp/attention-lanes.cu
    cp /tmp/attention-lanes.cu kernels/attention.cu
    timeout 150 python3 -m pytest conformance/test_kernels.py conformance/test_kernels_model.py conformance/test_decode_graph.py \
        conformance/test_batch.py -k "attention or model or graph or batch" -q -n 12 -p no:cacheprovider > "$out/attn-lanes.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/attn-lanes.log" | head -10; tail -1 "$out/attn-lanes.log"
    for s in qwen3-0.6b qwen3-30b-a3b; do
        for v in default lanes default lanes; do
            cp /tmp/attention-$v.cu kernels/attention.cu
            echo "$s $v: $(timeout 60 python3 -m engine bench "$dir/$s.gguf" --backend cuda -r 3 -p 0 -n 128 2>/dev/null | grep -oE "tg128 .*")"
        done
    done
    cp /tmp/attention-file.cu kernels/attention.cu
    echo "== 7. side by side, REPS=3 (Gemma 4's fused ops on: BRASS_GEMMA4_FUSED_OPS=${G4:-1})"
    bash ci/gpu_llama_builds.sh wait 200 > /dev/null; bash ci/gpu_llama_builds.sh status | head -1
    BRASS_GEMMA4_FUSED_OPS=${G4:-1} LLAMA_BENCH=/tmp/llama-bench-11434/llama.cpp/build/bin/llama-bench REPS=3 DROP=1 \
        timeout $(( 585 - (SECONDS - t0) )) bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b,gemma-4-26b-a4b,qwen3.6-35b-a3b 2>&1 \
        | grep -v "^WARNING"
    echo "done at t=$((SECONDS - t0)) s"
fi

if [ "${1:-1}" = 4 ]; then
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-30b-a3b gemma-4-26b-a4b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== 8. the whole suite on the final defaults (t=$((SECONDS - t0)) s)"
    timeout 300 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    echo "== 9. tg128 on the defaults (t=$((SECONDS - t0)) s)"
    for s in qwen3-0.6b qwen3-30b-a3b gemma-4-26b-a4b; do
        [ $((SECONDS - t0)) -lt 340 ] || break
        echo "$s: $(timeout 45 python3 -m engine bench "$dir/$s.gguf" --backend cuda -r 3 -p 0 -n 128 2>/dev/null | grep -oE "tg128 .*")"
    done
    echo "done at t=$((SECONDS - t0)) s"
fi
