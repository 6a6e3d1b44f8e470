#!/usr/bin/env bash
# One GPU call for the decode levers of 2026-12-01 (third session): programmatic dependent
# launch in the captured graphs, the mat-vecs' L2 prefetch of small matrices, the decode gated
# delta-net kernel. In order, each part with its own time limit so that the call returns what
# it did:
#   1. the whole conformance suite (the PDL chain test, the GDN kernel tests, graph = eager);
#   2. the PDL chain test's teeth: a copy of the tree whose `add` kernel lacks PDL_ENTRY must fail it;
#   3. brass bench tg128 on the Qwen3-0.6B and -8B shapes, the tree as it is against a copy
#      without the L2 prefetch (MV_PREFETCH 0), alternated twice;
#   4. llama-bench and brass bench side by side on both shapes (llama-bench built meanwhile).
#   run(command="bash ci/gpu_pdl_session.sh", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
bash ci/gpu_llama_builds.sh start
(for s in qwen3-0.6b qwen3-8b; do python3 ci/shape_models.py $s $dir; done > "$out/shape-dense.log" 2>&1) &
dense=$!

echo "== 1. suite"
timeout 200 bash ci/gpu_conformance.sh -n 12 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

copy() {        # copy DIR: the engine, kernels and tests into DIR
    rm -rf "$1" && mkdir -p "$1" && cp -r engine kernels conformance golden ci pyproject.toml "$1"/
}
echo "== 2. teeth of the PDL chain test: add without PDL_ENTRY (must fail)"
copy /tmp/teeth
python3 - <<'PY'
from pathlib import Path
p = Path("/tmp/teeth/kernels/elementwise.cu"); s = p.read_text()
p.write_text(s.replace("    PDL_ENTRY();\n", "", 1))      # the first kernel of the file: add
PY
(cd /tmp/teeth && PYTHONPATH=/tmp/teeth${PYTHONPATH:+:$PYTHONPATH} timeout 60 python3 -m pytest \
    conformance/test_kernels.py -k pdl -q -p no:cacheprovider 2>&1 | grep -E "differ|passed|failed" | head -3)

echo "== 3. tg128 with the L2 prefetch (as committed) and without"
copy /tmp/nopf
sed -i 's/^#define MV_PREFETCH 1 /#define MV_PREFETCH 0 /' /tmp/nopf/kernels/matvec.cuh
grep -c "^#define MV_PREFETCH 0 " /tmp/nopf/kernels/matvec.cuh
wait $dense
for i in 1 2; do
    for s in qwen3-0.6b qwen3-8b; do
        echo "prefetch $s: $(timeout 40 python3 -m engine bench $dir/$s.gguf --backend cuda -p 0 -n 128 -r 3 2>/dev/null | grep -o 'tg128.*')"
        echo "no prefetch $s: $(cd /tmp/nopf && PYTHONPATH=/tmp/nopf${PYTHONPATH:+:$PYTHONPATH} timeout 40 python3 -m engine bench $dir/$s.gguf --backend cuda -p 0 -n 128 -r 3 2>/dev/null | grep -o 'tg128.*')"
    done
done

echo "== 4. side by side"
bash ci/gpu_llama_builds.sh wait 240 > /dev/null; bash ci/gpu_llama_builds.sh status | head -1
LLAMA_BENCH=/tmp/llama-bench-11434/llama.cpp/build/bin/llama-bench REPS=3 timeout 200 \
    bash ci/gpu_side_by_side.sh qwen3-0.6b,qwen3-8b 2>&1 | grep -v "^WARNING"
