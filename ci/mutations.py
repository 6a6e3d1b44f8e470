"""Mutation check for the CPU engine: plant one deliberate bug at a time, run the tests that
should catch it, restore the file, and print which tests failed.

    BRASS_CACHE=~/.cache/brass python ci/mutations.py            # all mutations
    python ci/mutations.py --only rope_base                      # one

A mutation that no test catches is reported as SURVIVED and makes the script exit 1.
(The CUDA kernels have their own: ci/gpu_mutations.sh.)
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
        ["conformance/test_quants.py", "conformance/test_models.py::test_activations"],
        "Q4_K/Q5_K: scales 4-7 take the min's nibble (scale nibble order)",
    ),
    "rope_base": (
        "engine/arch/common.py",
        "base = cfg.rope_base if rope_base is None else rope_base",
        "base = 10000.0 if rope_base is None else rope_base",
        ["conformance/test_models.py::test_activations"],
        "rope base ignored (10000 for every model)",
    ),
    "sliding_window_off_by_one": (
        "engine/backends/numpy_backend.py",
        "visible &= (pos[:, None] - s_idx[None, :]) < window",
        "visible &= (pos[:, None] - s_idx[None, :]) <= window",
        ["conformance/test_reference_ops.py", "conformance/test_models.py::test_activations"],
        "sliding window one token too wide",
    ),
    "moe_topk_ties_and_order": (
        "engine/backends/numpy_backend.py",
        'idx = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k].astype(np.int32)',
        'idx = np.argsort(np.asarray(x), axis=-1, kind="stable")[..., -k:][..., ::-1].astype(np.int32)',
        ["conformance/test_reference_ops.py", "conformance/test_models.py::test_activations"],
        "MoE top-k: ties broken towards the higher expert id",
    ),
    "moe_weights_not_normalized": (
        "engine/arch/qwen3moe.py",
        "cfg.expert_weights_norm = True",
        "cfg.expert_weights_norm = False",
        ["conformance/test_models.py::test_activations"],
        "qwen3moe: expert weights not renormalised over the top-k",
    ),
    "bpe_merge_rank": (
        "engine/tokenizer/merges.py",
        "heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))",
        "heapq.heappush(queue, (-rank, left, right, symbols[left] + symbols[right]))",
        ["conformance/test_tokenizer.py"],
        "BPE: the highest merge rank applied first instead of the lowest",
    ),
    "bpe_adjacent_merge_ranks_swapped": (
        "engine/tokenizer/vocab.py",
        "ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))",
        "ranks = dict(zip(reversed(merges), (r ^ 1 for r in range(len(merges) - 1, -1, -1))))",
        ["conformance/test_tokenizer.py"],
        "BPE: the ranks of merges 2k and 2k+1 swapped (only the corpus golden catches it)",
    ),
    "q4_1_min_term": (
        "engine/backends/numpy_backend.py",
        "return _mm(xq, dq) + _mm(qb.s.astype(F32), mins)",
        "return _mm(xq, dq + np.repeat(mins, 32, axis=-1))",
        ["conformance/test_models.py::test_activations"],
        "Q4_1/Q5_1: mins multiplied by the exact activation sum instead of llama.cpp's fp16 s",
    ),
    "gemma_embed_scale": (
        "engine/arch/gemma3.py",
        'x = f.cb(b.scale(x, math.sqrt(cfg.n_embd)), "inp_scaled")',
        'x = f.cb(b.scale(x, math.sqrt(cfg.n_embd - 1)), "inp_scaled")',
        ["conformance/test_models.py::test_activations"],
        "gemma3: embedding scaled by sqrt(n_embd - 1)",
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
