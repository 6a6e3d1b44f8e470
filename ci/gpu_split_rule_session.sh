#!/usr/bin/env bash
# Two GPU calls, sent back to back on a warm machine (it goes back ~30 s after a call ends), for
# the seventh session (2026-12-02): the split mat-vec as a per-matrix choice.
#
# The sixth session's split (every decode mat-vec's rows over MV_SPLIT warps, one switch for all)
# took Qwen3-8B from 288.0 to 301.8 tok/s and Qwen3-0.6B from 840.9 down to 802.7: a short row
# split leaves lanes idle. Now matvec_split_<kind> / matvec_cols_split_<kind> sit beside the
# unsplit kernels and the backend splits rows of K >= MV_SPLIT_MIN_K (kernels/matvec.cuh).
#   1. the mat-vec, batch and graph checks (the split kernels at K = 4096 / 12288 / 28672 among
#      them); tg128 of the 0.6B, 8B and 30B-A3B shapes at MV_SPLIT_MIN_K 4096 / 8192 / never,
#      alternated; the batched step's tokens per block (MV_COLS 8 / 16) and staging budget
#      (MV_COLS_STAGE_MAX_K) at 16 sequences (brass bench --parallel 16), alternated, the
#      batched-equals-alone check at the fastest. The choices go to /tmp for call 2. llama-bench
#      builds meanwhile.
#   2. the whole suite with those choices, then side by side with llama.cpp (REPS=3).
#   run(command="bash ci/gpu_split_rule_session.sh 1", carry=[".whl", ".stage"]); then at once 2.
# Then write the choices into kernels/matvec.cuh (the backend reads them from there).
set -uo pipefail
t0=$SECONDS
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
apply_choices() {
    [ -f /tmp/mv-min-k ] && matvec_define MV_SPLIT_MIN_K "$(cat /tmp/mv-min-k)"
    [ -f /tmp/mv-cols ] && { read -r c s < /tmp/mv-cols; matvec_define MV_COLS "$c"; matvec_define MV_COLS_STAGE_MAX_K "$s"; }
    grep -E "^#define (MV_SPLIT|MV_SPLIT_MIN_K|MV_COLS|MV_COLS_STAGE_MAX_K) " kernels/matvec.cuh | tr '\n' ' '; echo
}
tg() { brass_tg "$dir/$1.gguf" 90; }     # $1 shape

if [ "${1:-1}" = 1 ]; then
    rm -f /tmp/mv-min-k /tmp/mv-cols /tmp/mv-tg /tmp/mv-par
    (setsid nohup bash -c ". ci/gpu_lib.sh; llama_build /tmp/llama-build.log $(( $(nproc) / 2 )) llama-bench; wait" \
        > /dev/null 2>&1 < /dev/null &)
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== the mat-vec, batch and graph checks at $(apply_choices)"
    timeout 150 python3 -m pytest conformance/test_kernels.py conformance/test_batch.py conformance/test_decode_graph.py \
        -k "matmul or batched or batch or graph" -q -n 12 -p no:cacheprovider > "$out/checks.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/checks.log" | head -8; tail -1 "$out/checks.log"
    while [ ! -f "$dir/qwen3-30b-a3b.gguf" ] && [ $((SECONDS - t0)) -lt 200 ]; do sleep 2; done
    sleep 3
    echo "== tg128 at MV_SPLIT_MIN_K 4096 / 8192 / never, alternated (t=$((SECONDS - t0)) s)"
    for r in 1 2; do
        for k in 4096 8192 1000000; do
            matvec_define MV_SPLIT_MIN_K $k
            for m in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
                [ $m = qwen3-30b-a3b ] && [ $k = 8192 ] && continue   # its rows are 2048 / 4096 long
                [ $((SECONDS - t0)) -lt 400 ] || break 3
                v=$(tg $m); echo "min_k $k $m: $v"
                echo "$k $m $(echo "$v" | awk -F'|' '{print $2}' | awk '{print $1}')" >> /tmp/mv-tg
            done
        done
    done
    matvec_define MV_SPLIT_MIN_K 4096
    echo "== 16 sequences (brass bench --parallel 16 -p 0 -n 64 -r 2, Qwen3-8B): MV_COLS, MV_COLS_STAGE_MAX_K (t=$((SECONDS - t0)) s)"
    for v in "8 49152" "16 49152" "16 98304" "8 98304" "8 49152" "16 98304"; do
        [ $((SECONDS - t0)) -lt 480 ] || break
        read -r c s <<< "$v"; matvec_define MV_COLS $c; matvec_define MV_COLS_STAGE_MAX_K $s
        r=$(timeout 60 python3 -m engine bench "$dir/qwen3-8b.gguf" --backend cuda -r 2 -p 0 -n 64 --parallel 16 \
            2>> "$out/par.err" | grep -oE "tg64x16 .*")
        echo "cols $c stage $s: $r"; echo "$c $s $(echo "$r" | awk -F'|' '{print $2}' | awk '{print $1}')" >> /tmp/mv-par
    done
    python3 - <<'EOF'
