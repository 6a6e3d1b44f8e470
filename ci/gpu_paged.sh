# shellcheck shell=bash disable=SC2154     # out, dir (brass_env), bin, server (llama_env): ci/gpu_lib.sh
# Sourced by ci/gpu.sh (from the repository root, after ci/gpu_lib.sh, whose functions it
# calls): the `paged` subcommand, issue 47's paged KV cache on CUDA, its tests and its three
# bars. `bash ci/gpu.sh paged [tests|chat|load|memory]` runs it; ci/gpu.sh's help lists it.

# shellcheck disable=SC2034     # serve_args: paged_serve (ci/gpu_lib.sh) reads the caller's
sub_paged() {     # [tests | chat | load | memory] (tests and chat by default; one part a call fits a call's 600 s)
    # Issue 47, the paged KV cache on CUDA. tests: the kernels that read and write caches
    # through block tables (their CPU builds too), the CUDA backend's attention ops, the
    # batched steps (row kernels, bucket graphs over one pool), prompt graphs, and prefix
    # caching on both backends; prints each file's pass/fail and the failures. chat: the
    # 10-turn chat bar on a shape-true file (SHAPE, default qwen3-0.6b): brass serve on CUDA
    # with prefix caching, then without (--no-prefix-cache: every turn reads its whole
    # history), ci/chat_ttft.py against each (200-token user messages, 128 tokens generated;
    # --history words: the random model's replies read back as text would be 2-4x as long);
    # TTFT of turn 10 over turn 1 <= 1.3 with caching. load: SHAPE_LOAD (default qwen3-8b),
    # 16 streaming clients sharing a 2,000-token system prompt, each with its own 100-token
    # question, two requests each (ci/shared_prefix_load.py), against brass serve --parallel
    # 16 with and without prefix caching. LLAMA=1 adds llama-server (cache_prompt on, its
    # default) to chat (one slot) and load (--parallel 16, 16 x 4,096 context), once `llama
    # start` / `llama wait` have built it on this warm runner; each part then prints one table
    # (--compare): load's tok/s and TTFT p50 ratios to llama-server and the bars (>= 1.5x,
    # <= 0.5x). memory: MEM_SEQS (64) sequences of MEM_TOKENS (4,096: MEM_GEN 128 generated)
    # held at once by brass serve --parallel MEM_SEQS on SHAPE_LOAD, its pool exactly their
    # blocks (--kv-blocks), ci/paged_memory.py sampling /metrics and nvidia-smi: KV bytes a
    # token, the pool, device memory, the per-session layout's need against the card; then the
    # same server with 1/64 of the pool, idle: the pool's memory a token, measured. ARGS:
    # more options for the part's client script (smaller runs: ARGS="--turns 3").
    local what="${1:-all}" rc=0 f mode llama="" name="${SHAPE:-qwen3-0.6b}" lname="${SHAPE_LOAD:-qwen3-8b}" serve_args
    gpu_name
    if [ "${LLAMA:-0}" = 1 ] && [[ "$what" =~ ^(all|chat|load)$ ]]; then
        llama_env
        if need_llama "${LLAMA_WAIT:-0}"; then llama=1; else echo "llama-server's runs skipped: not built (llama start, then llama wait)"; fi
    fi
    if [ "$what" = all ] || [ "$what" = tests ]; then
        for f in conformance/kernels/test_kernels_attention_rowwise.py conformance/kernels/test_kernels_attention_tiled.py \
                 conformance/kernels/test_kernels_fused_cpu.py conformance/kernels/test_kernels_gemma4.py \
                 conformance/models/test_batch.py conformance/models/test_prompt_graphs.py \
                 conformance/models/test_decode_graph.py conformance/server/test_prefix_cache.py \
                 conformance/server/test_server_cuda.py conformance/kernels/test_cuda_options.py \
                 conformance/kernels/test_kernels_paged_offsets.py; do
            guarded 500 python3 -m pytest "$f" -q -rfE -p no:cacheprovider > "$out/paged-$(basename "$f" .py).log" 2>&1
            local r=$?
            echo "$([ $r = 0 ] && echo PASS || echo "FAIL ($r)") $f: $(tail -1 "$out/paged-$(basename "$f" .py).log")"
            [ $r = 0 ] || { rc=1; grep -E "^(FAILED|ERROR)" "$out/paged-$(basename "$f" .py).log" | head -10; }
        done
        guarded 590 python3 -m pytest conformance/kernels/test_kernels.py conformance/kernels/test_kernels_model.py \
            -k "attention or rope_store or kv_store or lockstep or free_running" -q -rfE -p no:cacheprovider \
            > "$out/paged-test_kernels.log" 2>&1
        local r=$?
        echo "$([ $r = 0 ] && echo PASS || echo "FAIL ($r)") test_kernels.py/test_kernels_model.py (attention, rope_store, kv_store, model): $(tail -1 "$out/paged-test_kernels.log")"
        [ $r = 0 ] || { rc=1; grep -E "^(FAILED|ERROR)" "$out/paged-test_kernels.log" | head -10; }
    fi
    if [ "$what" = all ] || [ "$what" = chat ]; then
        shape "$name" || return 1
        # each run's deadline (t, s): brass with caching, without, llama-server (its ten turns
        # take seconds; the rest of the call where it does not run)
        local chat=(ci/chat_ttft.py --turns 10 --user-tokens 200 --max-tokens 128 --history words) deadline=(300 590)
        [ -n "$llama" ] && deadline=(250 450)
        serve_args=""
        for mode in cached uncached; do
            echo "== $name, brass serve, prefix caching $([ $mode = cached ] && echo on || echo off)"
            paged_serve "$mode" "$dir/$name.gguf" 4 8184 paged-chat "${deadline[$([ $mode = cached ] && echo 0 || echo 1)]}" \
                python3 "${chat[@]}" ${ARGS:-} --url http://127.0.0.1:8184/v1 --label "brass-$mode" --json "$out/paged-chat-$mode.json"
            local r=$?
            [ $mode = cached ] && [ $r != 0 ] && rc=1
        done
        if [ -n "$llama" ]; then
            echo "== $name, llama-server, cache_prompt on"
            llama_serve "$dir/$name.gguf" 8187 paged-chat 590 "--parallel 1 -c 4096" \
                python3 "${chat[@]}" ${ARGS:-} --url http://127.0.0.1:8187/v1 --label llama-server --json "$out/paged-chat-llama-server.json"
        fi
        local runs=() m
        for m in cached uncached llama-server; do [ -f "$out/paged-chat-$m.json" ] && runs+=("$out/paged-chat-$m.json"); done
        [ ${#runs[@]} -gt 0 ] && python3 ci/chat_ttft.py --compare "${runs[@]}"
    fi
    if [ "$what" = load ]; then
        guarded 200 bash -c ". ci/gpu_lib.sh; dir='$dir'; shape '$lname'" || { echo "no $lname shape file"; return 1; }
        local load=(ci/shared_prefix_load.py --clients 16 --requests 2 --system-tokens 2000 --question-tokens 100
                    --max-tokens 128)
        serve_args=""
        echo "== $lname, brass serve --parallel 16, prefix caching on"
        paged_serve cached "$dir/$lname.gguf" 16 8185 paged-load "$([ -n "$llama" ] && echo 330 || echo 400)" \
            python3 "${load[@]}" ${ARGS:-} --url http://127.0.0.1:8185/v1 --label brass-cached --json "$out/paged-load-cached.json" || rc=1
        if [ -n "$llama" ]; then
            echo "== $lname, llama-server --parallel 16, cache_prompt on"
            llama_serve "$dir/$lname.gguf" 8187 paged-load 460 "--parallel 16 -c 65536" \
                python3 "${load[@]}" ${ARGS:-} --url http://127.0.0.1:8187/v1 --label llama-server --json "$out/paged-load-llama-server.json"
        fi
        echo "== $lname, brass serve --parallel 16, prefix caching off"
        paged_serve uncached "$dir/$lname.gguf" 16 8185 paged-load 590 \
            python3 "${load[@]}" ${ARGS:-} --url http://127.0.0.1:8185/v1 --label brass-uncached --json "$out/paged-load-uncached.json"
        local runs=() m
        for m in cached uncached llama-server; do [ -f "$out/paged-load-$m.json" ] && runs+=("$out/paged-load-$m.json"); done
        # the bars are against llama-server: without its run, each brass run's line above says it all
        [ -f "$out/paged-load-llama-server.json" ] && { python3 ci/shared_prefix_load.py --compare "${runs[@]}" || rc=1; }
    fi
    if [ "$what" = memory ]; then
        guarded 200 bash -c ". ci/gpu_lib.sh; dir='$dir'; shape '$lname'" || { echo "no $lname shape file"; return 1; }
        local seqs="${MEM_SEQS:-64}" tokens="${MEM_TOKENS:-4096}" gen="${MEM_GEN:-128}" before
        before=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | head -1)
        serve_args="--kv-blocks $(( seqs * ((tokens + 15) / 16) )) --max-waiting $seqs"
        local big="$out/paged-memory.json" small="$out/paged-memory-small.json"
        rm -f "$big" "$small"     # an earlier run's files in $out must not stand in for this one's
        echo "== $lname, $seqs sequences of $tokens tokens at once ($gen generated)"
        # until t = 450 s: the small pass below needs the rest of the call (the server's start
        # and one tiny request)
        paged_serve cached "$dir/$lname.gguf" "$seqs" 8186 paged-memory 450 \
            python3 ci/paged_memory.py --url http://127.0.0.1:8186/v1 --model-file "$dir/$lname.gguf" \
            --sequences "$seqs" --prompt-tokens $(( tokens - gen )) --max-tokens "$gen" ${ARGS:-} \
            ${before:+--device-before-mib "$before"} --json "$big" || rc=1
        # the pool's own device memory: the same server with 1/64 of the blocks, idle (one tiny
        # request), its memory apart over the blocks apart
        serve_args="--kv-blocks $(( (seqs * ((tokens + 15) / 16) + 63) / 64 )) --max-waiting $seqs"
        echo "== the same server with a pool of 1/64 the blocks (the pool's memory by difference)"
        if [ ! -f "$big" ]; then
            echo "the 1/64-pool pass skipped: the big pass wrote no $big"
        elif [ "$(left 590)" -lt 60 ]; then
            # 60 s: room for the server to start and answer one tiny request; with less the
            # pass would end in a timeout, not a figure
            echo "the 1/64-pool pass skipped at t=$(t) s: under 60 s left of the call"
        else
            # its table says nothing the JSON does not: only the server's line (ready, did not
            # start, or skipped) is shown
            paged_serve cached "$dir/$lname.gguf" "$seqs" 8186 paged-memory-small 590 \
                python3 ci/paged_memory.py --url http://127.0.0.1:8186/v1 --model-file "$dir/$lname.gguf" \
                --sequences 1 --prompt-tokens 15 --max-tokens 1 --json "$small" > "$out/paged-memory-small.txt"
            grep -E "^brass serve \(" "$out/paged-memory-small.txt"
        fi
        if [ -f "$big" ] && [ -f "$small" ]; then
            python3 ci/paged_memory.py --difference "$big" "$small"
        else
            echo "no --difference (the KV bytes a token, measured) at t=$(t) s: no $([ -f "$big" ] && echo "$small" || echo "$big")"
        fi
    fi
    return $rc
}
