#!/usr/bin/env bash
# The seventeenth session's GPU calls (2026-12-03).
#   a: the first half of llama.cpp's binaries copied out of the working tree (carry
#      [".whl", ".stage/llama-sm90-1"]), MMQ_VEC_LOADS timed against the default (the
#      sixteenth session's `vec`, now Q6_K's unpack as well), then ncu on the Q4_K mat-vec of
#      issue 8's bar (4096 x 12288) and three kernel-side variants of it (ci/gpu_preload.py).
#   b: MV_PRELOAD_ROWS=2 against 1 (bits, the mat-vecs alone, tg128), MMQ_VEC_LOADS again.
# Both ran (perf/NOTES.md, seventeenth session); so did, inline, the whole suite twice, the side
# by side (gpu_sixteenth_session.sh sbs), rows / depth 1 / 2 against 2 / 1 and its GPU tests.
# Next: `suite` below, twice, on the tree with MV_PRELOAD_ROWS=2 and MV_PRELOAD=1 (the defaults
# now; the whole suite reached 97 % once with them before the device time ran out).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

preload_rows() { sed -i "s/^#define MV_PRELOAD_ROWS [0-9]*/#define MV_PRELOAD_ROWS $1/" kernels/matvec.cuh; }

case "${1:-a}" in
a)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ 2> /dev/null
    bash ci/gpu_sixteenth_session.sh vec
    MODES=" " NCU_CASES="Q4_K 4096 12288" guarded 400 bash ci/gpu_profile.sh
    # kernel-side knobs of the decode mat-vec (the backend's grid unchanged): all three of a
    # lane's items of the bar's rows loaded before PDL_ENTRY, the L2 prefetch on every size,
    # the activations read from global memory instead of staged at K = 12288
    guarded 590 python3 ci/gpu_preload.py \
        --variants ";MV_PRELOAD=3;MV_PREFETCH_MAX_BYTES=67108864;MV_STAGE_MAX_K=8192" 2>&1 \
        | grep -v "^WARNING" | tail -14
    ;;
b)
    # MV_PRELOAD_ROWS=2 (two Q4_K rows a warp, each staged item read once for both), after the
    # 128-bit reads of a staged block's factors and of Q4_K's header: its bits against one row's
    # (gpu_preload: the backend's one-row grid, the extra blocks idle), the Q4_K mat-vecs alone
    # and tg128 with the header set to 1 and to 2 in turn (the backend reads it at import);
    # MMQ_VEC_LOADS now with Q6_K's unpack too
    for m in qwen3-0.6b qwen3-8b; do [ -f "$dir/$m.gguf" ] || python3 ci/shape_models.py "$m" "$dir" > /dev/null; done
    echo "shapes written (t=$(t) s)"
    guarded 150 python3 ci/gpu_tune_mmq.py --only "default,vec loads" 2>&1 | grep -v "^WARNING" | tail -4
    guarded 280 python3 ci/gpu_preload.py --variants ";MV_TAIL_LOAD=0;MV_PRELOAD_ROWS=2;MV_PRELOAD_ROWS=2,MV_PRELOAD=1" 2>&1 \
        | grep -v "^WARNING" | tail -12
    for r in 1 2; do
        preload_rows $r
        echo "== MV_PRELOAD_ROWS=$r"
        guarded 400 python3 ci/gpu_speed.py --types Q4_K 2>&1 | grep -v "^WARNING" | tail -6
    done
    for round in 1 2; do
        for r in 1 2; do
            [ "$(left 560)" -ge 30 ] || break
            preload_rows $r
            echo "qwen3-0.6b rows=$r: $(brass_tg "$dir/qwen3-0.6b.gguf" 40)"
            [ $round = 1 ] && echo "qwen3-8b rows=$r: $(brass_tg "$dir/qwen3-8b.gguf" 50)"
        done
    done
    preload_rows 1
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
esac
echo "done at t=$(t) s"
