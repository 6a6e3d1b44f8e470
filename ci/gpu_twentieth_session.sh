#!/usr/bin/env bash
# The twentieth session's GPU calls. Carry [".whl", ".stage", ".scratch/mmq-old.cu"] for tail.
#   tail:  (.scratch/mmq-old.cu: git show 85456ce:kernels/mmq.cu) mmq_id's out-of-range block row (scheduled last) walking all S slots in every thread
#          (the nineteenth session's kernels/mmq.cu, carried as .scratch/mmq-old.cu) against a
#          thread per slot (the tree's): ci/gpu_tune_mmq.py's default alternated twice (µs a
#          layer), ncu's SM active cycles against elapsed on the tree's mmq_id_q4_k, the 30B-A3B
#          pp512 alternated twice, the mmq GPU tests on the tree's. llama-bench builds meanwhile
#          (detached, so that `sbs` in the next call finds it while the runner is warm).
#   sbs:   the three qwen3 shapes side by side (REPS=3), llama-bench from the build above (or
#          built now, ~4.5 min).
#   suite: the whole suite.
#   final: the whole suite, then `pytest perf/ --benchmark` in the time left (its results JSON
#          to $OUT, for python -m perf.baseline).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

pp30() {
    timeout "${1:-70}" python3 -m engine bench "$dir/qwen3-30b-a3b.gguf" --backend cuda -r 3 -p 512 -n 0 2>/dev/null \
        | grep -oE "pp512 .*"
}

case "${1:-tail}" in
tail)
    [ -f .stage/llama-bin-11434-src.tar.xz ] && LLAMA_NICE=10 llama_ready
    mkdir -p "$dir"
    python3 ci/shape_models.py qwen3-30b-a3b "$dir" > /dev/null &
    writer=$!
    cp kernels/mmq.cu /tmp/mmq-new.cu; cp .scratch/mmq-old.cu /tmp/mmq-old.cu
    for i in 1 2; do for v in old new; do
        cp /tmp/mmq-$v.cu kernels/mmq.cu
        echo "-- $v: $(guarded 200 python3 ci/gpu_tune_mmq.py --only default 2>&1 | grep -E '^\| default')"
    done; done
    cp /tmp/mmq-new.cu kernels/mmq.cu
    echo "== ncu, mmq_id_q4_k (t=$(t) s)"
    for v in old new; do
        cp /tmp/mmq-$v.cu kernels/mmq.cu
        guarded 300 ncu --section SpeedOfLight -k regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only default \
            > "$out/ncu-$v.txt" 2>&1
        echo "-- $v"; grep -E "Duration|Elapsed Cycles|SM Active Cycles" "$out/ncu-$v.txt"
    done
    cp /tmp/mmq-new.cu kernels/mmq.cu
    wait "$writer"
    echo "== qwen3-30b-a3b pp512, old and new alternated (t=$(t) s)"
    for i in 1 2; do for v in old new; do
        [ "$(left 400)" -ge 45 ] || break 2
        cp /tmp/mmq-$v.cu kernels/mmq.cu; echo "$v: $(pp30 60)"
    done; done
    cp /tmp/mmq-new.cu kernels/mmq.cu
    echo "== the mmq GPU tests (t=$(t) s)"
    guarded 590 bash ci/gpu_conformance.sh -n 8 -q -k "mmq or moe or matmul_id" > "$out/mmq-tests.log" 2>&1
    tail -1 "$out/mmq-tests.log"; grep -E "^(FAILED|ERROR)" "$out/mmq-tests.log" | head
    rm -f "$out/gpu-conformance.xml"
    echo "llama.cpp build: $(tail -1 /tmp/llama-build.log 2>/dev/null)"
    ;;
sbs)
    need_llama 300 || exit 1
    mkdir -p "$dir"
    for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
        [ -f "$dir/$s.gguf" ] || python3 ci/shape_models.py "$s" "$dir" > /dev/null
    done
    echo "shapes written (t=$(t) s)"
    LLAMA_BENCH="$bin/llama-bench" REPS=3 guarded 595 bash ci/gpu_side_by_side.sh 2>&1 | grep -v "^WARNING"
    ;;
suite)
    brass_suite 590 -n 14 -q
    ;;
final)
    brass_suite 420 -n 14 -q
    echo "== pytest perf/ --benchmark (t=$(t) s)"
    guarded 590 python3 -m pytest perf/ --benchmark -q -p no:cacheprovider > "$out/perf.log" 2>&1
    echo "perf exit $?"; grep -vE "^WARNING|^\s*$" "$out/perf.log" | tail -30
    cp perf/.results/*.json "$out/" 2>/dev/null
    ;;
esac
echo "done at t=$(t) s"
