#!/usr/bin/env bash
# Three GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends),
# for what the sixth session of 2026-12-02 left to measure:
#   1. decode mat-vecs with a row split over MV_SPLIT warps (kernels/matvec.cuh, written and
#      CPU-checked without a GPU): its GPU checks at 2 and 4, the mat-vecs alone (ci/gpu_speed.py:
#      issue 8's Q4_K bar is 75 % of the copy rate, 59 % at 1) and tg128 of the 0.6B and 8B
#      shapes at 1 / 2 / 4, alternated; the fastest split whose checks passed and that decodes
#      the 8B >= 2 % faster than 1 is kept for calls 2 and 3 (in /tmp);
#      llama-server and llama-bench build meanwhile;
#   2. the whole suite with that split, then side by side with llama.cpp (REPS=3);
#   3. decode attention a slot per thread (ATTN_SLOT_LANES, on since the sixth session: timed
#      only on head_dim 128) against a slot per warp on Gemma-4-26B-A4B (head_dim 256 / 512),
#      alternated; issue 11's load test (ci/gpu_serving.sh: 1 / 4 / 16 streaming clients
#      against llama-server --parallel 16 on the 8B shape) with that split; the CUDA mutations
#      (ci/gpu_mutations.sh, the delta net's and conv's among them) in what time is left.
#   run(command="bash ci/gpu_split_session.sh 1", carry=[".whl", ".stage"]); then at once 2, then 3.
# Then write the chosen MV_SPLIT into kernels/matvec.cuh (the backend reads it from there).
set -uo pipefail
t0=$SECONDS
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
split_to() { sed -i "s/^#define MV_SPLIT [0-9]*/#define MV_SPLIT $1/" kernels/matvec.cuh; }
[ -f /tmp/mv-split ] && split_to "$(cat /tmp/mv-split)"
tg() { brass_tg "$dir/$1.gguf"; }     # $1 shape

if [ "${1:-1}" = 1 ]; then
    rm -f /tmp/mv-split /tmp/mv-split-passed /tmp/mv-split-tg   # a rerun starts afresh
    split_to 1
    # detached, so that it goes on after this call (a warm runner keeps /tmp and its processes)
    (setsid nohup bash -c ". ci/gpu_lib.sh; llama_build /tmp/llama-build.log $(( $(nproc) / 2 )) llama-server llama-bench; wait" \
        > /dev/null 2>&1 < /dev/null &)
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    for s in 2 4; do
        split_to $s
        echo "== MV_SPLIT=$s: the mat-vec, batch, graph and whole-model checks (t=$((SECONDS - t0)) s)"
        timeout 120 python3 -m pytest conformance/test_kernels.py conformance/test_batch.py conformance/test_decode_graph.py \
            conformance/test_kernels_model.py -k "matvec or matmul or mat_vec or batch or graph or model" -q -n 12 \
            -p no:cacheprovider > "$out/split-$s.log" 2>&1
        echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/split-$s.log" | head -8; tail -1 "$out/split-$s.log"
        # passed: pytest's summary line says so and names no failure (a timeout leaves none)
        tail -1 "$out/split-$s.log" | grep " passed" | grep -qv " failed\| error" && echo $s >> /tmp/mv-split-passed
    done
    for s in 1 2 4; do
        split_to $s
        echo "== MV_SPLIT=$s: mat-vecs alone (t=$((SECONDS - t0)) s)"
        timeout 70 python3 ci/gpu_speed.py --dir "$dir" 2>&1 | grep -E "copy|Q4_K|Q6_K|Q8_0|F16" | tail -9
    done
    echo "== tg128 at MV_SPLIT 1 / 2 / 4, alternated (shapes: $(tail -1 /tmp/brass-shapes.log); t=$((SECONDS - t0)) s)"
    for r in 1 2; do
        for s in 1 2 4; do
            split_to $s
            for m in qwen3-0.6b qwen3-8b; do
                [ $((SECONDS - t0)) -lt 500 ] || break 3
                v=$(tg $m); echo "split $s $m: $v"
                echo "$s $m $(echo "$v" | awk -F'|' '{print $2}' | awk '{print $1}')" >> /tmp/mv-split-tg
            done
        done
    done
    # the fastest passed split on the 8B (mean of its runs), if >= 2 % faster than 1
    python3 - <<'EOF'
import collections, pathlib
runs = collections.defaultdict(list)
tg = pathlib.Path("/tmp/mv-split-tg")
for line in (tg.read_text() if tg.exists() else "").split("\n"):
    p = line.split()
    if len(p) == 3 and p[1] == "qwen3-8b" and p[2]:
        runs[int(p[0])].append(float(p[2]))
passed = {int(s) for s in pathlib.Path("/tmp/mv-split-passed").read_text().split()} \
    if pathlib.Path("/tmp/mv-split-passed").exists() else set()
mean = {s: sum(v) / len(v) for s, v in runs.items() if v}
base = mean.get(1)
best = max((s for s in mean if s in passed), key=mean.get, default=None)
print("8B tg128 means:", {s: round(m, 1) for s, m in sorted(mean.items())}, "checks passed:", sorted(passed))
if base and best and mean[best] >= 1.02 * base:
    pathlib.Path("/tmp/mv-split").write_text(str(best))
    print(f"kept MV_SPLIT={best}")
else:
    print("kept MV_SPLIT=1")
EOF
    echo "llama.cpp build: $(tail -1 /tmp/llama-build.log)"
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== the whole suite at MV_SPLIT=$(grep -oE '^#define MV_SPLIT [0-9]+' kernels/matvec.cuh | awk '{print $3}') (t=$((SECONDS - t0)) s)"
    timeout 300 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    echo "== side by side (t=$((SECONDS - t0)) s)"
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" ] && [ $((SECONDS - t0)) -lt 360 ]; do sleep 5; done
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=3 \
        timeout $(( 585 - (SECONDS - t0) )) bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 3 ]; then
    echo "== gemma-4-26b-a4b tg128, decode attention a slot per thread (1) or per warp (0), alternated"
    [ -f "$dir/gemma-4-26b-a4b.gguf" ] || python3 ci/shape_models.py gemma-4-26b-a4b "$dir" > /dev/null
    cp kernels/attention.cu /tmp/attention-lanes.cu
    for v in 1 0 1 0; do
        sed "s/^#define ATTN_SLOT_LANES [0-9]*/#define ATTN_SLOT_LANES $v/" /tmp/attention-lanes.cu > kernels/attention.cu
        echo "lanes $v: $(tg gemma-4-26b-a4b)"
    done
    cp /tmp/attention-lanes.cu kernels/attention.cu
    rm -f "$dir/gemma-4-26b-a4b.gguf"            # the disk: the 8B's and llama-server's room
    echo "== issue 11's load test at MV_SPLIT=$(grep -oE '^#define MV_SPLIT [0-9]+' kernels/matvec.cuh | awk '{print $3}') (t=$((SECONDS - t0)) s)"
    timeout $(( 500 - (SECONDS - t0) )) bash ci/gpu_serving.sh 2>&1 | tail -30
    if [ $((SECONDS - t0)) -lt 480 ]; then
        echo "== CUDA mutations (ci/gpu_mutations.sh: each planted bug must be caught; t=$((SECONDS - t0)) s)"
        timeout $(( 585 - (SECONDS - t0) )) bash ci/gpu_mutations.sh 2>&1 | tail -8
    fi
    echo "done at t=$((SECONDS - t0)) s"
fi
