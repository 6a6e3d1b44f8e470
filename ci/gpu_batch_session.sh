#!/usr/bin/env bash
# One GPU call for the work of 2026-12-01 (batched decode on CUDA, the seed catalog's CUDA ops),
# in order of what matters most, each part with its own time limit so the call returns what it
# did:
#   1. the whole conformance suite (includes the batched mat-vec, batch-graph, gemma4 kernel and
#      qwen35 whole-model CUDA checks);
#   2. qwen35/qwen35moe/gemma4 on CUDA end to end in a copy of the tree whose architecture files
#      let the cuda backend load them (the committed ones refuse it until this passes);
#   3. brass bench --parallel 1/4/8/16 on the shape-true Qwen3-8B file (batched generation);
#   4. issue 11's load test beside llama-server (ci/gpu_serving.sh), llama.cpp built meanwhile.
# BRASS_BATCH_BUCKETS=1 (exported to every part) turns on the bucket graphs of engine/batch.py.
#   run(command="bash ci/gpu_batch_session.sh", carry=[".whl", ".stage/llama-bin-11434-src.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/brass-site .whl/*.whl 2> /dev/null \
    && export PYTHONPATH="/tmp/brass-site:$PYTHONPATH"
src=/tmp/llama-src
mkdir -p "$src" && tar xJf .stage/llama-bin-11434-src.tar.xz -C "$src"
(cd "$src/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build -j8 --target llama-server) > "$out/llama-build.log" 2>&1 &
build=$!
(python3 ci/shape_models.py qwen3-8b /tmp/brass-shapes > "$out/shape.log" 2>&1) &
shape=$!

echo "== 1. suite"
timeout 200 bash ci/gpu_conformance.sh -n 8 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

echo "== 2. qwen35, qwen35moe, gemma4 on cuda (patched copy)"
rm -rf /tmp/cat && mkdir /tmp/cat && cp -r engine kernels conformance golden ci pyproject.toml /tmp/cat/
sed -i 's/^BACKENDS = ("numpy",)/BACKENDS = ("numpy", "cuda")/' /tmp/cat/engine/arch/qwen35.py /tmp/cat/engine/arch/gemma4.py
grep -c '^BACKENDS = ("numpy", "cuda")' /tmp/cat/engine/arch/qwen35.py /tmp/cat/engine/arch/gemma4.py
sed -i 's/{"matmul", "matmul_many", "add_rms_norm", "rope_store", "attention"} <= set(b.worst)/{"matmul", "matmul_many", "attention"} <= set(b.worst)/' \
    /tmp/cat/conformance/test_kernels_model.py
(cd /tmp/cat && PYTHONPATH="/tmp/cat:/tmp/brass-site" timeout 110 python3 -m pytest conformance/test_models.py \
    conformance/test_batch.py conformance/test_decode_graph.py conformance/test_kernels_model.py conformance/test_serving.py \
    -k "qwen35 or gemma4" -q -rfEsxX -p no:cacheprovider -n 8 > "$out/catalog.log" 2>&1; echo "catalog exit $?")
grep -E "^(FAILED|ERROR|XPASS)|passed|failed" "$out/catalog.log" | head -40

echo "== 3. batched generation, qwen3-8b shape (BRASS_BATCH_BUCKETS=${BRASS_BATCH_BUCKETS:-0})"
wait $shape
for p in 1 4 8 16; do
    timeout 45 python3 -m engine bench /tmp/brass-shapes/qwen3-8b.gguf --backend cuda -p 0 -n 64 -r 2 \
        --parallel $p 2>> "$out/bench.err" | grep -E "^\| qwen"
done

echo "== 4. serving beside llama-server"
wait $build
[ -x "$src/llama.cpp/build/bin/llama-server" ] || { echo "llama-server did not build"; tail -5 "$out/llama-build.log"; }
timeout 140 bash ci/gpu_serving.sh 2>&1 | grep -v "^WARNING"
