#!/usr/bin/env bash
# Which serving feature holds on to GPU memory (the 420 s soak of 2026-12-02 on the 8B shape:
# the server's GPU memory 21.5 -> 39.5 GB after warm-up): brass serve on the Qwen3-0.6B shape
# four times at once, each beside its own soak (ci/soak.py --gpu samples each server process's
# own memory): the defaults, then BRASS_SHARED_PROMPT_GRAPHS=0, BRASS_BATCH_BUCKETS=0 and
# BRASS_PROMPT_GRAPHS=0, one each. Usage: ci/gpu_soak_probe.sh [SECONDS] (default 100).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
secs=${1:-100}
[ -f "$dir/qwen3-0.6b.gguf" ] || python3 ci/shape_models.py qwen3-0.6b "$dir" > /dev/null || exit 1
i=0
for v in NONE=1 BRASS_SHARED_PROMPT_GRAPHS=0 BRASS_BATCH_BUCKETS=0 BRASS_PROMPT_GRAPHS=0; do
    port=$((8190 + i))
    env "$v" setsid nohup python3 -m brass serve "$dir/qwen3-0.6b.gguf" --backend cuda --parallel 16 --port $port \
        > /tmp/probe-serve-$i.log 2>&1 < /dev/null &
    echo $! > /tmp/probe-$i.pid
    echo "$v" > /tmp/probe-$i.what
    i=$((i + 1))
done
for i in 0 1 2 3; do
    for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$((8190 + i))/health" > /dev/null && break; sleep 1; done
done
for i in 0 1 2 3; do
    python3 ci/soak.py --url "http://127.0.0.1:$((8190 + i))" --clients 16 --seconds "$secs" --idle 10 --warmup 20 \
        --pid "$(cat /tmp/probe-$i.pid)" --gpu --json /tmp/probe-$i.json > /tmp/probe-soak-$i.log 2>&1 &
done
wait $(jobs -p | tail -4) 2> /dev/null
sleep 1
for i in 0 1 2 3; do
    echo "$(cat /tmp/probe-$i.what): $(python3 -c "
import json; d = json.load(open('/tmp/probe-$i.json'))
print(d['completed'], 'done', d['dropped'], 'dropped', d['failed'], 'failed; GPU MB first / after warm-up / last:',
      d.get('gpu_mb_first'), d['gpu_mb_after_warmup'], d['gpu_mb_last'])" 2>&1 | tail -1)"
    kill "$(cat /tmp/probe-$i.pid)" 2> /dev/null
done
