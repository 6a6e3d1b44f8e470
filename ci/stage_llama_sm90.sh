#!/usr/bin/env bash
# llama-server and llama-bench built here for the GPU runner (sm_90, CUDA 13.0, the recipe of
# ci/gpu_lib.sh llama_build), packed for the runner: the binaries and their shared libraries
# (libggml-cuda alone 67 MB) as one tar.xz of ~44 MB, split in two parts (.stage/llama-sm90-1/,
# .stage/llama-sm90-2/ with the whole file's sha256), since a call carries 64 MiB with the tree
# and the wheels: two consecutive calls bring one each (the first copies .stage/llama-sm90-1/*
# to /tmp/llama-parts/, the second carries .stage/llama-sm90-2 and ci/gpu_lib.sh's llama_ready
# joins them). A runner call that finds them skips the ~4.5 min build.
#
# Needs nvcc 13.0 and cuBLAS headers and libraries (the nvidia-cublas wheel's, linked into the
# toolkit's folders), and a libcuda.so to link against: a machine without a driver has none, so
# a stub exporting the driver calls libggml-cuda makes is written first (at run time the
# runner's own libcuda.so.1 is loaded). ~45 min on 2 cores. Usage: ci/stage_llama_sm90.sh
set -euo pipefail
cd "$(dirname "$0")/.."
src=/tmp/llama-sm90-src
build="$src/llama.cpp/build"
cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if [ ! -e "$cuda/lib/stubs/libcuda.so" ] && ! ldconfig -p | grep -q "libcuda.so "; then
    mkdir -p "$cuda/lib/stubs"
    # the driver calls of ggml-cuda b11434 (nm -D --undefined-only libggml-cuda.so)
    for s in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve \
             cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap; do
        echo "int $s(void) { return 0; }"
    done > /tmp/libcuda-stub.c
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/stubs/libcuda.so" /tmp/libcuda-stub.c
    ln -sf libcuda.so "$cuda/lib/stubs/libcuda.so.1"   # the name the executables' link looks for
fi
export LD_LIBRARY_PATH="$cuda/lib/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"   # (only for ld here)
[ -f .stage/llama-bin-11434-src.tar.xz ] || bash ci/stage_llama_src.sh
rm -rf "$src" && mkdir -p "$src" && tar xJf .stage/llama-bin-11434-src.tar.xz -C "$src"
(cd "$src/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build -j"$(nproc)" --target llama-server llama-bench)
tar cf - -C "$build/bin" llama-server llama-bench $(cd "$build/bin" && ls lib*.so*) | xz -T0 -6 > /tmp/llama-sm90.tar.xz
rm -rf .stage/llama-sm90-1 .stage/llama-sm90-2 && mkdir -p .stage/llama-sm90-1 .stage/llama-sm90-2
split -b 24000000 -d -a 1 /tmp/llama-sm90.tar.xz /tmp/llama-sm90.tar.xz.part
mv /tmp/llama-sm90.tar.xz.part0 .stage/llama-sm90-1/
mv /tmp/llama-sm90.tar.xz.part1 .stage/llama-sm90-2/
sha256sum < /tmp/llama-sm90.tar.xz | cut -c1-64 > .stage/llama-sm90-2/sha256
du -sh .stage/llama-sm90-1 .stage/llama-sm90-2
