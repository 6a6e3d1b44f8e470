#!/usr/bin/env bash
# The fifteenth session's last GPU call (2026-12-03; carry [".whl"]):
#   coop (TUNE_END, END: when the table and the tg128 runs stop, in s): matvec_coop_q6_k's variants (ci/gpu_tune_coop.py: MV_COOP_L2_AHEAD, warps, blocks per
#      SM on the output heads' shapes, the same bits), then tg128 of the Qwen3-0.6B shape with
#      BRASS_COOP_L2_AHEAD=0 and the best value the table gave its head, alternated while the
#      call has time (the first run of each compiles matvec_q.cu with that macro: ~1 min).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

case "${1:-coop}" in
coop)
    python3 ci/shape_models.py qwen3-0.6b "$dir" > /dev/null &
    # the kernels compiled meanwhile (CPU only; a fresh machine has none cached): every source
    # as the backend compiles it, and matvec_q.cu with each MV_COOP_L2_AHEAD the table may pick
    srcs=$(python3 -c "from engine.backends.cuda.backend import launched_kernels as k; print(' '.join(sorted({s for s, _ in k()})))")
    (for s in $srcs; do echo "$s"; done; for a in 1 2 3 4 6; do echo "matvec_q.cu -DMV_COOP_L2_AHEAD=$a"; done) \
        | xargs -P 12 -L 1 python3 -c 'import sys; from engine.backends.cuda.compiler import compile_source; compile_source(sys.argv[1], "sm_90", tuple(sys.argv[2:]))' \
        > "$out/warm.log" 2>&1 &
    guarded ${TUNE_END:-110} python3 ci/gpu_tune_coop.py 2>&1 | grep -v "^WARNING" | tee "$out/tune-coop.txt" | tail -40
    wait; grep -i error "$out/warm.log" | head -3; rm -f "$out/warm.log"
    # the best L2-ahead value on the 0.6B's head at the default warps and blocks per SM
    best=$(awk '$1 == 151936 && $2 == 1024 && $3 == 8 && $4 == 8 && $6 == 0 && $NF == "yes" {print $9, $5}' "$out/tune-coop.txt" \
           | sort -n | head -1 | cut -d" " -f2)
    echo "best MV_COOP_L2_AHEAD on the 0.6B head: ${best:-none} (t=$(t) s)"
    if [ -n "$best" ] && [ "$best" != 0 ]; then
        for round in 1 2 3; do
            for a in 0 "$best"; do
                [ "$(left ${END:-185})" -ge 45 ] || break 2
                echo "qwen3-0.6b BRASS_COOP_L2_AHEAD=$a: $(BRASS_COOP_L2_AHEAD=$a brass_tg "$dir/qwen3-0.6b.gguf" 45)"
            done
        done
    fi
    ;;
esac
echo "done at t=$(t) s"
