#!/usr/bin/env bash
# One GPU call for the decode levers of 2026-12-01 (third session): programmatic dependent
# launch in the captured graphs, the mat-vecs' L2 prefetch, the decode gated delta-net kernel.
# In order, each part with its own time limit so that the call returns what it did:
#   1. the whole conformance suite (the PDL chain test, the GDN kernel tests, graph = eager);
#   2. the PDL chain test's teeth: a copy of the tree whose `add` kernel lacks PDL_ENTRY must fail it;
#   3. mat-vec variants with and without the L2 prefetch (ci/gpu_tune_matvec.py);
#   4. brass bench on the Qwen3-0.6B and -8B shapes with BRASS_PDL=1 and 0, one after the other.
# Meanwhile llama-bench builds (ci/gpu_llama_builds.sh, detached: the next call finds it on a
# warm machine) and the shape-true files are written, the MoE ones for the next call.
#   run(command="bash ci/gpu_pdl_session.sh", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
. ci/gpu_lib.sh
brass_wheels
bash ci/gpu_llama_builds.sh start
dir=/tmp/brass-shapes
(for s in qwen3-0.6b qwen3-8b; do python3 ci/shape_models.py $s $dir; done > "$out/shape-dense.log" 2>&1) &
dense=$!
(for s in qwen3-30b-a3b qwen3.6-35b-a3b; do python3 ci/shape_models.py $s $dir; done > "$out/shape-moe.log" 2>&1 < /dev/null &)

echo "== 1. suite"
timeout 210 bash ci/gpu_conformance.sh -n 8 -q > "$out/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -30
cat "$out/gpu-conformance-summary.txt" 2>/dev/null

echo "== 2. teeth of the PDL chain test: add without PDL_ENTRY"
rm -rf /tmp/teeth && mkdir -p /tmp/teeth && cp -r engine kernels conformance golden ci pyproject.toml /tmp/teeth/
python3 - <<'PY'
from pathlib import Path
p = Path("/tmp/teeth/kernels/elementwise.cu"); s = p.read_text()
p.write_text(s.replace("    PDL_ENTRY();\n", "", 1))      # the first kernel of the file: add
PY
(cd /tmp/teeth && PYTHONPATH=/tmp/teeth${PYTHONPATH:+:$PYTHONPATH} timeout 60 python3 -m pytest \
    conformance/test_kernels.py -k pdl -q -p no:cacheprovider 2>&1 | grep -E "differ|passed|failed" | head -3)

echo "== 3. mat-vec variants (prefetch on / off)"
timeout 80 python3 ci/gpu_tune_matvec.py "$out/tune.txt" 2>&1 | grep -v "^WARNING" | tail -12

echo "== 4. brass bench, PDL on / off"
wait $dense
for s in qwen3-0.6b qwen3-8b; do
    for pdl in 1 0 1; do
        echo "BRASS_PDL=$pdl"
        BRASS_PDL=$pdl timeout 45 python3 -m engine bench $dir/$s.gguf --backend cuda -p 512 -n 128 -r 3 \
            2>> "$out/bench.err" | grep -E "^\| qwen|kernels"
    done
done
bash ci/gpu_llama_builds.sh status
df -h /tmp | tail -1
