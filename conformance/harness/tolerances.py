"""Tolerances of the whole-model comparisons with llama.cpp's goldens, each with its reason.

Error measure: NMSE = Σ(ours − golden)² / Σ golden² over a node's array (llama.cpp's own
test-backend-ops measure). Figures measured on the goldens of 2026-11-30 are quoted so a
change in behaviour shows up as a change in these numbers.

Why the numbers are what they are:
- The golden arrays are stored as float16: NMSE ≈ 8e-8 from storage alone (2^-11 relative
  rounding, squared, averaged).
- The numpy backend rounds where llama.cpp's CPU path rounds (activation quantization to
  Q8_0/Q8_1/Q8_K, F16 KV cache, F16 softmax for V, GELU through F16), so layer 0 agrees to the
  storage rounding (measured ≤ 1.8e-7 on every role of every model) — except that the
  remaining differences (exp/tanh implementations, summation order, ~1e-7 relative) now and
  then move an activation across a Q8 rounding boundary. One such flip shifts the rows it
  feeds by one quantization step: ~1e-6 to 1e-5 NMSE in the next mat-mul's output (measured
  1.2e-5 in qwen2.5's layer-0 FFN).
- Flips compound layer after layer. In the real models (18-30 layers) the worst node of any
  layer reaches 8.5e-3 (gemma3-270m result_norm; gemma's post-norms amplify); in the 2-layer
  synthetic models 5.5e-5.
- The CUDA backend quantizes every activation to Q8_1 as llama.cpp's CUDA path does, not as
  the CPU goldens did: without the CPU's rounding, a mat-mul output differs from the golden by
  ~1e-4..3e-4 NMSE at layer 0 already (measured: unemulated numpy 1.5e-4..2.8e-4). The CUDA
  kernels' exactness is checked op by op against the numpy reference in Q8_1 mode
  (test_kernels*.py); here CUDA gets the bounds of an engine that does not emulate the CPU.
"""

# NMSE bounds for per-layer activations: (layer 0, any layer), by backend, golden set (llama.cpp
# CPU or CUDA, see goldens.references) and model kind.
ACTIVATIONS = {
    # layer 0: storage rounding + a few flips (max measured 1.2e-5) → 1e-4, 8× margin;
    # any layer: measured max 8.5e-3 (real), 5.5e-5 (synthetic) → 2e-2 and 5e-4.
    ("numpy", "cpu", "real"): (1e-4, 2e-2),
    ("numpy", "cpu", "synthetic"): (1e-4, 5e-4),
    # CUDA vs the CPU set (models the CUDA set does not hold): Q8_1 instead of the CPU's
    # rounding (≈3e-4 at layer 0) → 2e-3; deep layers as the unemulated reference drifts,
    # bounded like llama.cpp's whole-graph check (≤ 5e-2).
    ("cuda", "cpu", "real"): (2e-3, 5e-2),
    ("cuda", "cpu", "synthetic"): (2e-3, 5e-3),
}

# CUDA vs llama.cpp's own CUDA backend (golden/cuda/): per model and node role, at most
# SPREAD_FACTOR times the distance between llama.cpp's own CUDA and CPU backends on that model
# and role (golden/cuda/manifest.json, spread_vs_cpu; layer 0 and any layer apart) — the
# target of issue 9 — and never below CUDA_FLOOR. Measured on the H200 (2026-11-30): every
# node of every model within 3.5x of that spread, except where llama.cpp's two backends agree
# exactly (attn_norm, and q/k at layer 0 for Q4_0/BF16 weights: spread <= 3e-10). There Brass
# is one activation rounding away (<= 1.8e-4): llama.cpp's prompt GEMM (MMQ) takes Q4_0/Q5_0
# as int8 after subtracting the offset from the nibbles, exactly like the CPU's Q8_0 dot,
# while Brass uses the mat-vec form (offset times the float sum of x) for every batch. Hence
# the floor, 3e-4, about one Q8_1 rounding of an activation (measured 1.1e-4..1.8e-4).
SPREAD_FACTOR = 10
CUDA_FLOOR = 3e-4
# Roles the spread does not cover (real models' logits, stored as top-16): the bound of the
# CUDA-vs-CPU comparison above.
CUDA_LOGITS_FALLBACK = {"real": 2e-2, "synthetic": 5e-3}

