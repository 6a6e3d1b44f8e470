#!/usr/bin/env bash
# The next session's GPU calls (written 2026-12-03, fifteenth session; carry [".whl"]):
#   coop: the 0.6B output head's kernel: ci/gpu_tune_coop.py (MV_COOP_ROWS 1 and 2, warps,
#      blocks per SM; every variant's bits against the default's), then ncu's stall reasons and
#      occupancy for matvec_coop_q6_k on 151936 x 1024 (ci/gpu_profile.sh NCU_CASES).
#   suite: the whole GPU suite alone (until t = 580); the environment passes through.
#   part1: the first half of llama.cpp's prebuilt binaries, carry [".stage/llama-sm90-1"]; a
#      call right after it that carries ".stage/llama-sm90-2" too finds llama-bench ready
#      (llama_ready in ci/gpu_lib.sh; it worked in the fifteenth session).
# Run in the sixteenth session (2026-12-03): coop (MODES=decode), mmqncu, norm, q6k, sbs, suite.
# Written for the seventeenth, not yet run:
#   vec: MMQ_VEC_LOADS (Q4_K's MoE-prompt unpack from 16-byte loads) timed against the default
#      with its bits checked (ci/gpu_tune_mmq.py), then ncu's L1/TEX and sector use of it; if it
#      wins 5 % a layer, flip its #define, run test_kernels_mmq on the GPU, then sbs with
#      SBS_SHAPES=qwen3-30b-a3b (after part1) for the 30B-A3B's pp512 (0.69x, bar 0.75x).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-coop}" in
coop)
    guarded 300 python3 ci/gpu_tune_coop.py 2>&1 | grep -v "^WARNING" | tee "$out/tune-coop.txt" | tail -30
    MODES="${MODES- }" NCU_CASES="Q6_K 151936 1024" guarded 420 bash ci/gpu_profile.sh
    ;;
mmqncu)
    # the 30B-A3B prompt's expert mat-mul under ncu's full set (where its time goes: the
    # fifth session found L1/TEX at 78 % and 7.9 cycles per issued instruction)
    guarded 300 ncu --clock-control none --set full --import-source yes -k regex:mmq_id_q4_k -c 1 \
        python3 ci/gpu_tune_mmq.py --only default > "$out/ncu-mmq-id.txt" 2>&1
    grep -E "Duration|Throughput|Occupancy|Registers Per|Warp Cycles Per Issued|Stall|Bank|Issue Slots|Eligible|Shared|Executed Ipc" "$out/ncu-mmq-id.txt" | head -60
    ;;
norm)
    # BRASS_NORM_MATVEC (the decode norms in the launches after them) and MMQ_ROWS_FAST (the MoE
    # prompt's unpack without bank conflicts), both written this session: their GPU tests, the
    # tile variants' times and bits, then tg128 with the norms in and out, alternated
    for m in qwen3-0.6b qwen3-8b; do [ -f "$dir/$m.gguf" ] || python3 ci/shape_models.py "$m" "$dir" > /dev/null; done
    echo "shapes written (t=$(t) s)"
    guarded 200 python3 ci/gpu_tune_mmq.py --only "default,rows fast,rows fast kb4,rows fast prefetch" 2>&1 \
        | grep -v "^WARNING" | tail -8
    BRASS_NORM_MATVEC=1 guarded 330 python3 -m pytest -q -n 8 -p no:cacheprovider \
        conformance/test_kernels.py conformance/test_kernels_model.py conformance/test_batch.py \
        conformance/test_decode_graph.py conformance/test_kernels_mmq.py \
        -k "norm or model or batch or graph or greedy or mmq" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -14
    echo "tests done (t=$(t) s)"
    for round in 1 2; do
        for on in 0 1; do
            [ "$(left 480)" -ge 25 ] || break
            echo "qwen3-0.6b norm_matvec=$on: $(BRASS_NORM_MATVEC=$on brass_tg "$dir/qwen3-0.6b.gguf" 40)"
        done
    done
    for on in 0 1; do
        [ "$(left 560)" -ge 40 ] || break
        echo "qwen3-8b norm_matvec=$on: $(BRASS_NORM_MATVEC=$on brass_tg "$dir/qwen3-8b.gguf" 60)"
    done
    ;;
q6k)
    # the Q6_K dot without __vsubss4 (q8s.hsum): its GPU tests (every Q6_K mat-vec, the coop head,
    # the batched and graph paths, bit-exactness between them), the mat-vecs alone, tg128; with
    # the first half of llama.cpp's binaries carried (.stage/llama-sm90-1) for the next call
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ 2> /dev/null
    for m in qwen3-0.6b qwen3-8b; do [ -f "$dir/$m.gguf" ] || python3 ci/shape_models.py "$m" "$dir" > /dev/null; done
    guarded 220 python3 -m pytest -q -n 8 -p no:cacheprovider conformance/test_kernels.py \
        conformance/test_batch.py conformance/test_decode_graph.py conformance/test_kernels_model.py \
        -k "q6 or Q6 or coop or mixed or matmul or glu or batch or graph or model" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -14
    echo "tests done (t=$(t) s)"
    guarded 330 python3 ci/gpu_speed.py 2>&1 | grep -v "^WARNING" | tail -16
    for m in qwen3-0.6b qwen3-0.6b qwen3-8b; do
        [ "$(left 560)" -ge 40 ] || break
        echo "$m: $(brass_tg "$dir/$m.gguf" 60)"
    done
    ;;
sbs)
    # llama.cpp's prebuilt binaries (the second half carried now), then side by side
    llama_ready || { echo "llama.cpp binaries not ready"; exit 1; }
    for s in ${SBS_SHAPES:-qwen3-0.6b}; do
        LLAMA_BENCH="$bin/llama-bench" REPS=3 guarded 590 bash ci/gpu_side_by_side.sh "$s" 2>&1 | grep -v "^WARNING"
    done
    ;;
vec)
    guarded 200 python3 ci/gpu_tune_mmq.py --only "default,vec loads,vec loads prefetch" 2>&1 \
        | grep -v "^WARNING" | tail -6
    guarded 400 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats -k regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only "vec loads" \
        > "$out/ncu-vec.txt" 2>&1
    grep -E "Duration|L1/TEX Cache|bytes transmitted|Warp Cycles|bank" "$out/ncu-vec.txt" | head -12
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
part1)
    mkdir -p /tmp/llama-parts && cp .stage/llama-sm90-1/* /tmp/llama-parts/ && ls -la /tmp/llama-parts
    ;;
esac
echo "done at t=$(t) s"
