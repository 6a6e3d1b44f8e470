#!/usr/bin/env bash
# The whole conformance suite on the GPU runner: writes a junit XML and a one-line summary
# (counts passed / skipped / failed) to $OUT (the runner's result folder; else the current
# directory). The runner has no network and no gguf-py or syrupy: wheels of them carried in
# .whl/ (pip download --no-deps gguf==0.19.0 syrupy -d .whl; run's carry=[".whl"]) are
# installed first; without them the tests that need them skip or fail to import, and the
# rest of the suite still runs.
# brass serve (FastAPI + uvicorn) needs these too (Python 3.12, x86_64; 3.7 MB with the above;
# without them conformance/test_server_cuda.py skips and says why):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --abi cp312 --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 \
#       uvicorn==0.54.0 h11==0.16.0 click==8.5.1 pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types==0.8.0 typing-extensions==4.16.0 typing-inspection==0.4.5 \
#       anyio==4.16.0 idna==3.20 annotated-doc==0.0.7 opentelemetry-api==1.45.2
# and, for ci/load_test.py (the openai client) on the runner, the same way: openai==3.57.0
#   httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter distro sniffio tqdm certifi
# and, for record_goldens.py --device cuda (llama-cpp-python's own imports), jinja2 markupsafe diskcache
# Usage (from the repository root, on the runner): ci/gpu_conformance.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. ci/gpu_lib.sh
brass_wheels
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
python3 -m pytest conformance/ -q -rfEs -p no:cacheprovider --continue-on-collection-errors -o junit_family=xunit1 --junitxml="$out/gpu-conformance.xml" "$@"
rc=$?
python3 ci/gpu_summary.py "$out/gpu-conformance.xml" | tee "$out/gpu-conformance-summary.txt"
# whole models against llama.cpp's goldens (CPU and CUDA sets): issue 9's table
python3 ci/gpu_summary.py "$out/gpu-conformance.xml" --models > "$out/gpu-models.txt" 2>&1 || true
exit $rc
