#!/usr/bin/env bash
# The fourteenth session's GPU calls (2026-12-03); carry [".whl",
# ".stage/llama-bin-11434-src.tar.xz"] for every call.
#   1. issue 11's soak with the step ahead kept (the default since the thirteenth session):
#      ci/gpu_soak.sh start (16 streaming clients, random disconnects, 1,000 idle connections,
#      600 s, 8B shape) detached, and the whole GPU suite beside it (as in the eleventh session).
#   2. (right after 1, while the machine is warm) the soak's result; on a fresh machine (the
#      soak lost) a soak of this call's own, as long as the call allows, instead. Then the load
#      test again: llama-server, brass, llama-server, on a quiet machine (llama.cpp built beside
#      the soak's end, niced).
#   3. BRASS_ROPE_ATTENTION (rope_store folded into the decode attention kernel) and
#      BRASS_ARGMAX_ADVANCE (the greedy advance in the argmax's final kernel): their GPU tests
#      and the model checks (lockstep, free running, graph against eager, batched) with both on,
#      beside llama.cpp's build (niced); tg128 of each setting in turn on the 0.6B (twice) and
#      8B shapes; then the 0.6B side by side with both off and both on.
#   suite: the whole GPU suite alone (until t = 580); the environment passes through (e.g.
#      BRASS_ROPE_ATTENTION=1 bash ci/gpu_fourteenth_session.sh suite).
#   5. the 0.6B decode's kernels by time (CUPTI), rope_attention off then on; the mat-vecs
#      alone beside a streaming read of the same bytes (ci/gpu_speed.py: the Q4_K 75 % bar).
#   4. (the last ~2 minutes of device time) the second form of rope_attention: tg128 of the 0.6B
#      with it off and on, alternated, then its GPU test.
#   part1: the first half of llama.cpp's prebuilt binaries (ci/stage_llama_sm90.sh), carry
#      [".stage/llama-sm90-1"]; a call right after it that also carries ".stage/llama-sm90-2"
#      finds llama-server and llama-bench ready (llama_ready) instead of building them (~5 min).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-1}" in
part1)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ && ls -la /tmp/llama-parts
    ;;
1)
    bash ci/gpu_soak.sh start
    brass_suite 570 -n 12 -q
    echo "soak at t=$(t) s: $(tail -1 /tmp/brass-soak/soak.log 2> /dev/null)"
    ;;
2)
    if [ -f /tmp/brass-soak/serve.pid ]; then
        LLAMA_NICE=15 llama_ready || echo "llama.cpp building (t=$(t) s)"
        WAIT=150 bash ci/gpu_soak.sh result
    else
        echo "a fresh machine: the soak of call 1 is gone; a soak of this call's own"
        SOAK_SECONDS=510 bash ci/gpu_soak.sh start && WAIT=$(left 585) bash ci/gpu_soak.sh result
        echo "done at t=$(t) s"; exit 0
    fi
    [ -f "$dir/qwen3-8b.gguf" ] || python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null
    if need_llama 380; then
        serve_round llama-server "" r1
        serve_round brass 1 r1k1
        serve_round llama-server "" r2
    fi
    python3 ci/load_table.py "$out"        # the load JSONs come back with the call
    ;;
3)
    LLAMA_NICE=15 llama_ready || echo "llama.cpp building (t=$(t) s)"
    for m in qwen3-0.6b qwen3-8b; do [ -f "$dir/$m.gguf" ] || python3 ci/shape_models.py "$m" "$dir" > /dev/null; done
    echo "shapes written (t=$(t) s)"
    BRASS_ROPE_ATTENTION=1 BRASS_ARGMAX_ADVANCE=1 guarded 230 python3 -m pytest -q -n 8 -p no:cacheprovider \
        conformance/test_kernels.py conformance/test_kernels_model.py conformance/test_batch.py \
        conformance/test_decode_graph.py -k "rope or attention or argmax or model or batch or graph or greedy" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
    echo "tests done (t=$(t) s)"
    # tg128, each setting in turn (BRASS_ROPE_ATTENTION, BRASS_ARGMAX_ADVANCE), twice on the 0.6B
    for round in 1 2; do
        for rv in "0 0" "1 0" "0 1" "1 1"; do
            set -- $rv
            [ "$(left 400)" -ge 25 ] || break
            echo "qwen3-0.6b rope=$1 advance=$2: $(BRASS_ROPE_ATTENTION=$1 BRASS_ARGMAX_ADVANCE=$2 brass_tg "$dir/qwen3-0.6b.gguf" 40)"
        done
    done
    for rv in "0 0" "1 1"; do
        set -- $rv
        [ "$(left 420)" -ge 40 ] || break
        echo "qwen3-8b rope=$1 advance=$2: $(BRASS_ROPE_ATTENTION=$1 BRASS_ARGMAX_ADVANCE=$2 brass_tg "$dir/qwen3-8b.gguf" 60)"
    done
    if need_llama 440; then
        for on in 0 1; do
            echo "== side by side, rope and advance $on"
            BRASS_ROPE_ATTENTION=$on BRASS_ARGMAX_ADVANCE=$on LLAMA_BENCH="$bin/llama-bench" REPS=3 \
                guarded 580 bash ci/gpu_side_by_side.sh qwen3-0.6b 2>&1 | grep -v "^WARNING"
        done
    fi
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
5)
    python3 ci/shape_models.py qwen3-0.6b "$dir" > /dev/null
    for v in 0 1; do
        echo "== BRASS_ROPE_ATTENTION=$v"
        BRASS_ROPE_ATTENTION=$v guarded $((200 + 200 * v)) python3 ci/gpu_profile.py torch decode "$dir/qwen3-0.6b.gguf" 20 \
            2>&1 | grep -vi warn | head -24
    done
    guarded 590 python3 ci/gpu_speed.py
    ;;
4)
    python3 ci/shape_models.py qwen3-0.6b "$dir" > /dev/null
    for round in 1 2; do
        for v in 0 1; do
            echo "qwen3-0.6b BRASS_ROPE_ATTENTION=$v: $(BRASS_ROPE_ATTENTION=$v brass_tg "$dir/qwen3-0.6b.gguf" 25)"
        done
    done
    echo "t=$(t) s"
    guarded 118 python3 -m pytest -q -p no:cacheprovider conformance/test_kernels.py -k rope_attention 2>&1 | tail -2
    ;;
esac
rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/bytes-*
echo "done at t=$(t) s"
