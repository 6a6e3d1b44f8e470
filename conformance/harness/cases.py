"""The kernel case table that drives both the conformance tests (conformance/test_kernels*.py)
and the benchmarks (perf/test_kernels_matvec.py), and the helpers they need: a writer for
small GGUF files of random weights (so that weights reach a backend the way a model's do,
through `backend.weight(gf, name)`), the NMSE measure, and the reference the CUDA kernels are
held to (`cuda_reference()`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from brass import quants
from brass.gguf import BLOCK_SIZES, GGMLType

QUANT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
               GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
WEIGHT_TYPES = FLOAT_TYPES + QUANT_TYPES

# ---- bounds (NMSE, llama.cpp test-backend-ops' measure) -------------------------------------
# Ops that do the same IEEE float32 operations in the same order as the reference (gathers,
# dequantization, adds and products, the F16 cache write) must match bit for bit.
EXACT = 0.0
# Mat-vec: the kernels form the same integer dot products of the same quants as the reference
# (int8 × Q8_1 blocks; float weights × float32 x) and differ only in float32 rounding of the
# block products and in the order of the sums: each ~2^-24 relative to the terms, so NMSE
# ~1e-13 over several outputs (measured 1e-14..2e-13; the reference itself against float64
# also 1e-13). 1e-10 leaves a thousandfold margin, while one wrong quant in a row of 4096
# already gives ~1e-5. (One output alone can cancel to near zero and exceed it: 1.5e-10 was
# seen for N = T = 1, hence MATMUL_SHAPES.)
MATMUL = 1e-10
# MMQ (kernels/mmq.cu) against the decode mat-vec on the same GPU: per block of 32 the same
# integer dot product of the same quants, scaled by the same float32 operations (up to FMA
# contraction, one rounding of 2^-24 relative to the block's value); only the order in which
# a row's K/32 block values are added differs (MMQ: block after block; the mat-vec: strided
# over lanes, then a shuffle tree). Each partial sum rounds by ~2^-24 relative, as a random
# walk over <= 128 blocks: NMSE ~1e-14 pooled over the outputs, 2^-48 * K/32 ~ 5e-13 at worst
# for K = 4096. 1e-11 leaves a 20x margin above that; a wrong quant, scale or tile edge gives
# 1e-6 or more.
MMQ_SUM_ORDER = 1e-11
# Norm: the same float32 operations; only the double-precision sum of squares is added in
# another order, which can move the float32 mean by one ulp at a rounding tie (2^-24 relative).
RMS_NORM = 1e-12
# exp/cos/sin/tanh in float32 on both sides, each within ~2 ulp of the true value (CUDA's
# expf/cosf/sinf, numpy's float32 routines): relative errors ~2^-23, NMSE ~1e-14.
TRANSCENDENTAL = 1e-12
# GELU's result rounded to F16 after tanh: a float32 ulp apart on either side flips the F16
# rounding of an element with probability ~2^-12, and a flip moves that element by 2^-11
# relative: NMSE ~(2^-12)(2^-11)^2 ~ 6e-11.
F16_ROUNDED = 1e-9
# Attention probabilities rounded to F16 before V.softmax: the same flips, but one flipped
# probability moves a whole output row, which is itself an average and so small (measured up
# to ~7e-9 from a few flips). Bound by every probability off by one F16 ulp: the output then
# errs by 2^-11 relative, NMSE 2^-22 = 2.4e-7. A wrong head, mask or window slot errs by
# more than 1e-3.
ATTENTION = 2.5e-7
# Attention whose logits are equal along each row (every cache slot holds the same key, and
# q and k are multiples of 1/4 and 1/8 so that every dot product is exact in any order):
# exp(l - m) = 1 exactly for every visible slot, the sum of n ones is exact, 1/n is rounded
# once to float32 and then to F16, so a kernel that normalises before rounding gets each
# probability bit for bit as the reference does, and its output differs only by the float32
# order of the n products added (each exact: two halves): NMSE ~n * 2^-48 (measured <= 1e-14).
# ATTENTION cannot see where the rounding happens (any placement errs by at most one F16 ulp,
# which is what it allows); here a kernel that rounds exp(l - m) to F16 and normalises after
# P.V (as a flash-attention kernel usually does) errs by the F16 rounding of 1/n, up to
# 2^-11 relative (NMSE ~1e-8 and more, 0 only where n is a power of two). 1e-10 separates them.
ATTENTION_UNIFORM = 1e-10
# The fused gated FFN with GELU: its gate comes from a mat-vec (float32 rounding in another
# order than the reference's), and GELU rounds its input to F16, so a gate within a float32
# ulp of an F16 rounding boundary rounds the other way (measured 2.5e-9 on synth-gemma3's
# prefill). Bound by every element off by one F16 ulp, 2^-22, as for attention; a wrong row
# of either matrix errs by more than 1e-3.
F16_INPUT_ROUNDED = 2.5e-7
# A fused op that re-quantizes its own intermediate (the MoE FFN: h = act(gate) * up goes to
# Q8_1 blocks, or to float16 for the prompt GEMM, before the down projection) cannot be as
# tight as one mat-vec: h differs from the reference's h by float32 rounding, and a value that
# close to a quantization boundary rounds to the neighbouring quant, moving its product with
# the down weights by a whole quant step. Measured 1.3e-10 to 2.1e-10 on the H200; 1e-8 is
# fifty times that, while one wrong expert or weight row gives more than 1e-4.
REQUANTIZED = 1e-8
# The bound each backend op is held to (conformance/kernels/test_kernels_model.py checks every op of
# whole models against these, on the models' own activations).
# A fused op is held to the bound of the composition it replaces (engine/backends/base.py):
# add_rms_norm (and moe_norms) as the norm; rope_store as rope (its cache writes are F16 roundings of the
# roped values, compared separately); ffn_glu as the mat-vecs and SiLU, or with GELU as
# GELU's rounding of a mat-vec's output (ffn_glu_gelu); moe_route as the softmax (ids exactly); moe_ffn as
# the mat-vecs.
# The gated delta rule: dot products of D float32 terms summed sequentially on the GPU and
# pairwise (einsum) in numpy, expf against numpy's exp; each ~D * 2^-24 relative at worst, so
# NMSE ~1e-12 per token, compounded over a few tokens of state updates. A wrong head mapping,
# a missing decay or a state not carried gives O(1).
RECURRENCE = 1e-10
# The chunked gated delta rule (kernels/delta_chunked.cu, the prompt default) against the
# sequential numpy rule: both in float32, summing in different orders (the chunk's C x C and
# C x D matrix products, a triangular solve, the state carried per chunk instead of per
# token). Measured with the numpy twin (engine/delta_chunked.py, float32) and the sequential
# rule (float32), each against the sequential rule in float64, over T = 1..512, D = 32..128,
# Hv 4..32, strong and weak decay: the chunked form errs by <= 1.1e-12, the float32 sequential
# rule itself by <= 1.3e-11 (weak decay, T = 512: the state keeps every token's rounding),
# so the two differ by <= 1.1e-11 (measured 1.0e-11). The kernel sums over D and C in
# yet another order (sequential float32 sums with FMAs, where numpy's BLAS blocks them),
# which may multiply the chunked side's error by a few; 1e-9 is ~75x the worst measured
# difference, while a wrong head mapping, decay, chunk edge or solve row gives 1e-3 or more.
DELTA_CHUNKED = 1e-9

OP_BOUNDS = {
    "embed": EXACT, "add": EXACT, "mul": EXACT, "scale": EXACT, "weighted_sum": EXACT,
    "take_rows": EXACT, "topk": EXACT, "argmax": EXACT, "kv_store": EXACT,
    "matmul": MATMUL, "matmul_id": MATMUL, "matmul_many": MATMUL, "rms_norm": RMS_NORM,
    "rope": TRANSCENDENTAL, "swiglu": TRANSCENDENTAL, "softmax": TRANSCENDENTAL,
    "geglu": F16_ROUNDED, "attention": ATTENTION,
    "add_rms_norm": RMS_NORM, "moe_norms": RMS_NORM, "rope_store": TRANSCENDENTAL, "ffn_glu": max(MATMUL, TRANSCENDENTAL), "ffn_glu_gelu": F16_INPUT_ROUNDED,
    "moe_route": TRANSCENDENTAL, "moe_ffn": REQUANTIZED,
    "sigmoid": TRANSCENDENTAL, "softplus": TRANSCENDENTAL, "silu": TRANSCENDENTAL,
    "ssm_conv": EXACT, "gated_delta_net": RECURRENCE,
    "ssm_conv_silu": TRANSCENDENTAL,        # ssm_conv's exact sums, then unary's silu
    # the delta-net compositions of engine/backends/base.py, held to the ops they are made of:
    # l2_norm is rms_norm then an exact scale; rms_norm_gated is rms_norm times silu(z) and
    # sigmoid_gate x times sigmoid(gate), products of two results each within its bound
    # (relative errors ~2^-24 that add: still NMSE ~1e-14, far below 1e-12)
    "l2_norm": RMS_NORM, "rms_norm_gated": max(RMS_NORM, TRANSCENDENTAL),
    "sigmoid_gate": TRANSCENDENTAL,
    # delta_net_gates: sigmoid(beta), and softplus(alpha + dt_bias) times a (an exact add before
    # and an exact product after the transcendental one), each output within that one's bound
    "delta_net_gates": TRANSCENDENTAL,
    # gated_residual: sigmoid_gate's x * sigmoid(g), then an exact add of the residual
    "gated_residual": TRANSCENDENTAL,
    # gemma4: rope_ff is rope with one more IEEE operation on both sides (the angle divided by
    # the pair's factor, correctly rounded float32), so rope's bound; tanh and the softcap
    # (scale by the float32 1/cap, tanh, scale by cap: the products correctly rounded on both
    # sides, tanh within ~2 ulp) are transcendental; the per-expert scale is one float32
    # product per element, bit for bit.
    "rope_ff": TRANSCENDENTAL, "tanh": TRANSCENDENTAL, "softcap": TRANSCENDENTAL,
    "mul_expert_scale": EXACT,
}


# Mat-vec / mat-mul shapes (N outputs, K inputs, T tokens): rows that fill no tile evenly (a
# single row too), one K-quant super-block (k = 256) and longer rows, one token (the decode
# kernel) and token counts on either side of the prefill tile of 8. Every case has >= 7
# outputs: NMSE pools them, and a single output whose sum happens to cancel to near zero
# would turn float32 rounding of its terms into a large relative error.
MATMUL_SHAPES = ((1, 256, 8), (7, 256, 1), (33, 512, 3), (130, 1024, 1), (67, 2048, 9),
                 (19, 4096, 17), (37, 4096, 1), (13, 8192, 1), (21, 12288, 1), (9, 512, 33), (300, 1024, 64))
# (13, 8192, 1) and (21, 12288, 1): decode rows long enough for the split mat-vec
# (kernels/matvec.cuh MV_SPLIT_MIN_K), the other decode shapes a warp per row.
# The last two reach the prompt GEMM (brass.backends.base.GEMM_MIN_TOKENS): float16 operands,
# float32 sums, against the reference that rounds the same way.

# Benchmark shapes: a 4096-wide model's attention projection in decode, a matrix large enough
# (32768 x 4096, an output head) that GPU time outweighs Python's launch overhead, and the
# projection over a 64-token prefill.
PERF_MATMUL_SHAPES = ((4096, 4096, 1), (12288, 4096, 1), (32768, 4096, 1), (4096, 4096, 64),
                      (12288, 4096, 512))


def nmse(actual, expected, terms: float = 0.0) -> float:
    """Normalised mean squared error, sum((a - e)^2) / sum(e^2), in float64 (llama.cpp's
    test-backend-ops measure). `terms`: for a sum's outputs, the sum of its terms' squares;
    the denominator is the larger of the two (rounding is relative to the terms, and an output
    whose terms cancel would otherwise be held to a bound scaled by its own small value)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    den = max(float((e * e).sum()), terms)
    num = float(((a - e) ** 2).sum())
    return num / den if den else (0.0 if num == 0 else float("inf"))


