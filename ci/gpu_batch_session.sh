#!/usr/bin/env bash
# One GPU call for the work of 2026-12-01 (batched decode on CUDA, the seed catalog's CUDA ops),
# in order of what matters most, each part with its own time limit so the call returns what it
# did:
#   1. the whole conformance suite (includes the batched mat-vec, batch-graph, gemma4 kernel and
#      qwen35 whole-model CUDA checks);
#   2. the MMQ prompt GEMM (BRASS_MMQ=1) through the model op checks, and its timing; the
#      chunked delta-net prompt kernel's timing;
#   3. brass bench --parallel 1/4/8/16 on the shape-true Qwen3-8B file (batched generation);
#   4. issue 11's load test beside llama-server (ci/gpu_serving.sh), llama.cpp built meanwhile.
# BRASS_BATCH_BUCKETS=1 (exported to every part) turns on the bucket graphs of engine/batch.py.
#   run(command="bash ci/gpu_batch_session.sh", carry=[".whl", ".stage/llama-bin-11434-src.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_build "$out/llama-build.log" 8 llama-server
build=$LLAMA_BUILD_PID
src=$LLAMA_SRC_DIR
(python3 ci/shape_models.py qwen3-8b /tmp/brass-shapes > "$out/shape.log" 2>&1) &
shape=$!

echo "== 1. suite"
timeout 180 bash ci/gpu_conformance.sh -n 8 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

echo "== 2. MMQ prompt GEMM with BRASS_MMQ=1 (its own kernel tests ran in the suite): model ops, timing"
BRASS_MMQ=1 timeout 60 python3 -m pytest conformance/test_kernels.py conformance/test_kernels_model.py \
    -k "matmul or model" -q -rfEs -n 8 -p no:cacheprovider > "$out/mmq-model.log" 2>&1
echo "mmq model checks exit $?"; grep -E "^(FAILED|ERROR)|exceeds" "$out/mmq-model.log" | head -20; tail -1 "$out/mmq-model.log"
timeout 40 python3 ci/gpu_mmq_bench.py 2>&1 | grep -v "^WARNING" | tail -20
echo "== 2b. chunked delta-net prompt kernel (BRASS_DELTA_CHUNKED; its tests ran in the suite): timing at T = 512"
timeout 25 python3 perf/delta_chunked_timing.py 512 16 32 128 50 2>&1 | tail -5

echo "== 3. batched generation, qwen3-8b shape (BRASS_BATCH_BUCKETS=${BRASS_BATCH_BUCKETS:-0})"
wait $shape
for p in 1 4 8 16; do
    timeout 35 python3 -m engine bench /tmp/brass-shapes/qwen3-8b.gguf --backend cuda -p 0 -n 64 -r 2 \
        --parallel $p 2>> "$out/bench.err" | grep -E "^\| qwen"
done

echo "== 4. serving beside llama-server"
wait $build
[ -x "$src/llama.cpp/build/bin/llama-server" ] || { echo "llama-server did not build"; tail -5 "$out/llama-build.log"; }
timeout 140 bash ci/gpu_serving.sh 2>&1 | grep -v "^WARNING"
