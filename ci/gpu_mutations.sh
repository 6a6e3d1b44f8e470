#!/usr/bin/env bash
# Mutation check for the CUDA kernels, on the GPU runner: plant one deliberate bug at a time in
# a kernel source, run the conformance tests that should catch it, restore the source. Each
# line of output says whether the tests caught the bug (they must).
set -uo pipefail
cd "$(dirname "$0")/.."
export BRASS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
# a run cut short (a timeout) must not leave a planted bug behind for what runs next
trap 'for f in kernels/*.orig; do [ -e "$f" ] && mv "$f" "${f%.orig}"; done' EXIT INT TERM

mutate() {   # name, file, sed expression, pytest -k selection[, test file (test_kernels.py)]
    local name=$1 file=$2 expr=$3 sel=$4 tests=${5:-conformance/test_kernels.py}
    cp "$file" "$file.orig"
    sed -i "$expr" "$file"
    if cmp -s "$file" "$file.orig"; then
        echo "MUTATION $name: the edit did not apply"; status=1
    else
        python3 -m pytest "$tests" -q -p no:cacheprovider -k "$sel" > "${TMPDIR:-/tmp}/mutation-$name.log" 2>&1
        local rc=$?
        local summary; summary=$(tail -1 "${TMPDIR:-/tmp}/mutation-$name.log")
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
# The delta net (decode and chunked prompt): value head h reads key head h / (Hv / Hk), the
# grouped order of qwen3next, instead of h % Hk (the tiled order of qwen35).
mutate delta-net-grouped-heads kernels/ssm.cu \
    's|hk = h % Hk;|hk = h / (Hv / Hk);|' \
    "gated_delta_net"
mutate delta-chunked-grouped-heads kernels/delta_chunked.cu \
    's|hk = h % Hk;|hk = h / (Hv / Hk);|' \
    "chunked_kernel and not cpu" conformance/test_kernels_delta_chunked.py
# The causal conv1d carries a window shifted by one token (the prompt's own outputs are right).
mutate conv-window-shifted kernels/ssm.cu \
    's|const float v = X_ROW(p.n_tokens + j);|const float v = X_ROW(p.n_tokens + j - 1);|' \
    "ssm_conv"
exit $status