# CUDA against the CPU goldens on the gated delta-net hybrids (qwen35, qwen35moe) and Gemma 4
# (gemma4, dense and MoE), before golden/cuda/ held them (since 2026-12-02 it does, and
# test_models holds CUDA to that set, with SPREAD_ARGMAX_FACTOR below; it reads these entries
# only for a model the CUDA set lacks; ci/q8_1_oracle.py re-makes them). Their distance from the
# CPU goldens is Q8_1's, not a kernel's: the numpy backend in q8_1 mode (the CUDA kernels' oracle,
# kernels/cases.py cuda_reference) is as far from them, node for node. Measured on the H200
# (2026-12-01), CUDA against the oracle's figures (its own, unrounded): synth-qwen35 final_output-2
# 1.139e-2 (1.14e-2), ffn_out-2 9.4e-3 (9.6e-3), result_output 5.97e-3 (6.2e-3); synth-qwen35moe
# ffn_moe_out-0 2.77e-3 (2.8e-3), final_output-2 2.17e-2 (2.2e-2); and its teacher-forced and greedy
# disagreements are the oracle's, position for position (e.g. long prompt position 25, margin
# 0.819). Rounding to Q8_1 instead of the CPU's Q8_K/Q8_0 costs ~7e-5 at the first mat-mul
# (gdn_conv-0); every layer adds its own and carries the earlier ones, and the delta-net's output
# norm rms(o)·silu(z) scales each (token, head) row of o to unit RMS, so the rows where o is small,
# whose relative error is the largest, weigh as much as the rest: 4.2e-3 at o becomes 1.1e-2 after
# it (synth-qwen35 layer 2; synth-qwen35moe 8.3e-3 → 2.2e-2); the oracle's worst node in the other
# synthetic models (two layers deep) is 1.3e-3 (synth-qwen3). So the bound of a node is Q8_1_FACTOR
# times the oracle's NMSE at that role (layer 0, any layer), never below Q8_1_FLOOR (the numpy
# backend's own layer-0 bound: storage rounding and a few flips). The factor: CUDA's figures sit at
# 0.97-1.0x the oracle's, and moving every mat-mul output of the oracle by up to 2 float32 ulps at
# random (a GPU's other summation order) changed its distance by at most 2 % at any node (12 runs);
# twice the oracle leaves room for that and for another prompt's or GPU's flips, while an op that is
# wrong (a head mapping, a decay, a state not carried) gives O(1). Small defects hide under these
# bounds: conformance/kernels/test_kernels_model.py (each op against the oracle, 1e-10 to exact) is the
# check that finds them; these say the whole model is as close to llama.cpp's CPU as Q8_1 allows.
# Gemma 4: its activations stay within the ACTIVATIONS/LOGITS bounds of CUDA vs the CPU set, but its
# teacher-forced argmax does not: Q8_1 moves its logits enough to flip clear positions (llama.cpp
# margins 0.31-0.70, while ARGMAX_MAX_DISAGREEMENT allows none for a model whose arch is not named
# moe). The oracle flips the same ones: on the H200 (2026-12-01) CUDA's disagreements were
# synth-gemma4 digits 34 (880 for 516, margin 0.312), synth-gemma4moe plain 24 and 36, long 30, chat
# 48 (margins 0.346, 0.351, 0.697, 0.418), and the oracle's are those positions with the same
# tokens, and no others. Their greedy streams do not part before a near-tie (stream None), nor did
# CUDA's: that test stays a normal one.
# Figures from `python ci/q8_1_oracle.py MODEL...` (2026-12-01: the numpy backend in q8_1 mode
# against the CPU goldens, the comparisons of test_models; `--check` compares with these), rounded
# up to two digits (margins to three decimals): activations role → (layer 0, any layer); top16: the
# teacher-forced top-16 logits' NMSE on the worst prompt; argmax: (the share of clear positions,
# margin > ARGMAX_EPS, whose argmax differs, the largest such margin). Teacher-forced, CUDA may
# differ at up to Q8_1_FACTOR times the oracle's share, and nowhere with a margin above Q8_1_FACTOR
# times its largest. stream: where the oracle's greedy stream first parts from llama.cpp's above
# STREAM_EPS, None if it does not. Where it parts, a stream bound of twice those margins leaves
# fewer than 8 tokens to compare, so against the CPU set the greedy check cannot be made meaningful
# (test_models expects it to fail there, strictly: CUDA parts where the oracle parts); it needs
# llama.cpp's CUDA goldens.
Q8_1_FACTOR = 2.0
Q8_1_FLOOR = 1e-4
Q8_1_ORACLE = {
    "synth-qwen35": {
        "activations": {
            "attn_norm": (4.4e-08, 4.9e-03), "gdn_conv": (6.4e-05, 2.3e-03),
            "gdn_q": (7.3e-05, 2.6e-03), "gdn_k": (7.5e-05, 2.2e-03),
            "gdn_gate": (5.4e-08, 6.4e-04), "gdn_beta": (5.0e-08, 2.7e-04),
            "gdn_out": (1.7e-04, 4.2e-03), "gdn_gated_norm": (2.1e-04, 1.2e-02),
            "attn_proj": (3.0e-04, 1.2e-02), "ffn_inp": (2.8e-04, 4.5e-03),
            "ffn_norm": (3.4e-04, 5.1e-03), "ffn_out": (1.0e-03, 1.2e-02),
            "l_out": (6.3e-04, 5.5e-03), "q_rope": (0.0, 4.9e-03), "k_rope": (0.0, 4.4e-03),
            "kqv_out": (0.0, 4.2e-03), "attn_gated": (0.0, 4.9e-03), "result_norm": (0.0, 6.0e-03),
            "result_output": (0.0, 6.2e-03)},
        "top16": 1.9e-03,
        "argmax": (9 / 261, 0.820),
        "stream": "prompt code, token 0, margin 0.258",
    },
    "synth-qwen35moe": {
        "activations": {
            "attn_norm": (4.3e-08, 3.0e-03), "gdn_conv": (7.2e-05, 2.8e-03),
            "gdn_q": (6.9e-05, 3.6e-03), "gdn_k": (8.7e-05, 2.7e-03),
            "gdn_gate": (5.0e-08, 6.9e-04), "gdn_beta": (4.9e-08, 4.5e-04),
            "gdn_out": (2.0e-04, 8.3e-03), "gdn_gated_norm": (3.4e-04, 2.2e-02),
            "attn_proj": (1.1e-03, 2.3e-02), "ffn_inp": (9.6e-04, 7.2e-03),
            "ffn_norm": (9.3e-04, 7.8e-03), "moe_logits": (1.1e-03, 5.4e-03),
            "moe_probs": (2.7e-04, 2.4e-03), "moe_weights": (1.9e-04, 1.8e-03),
            "moe_out": (2.8e-03, 2.0e-02), "shexp_out": (2.5e-03, 2.1e-02),
            "shexp_gate": (1.1e-04, 2.9e-03), "ffn_out": (2.7e-03, 2.3e-02),
            "l_out": (1.7e-03, 9.7e-03), "q_rope": (0.0, 1.7e-03), "k_rope": (0.0, 1.9e-03),
            "kqv_out": (0.0, 3.5e-03), "attn_gated": (0.0, 3.6e-03), "result_norm": (0.0, 1.1e-02),
            "result_output": (0.0, 1.1e-02)},
        "top16": 1.1e-02,
        "argmax": (8 / 251, 0.779),
        "stream": "prompt plain, token 1, margin 0.446",
    },
    "synth-gemma4": {
        "activations": {
            "attn_norm": (4.3e-08, 1.9e-03), "q_rope": (7.6e-05, 2.0e-03),
            "k_rope": (7.0e-05, 1.9e-03), "v_norm": (7.0e-05, 1.9e-03),
            "kqv_out": (1.5e-04, 3.2e-03), "attn_proj": (2.8e-04, 3.2e-03),
            "attn_post_norm": (2.9e-04, 3.4e-03), "ffn_inp": (2.6e-04, 2.1e-03),
            "ffn_out": (7.3e-04, 4.2e-03), "ffn_post_norm": (8.0e-04, 4.3e-03),
            "l_out": (5.2e-04, 2.3e-03), "result_norm": (0.0, 2.4e-03),
            "result_output": (0.0, 2.4e-03)},
        "top16": 2.7e-04,
        "argmax": (1 / 235, 0.312),
        "stream": None,
    },
    "synth-gemma4moe": {
        "activations": {
            "attn_norm": (4.2e-08, 4.5e-04), "q_rope": (7.2e-05, 5.5e-04),
            "k_rope": (4.2e-08, 4.4e-04), "v_norm": (7.6e-05, 4.8e-04),
            "kqv_out": (3.0e-04, 2.2e-03), "attn_proj": (5.0e-04, 2.3e-03),
            "attn_post_norm": (5.0e-04, 2.6e-03), "ffn_inp": (4.4e-05, 8.5e-04),
            "moe_logits": (4.4e-05, 5.5e-04), "moe_probs": (2.1e-05, 3.7e-04),
            "moe_weights": (1.7e-05, 2.8e-04), "moe_out": (4.3e-04, 3.0e-03),
            "moe_dense": (4.1e-04, 3.1e-03), "moe_normed": (4.4e-04, 2.3e-03),
            "ffn_out": (4.3e-04, 2.8e-03), "ffn_post_norm": (4.3e-04, 2.8e-03),
            "l_out": (7.5e-05, 1.3e-03), "result_norm": (0.0, 1.3e-03),
            "result_output": (0.0, 1.4e-03)},
        "top16": 4.7e-04,
        "argmax": (4 / 221, 0.697),
        "stream": None,
    },
}

