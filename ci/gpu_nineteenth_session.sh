#!/usr/bin/env bash
# The nineteenth session's GPU calls: the eighteenth's levers timed in one call, the suite on the
# choice in the next (the choice kept under /tmp, which a warm runner keeps between calls).
# Carry [".whl"].
#   tune:  ci/gpu_tune_mmq.py over the MoE prompt's new tile variants (every output the default's
#          bits; the best applied when 5 % faster per layer), MV_MIN_BLOCKS=4 against the
#          default (ci/gpu_preload.py: bits, the mat-vecs alone, tg128 of the 0.6B shape
#          alternated; kept when issue 8's Q4_K 4096 x 12288 is 3 % faster and tg128 no more
#          than 0.5 % slower), then the Qwen3-30B-A3B pp512 default and chosen alternated.
#          The chosen kernels/mmq.cu and matvec.cuh go to /tmp/brass-chosen/.
#   suite: the whole suite on /tmp/brass-chosen/'s sources when present (else the tree's).
#   async: (written for the next session, not yet run) the unpack-latency variants (MMQ_X_ASYNC,
#          MMQ_UNPACK_UNROLL; ci/gpu_tune_mmq.py, bits checked, the best applied when 5 % faster a
#          layer), the Qwen3-30B-A3B pp512 with it against the default alternated, ncu's stall
#          reasons on both, and the mmq GPU tests on the choice; kept as in tune for `suite`.
#   ldg:   (written for the next session, not yet run) MV_LDG=1 (the Q4_K mat-vecs' weight loads
#          as ld.global.nc where the default's are generic) against the default, as tune does
#          MV_MIN_BLOCKS (kept under the same rule into /tmp/brass-chosen/matvec_q.cuh).
#   sbs:   llama.cpp's llama-bench built from the carried source (.stage/llama-bin-11434-src.tar.xz,
#          ci/stage_llama_src.sh; carry [".whl", ".stage"]) while the three qwen3 shapes are
#          written and Brass's kernels compiled, then ci/gpu_side_by_side.sh (REPS=3).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
keep=/tmp/brass-chosen

pp30() {
    timeout "${1:-70}" python3 -m engine bench "$dir/qwen3-30b-a3b.gguf" --backend cuda -r 3 -p 512 -n 0 2>/dev/null \
        | grep -oE "pp512 .*"
}

# keep_mv JSON NAME VALUE FILE: a mat-vec switch (ci/gpu_preload.py's --json of the default and
# NAME=VALUE) set into $keep/FILE when every output is the default's, issue 8's Q4_K 4096 x 12288
# mat-vec is at least 3 % faster, and no shape's tg128 is more than 0.5 % slower
keep_mv() {
    if python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
base, var = d["variants"]
us = {(m["type"], m["N"], m["K"], m["variant"]): m["us"] for m in d["matvec"]}
bar = us[("Q4_K", 4096, 12288, base)] / us[("Q4_K", 4096, 12288, var)]
tg = [min(r[var]) / max(r[base]) for r in d["tg"]]
print(f"{var}: the bar's mat-vec {bar:.3f}x, tg128 worst {min(tg) if tg else 0:.3f}x")
sys.exit(0 if not d["differ"] and bar >= 1.03 and tg and min(tg) >= 0.995 else 1)
PY
    then sed -i "s/^#define $2 [0-9]*/#define $2 $3/" "$keep/$4"; echo "kept"; else echo "not kept"; fi
}

# tune_mmq UNTIL VARIANTS: the 30B-A3B shape written in the background (pid $writer), then
# ci/gpu_tune_mmq.py --apply over VARIANTS ("default" first) until t = UNTIL; the tree's
# kernels/mmq.cu before and after in /tmp/mmq-default.cu and /tmp/mmq-chosen.cu (and $keep)
tune_mmq() {
    mkdir -p "$dir" "$keep"
    [ -f "$dir/qwen3-30b-a3b.gguf" ] || python3 ci/shape_models.py qwen3-30b-a3b "$dir" > /dev/null &
    writer=$!
    cp kernels/mmq.cu /tmp/mmq-default.cu
    guarded "$1" python3 ci/gpu_tune_mmq.py --apply --only "$2" \
        2>&1 | grep -v "^WARNING" | tee "$out/tune-mmq.txt" | tail -14
    cp kernels/mmq.cu /tmp/mmq-chosen.cu
    cp kernels/mmq.cu "$keep/mmq.cu"
    diff /tmp/mmq-default.cu /tmp/mmq-chosen.cu | grep "^>"
}

