#!/usr/bin/env bash
# The whole conformance suite on the GPU runner: writes a junit XML and a one-line summary
# (counts passed / skipped / failed) to $OUT (the runner's result folder; else the current
# directory). The runner has no network and no gguf-py or syrupy: wheels of them carried in
# .whl/ (pip download --no-deps gguf==0.19.0 syrupy -d .whl; run's carry=[".whl"]) are
# installed first; without them the tests that need them skip or fail to import, and the
# rest of the suite still runs.
# Usage (from the repository root, on the runner): ci/gpu_conformance.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/brass-site .whl/*.whl \
        && export PYTHONPATH="/tmp/brass-site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
python3 -m pytest conformance/ -q -rfEs -p no:cacheprovider --continue-on-collection-errors -o junit_family=xunit1 --junitxml="$out/gpu-conformance.xml" "$@"
rc=$?
python3 ci/gpu_summary.py "$out/gpu-conformance.xml" | tee "$out/gpu-conformance-summary.txt"
exit $rc
