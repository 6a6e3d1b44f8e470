#!/usr/bin/env bash
# The llama.cpp source of the goldens' build (b11312, vendored in llama-cpp-python 0.3.36) for
# the GPU runner, which has no network: the 77 MB sdist from PyPI trimmed to what
# ci/build_llamacpp_cuda.sh needs (the CMake tree and the ctypes binding), packed as
# .stage/llama-b11312-src.tar.xz (~3.6 MB, under the runner's 64 MiB carry).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/stage_lib.sh
fetch_sdist llama-cpp-python llama_cpp_python-0.3.36.tar.gz
mkdir -p .stage
root="$tmp/llama_cpp_python-0.3.36"
(cd "$root" && tar cJf - --exclude='*.md' vendor/llama.cpp/{CMakeLists.txt,cmake,ggml,include,src,vendor,licenses,LICENSE} llama_cpp) \
    > .stage/llama-b11312-src.tar.xz
ls -la .stage/llama-b11312-src.tar.xz