# CUDA against llama.cpp's CUDA goldens on a model that is chaotic for llama.cpp itself. The
# fixed rules below (no disagreement at a margin above ARGMAX_EPS for a dense model, 1 % for MoE;
# top-16 NMSE <= LOGITS; greedy tokens equal up to the first near-tie) were set on models whose
# own spread is ~0: llama.cpp's CPU backend, held to its CUDA goldens by them, passes every such
# model. On four it would fail them itself (test_models.llama_spread; `python ci/cuda_spread.py`
# prints these figures: llama.cpp's CPU against its CUDA goldens on the teacher-forced rows both
# cover, clear = CUDA margin > 0.25): synth-qwen35 20 of 158 clear positions differ (12.7 %, at
# CUDA margins up to 1.137; top-16 NMSE 4.7e-3), synth-qwen35moe 17/131 (13.0 %, 1.581; 3.6e-3),
# synth-gemma4 3/150 (2.0 %, 0.514; 7.6e-4), synth-gemma4moe 3/149 (2.0 %, 1.092; 4.1e-4). Their
# recurrent states and routers carry a rounding difference (an activation on the other side of a
# Q8 rounding step) on and on: llama.cpp's own step-by-step and batched CUDA passes differ by up
# to 2.5, 4.4, 0.8 and 2.1 logits (manifest: decode_vs_batch_max_logit_diff; <= 0.3 on the other
# synthetic models). A position that flips below the margins at which llama.cpp's own backends
# flip says nothing about a defect. So where that spread exceeds the fixed rule
# (test_models.spread_rule; everywhere else the fixed rule stands unchanged: the dense synthetic
# and real models have no disagreement above their ARGMAX_EPS, synth-qwen3moe's 1 of 175 is under
# its 1 %), Brass, counted on the settled positions as before, may differ at no more than
# SPREAD_ARGMAX_FACTOR times llama.cpp's own share of disagreeing clear positions, at no margin
# above SPREAD_ARGMAX_FACTOR times the largest margin at which llama.cpp's backends disagree, and
# its top-16 NMSE may reach SPREAD_LOGITS_FACTOR times llama.cpp's own (never below LOGITS):
# 25.3 % / 26.0 % / 4.0 % / 4.0 %, margins 2.27 / 3.16 / 1.03 / 2.18, NMSE 1.9e-2 / 1.4e-2 /
# 5e-3 / 5e-3. The factor: llama.cpp's figures are one sample of 3 to 20 disagreements (a count
# of 3 alone is uncertain by about a factor of 2), and Brass is held on more positions (also
# past the point where llama.cpp's two sequences part, where the states have run longer). The
# numpy backend in q8_1 mode (the CUDA kernels' oracle, standing in for Brass's CUDA: against
# the CUDA goldens it gives the H200's 242/251, 2.56 on synth-qwen35 and 230/231 on synth-gemma4,
# one position off on the MoE models) sits at 0.28 / 0.33 / 0.22 / 0.69 times llama.cpp's share
# (the H200: 9/251, 9/235, 1/231, 4/217, at most 0.92 times), 0.72 / 1.47 / 0.63 / 1.11 times
# its largest margin and 0.91 / 2.1 / 1.2 / 1.9 times its top-16 NMSE: twice the spread (four
# times in NMSE, which squares it) holds it with room. What these bounds cannot see (the
# stand-in with a planted bug, `python ci/cuda_spread.py --plant NAME:SIZE --numpy`): a rope base
# of 10000 fails on all four, an RMS epsilon 10x on the two hybrids (on Gemma 4 not even 1000x:
# its norms' inputs are far above it), a delta-net log-decay 30 % off on both hybrids (10 % on
# synth-qwen35moe only, 2 % on neither), expert 1's output 1.25x on both MoE models (1.1x on
# synth-qwen35moe only, 1.02x on neither), a rope base 10x low on neither hybrid. Every one of
# those smaller bugs fails the numpy backend's tests against the CPU goldens (which it matches on
# these models to 0.19 of a logit, 100 % of clear positions): a bug in the architecture code is
# caught there, one in a CUDA kernel by test_kernels_model (each op against the oracle). On these
# models the CUDA goldens say only that Brass's CUDA is no farther from llama.cpp's CUDA than
# llama.cpp's own CPU backend is.
SPREAD_ARGMAX_FACTOR = 2.0
SPREAD_LOGITS_FACTOR = SPREAD_ARGMAX_FACTOR ** 2
# The greedy stream on those models is compared up to the first step whose llama.cpp margin is
# below the largest at which its own backends disagree (1.14 / 1.58 / 0.51 / 1.09, not
# STREAM_EPS: the stand-in's synth-qwen35moe stream parts at margins 0.50 and 0.90 before any
# near-tie of 0.25, where llama.cpp's own CUDA decode and batched passes are up to 4.4 apart),
# and, on every model of the CUDA set, only before llama.cpp's own CUDA and CPU streams part
# (their later CUDA tokens are no settled reference; on the models of the fixed rule this cuts
# nothing). That leaves fewer than the 8 tokens the greedy test needs on all four (5, 1, 2, 0 of
# 160): there it compares them and reports a skip with the count, not a pass. Their generated
# positions are held by the teacher-forced rule above, the decode path by test_kernels_model.
#
# Chosen experts (moe_topk) must equal llama.cpp's CUDA goldens except at the tokens where
# llama.cpp's own CPU and CUDA goldens choose otherwise. Measured: llama.cpp's two backends
# differ at one token (synth-qwen35moe, layer 2, token 2), where the router is no near tie (its
# k-th and (k+1)-th probabilities 0.165 apart on both backends): the residual entering that layer's
# FFN already differs by 1.6e-1 NMSE at that token. The stand-in differs there and nowhere else.
# A near-tie bound on the router would not have spared it; llama.cpp's own choice does.

