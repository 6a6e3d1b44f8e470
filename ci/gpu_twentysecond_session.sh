#!/usr/bin/env bash
# The twenty-second session's GPU calls (carry [".whl", ".stage"]), back to back on one warm runner.
#   prep:  llama.cpp b11434 built in the background (detached, every core: `sbs` finds it), the
#          three qwen3 shapes written, and the new mat-vec defaults (MV_Q4K_SEL=1,
#          MV_STAGE_BATCH_SPLIT=2) timed against the old ones (ci/gpu_preload.py, bits compared).
#   sbs:   the three qwen3 shapes side by side with llama-bench (REPS=3).
#   suite: the whole suite.
#   suite_bg: the whole suite started in the background from a copy of the tree in /tmp (so that
#          the next calls, which copy the tree again, cannot change files under it), on a warm
#          runner going on between calls (staging calls, say); carry [".whl"]. suite_wait [N]:
#          waits for it until t = N (default 590) and prints what `suite` prints. suite_bg refuses
#          while an earlier one has not ended (suite_wait first: a second run after the first).
#   probe: (carry [".whl"]) the defaults against each of VARIANTS (";"-separated builds, each a
#          ","-separated list of kernels/matvec.cuh switches; the first, empty, is the defaults)
#          through ci/gpu_preload.py: bits compared, then the mat-vec shapes and tg128 and greedy
#          tokens of Qwen3-0.6B and 8B alternated (SHAPES= empty: the mat-vecs alone). The levers
#          timed so far and their figures: perf/NOTES.md.
#   bar:   issue 8's bar kernel and its harness's streaming-read floor, three times (issue 8's
#          figures are best of 3 each; ci/gpu_speed.py --types Q4_K; ~90 s warm, carry [".whl"]).
#   stalls: ncu's stall samples of issue 8's bar kernel per SASS instruction (ci/ncu_stalls.py).
#   real:  the three real models' whole-model tests on CUDA against llama.cpp's CUDA goldens
#          (test_models: activations, teacher-forced, greedy) once ci/gpu_stage.sh has put them in
#          $BRASS_CACHE (here: `bash ci/stage_parts.sh split` and `slim`, then one call per part,
#          `bash ci/gpu_stage.sh` carrying that part alone, back to back on one warm runner:
#          2 + 4 + 8 calls; then `stage_parts.sh back`), with the models table
#          (ci/gpu_summary.py --models). Carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env
case "${1:-prep}" in
prep)
    llama_ready || true
    mkdir -p "$dir"
    (for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
        [ -f "$dir/$s.gguf" ] || python3 ci/shape_models.py "$s" "$dir" > /dev/null
    done) &
    writer=$!
    guarded 400 python3 ci/gpu_preload.py --variants ";MV_Q4K_SEL=0,MV_STAGE_BATCH_SPLIT=1;;MV_Q4K_SEL=0,MV_STAGE_BATCH_SPLIT=1" \
        --json "$out/confirm.json" 2>&1 | grep -vE "^WARNING|^\|"
    wait "$writer"; echo "shapes written (t=$(t) s)"
    need_llama 580 && echo "llama.cpp built (t=$(t) s)"
    ;;
sbs)
    need_llama 200 || exit 1
    for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
        [ -f "$dir/$s.gguf" ] || python3 ci/shape_models.py "$s" "$dir" > /dev/null
    done
    LLAMA_BENCH="$bin/llama-bench" REPS=3 guarded 595 bash ci/gpu_side_by_side.sh 2>&1 | grep -v "^WARNING"
    ;;
suite)
    brass_suite 590 -n 14 -q
    ;;
suite_bg)
    if [ -d /tmp/brass-suite-out ] && [ ! -f /tmp/brass-suite-out/rc ]; then
        echo "a background suite is still running: suite_wait first"; exit 1   # never pull its tree away
    fi
    rm -rf /tmp/brass-suite /tmp/brass-suite-out && mkdir -p /tmp/brass-suite /tmp/brass-suite-out
    cp -a . /tmp/brass-suite/
    (cd /tmp/brass-suite && setsid nohup env OUT=/tmp/brass-suite-out bash -c \
        'bash ci/gpu_conformance.sh -n 14 -q > $OUT/suite.log 2>&1; echo $? > $OUT/rc' > /dev/null 2>&1 < /dev/null &)
    echo "suite started in the background (t=$(t) s)"
    ;;
suite_wait)
    s=/tmp/brass-suite-out
    [ -d "$s" ] || { echo "no background suite here (a fresh runner?)"; exit 1; }
    while [ ! -f "$s/rc" ] && [ "$(left "${2:-590}")" -gt 0 ]; do sleep 5; done
    [ -f "$s/rc" ] && echo "suite exit $(cat "$s/rc") (t=$(t) s)" || echo "suite still running at t=$(t) s"
    suite_report "$s"
    cp "$s/suite.log" "$s/gpu-models.txt" "$out/" 2>/dev/null
    ;;
probe)
    sh=${SHAPES-qwen3-0.6b,qwen3-8b}     # SHAPES= (empty): the mat-vecs alone, no tg128
    guarded 590 python3 ci/gpu_preload.py ${sh:+--shapes "$sh"} --json "$out/variants.json" --variants \
        "${VARIANTS:?VARIANTS: the builds to time, e.g. \";MV_STAGE_BATCH_SPLIT=1\"}" \
        2>&1 | grep -vE "^WARNING|^\|"
    ;;
bar)
    for i in 1 2 3; do guarded 590 python3 ci/gpu_speed.py --types Q4_K 2>&1 | grep -v "^WARNING"; done
    ;;
real)
    export BRASS_CACHE=${BRASS_CACHE:-/tmp/brass-cache}
    bash ci/gpu_stage.sh | grep -v "out of order"
    guarded 590 python3 -m pytest conformance/test_models.py -q -rs -p no:cacheprovider \
        -k "cuda and (smollm2 or gemma3-270m or qwen2.5)" --junitxml="$out/real.xml" > "$out/real.log" 2>&1
    echo "pytest exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/real.log" | tail -12
    python3 ci/gpu_summary.py "$out/real.xml" --models
    ;;
stalls)
    # the bar kernel under ncu's full set: every stall reason's samples (the raw page) and per
    # SASS instruction (the source page, as CSV) into $OUT, the top instructions printed
    guarded 230 ncu --set full --import-source no -k regex:matvec_split_q4_k -c 1 -o "$out/q4k" \
        python3 ci/gpu_speed.py --types Q4_K --no-floor > "$out/ncu-run.txt" 2>&1
    echo "ncu exit $? (t=$(t) s)"
    ncu -i "$out/q4k.ncu-rep" --page raw --csv > "$out/raw.csv" 2>&1
    ncu -i "$out/q4k.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
    python3 ci/ncu_stalls.py "$out/raw.csv" "$out/sass.csv" 25
    ;;
esac
echo "done at t=$(t) s"
