#!/usr/bin/env bash
# The whole conformance suite on the GPU runner: writes a junit XML and a one-line summary
# (counts passed / skipped / failed) to $OUT (the runner's result folder; else the current
# directory). The runner has no network and no gguf-py or syrupy: tests that need them skip.
# Usage (from the repository root, on the runner): ci/gpu_conformance.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
python3 -m pytest conformance/ -q -rfEs -p no:cacheprovider -o junit_family=xunit1 --junitxml="$out/gpu-conformance.xml" "$@"
rc=$?
python3 ci/gpu_summary.py "$out/gpu-conformance.xml" | tee "$out/gpu-conformance-summary.txt"
exit $rc