# Final logits (result_output; real models: the golden's top-16 per position).
LOGITS = {
    # measured max 9.1e-4 (real), 5.3e-5 (synthetic)
    ("numpy", "cpu", "real"): 5e-3,
    ("numpy", "cpu", "synthetic"): 5e-4,
    ("cuda", "cpu", "real"): 2e-2,
    ("cuda", "cpu", "synthetic"): 5e-3,
    ("cuda", "cuda", "real"): CUDA_LOGITS_FALLBACK["real"],
    ("cuda", "cuda", "synthetic"): CUDA_LOGITS_FALLBACK["synthetic"],
}

# Teacher-forced argmax must equal llama.cpp's wherever llama.cpp's top1 − top2 margin exceeds
# EPS (logits). Measured: the largest margin at which our argmax differed was 0.345 (real,
# gemma3-270m, 607-token prompt) and 0.098 (synthetic); EPS is about twice that. Positions
# above EPS: 63-73 % (real), 75-78 % (synthetic) — the check is not vacuous
# (MIN_COVERAGE asserts it).
ARGMAX_EPS = {("cpu", "real"): 0.75, ("cpu", "synthetic"): 0.25,
              # Against llama.cpp's CUDA goldens, counted only where llama.cpp's CPU and CUDA
              # backends agree with each other (test_models.settled_positions). llama.cpp's own
              # two backends part at CUDA margins up to 0.776 on a real model (smollm2-135m;
              # gemma3-270m 0.18, qwen2.5 0.05) and 0.16 on the synthetic ones (MoE aside): a
              # margin below that says nothing about a defect. Real: 1.0; synthetic: 0.25 (the
              # issue's target; every dense synthetic model agrees at 100 % there). Nor does a
              # position where llama.cpp's two backends agree on the argmax but put its logit
              # further apart than the margin (settled_positions, since 2026-12-04: smollm2's
              # long prompt position 1, margin 1.857, its top-1 logit 32.83 on llama.cpp's CPU
              # and 10.50 on its CUDA; 1 of 162 clear positions there, 1 of 431 on gemma3-270m,
              # none on qwen2.5 or a dense synthetic model). The figures of SPREAD_ARGMAX_FACTOR
              # above were measured before that, on argmax agreement alone.
              ("cuda", "real"): 1.0, ("cuda", "synthetic"): 0.25}
