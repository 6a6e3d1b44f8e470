#!/usr/bin/env bash
# Three GPU calls, sent back to back on a warm machine, for what the third session of 2026-12-01
# wrote without a GPU (each switch is off by default until these calls measure it):
#   BRASS_F16_WEIGHTS=1  a dense prompt GEMM reads the weight's float16 copy kept since the first prompt
#   BRASS_MOE_MMQ=1      a prompt's expert mat-muls on int8 tiles planned on the device (no host sync)
#   BRASS_ATTN_TILED=1   a prompt's attention in tiles on tensor cores
#   BRASS_PROMPT_GRAPHS=1  a session's prompt of a length read before replays a captured graph
#   BRASS_GEMMA4_FUSED_MOE=1  Gemma 4's routed experts through the fused moe_ffn kernels (decode)
#   moe_route on one warp instead of eight (a copy of the tree with ROUTE_THREADS 32)
#   and, on by default already (bit-identical on the CPU, not yet timed): attention.cu's pass 1
#   with 4 slots in flight per warp, against a copy with ATTN_SLOTS_PER_WARP 1
# Part 1: the suite with the defaults (the new kernels' own GPU tests run whatever the
#   switches), then the kernel, op and whole-model checks with the five switches on; llama-bench
#   builds and the shape-true files are written meanwhile (detached: part 2 finds them).
# Part 2: pp512 of each switch against the defaults (0.6B and 8B: F16 weights, tiled attention,
#   prompt graphs, all four;
#   30B-A3B: MoE MMQ), tg128 of the 30B-A3B with moe_route on 256 and on 32 threads, and of
#   the slots in flight. Part 3: llama-bench and brass bench side by side with the switches on.
#   run(command="bash ci/gpu_levers_session.sh 1", carry=[".whl", ".stage"]); then at once
#   run(command="bash ci/gpu_levers_session.sh 2", carry=[".whl", ".stage"]); then at once
#   run(command="bash ci/gpu_levers_session.sh 3", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
. ci/gpu_lib.sh
brass_wheels
dir=/tmp/brass-shapes
ON="BRASS_F16_WEIGHTS=1 BRASS_MOE_MMQ=1 BRASS_ATTN_TILED=1 BRASS_PROMPT_GRAPHS=1 BRASS_GEMMA4_FUSED_MOE=1"

if [ "${1:-1}" = 1 ]; then
    bash ci/gpu_llama_builds.sh start
    (setsid nohup bash -c "for s in qwen3-0.6b qwen3-8b qwen3-30b-a3b gemma-4-26b-a4b; do python3 ci/shape_models.py \$s $dir; done" \
        > /tmp/brass-shapes.log 2>&1 < /dev/null &)
    echo "== 1. suite (defaults)"
    timeout 220 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20
    cat "$out/gpu-conformance-summary.txt" 2>/dev/null
    echo "== 2. $ON: kernels, whole models' ops, whole models, graphs"
    env $ON timeout 200 python3 -m pytest conformance/test_kernels.py conformance/test_kernels_mmq.py \
        conformance/test_kernels_attention_tiled.py conformance/test_kernels_model.py conformance/test_models.py \
        conformance/test_decode_graph.py conformance/test_batch.py conformance/test_prompt_graphs.py \
        conformance/test_serving.py -q -rfE -n 12 -p no:cacheprovider > "$out/switches.log" 2>&1
    echo "exit $?"; grep -E "^(FAILED|ERROR)" "$out/switches.log" | head -20; tail -1 "$out/switches.log"
    bash ci/gpu_llama_builds.sh status | head -1; tail -3 /tmp/brass-shapes.log
    exit 0
fi

if [ "${1:-1}" = 2 ]; then
echo "== 3. prompt speed: each switch against the defaults (-r 2)"
b() {   # b SHAPE ARGS...: the bench's figure, e.g. "pp512  | 23523.00 ± 12.00 |"
    local s=$1; shift
    timeout 70 python3 -m engine bench "$dir/$s.gguf" --backend cuda -r 2 "$@" 2>/dev/null | grep -oE "(pp|tg)[0-9]+ .*"
}
for s in qwen3-0.6b qwen3-8b; do
    echo "$s defaults: $(b $s -p 512 -n 0)"
    echo "$s BRASS_F16_WEIGHTS=1: $(BRASS_F16_WEIGHTS=1 b $s -p 512 -n 0)"
    echo "$s BRASS_ATTN_TILED=1: $(BRASS_ATTN_TILED=1 b $s -p 512 -n 0)"
    echo "$s BRASS_PROMPT_GRAPHS=1: $(BRASS_PROMPT_GRAPHS=1 b $s -p 512 -n 0)"
    echo "$s all four: $(export $ON; b $s -p 512 -n 0)"
done
echo "qwen3-30b-a3b defaults: $(b qwen3-30b-a3b -p 512 -n 0)"
echo "qwen3-30b-a3b BRASS_MOE_MMQ=1: $(BRASS_MOE_MMQ=1 b qwen3-30b-a3b -p 512 -n 0)"
echo "qwen3-30b-a3b all four: $(export $ON; b qwen3-30b-a3b -p 512 -n 0)"
rm -rf /tmp/route32 && mkdir -p /tmp/route32 && cp -r engine kernels ci pyproject.toml /tmp/route32/
sed -i 's/^#define ROUTE_THREADS 256$/#define ROUTE_THREADS 32/' /tmp/route32/kernels/fused.cu
echo "qwen3-30b-a3b moe_route 256 threads: $(b qwen3-30b-a3b -p 0 -n 128)"
echo "qwen3-30b-a3b moe_route 32 threads ($(grep -c '^#define ROUTE_THREADS 32$' /tmp/route32/kernels/fused.cu)): $(cd /tmp/route32 && PYTHONPATH=/tmp/route32${PYTHONPATH:+:$PYTHONPATH} b qwen3-30b-a3b -p 0 -n 128)"

rm -rf /tmp/slots1 && mkdir -p /tmp/slots1 && cp -r engine kernels ci pyproject.toml /tmp/slots1/
sed -i 's/^#define ATTN_SLOTS_PER_WARP 4 /#define ATTN_SLOTS_PER_WARP 1 /' /tmp/slots1/kernels/attention.cu
for s in qwen3-0.6b qwen3-30b-a3b; do
    echo "$s tg128, attention pass 1 with 4 slots in flight per warp: $(b $s -p 0 -n 128)"
    echo "$s tg128, with 1 ($(grep -c '^#define ATTN_SLOTS_PER_WARP 1 ' /tmp/slots1/kernels/attention.cu)): $(cd /tmp/slots1 && PYTHONPATH=/tmp/slots1${PYTHONPATH:+:$PYTHONPATH} b $s -p 0 -n 128)"
done

echo "gemma-4-26b-a4b tg128: $(b gemma-4-26b-a4b -p 0 -n 128)"
echo "gemma-4-26b-a4b tg128 BRASS_GEMMA4_FUSED_MOE=1: $(BRASS_GEMMA4_FUSED_MOE=1 b gemma-4-26b-a4b -p 0 -n 128)"

[ "${1:-1}" = 2 ] && exit 0
fi

if [ "${1:-1}" = 3 ]; then
echo "== 4. side by side, $ON"
bash ci/gpu_llama_builds.sh wait 120 > /dev/null; bash ci/gpu_llama_builds.sh status | head -1
env $ON LLAMA_BENCH=/tmp/llama-bench-11434/llama.cpp/build/bin/llama-bench REPS=3 timeout 420 \
    bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b,qwen3-30b-a3b,gemma-4-26b-a4b 2>&1 | grep -v "^WARNING"
fi
