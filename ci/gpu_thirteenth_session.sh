#!/usr/bin/env bash
# The thirteenth session's GPU calls (2026-12-03). Every call starts what it needs itself (the
# machine may go back between calls). llama-server and llama-bench come carried, built on the
# development machine for sm_90 with the same recipe (ci/gpu_lib.sh llama_build) and CUDA
# 13.0 (.stage/llama-sm90/: the binaries and their ggml/llama libraries, packed by
# ci/stage_llama_sm90.sh); where they do not
# run there, the source is built detached as before (~4.5 min).
#   1. the load test (issue 11): per round llama-server once, brass with
#      BRASS_BATCH_KEEP_AHEAD=0 and =1 (the order alternates), two rounds, REQUESTS=6.
#   2. the whole GPU suite on this tree, then the side by side of the 0.6B shape.
#   3. the side by side of the 8B and 30B-A3B shapes.
#   suite: the whole GPU suite alone (until t = 580).
#   run(command="bash ci/gpu_thirteenth_session.sh 1", carry=[".whl", ".stage"])
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
brass_env
bin="$LLAMA_SRC_DIR/llama.cpp/build/bin"
server="$bin/llama-server"
# the carried binaries find their libraries here; cuBLAS where the runner keeps it
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null) "$bin"; do
    [ -d "$d" ] || [ "$d" = "$bin" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

llama_ready() {     # 0: llama-server and llama-bench run here; else a build is started
    if [ ! -x "$server" ] && [ -x .stage/llama-sm90/llama-server ]; then
        mkdir -p "$bin" && cp -a .stage/llama-sm90/. "$bin/"
        for f in "$bin"/*.xz; do [ -f "$f" ] && xz -d -T0 "$f"; done    # (ggml-cuda: 67 MB unpacked)
    fi
    if [ -x "$server" ] && "$server" --version > /dev/null 2>&1 && "$bin/llama-bench" --help > /dev/null 2>&1; then
        return 0
    fi
    if [ ! -f /tmp/llama-build.log ]; then
        echo "llama.cpp: carried binaries absent or not running here ($("$server" --version 2>&1 | tail -1)); building"
        rm -rf "$LLAMA_SRC_DIR"
        llama_build_detached
    fi
    return 1
}

need_llama() {     # $1: until t = $1, wait for llama-server
    llama_ready && return 0
    while [ "$(left "$1")" -gt 0 ]; do sleep 5; llama_ready && return 0; done
    echo "llama.cpp not built by t=$(t) s:"; tail -3 /tmp/llama-build.log; return 1
}

serve_round() {     # $1: engine (llama-server or brass), $2: KEEP_AHEAD for brass, $3 run tag
    [ "$(left 590)" -ge 75 ] || { echo "skipped $1 $3 (t=$(t) s)"; return 1; }
    echo "== $1${2:+ BRASS_BATCH_KEEP_AHEAD=$2} ($3, t=$(t) s)"
    ENGINES=$1 BRASS_BATCH_KEEP_AHEAD=${2:-0} REQUESTS=6 timeout "$(left 590)" bash ci/gpu_serving.sh 2>&1 \
        | grep -E "^(brass after|brass: |llama-server did|brass serve did|load_test)"
    for f in "$out"/load-$1-*.json; do
        [ -f "$f" ] && mv "$f" "${f%.json}.$3.json"
    done
    rm -f "$out"/load-*.err "$out"/llama-server.log "$out"/brass-serve.log
}

case "${1:-1}" in
1)
    llama_ready || echo "llama.cpp building (t=$(t) s)"
    [ -f "$dir/qwen3-8b.gguf" ] || { python3 ci/shape_models.py qwen3-8b "$dir" > /dev/null; echo "8B shape written (t=$(t) s)"; }
    need_llama 300 || exit 1
    serve_round llama-server "" r1
    serve_round brass 0 r1k0
    serve_round brass 1 r1k1
    serve_round llama-server "" r2
    serve_round brass 1 r2k1
    serve_round brass 0 r2k0
    python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from tabulate import tabulate
rows = []
for f in sorted(Path(sys.argv[1]).glob("load-*.json")):
    d = json.loads(f.read_text())
    engine, rest = f.stem.split("-", 1)[1].rsplit("-", 1)[0], f.stem.rsplit("-", 1)[1]
    n, tag = rest.split(".", 1)
    rows.append([tag, engine, int(n), d["tokens_per_s"], round(d["ttft_p50_s"] * 1e3, 1),
                 round(d["ttft_p99_s"] * 1e3, 1), f"{d['completed']}/{d['failed']}"])
rows.sort(key=lambda r: (r[2], r[0], r[1]))
print(tabulate(rows, headers=["run", "engine", "clients", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                              "done/failed"], tablefmt="github"))
PY
    ;;
suite)
    brass_suite 580 -n 14 -q
    ;;
2)
    llama_ready || true
    brass_suite 430 -n 14 -q
    need_llama 440 && LLAMA_BENCH="$bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-0.6b 2>&1 | grep -v "^WARNING"
    ;;
3)
    need_llama 300 || exit 1
    LLAMA_BENCH="$bin/llama-bench" REPS=2 \
        guarded 590 bash ci/gpu_side_by_side.sh qwen3-8b,qwen3-30b-a3b 2>&1 | grep -v "^WARNING"
    ;;
esac
rm -f "$out"/llama-*.log "$out"/brass-*.log "$out"/bytes-*
echo "done at t=$(t) s"
