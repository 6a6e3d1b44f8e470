"""Mutation check for the CPU engine: plant one deliberate bug at a time, run the tests that
should catch it, restore the file, and print which tests failed.

    BRASS_CACHE=~/.cache/brass python ci/mutations.py            # all mutations
    python ci/mutations.py --only rope_base                      # one

A mutation that no test catches is reported as SURVIVED and makes the script exit 1.
(The CUDA kernels have their own: ci/gpu.sh mutations.)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]

# name: (file, exact text, replacement, tests to run, what the bug is)
MUTATIONS = {
    "q4k_scale_nibbles": (
        "engine/quants.py",
        "sc = np.concatenate([lo & 0x3F, (mixed & 0x0F)",
        "sc = np.concatenate([lo & 0x3F, (mixed >> 4)",
        ["conformance/kernels/test_quants.py", "conformance/models/test_models.py::test_activations"],
        "Q4_K/Q5_K: scales 4-7 take the min's nibble (scale nibble order)",
    ),
    "rope_base": (
        "engine/arch/common.py",
        "base = cfg.rope_base if rope_base is None else rope_base",
        "base = 10000.0 if rope_base is None else rope_base",
        ["conformance/models/test_models.py::test_activations"],
        "rope base ignored (10000 for every model)",
    ),
    "sliding_window_off_by_one": (
        "engine/backends/numpy_backend.py",
        "visible &= (pos[:, None] - s_idx[None, :]) < window",
        "visible &= (pos[:, None] - s_idx[None, :]) <= window",
        ["conformance/kernels/test_reference_ops.py", "conformance/models/test_models.py::test_activations"],
        "sliding window one token too wide",
    ),
    "moe_topk_ties_and_order": (
        "engine/backends/numpy_backend.py",
        'idx = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k].astype(np.int32)',
        'idx = np.argsort(np.asarray(x), axis=-1, kind="stable")[..., -k:][..., ::-1].astype(np.int32)',
        ["conformance/kernels/test_reference_ops.py", "conformance/models/test_models.py::test_activations"],
        "MoE top-k: ties broken towards the higher expert id",
    ),
    "moe_weights_not_normalized": (
        "engine/arch/qwen3moe.py",
        "cfg.expert_weights_norm = True",
        "cfg.expert_weights_norm = False",
        ["conformance/models/test_models.py::test_activations"],
        "qwen3moe: expert weights not renormalised over the top-k",
    ),
    "bpe_merge_rank": (
        "engine/tokenizer/merges.py",
        "heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))",
        "heapq.heappush(queue, (-rank, left, right, symbols[left] + symbols[right]))",
        ["conformance/tokenizer/test_tokenizer.py"],
        "BPE: the highest merge rank applied first instead of the lowest",
    ),
    "bpe_adjacent_merge_ranks_swapped": (
        "engine/tokenizer/vocab.py",
        "ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))",
        "ranks = dict(zip(reversed(merges), (r ^ 1 for r in range(len(merges) - 1, -1, -1))))",
        ["conformance/tokenizer/test_tokenizer.py"],
        "BPE: the ranks of merges 2k and 2k+1 swapped (only the corpus golden catches it)",
    ),
    "q4_1_min_term": (
        "engine/backends/numpy_backend.py",
        "return _mm(xq, dq, by_row) + _mm(qb.s.astype(F32), mins, by_row)",
        "return _mm(xq, dq + np.repeat(mins, 32, axis=-1), by_row)",
        ["conformance/models/test_models.py::test_activations"],
        "Q4_1/Q5_1: mins multiplied by the exact activation sum instead of llama.cpp's fp16 s",
    ),
    "gemma_embed_scale": (
        "engine/arch/gemma3.py",
        'x = f.cb(b.scale(x, math.sqrt(cfg.n_embd)), "inp_scaled")',
        'x = f.cb(b.scale(x, math.sqrt(cfg.n_embd - 1)), "inp_scaled")',
        ["conformance/models/test_models.py::test_activations"],
        "gemma3: embedding scaled by sqrt(n_embd - 1)",
    ),
    # the seed catalog's ops (issue 12): qwen35 / qwen35moe hybrids and gemma4
    "delta_net_grouped_heads": (
        "engine/backends/numpy_backend.py",
        "head = np.arange(Hv) % q.shape[1]",
        "head = np.arange(Hv) // (Hv // q.shape[1])",
        ["conformance/models/test_models.py::test_activations[synth-qwen35-numpy]", "conformance/models/test_models.py::test_activations[synth-qwen35moe-numpy]"],
        "delta net: value head h reads key head h // (Hv/Hk) (qwen3next's grouped order) instead of h mod Hk",
    ),
    "conv_state_shifted": (
        "engine/backends/numpy_backend.py",
        "conv_state[...] = X[T:]",
        "conv_state[...] = X[T - 1:-1]",
        ["conformance/models/test_models.py::test_greedy_stream[synth-qwen35-numpy]",
         "conformance/models/test_models.py::test_teacher_forced[synth-qwen35-numpy]"],
        "causal conv1d: the carried window shifted by one token (the prompt's own output is right)",
    ),
    "gated_norm_gate_first": (
        "engine/backends/base.py",
        "return self.mul(self.rms_norm(x, w, eps), self.silu(z))",
        "return self.rms_norm(self.mul(x, self.silu(z)), w, eps)",
        ["conformance/models/test_models.py::test_activations[synth-qwen35-numpy]"],
        "delta net's output norm: silu(z) applied before the RMS norm instead of after",
    ),
    "shared_expert_gate_no_sigmoid": (
        "engine/arch/qwen35moe.py",
        'gate = f.cb(b.sigmoid(gate), "shared_expert_gate_sigmoid", il)',
        'gate = f.cb(gate, "shared_expert_gate_sigmoid", il)',
        ["conformance/models/test_models.py::test_activations[synth-qwen35moe-numpy]"],
        "qwen35moe: the shared expert scaled by its gate logit, not sigmoid(logit)",
    ),
    "gemma4_attn_scale": (
        "engine/arch/gemma4.py",
        "cfg.attn_scale = 1.0            # llama.cpp",
        "cfg.attn_scale = cfg.head_dim ** -0.5            # llama.cpp",
        ["conformance/models/test_models.py::test_activations[synth-gemma4-numpy]"],
        "gemma4: attention scaled by 1/sqrt(head_dim) instead of 1.0",
    ),
    "gemma4_values_not_normed": (
        "engine/arch/gemma4.py",
        'v = f.cb(b.rms_norm(v.reshape(T, Hkv, hd), None, cfg.norm_eps), "Vcur_normed", il)',
        'v = f.cb(v.reshape(T, Hkv, hd), "Vcur_normed", il)',
        ["conformance/models/test_models.py::test_activations[synth-gemma4-numpy]"],
        "gemma4: values without their RMS norm (on full layers, the raw key projection)",
    ),
    "gemma4_expert_scale_dropped": (
        "engine/backends/base.py",      # Backend.moe_ffn: gemma4's routed experts (the fused op)
        "            y = self.mul_expert_scale(y, down_scale, ids)",
        "            y = y",
        ["conformance/models/test_models.py::test_activations[synth-gemma4moe-numpy]"],
        "gemma4 MoE: the per-expert down scale (ffn_down_exps.scale) not applied",
    ),
    # the delta net's CUDA kernels, through their CPU builds (conformance/harness/delta_host.py)
    "cuda_delta_decode_grouped_heads": (
        "kernels/ssm.cu",
        "hk = h % Hk;",
        "hk = h / (Hv / Hk);",
        ["conformance/kernels/test_kernels_delta_chunked.py::test_decode_kernel_on_the_cpu"],
        "CUDA delta net (decode, ssm.cu): value heads read key heads in the grouped order",
    ),
    "cuda_delta_chunked_grouped_heads": (
        "kernels/delta_chunked.cu",
        "hk = h % Hk;",
        "hk = h / (Hv / Hk);",
        ["conformance/kernels/test_kernels_delta_chunked.py::test_chunked_kernel_on_the_cpu"],
        "CUDA delta net (chunked prompt, delta_chunked.cu): value heads in the grouped order",
    ),
    # a prompt graph's padding rows (engine/model.py prompt_class) left in the recurrent states
    "cuda_delta_chunked_tail_unmasked": (
        "kernels/delta_chunked.cu",
        "const int T = min(p.n_tokens, *n_real), Hv",
        "const int T = p.n_tokens, Hv",
        ["conformance/kernels/test_kernels_tail_mask.py::test_chunked_kernel_masks_the_tail_on_the_cpu"],
        "CUDA delta net (chunked prompt): the padding rows of a class graph update the state",
    ),
    "cuda_conv_window_past_the_prompt": (
        "kernels/ssm.cu",
        "const float v = X_ROW(T + j);",
        "const float v = X_ROW(p.n_tokens + j);",
        ["conformance/kernels/test_kernels_tail_mask.py::test_conv_masks_the_tail_on_the_cpu"],
        "CUDA conv1d: the carried window taken after the padding rows, not the prompt's last",
    ),
    "delta_net_tail_unmasked": (
        "engine/arch/qwen35.py",
        'real = {} if f.n_real is None else {"n_real": f.n_real}',
        "real = {}",
        ["conformance/models/test_prompt_classes.py::test_padded_replays_equal_eager_reads[synth-qwen35]"],
        "qwen35: a padded prompt's delta-net layers not told the real row count",
    ),
}


def run(name: str, timeout: int) -> tuple[str, str, list[str]]:
    path_rel, old, new, tests, what = MUTATIONS[name]
    path = ROOT / path_rel
    original = path.read_text()
    if original.count(old) != 1:
        return what, "NOT APPLIED (text not found once)", []
    path.write_text(original.replace(old, new))
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        failed = sorted(set(re.findall(r"^FAILED (\S+)", r.stdout, re.M)))
        status = "caught" if r.returncode != 0 and failed else (
            "caught (error)" if r.returncode not in (0, 5) else "SURVIVED")
        return what, status, failed
    finally:
        path.write_text(original)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutation names")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(MUTATIONS)
    rows, survived = [], False
    for n in names:
        what, status, failed = run(n, args.timeout)
        survived |= status.startswith(("SURVIVED", "NOT"))
        rows.append((n, what, status, "\n".join(failed[:4]) + (f"\n(+{len(failed) - 4} more)" if len(failed) > 4 else "")))
        print(f"{n}: {status}", flush=True)
    print(tabulate(rows, headers=["mutation", "bug", "result", "failing tests"], tablefmt="grid"))
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
