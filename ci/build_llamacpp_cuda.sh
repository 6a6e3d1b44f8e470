#!/usr/bin/env bash
# llama.cpp b11312 (the goldens' build, vendored in llama-cpp-python 0.3.36) with CUDA, as
# shared libraries for llama-cpp-python's ctypes binding: what `record_goldens.py --device cuda`
# and `brass diff --reference cuda` load through LLAMA_CPP_LIB_PATH. ~4.5 min on the runner's
# 16 cores.
#
# Source: the sdist (77 MB, over the runner's 64 MiB carry) trimmed to the CMake tree and the
# ctypes binding (~3.6 MB) by `ci/gpu.sh stage recorder-src` into .stage/llama-b11312-src.tar.xz,
# carried as .stage. `ci/gpu.sh llama start` runs this script in the background on the runner.
#
# Usage: ci/build_llamacpp_cuda.sh [SRC_TAR] [PREFIX]; then
#   export PYTHONPATH=PREFIX/py:$PYTHONPATH LLAMA_CPP_LIB_PATH=PREFIX/lib
set -euo pipefail
src_tar="${1:-.stage/llama-b11312-src.tar.xz}"
prefix="${2:-/tmp/llama-b11312-cuda}"
work=/tmp/llama-b11312-src
flags=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON
       -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF
       -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release)
mkdir -p "$work" "$prefix/lib" "$prefix/py"
tar xJf "$src_tar" -C "$work"
cd "$work/vendor/llama.cpp"
cmake -B build -G Ninja "${flags[@]}" > "$prefix/build.log" 2>&1
cmake --build build -j"${JOBS:-$(nproc)}" --target llama >> "$prefix/build.log" 2>&1
find build -name 'lib*.so*' -exec cp -P {} "$prefix/lib/" \;
cp -r "$work/llama_cpp" "$prefix/py/"
python3 - "$prefix/lib/build-info.json" "${flags[@]}" <<'PY'
import json, subprocess, sys
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
json.dump({"source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp (b11312)",
           "cmake_flags": sys.argv[2:], "nvcc": nvcc[-1] if nvcc else "unknown",
           "script": "ci/build_llamacpp_cuda.sh"}, open(sys.argv[1], "w"), indent=1)
PY
ls "$prefix/lib"
