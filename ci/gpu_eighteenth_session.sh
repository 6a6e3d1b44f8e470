#!/usr/bin/env bash
# The eighteenth session's GPU calls (written 2026-12-03 without device time: the session had
# 6 s of it). Carry [".whl"].
#   mmq: the MoE prompt's new tile variants (MMQ_BANKS, MMQ_X_RAW, MMQ_SKIP_PAD; ci/gpu_tune_mmq.py,
#        every output the default's bits), the best applied when 5 % faster per layer; its GPU
#        tests (-k mmq); the Qwen3-30B-A3B pp512 with it against the default, alternated; ncu
#        on its mmq_id_q4_k (shared-memory wavefronts and bank conflicts, occupancy).
#   mv:  MV_MIN_BLOCKS=4 (the Q4_K mat-vecs capped at 64 registers: 4 blocks an SM, issue 8's
#        4096 x 12288 in one wave) against the default: bits and the mat-vecs alone
#        (ci/gpu_preload.py), then tg128 of the 0.6B and 8B shapes alternated.
#   suite: the whole suite (twice, in two calls), with MMQ_APPLY="MMQ_BANKS=1 ..." set into
#        kernels/mmq.cu first when given (each call starts from the committed tree), and
#        MV_APPLY="MV_MIN_BLOCKS=4" into kernels/matvec.cuh likewise.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env

apply_mmq() {   # "NAME=VALUE ...": kernels/mmq.cu's #define lines
    local kv
    for kv in $1; do sed -i "s/^#define ${kv%%=*} [0-9]*/#define ${kv%%=*} ${kv#*=}/" kernels/mmq.cu; done
}
pp30() {
    timeout "${1:-70}" python3 -m engine bench "$dir/qwen3-30b-a3b.gguf" --backend cuda -r 3 -p 512 -n 0 2>/dev/null \
        | grep -oE "pp512 .*"
}

case "${1:-mmq}" in
mmq)
    mkdir -p "$dir"
    [ -f "$dir/qwen3-30b-a3b.gguf" ] || python3 ci/shape_models.py qwen3-30b-a3b "$dir" > /dev/null &
    writer=$!
    cp kernels/mmq.cu /tmp/mmq-default.cu
    guarded 240 python3 ci/gpu_tune_mmq.py --apply --only "default,banks,banks cap5,x raw,banks x raw,banks x raw cap5,banks x raw skip,banks x raw skip cap5,banks x raw skip 64x32,skip" \
        2>&1 | grep -v "^WARNING" | tee "$out/tune-mmq.txt" | tail -16
    cp kernels/mmq.cu /tmp/mmq-chosen.cu
    diff /tmp/mmq-default.cu /tmp/mmq-chosen.cu | grep "^>"
    echo "== the mmq GPU tests with it (t=$(t) s)"
    guarded 330 bash ci/gpu_conformance.sh -n 8 -q -k "mmq or moe or matmul_id" > "$out/mmq-tests.log" 2>&1
    tail -2 "$out/mmq-tests.log"; grep -E "^(FAILED|ERROR)" "$out/mmq-tests.log" | head
    wait "$writer"
    echo "== qwen3-30b-a3b pp512, default (d) and chosen (c), alternated (t=$(t) s)"
    if cmp -s /tmp/mmq-default.cu /tmp/mmq-chosen.cu; then echo "(the default was kept)"; else
        for i in 1 2; do for v in default chosen; do
            [ "$(left 520)" -ge 40 ] || break 2
            cp /tmp/mmq-$v.cu kernels/mmq.cu; echo "$v: $(pp30 60)"
        done; done
    fi
    cp /tmp/mmq-chosen.cu kernels/mmq.cu
    chosen=$(grep -oE "^best: .*\(([^,]*)," "$out/tune-mmq.txt" | sed -E 's/.*\(([^,]*),/\1/')
    echo "== ncu, mmq_id_q4_k: default and ${chosen:-default} (t=$(t) s)"
    cp /tmp/mmq-default.cu kernels/mmq.cu
    for v in default ${chosen:+"$chosen"}; do
        [ "$(left 590)" -ge 40 ] || break
        guarded 590 ncu --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis_Tables \
            --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_lg.sum \
            -k regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only "$v" > "$out/ncu-mmq-$v.txt" 2>&1
        echo "-- $v"; grep -E "Duration|L1/TEX Cache Throughput|DRAM Throughput|Achieved Occupancy|Block Limit (Registers|Shared)|bank_conflicts|wavefronts|requests" "$out/ncu-mmq-$v.txt" | head -14
    done
    cp /tmp/mmq-chosen.cu kernels/mmq.cu
    ;;
mv)
    guarded 560 python3 ci/gpu_preload.py --variants ";MV_MIN_BLOCKS=4" --shapes qwen3-0.6b,qwen3-8b --rounds 2 \
        --json "$out/preload-min-blocks.json" 2>&1 | grep -v "^WARNING" | tail -24
    ;;
suite)
    [ -n "${MMQ_APPLY:-}" ] && apply_mmq "$MMQ_APPLY" && grep -E "^#define MMQ_(BANKS|X_RAW|SKIP_PAD|MIN_BLOCKS|COLS|THREADS) " kernels/mmq.cu
    for kv in ${MV_APPLY:-}; do matvec_define "${kv%%=*}" "${kv#*=}"; grep "^#define ${kv%%=*} " kernels/matvec.cuh; done
    brass_suite 580 -n 14 -q
    ;;
esac
echo "done at t=$(t) s"
