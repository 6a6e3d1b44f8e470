#!/usr/bin/env bash
# One call's worth of CUDA kernel work on the GPU runner: the kernel conformance tests with a
# table of their NMSE, then the mat-vec benchmarks. Logs and the junit XML go to $OUT.
# Usage: ci/gpu_dev.sh [pytest args for the conformance part, e.g. -k matmul]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
python3 -m pytest conformance/test_kernels.py conformance/test_kernels_model.py conformance/test_kernels_plumbing.py -q -rfEs \
    -p no:cacheprovider -o junit_family=xunit1 --junitxml="$out/kernels.xml" "$@" > "$out/kernels.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|Error|error:|assert" "$out/kernels.log" | head -40
tail -3 "$out/kernels.log"
python3 ci/gpu_summary.py "$out/kernels.xml" --table
if [ "${BRASS_SKIP_PERF:-0}" != 1 ]; then
    ci/gpu_perf.sh
fi
exit $rc
