#!/usr/bin/env bash
# Issue 11's soak on the GPU: brass serve --backend cuda --parallel 16 on the shape-true Qwen3-8B
# file, driven by ci/soak.py (16 streaming clients with random disconnects, 1,000 idle
# connections, /health timed, the server's RSS and the GPU memory sampled, --gpu). The soak
# outlasts what one call does beside it, so it runs detached across consecutive calls of a warm
# runner (background processes and /tmp survive between them):
#   ci/gpu_soak.sh start     the shape written if missing, the server started, the soak detached
#   ci/gpu_soak.sh result    waits for the soak (at most WAIT seconds, default 560), prints its
#                            one-line summary and its GPU memory series, copies its JSON to
#                            $OUT, stops the server (a soak
#                            not done by then is left running, for a later `result`)
# Env: SOAK_SECONDS (600), SHAPE (qwen3-8b), PORT (8183).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
shape="${SHAPE:-qwen3-8b}"
port="${PORT:-8183}"
state=/tmp/brass-soak
mkdir -p "$state"

if [ "${1:-start}" = start ]; then
    [ -f "$dir/$shape.gguf" ] || python3 ci/shape_models.py "$shape" "$dir" > /dev/null || exit 1
    # a server of an earlier start still running would hold the port and GPU memory
    [ -f "$state/serve.pid" ] && kill "$(cat "$state/serve.pid")" 2> /dev/null
    rm -f "$state"/*
    setsid nohup python3 -m brass serve "$dir/$shape.gguf" --backend cuda --parallel 16 --port "$port" \
        > "$state/serve.log" 2>&1 < /dev/null &
    echo $! > "$state/serve.pid"
    for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    curl -sf "http://127.0.0.1:$port/health" > /dev/null || {
        echo "soak: brass serve did not start in 180 s"; tail -5 "$state/serve.log"
        kill "$(cat "$state/serve.pid")" 2> /dev/null; exit 1; }
    (setsid nohup bash -c "python3 ci/soak.py --url http://127.0.0.1:$port --clients 16 --seconds ${SOAK_SECONDS:-600} \
        --idle 1000 --pid $(cat "$state/serve.pid") --gpu --json $state/soak.json > $state/soak.log 2>&1; \
        echo \$? > $state/soak.rc" > /dev/null 2>&1 < /dev/null &)
    echo "soak: started at $(date +%T) for ${SOAK_SECONDS:-600} s on $shape (server pid $(cat "$state/serve.pid"))"
    exit 0
fi

if [ "$1" = result ]; then
    t0=$SECONDS
    while [ ! -f "$state/soak.rc" ] && [ $((SECONDS - t0)) -lt "${WAIT:-560}" ]; do sleep 5; done
    if [ -f "$state/soak.rc" ]; then
        echo "soak exit $(cat "$state/soak.rc"): $(tail -1 "$state/soak.log")"
        cp "$state/soak.json" "$out/" 2> /dev/null
        kill "$(cat "$state/serve.pid")" 2> /dev/null
        grep -ciE "traceback|error" "$state/serve.log" | sed 's/^/server log lines naming an error: /'
        # the process's GPU memory beside what its prompt graphs say they hold, 12 samples
        python3 -c "
import json; s = json.load(open('$state/soak.json'))['gpu_series'] or []
for t, g, gr in s[::max(1, len(s) // 12)]: print(f'  t={t:6.1f} s  process GPU {g} MB  prompt graphs {gr} MB')"
    else
        # left running: a later `result` (on the same warm machine) still gets it
        echo "soak: still running after $((SECONDS - t0)) s (server and soak left running): $(tail -2 "$state/soak.log")"
        exit 1
    fi
fi