MIN_COVERAGE = 0.5

# The one exception: on CUDA a mixture-of-experts model may choose another expert where its
# router is near a tie, because the activations reaching the router were rounded to Q8_1
# rather than the CPU's Q8_0/Q8_K; that token's logits then move by whole units. Measured on
# the H200 (synth-qwen3moe, 311 positions): one such position (llama.cpp margin 0.464, our
# max |Δlogit| 4.07 there), while dense models on CUDA stay within 0.32 logits and the
# numpy backend (CPU rounding) within 0.14 on the same model. At most 1 % of the clear
# positions may disagree in that case; everywhere else none may.
# Against llama.cpp's CUDA goldens the same holds (measured: synth-qwen3moe 1 of 236 settled
# clear positions, margin 0.485; llama.cpp's own CPU and CUDA backends part at a CUDA margin of
# 2.5 on the same model by choosing another expert).
ARGMAX_MAX_DISAGREEMENT = {("cuda", "cpu", "moe"): 0.01, ("cuda", "cuda", "moe"): 0.01}

# The same on the numpy backend, whose mat-muls go through BLAS: which kernels OpenBLAS picks
# for the CPU it runs on changes the summation order, hence which activations cross a Q8
# rounding boundary, hence, in a mixture-of-experts model, now and then which expert a token
# is routed to. Measured 2026-12-01 on an AMD EPYC: with OpenBLAS's Zen (and Haswell) kernels
# synth-gemma4moe's chat prompt routes position 10 otherwise at layer 2 (router logits 4.9e-2
# apart between the two kernel sets there; its top-1 logit 1.48 from llama.cpp's, the
# prompt's top-16 NMSE 5.9e-4 against 5e-4), with the SkylakeX kernels on the same machine it
# does not; every other position of every synthetic model stays within 0.19 of llama.cpp's
# top-1 logit on both. So for a MoE model on numpy a position whose top-1 logit leaves
# llama.cpp's by more than MOE_ROUTING_JUMP ends that prompt's logit comparison (every later
# position attends to its keys and values) only where it is known (MOE_ROUTING_JUMPS: model,
# prompt -> the position); a jump anywhere else fails as before, and what was left out is
# printed. The argmax check still covers the positions left out.
MOE_ROUTING_JUMP = 0.5
MOE_ROUTING_JUMPS = {("synth-gemma4moe", "chat"): 10}
MOE_ROUTING_JUMP_PROMPTS = 1