# pp30_alternated UNTIL: the 30B-A3B pp512 with /tmp/mmq-default.cu and /tmp/mmq-chosen.cu
# alternated twice (after the writer), while there is time before t = UNTIL
pp30_alternated() {
    wait "$writer"
    echo "== qwen3-30b-a3b pp512, default and chosen, alternated (t=$(t) s)"
    if cmp -s /tmp/mmq-default.cu /tmp/mmq-chosen.cu; then echo "(the default was kept)"; else
        for i in 1 2; do for v in default chosen; do
            [ "$(left "$1")" -ge 45 ] || break 2
            cp /tmp/mmq-$v.cu kernels/mmq.cu; echo "$v: $(pp30 60)"
        done; done
    fi
    cp /tmp/mmq-chosen.cu kernels/mmq.cu
}

case "${1:-tune}" in
tune)
    tune_mmq 230 "default,banks,banks cap5,x raw,banks x raw,banks x raw cap5,banks x raw skip,banks x raw skip cap5,skip"
    echo "== MV_MIN_BLOCKS=4 (t=$(t) s)"
    guarded 400 python3 ci/gpu_preload.py --variants ";MV_MIN_BLOCKS=4" --shapes qwen3-0.6b --rounds 2 \
        --json "$out/preload-min-blocks.json" 2>&1 | grep -v "^WARNING" | tail -14
    cp kernels/matvec.cuh "$keep/matvec.cuh"
    keep_mv "$out/preload-min-blocks.json" MV_MIN_BLOCKS 4 matvec.cuh
    pp30_alternated 585
    ;;
async)
    tune_mmq 200 "default,x async,unroll2,unroll2 x async,unroll2 x async cap4,unroll4 x async cap4"
    chosen=$(grep -oE "^best: .*\(([^,]*)," "$out/tune-mmq.txt" | sed -E 's/.*\(([^,]*),/\1/')
    echo "== the mmq GPU tests with it (t=$(t) s)"
    guarded 330 bash ci/gpu_conformance.sh -n 8 -q -k "mmq or moe or matmul_id" > "$out/mmq-tests.log" 2>&1
    tail -2 "$out/mmq-tests.log"; grep -E "^(FAILED|ERROR)" "$out/mmq-tests.log" | head
    rm -f "$out/gpu-conformance.xml"
    pp30_alternated 480
    echo "== ncu stall reasons, mmq_id_q4_k: default and ${chosen:-default} (t=$(t) s)"
    cp /tmp/mmq-default.cu kernels/mmq.cu
    for v in default ${chosen:+"$chosen"}; do
        [ "$(left 590)" -ge 40 ] || break
        guarded 590 ncu --section SpeedOfLight --section Occupancy \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            -k regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only "$v" > "$out/ncu-mmq-${v// /-}.txt" 2>&1
        echo "-- $v"; grep -E "Duration|L1/TEX Cache Throughput|Achieved Occupancy|stalled" "$out/ncu-mmq-${v// /-}.txt" \
            | awk '$NF + 0 >= 0.2 || !/stalled/' | head -16
    done
    cp /tmp/mmq-chosen.cu kernels/mmq.cu
    ;;
ldg)
    mkdir -p "$keep"
    guarded 400 python3 ci/gpu_preload.py --variants ";MV_LDG=1" --shapes qwen3-0.6b,qwen3-8b --rounds 2 \
        --json "$out/preload-ldg.json" 2>&1 | grep -v "^WARNING" | tail -14
    cp kernels/matvec_q.cuh "$keep/matvec_q.cuh"
    keep_mv "$out/preload-ldg.json" MV_LDG 1 matvec_q.cuh
    ;;
suite)
    for f in mmq.cu matvec.cuh matvec_q.cuh; do
        [ -f "$keep/$f" ] && cp "$keep/$f" "kernels/$f" && echo "kernels/$f from $keep"
    done
    grep -E "^#define (MMQ_(BANKS|X_RAW|SKIP_PAD|MIN_BLOCKS|X_ASYNC|UNPACK_UNROLL)|MV_MIN_BLOCKS|MV_LDG) " kernels/mmq.cu \
        kernels/matvec.cuh kernels/matvec_q.cuh
    brass_suite 585 -n 14 -q
    ;;
sbs)
    llama_build "$out/llama-build.log" "$(nproc)" llama-bench
    mkdir -p "$dir"
    for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do python3 ci/shape_models.py "$s" "$dir" > /dev/null; done
    echo "shapes written (t=$(t) s)"
    # Brass's kernels compiled while the build goes on (the NVRTC cache is per machine)
    timeout 200 python3 -m engine bench "$dir/qwen3-0.6b.gguf" --backend cuda -r 1 -p 64 -n 8 > /dev/null 2>&1
    echo "kernels compiled (t=$(t) s)"
    wait "$LLAMA_BUILD_PID"; echo "llama.cpp built: exit $? (t=$(t) s)"; tail -2 "$out/llama-build.log"
    LLAMA_BENCH="$LLAMA_SRC_DIR/llama.cpp/build/bin/llama-bench" REPS=3 guarded 595 bash ci/gpu_side_by_side.sh 2>&1 | grep -v "^WARNING"
    rm -f "$out/llama-build.log"
    ;;
esac
echo "done at t=$(t) s"