def f16_steps(a, b) -> np.ndarray:
    """How many F16 values apart each element of a and b is (F16 arrays; +0 and -0 are 0
    apart): the bit patterns mapped onto a monotonic integer line."""
    def line(x):
        u = np.ascontiguousarray(x, np.float16).view(np.uint16).astype(np.int32)
        return np.where(u & 0x8000, 0x8000 - u, u)       # negatives below zero, -0 onto +0
    return np.abs(line(a) - line(b))


# A roped element's float32 error is absolute in its pair's size, not relative to itself:
# x*cos - y*sin with cos and sin each within ~2 ulp (2^-23, CUDA's and numpy's float32 routines,
# the angle bit-identical on both sides) errs by about 7 * 2^-24 * max|head element| (|x| + |y|
# is at most twice the head's largest element), and both sides err. An element whose pair
# cancels is small, so that error can be several of its own F16 steps (the GPU suite saw 2,
# synth-qwen3moe, 2026-12-06). 2^-20 of the head's largest element covers both sides; a wrong
# angle, pair or sign errs by the element's own size.
ROPE_PAIR_ERROR = 2.0 ** -20


def rope_cache_excess(got, want) -> float:
    """The worst ratio, over a rope_store's F16 cache `[n_ctx, H_kv, D]`, of an element's
    distance from the reference to what rounding allows: one F16 step at the larger of the two
    (each side rounds its float32 key half a step) plus ROPE_PAIR_ERROR of the head's largest
    element. Above 1 is a fault; equal bit patterns (unwritten, poisoned slots) count 0."""
    g16 = np.ascontiguousarray(got, np.float16)
    w16 = np.ascontiguousarray(want, np.float16)
    same = g16.view(np.uint16) == w16.view(np.uint16)
    g, w = g16.astype(np.float64), w16.astype(np.float64)
    with np.errstate(invalid="ignore"):
        head = np.nanmax(np.where(np.isfinite(w), np.abs(w), np.nan), axis=-1, keepdims=True)
        step = np.spacing(np.maximum(np.abs(g16), np.abs(w16))).astype(np.float64)
        allowed = step + ROPE_PAIR_ERROR * np.nan_to_num(head)
        excess = np.where(same, 0.0, np.abs(g - w) / allowed)
    excess = np.nan_to_num(excess, nan=np.inf)       # a NaN where the reference has none
    return float(excess.max()) if excess.size else 0.0