def moe_routing_jump(model: str, prompt: str, ours_top1, ref_top1):
    """Where a known routing jump (MOE_ROUTING_JUMPS) cuts this prompt's comparison: its
    position if the first position whose top-1 logit is more than MOE_ROUTING_JUMP from
    llama.cpp's is exactly the known one, else None (compare the whole prompt)."""
    import numpy as np
    known = MOE_ROUTING_JUMPS.get((model, prompt))
    if known is None:
        return None
    far = np.nonzero(np.abs(np.asarray(ours_top1, np.float64) - ref_top1) > MOE_ROUTING_JUMP)[0]
    return known if far.size and int(far[0]) == known else None

# Free-running greedy tokens are compared up to the first step whose llama.cpp margin (step
# logits or teacher-forced) is below STREAM_EPS: beyond a near-tie, the two streams may
# legitimately part. llama.cpp's own step-by-step and batched passes differ by up to 1.65
# logits (manifest: decode_vs_batch_max_logit_diff), so the real-model bound is wider.
STREAM_EPS = {"real": 1.0, "synthetic": 0.25}
# A whole stream compared on the numpy backend alone (it steps as llama.cpp's recorded stream
# stepped, token by token): its logits stay within 0.14 of llama.cpp's on real models (above),
# so a step whose top-1/top-2 margin is at least twice that cannot flip.
NUMPY_STREAM_EPS = 0.3

# Free-running CUDA logits against the numpy reference's (conformance/kernels/
# test_kernels_model.py): activations are re-quantized to Q8_1 before every mat-vec, and a float
# ulp of difference upstream can move a quant by a whole step (1/127 of the block's largest
# value). With every quant off by one step at a largest-to-RMS ratio of 4, NMSE is
# (4/127)^2 ~ 1e-3. The split-K decode attention against the one-block kernel uses it too: its
# reordered sums move the attention output by float32 ulps, which the next Q8_1 quantization can
# turn into a whole quant step.
FREE_RUNNING = 1e-3