import collections, pathlib, statistics
runs = collections.defaultdict(list)
for line in pathlib.Path("/tmp/mv-tg").read_text().split("\n") if pathlib.Path("/tmp/mv-tg").exists() else []:
    p = line.split()
    if len(p) == 3:
        runs[(int(p[0]), p[1])].append(float(p[2]))
mean = {k: statistics.mean(v) for k, v in runs.items()}
never = 1000000
for m in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"):
    print(m, {k: round(mean[(k, mm)], 1) for (k, mm) in sorted(mean) if mm == m})
# the MIN_K whose geometric-mean speed-up over "never" is best, no shape more than 1 % slower;
# over the same shapes for every MIN_K: one not run at a MIN_K (the 30B-A3B at 8192, no row of
# it split there) counts as "never"
best, best_gain = never, 1.0
for k in (4096, 8192):
    ratios = [mean.get((k, m), mean[(never, m)]) / mean[(never, m)]
              for m in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b") if (never, m) in mean]
    if ratios and min(ratios) >= 0.99:
        g = statistics.geometric_mean(ratios)
        print(f"min_k {k}: ratios {[round(r, 3) for r in ratios]}, geometric mean {g:.3f}")
        if g > best_gain:
            best, best_gain = k, g
pathlib.Path("/tmp/mv-min-k").write_text(str(best))
print(f"kept MV_SPLIT_MIN_K={best}")
par = collections.defaultdict(list)
for line in pathlib.Path("/tmp/mv-par").read_text().split("\n") if pathlib.Path("/tmp/mv-par").exists() else []:
    p = line.split()
    if len(p) == 3:
        par[(int(p[0]), int(p[1]))].append(float(p[2]))
pm = {k: statistics.mean(v) for k, v in par.items()}
print("16 sequences, tok/s:", {f"{c}/{s}": round(v, 1) for (c, s), v in sorted(pm.items())})
base = pm.get((8, 49152))
top = max(pm, key=pm.get, default=None)
if base and top and pm[top] >= 1.03 * base:
    pathlib.Path("/tmp/mv-cols").write_text(f"{top[0]} {top[1]}")
    print(f"kept MV_COLS={top[0]} MV_COLS_STAGE_MAX_K={top[1]} (pending its check)")
else:
    print("kept MV_COLS=8 MV_COLS_STAGE_MAX_K=49152")
EOF
    if [ -f /tmp/mv-cols ]; then
        echo "== the batched checks at $(apply_choices)(t=$((SECONDS - t0)) s)"
        timeout 100 python3 -m pytest conformance/test_kernels.py conformance/test_batch.py -k "batched or batch" -q -n 12 \
            -p no:cacheprovider > "$out/cols-checks.log" 2>&1
        echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/cols-checks.log" | head -8; tail -1 "$out/cols-checks.log"
        tail -1 "$out/cols-checks.log" | grep " passed" | grep -qv " failed\| error" || { rm -f /tmp/mv-cols; echo "dropped"; }
    fi
    echo "llama.cpp build: $(tail -1 /tmp/llama-build.log)"
    echo "done at t=$((SECONDS - t0)) s"
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
    echo "== the whole suite at $(apply_choices)(t=$((SECONDS - t0)) s)"
    timeout 300 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    rm -f "$out/gpu-conformance.xml"             # the files that come back are counted
    echo "== side by side (t=$((SECONDS - t0)) s)"
    while [ ! -x "$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" ] && [ $((SECONDS - t0)) -lt 360 ]; do sleep 5; done
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=3 \
        timeout $(( 585 - (SECONDS - t0) )) bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    echo "done at t=$((SECONDS - t0)) s"
fi