def write_gguf(path: str | Path, tensors: dict, alignment: int = 32) -> Path:
    """Write a GGUF v3 file holding `tensors` {name: (GGMLType, numpy_shape, raw uint8 bytes)}
    and no metadata besides general.alignment."""
    path = Path(path)

    def gguf_str(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    infos, offset, blobs = [], 0, []
    for name, (qtype, shape, raw) in tensors.items():
        raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
        blck, tsize = BLOCK_SIZES[qtype]
        n = int(np.prod(shape))
        if raw.size != n // blck * tsize:
            raise ValueError(f"{name}: {raw.size} bytes for {qtype.name} {shape}")
        ne = tuple(reversed(shape))
        infos.append(gguf_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                     + struct.pack("<IQ", int(qtype), offset))
        blobs.append((offset, raw))
        offset = (offset + raw.size + alignment - 1) // alignment * alignment
    header = (b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1)
              + gguf_str("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", alignment))
    head = header + b"".join(infos)
    data_start = (len(head) + alignment - 1) // alignment * alignment
    with open(path, "wb") as f:
        f.write(head + b"\0" * (data_start - len(head)))
        for off, raw in blobs:
            f.seek(data_start + off)
            f.write(raw.tobytes())
        f.truncate(data_start + offset)
    return path


def random_weight_file(path, rng: np.random.Generator, specs: dict) -> Path:
    """A GGUF of random valid tensors: specs {name: (GGMLType, numpy_shape)}."""
    tensors = {}
    for name, (qtype, shape) in specs.items():
        rows = int(np.prod(shape[:-1]))
        tensors[name] = (qtype, shape, quants.random_blocks(qtype, rows, shape[-1], rng))
    return write_gguf(path, tensors)


def cuda_reference():
    """The reference for the CUDA backend: the numpy backend in its Q8_1 mode, which rounds
    activations as llama.cpp's CUDA path does (including Q4_0/Q5_0/Q4_1/Q5_1 constant terms
    taken against the fp16 block sum s)."""
    from brass.backends.numpy_backend import NumpyBackend
    return NumpyBackend(act_mode="q8_1")
