#!/usr/bin/env bash
# The thirteenth session's GPU calls (2026-12-03). Every call starts what it needs itself (the
# machine may go back between calls). llama-server and llama-bench come prebuilt
# (ci/stage_llama_sm90.sh: sm_90, CUDA 13.0, the recipe of ci/gpu_lib.sh llama_build), packed
# as one tar.xz of ~44 MB in two parts, since a call carries 64 MiB with the tree (31 MB) and
# the wheels: `part1` leaves the first on the machine, the next call (right after, while the
# machine is warm) brings the second. Where they are not there or do not run, the source is
# built detached as before (~4.5 min).
#   part1: run(command="bash ci/gpu_thirteenth_session.sh part1", carry=[".stage/llama-sm90-1"])
#   then run(command="bash ci/gpu_thirteenth_session.sh N", carry=[".whl", ".stage/llama-sm90-2",
#   ".stage/llama-bin-11434-src.tar.xz"]) for N in:
#   1. the load test (issue 11), REQUESTS=6: brass with BRASS_BATCH_KEEP_AHEAD=0 and =1 while
#      llama.cpp builds (when it must), then llama-server, brass =1 and =0, llama-server again;
#      before them (beside the build too) the Q6_K coop mat-vec (BRASS_Q6K_COOP) against the
#      default on the 0.6B and 8B shapes: the same greedy tokens, tg128 alternated;
#      then the batched step's kernels by time (CUPTI). Carry [".whl",
#      ".stage/llama-bin-11434-src.tar.xz"] alone when the prebuilt parts cannot come in two
#      calls in a row (the machine is not always kept between calls).
#   2. the whole GPU suite on this tree, then the side by side of the 0.6B shape.
#   3. the side by side of the 8B and 30B-A3B shapes.
#   suite: the whole GPU suite alone (until t = 580).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

coop_ab() {     # $1 shape, $2 rounds: BRASS_Q6K_COOP 0 / 1, the same 64 greedy tokens, tg128 alternated
    grep -q "matvec_coop_" kernels/matvec.cuh || return 0      # (a tree without the kernel)
    [ -f "$dir/$1.gguf" ] || python3 ci/shape_models.py "$1" "$dir" > /dev/null
    for v in 0 1; do
        BRASS_Q6K_COOP=$v timeout 90 python3 -m engine generate "$dir/$1.gguf" --backend cuda --prompt "The lighthouse" \
            --temperature 0 --max-tokens 64 --json 2> /dev/null \
            | python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens"])' > "/tmp/coop-$v.txt"
    done
    if [ -s /tmp/coop-0.txt ] && cmp -s /tmp/coop-0.txt /tmp/coop-1.txt; then
        echo "$1: 64 greedy tokens equal with and without the coop kernel"
    else
        echo "$1: greedy tokens DIFFER or missing:"; head -c 300 /tmp/coop-0.txt /tmp/coop-1.txt
    fi
    for round in $(seq 1 "$2"); do
        for v in 0 1; do
            [ "$(left 590)" -ge 60 ] || return
            echo "$1 BRASS_Q6K_COOP=$v: $(BRASS_Q6K_COOP=$v brass_tg "$dir/$1.gguf" 60)"
        done
    done
}

case "${1:-1}" in
part1)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ && ls -la /tmp/llama-parts
    ;;
1)
    # the build beside the first two rounds (brass only: both settings under the same load),
    # then llama-server and brass again on a quiet machine
    llama_ready || echo "llama.cpp building (t=$(t) s)"
    [ -f "$dir/qwen3-8b.gguf" ] || { python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null; echo "8B shape written (t=$(t) s)"; }
    grep -q "matvec_coop_" kernels/matvec.cuh && guarded 200 python3 ci/gpu_coop_check.py
    coop_ab qwen3-0.6b 2
    coop_ab qwen3-8b 1
    if ! llama_ready; then
        serve_round brass 0 b0
        serve_round brass 1 b1
    fi
    if need_llama 420; then
        serve_round llama-server "" r1
        serve_round brass 1 r1k1
        serve_round brass 0 r1k0
        serve_round llama-server "" r2
    fi
    python3 ci/load_table.py "$out"        # the load JSONs come back with the call
    guarded 590 python3 ci/gpu_profile.py torch batch "$dir/qwen3-8b.gguf" 20 2>&1 | grep -vi warn | head -24
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
2)
    llama_ready || true
    brass_suite 430 -n 14 -q
    need_llama 440 && LLAMA_BENCH="$bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b 2>&1 | grep -v "^WARNING"
    ;;
3)
    need_llama 300 || exit 1
    LLAMA_BENCH="$bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    ;;
esac
rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/bytes-*
echo "done at t=$(t) s"
