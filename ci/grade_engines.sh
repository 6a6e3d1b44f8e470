#!/usr/bin/env bash
# Grading step of .ci/run, after the README's test command: brass conform against brass serve,
# llama.cpp's own llama-server (built before this step by ci/build_llama_server.py) and
# llama-cpp-python's server on the catalog models, and the planted wrong servers failing by name
# (ci/grade_engines.py); then lm-eval against brass serve and llama-server
# (conformance/tools/test_lm_eval.py) where its extra installs and the step's time allows.
# The step's budget: 15 minutes on 2 cores, the one-time build of llama-server not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=900
start=$(date +%s)

timeout 780 python3 ci/grade_engines.py

if ! python3 -m pip install -q -e '.[eval]'; then
    echo "warning: lm-eval did not install; its test (conformance/tools/test_lm_eval.py) is not run"
    exit 0
fi
left=$(( BUDGET - ($(date +%s) - start) ))
if [ "$left" -lt 240 ]; then
    echo "lm-eval: not run, ${left} s of the step's ${BUDGET} s left (it needs about 4 minutes)"
    exit 0
fi
rc=0
BRASS_TEST_LM_EVAL=1 timeout "$left" python3 -m pytest conformance/tools/test_lm_eval.py -q -p no:cacheprovider \
    || rc=$?
echo "grading step: $(( $(date +%s) - start )) s of its ${BUDGET} s"
exit "$rc"
