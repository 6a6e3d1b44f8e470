#!/usr/bin/env bash
# One GPU call: the MoE prompt's expert mat-mul tiles measured, the best applied, the suite on it.
#   1. the expert mat-muls in tile variants (ci/gpu_tune_mmq.py --apply: the fastest variant
#      that equals the default bit for bit, if >= 5 % faster per layer, is written into this
#      copy's kernels/mmq.cu); since the fifth session of 2026-12-01 with MMQ_PACKED's variants
#      (mmq_tile_packed: half the shared-memory wavefronts, written after ncu showed the tile
#      bound by them; bit for bit the default on the CPU, never yet run on a GPU);
#   2. why BRASS_GEMMA4_FUSED_OPS=1 failed the lockstep (ci/gpu_gemma4_fused_ops_probe.py);
#   3. the whole suite on that tree;
#   4. the Qwen3-30B-A3B shape's pp512 with the default tiles and the chosen ones, alternated;
#   5. ncu on the chosen tiles' Q4_K expert mat-mul (stall reasons, occupancy), time allowing.
# A chosen variant lands by writing the same #define values into kernels/mmq.cu (the printed
# diff, mmq-applied.diff) and committing it with the suite's summary line.
# No llama.cpp build: beside it the suite took 386 s instead of 250 (calls 1 and 2 of that day).
#   run(command="bash ci/gpu_mmq_session.sh", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
t0=$SECONDS

(setsid nohup python3 ci/shape_models.py qwen3-30b-a3b "$dir" > /tmp/brass-shapes.log 2>&1 < /dev/null &)
cp kernels/mmq.cu /tmp/mmq-default.cu

echo "== 1. MoE prompt tiles (t=$((SECONDS - t0)) s)"
timeout 120 python3 ci/gpu_tune_mmq.py --apply 2>&1 | tee "$out/tune-mmq.txt" | tail -16
diff /tmp/mmq-default.cu kernels/mmq.cu > "$out/mmq-applied.diff" && echo "(tiles unchanged)" || cat "$out/mmq-applied.diff"
cp kernels/mmq.cu /tmp/mmq-chosen.cu

echo "== 2. Gemma 4's fused ops against the lockstep (t=$((SECONDS - t0)) s)"
timeout 60 python3 ci/gpu_gemma4_fused_ops_probe.py 2>&1 | grep -v "^WARNING" | head -60

echo "== 3. suite (t=$((SECONDS - t0)) s)"
timeout 260 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

echo "== 4. qwen3-30b-a3b pp512, default tiles (d) and chosen (c), alternated (t=$((SECONDS - t0)) s)"
cmp -s /tmp/mmq-default.cu /tmp/mmq-chosen.cu && echo "(the default was kept: nothing to compare)"
cmp -s /tmp/mmq-default.cu /tmp/mmq-chosen.cu || for i in 1 2; do
    for v in default chosen; do
        cp /tmp/mmq-$v.cu kernels/mmq.cu
        echo "$v: $(timeout 60 python3 -m engine bench "$dir/qwen3-30b-a3b.gguf" --backend cuda -r 3 -p 512 -n 0 2>/dev/null | grep -oE "pp512 .*")"
    done
done
cp /tmp/mmq-chosen.cu kernels/mmq.cu

if [ $((SECONDS - t0)) -lt 400 ]; then
    echo "== 5. ncu, mmq_id_q4_k of the chosen tiles (t=$((SECONDS - t0)) s)"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    chosen=$(grep -oE "^best: .*\(([^,]*)," "$out/tune-mmq.txt" | sed -E 's/.*\(([^,]*),/\1/')
    timeout 90 "$NCU" --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        -k regex:mmq_id_q4_k -c 1 python3 ci/gpu_tune_mmq.py --only "${chosen:-default}" > "$out/ncu-mmq.txt" 2>&1
    echo "ncu exit $?"; grep -E "Throughput|Occupancy|Stall|Warp Cycles|Registers|Block Limit|Issue|Duration|Hit Rate|Eligible" "$out/ncu-mmq.txt" | head -40
fi
echo "done at t=$((SECONDS - t0)) s"
