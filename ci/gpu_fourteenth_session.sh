#!/usr/bin/env bash
# The fourteenth session's GPU calls (2026-12-03); carry [".whl",
# ".stage/llama-bin-11434-src.tar.xz"] for every call.
#   1. issue 11's soak with the step ahead kept (the default since the thirteenth session):
#      ci/gpu_soak.sh start (16 streaming clients, random disconnects, 1,000 idle connections,
#      600 s, 8B shape) detached, and the whole GPU suite beside it (as in the eleventh session).
#   2. (right after 1, while the machine is warm) the soak's result; on a fresh machine (the
#      soak lost) a soak of this call's own, as long as the call allows, instead. Then the load
#      test again: llama-server, brass, llama-server, on a quiet machine (llama.cpp built beside
#      the soak's end, niced).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
llama_env

case "${1:-1}" in
1)
    bash ci/gpu_soak.sh start
    brass_suite 570 -n 12 -q
    echo "soak at t=$(t) s: $(tail -1 /tmp/brass-soak/soak.log 2> /dev/null)"
    ;;
2)
    if [ -f /tmp/brass-soak/serve.pid ]; then
        LLAMA_NICE=15 llama_ready || echo "llama.cpp building (t=$(t) s)"
        WAIT=150 bash ci/gpu_soak.sh result
    else
        echo "a fresh machine: the soak of call 1 is gone; a soak of this call's own"
        SOAK_SECONDS=510 bash ci/gpu_soak.sh start && WAIT=$(left 585) bash ci/gpu_soak.sh result
        echo "done at t=$(t) s"; exit 0
    fi
    [ -f "$dir/qwen3-8b.gguf" ] || python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null
    if need_llama 380; then
        serve_round llama-server "" r1
        serve_round brass 1 r1k1
        serve_round llama-server "" r2
    fi
    python3 ci/load_table.py "$out"
    rm -f "$out"/load-*.json
    ;;
esac
rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/bytes-*
echo "done at t=$(t) s"
