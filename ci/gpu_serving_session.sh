#!/usr/bin/env bash
# One GPU call (2026-12-01, second session): the suite again (a repeat run, with bucket graphs,
# the chunked delta-net kernel, the session pool, the server's warm-up and batched greedy steps
# run ahead now the defaults), batched generation with and without the run-ahead, and issue
# 11's load test beside llama-server; meanwhile llama-server and llama-bench build in one tree
# and the seed catalog's shape-true files are written, so that the next call (sent at once,
# while the machine is warm) runs the catalog side by side:
#   LLAMA_BENCH=/tmp/llama-src/llama.cpp/build/bin/llama-bench REPS=3 \
#       bash ci/gpu_side_by_side.sh qwen3.6-35b-a3b,gemma-4-26b-a4b
#   run(command="bash ci/gpu_serving_session.sh", carry=[".whl", ".stage/llama-bin-11434-src.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_build "$out/llama-build.log" 8 llama-server llama-bench
build=$LLAMA_BUILD_PID
src=$LLAMA_SRC_DIR
(for s in qwen3-8b qwen3.6-35b-a3b gemma-4-26b-a4b; do
     python3 ci/shape_models.py "$s" /tmp/brass-shapes || echo "shape $s failed"
 done > "$out/shape.log" 2>&1) &
shape=$!

echo "== 1. suite (repeat run)"
timeout 200 bash ci/gpu_conformance.sh -n 8 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

echo "== 2. batched generation, qwen3-8b shape: steps read back one by one, then run ahead"
until [ -f /tmp/brass-shapes/qwen3-8b.gguf ] || ! kill -0 $shape 2> /dev/null; do sleep 2; done

for ahead in 0 1; do
    for p in 1 16; do
        BRASS_BATCH_AHEAD=$ahead timeout 35 python3 -m engine bench /tmp/brass-shapes/qwen3-8b.gguf \
            --backend cuda -p 0 -n 64 -r 2 --parallel $p 2>> "$out/bench.err" | grep -E "^\| qwen" \
            | sed "s/^/ahead=$ahead /"
    done
done

echo "== 3. serving beside llama-server"
timeout 200 bash -c "while kill -0 $build 2> /dev/null; do sleep 3; done"
[ -x "$src/llama.cpp/build/bin/llama-server" ] || { echo "llama-server did not build"; tail -5 "$out/llama-build.log"; }
timeout 170 bash ci/gpu_serving.sh 2>&1 | grep -v "^WARNING"
echo "== shapes"; cat "$out/shape.log" | tail -5; ls -la /tmp/brass-shapes; df -h /tmp | tail -1
