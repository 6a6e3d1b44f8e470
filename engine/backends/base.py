"""The op surface every backend provides. Architecture files call only these methods.

Conventions (see docs/design.md):
- activations are float32 arrays `[T, D]` in the backend's own array type; heads are `[T, H, Dh]`;
- a linear weight `W` has numpy shape `(N, K)` and `matmul(x, W)` is `x @ W.T`;
- `pos` is an int32 array `[T]` on the device; attention masks, rope angles and KV slots are
  derived from it, so no op needs the host to know the sequence length (graph capture);
- the KV cache is float16 `[n_ctx, H_kv, Dh]` per layer; a token's slot is its position.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ..errors import UnsupportedError


# Prompts (mat-muls of many rows) go to tensor cores on the CUDA backend: the weight is
# dequantized to float16 and multiplied in float16 with float32 accumulation, instead of
# int8 dot products against Q8_1 activations. The numpy backend in its q8_1 mode (the CUDA
# kernels' oracle) rounds the same way under the same rule.
GEMM_MIN_TOKENS = 32


def uses_f16_gemm(n_rows: int, k: int, wtype) -> bool:
    """Whether the CUDA backend multiplies `[n_rows, k]` activations by a weight of GGML type
    `wtype` on tensor cores in float16 (k a multiple of 8: the GEMM's alignment; float32
    weights keep their precision on the mat-mul kernels). The expert mat-muls (mul_mat_id) go
    to the int8 tiles instead where uses_mmq_id says so."""
    return n_rows >= GEMM_MIN_TOKENS and k % 8 == 0 and int(wtype) != 0   # 0: GGML F32


# GGML type ids with an mmq_id_<type> kernel -> values per block (K must be a multiple):
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 (32), Q4_K, Q5_K, Q6_K (256-value super-blocks).
MMQ_BLOCK = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 39: 32, 12: 256, 13: 256, 14: 256}


def uses_mmq_id(n_tokens: int, k: int, wtype) -> bool:
    """Whether a prompt's expert mat-mul of `n_tokens` tokens, `k` features, against experts of
    GGML type `wtype` can go to the int8 tiles (kernels/mmq.cu mmq_id_<type>): a prompt and a
    type with an mmq kernel. A backend takes them where its moe_mmq option is on (the
    default): per block of 32 the same integer dot products and scaling as the decode
    mat-vec, planned on the device, where the float16 GEMMs' per-layer routing plan is read
    on the host (a MoE prompt then spends most of its wall time waiting for it)."""
    blk = MMQ_BLOCK.get(int(wtype))
    return blk is not None and n_tokens >= GEMM_MIN_TOKENS and k % blk == 0


class Weight(ABC):
    """A model tensor prepared by a backend. `type` is the GGML type, `shape` numpy-ordered."""

    name: str
    type: Any
    shape: tuple[int, ...]


class Backend(ABC):
    name: str = "abstract"

    def activate(self):
        """Context in which this backend's work runs: on a device backend, its device and
        stream become current for the calling thread, so array operations made outside the
        backend's own kernels (the architecture's reshape/sum, host copies) queue on the same
        stream in order, whichever thread runs them and however many backends exist."""
        return contextlib.nullcontext()

    # -- memory -----------------------------------------------------------------------------
    @abstractmethod
    def weight(self, gf, name: str) -> Weight:
        """Prepare GGUF tensor `name` of file `gf` for use by this backend."""

    @abstractmethod
    def asarray(self, a: np.ndarray, dtype=None):
        """Host array → backend array."""

    @abstractmethod
    def to_numpy(self, a) -> np.ndarray:
        """Backend array → host array (a synchronisation point on devices)."""

    @abstractmethod
    def empty(self, shape, dtype=np.float32):
        """Uninitialised backend array (callers overwrite every element)."""

    @abstractmethod
    def zeros(self, shape, dtype=np.float32):
        ...

    # -- ops --------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, table: Weight, ids):
        """Rows `ids` of a (possibly quantized) table as float32 `[T, D]`."""

    @abstractmethod
    def matmul(self, x, w: Weight):
        """`x [T, K] @ W.T → [T, N]` (ggml_mul_mat(W, x))."""

    @abstractmethod
    def matmul_id(self, x, w: Weight, ids):
        """Expert mat-vec (ggml_mul_mat_id). `w` is `(E, N, K)`, `ids` int32 `[T, k]`.
        `x` is `[T, K]` (the same row for every chosen expert) or `[T, k, K]` (one row per
        choice). Returns `[T, k, N]`."""

    @abstractmethod
    def rms_norm(self, x, w: Weight | None, eps: float):
        """RMS-normalise over the last axis, then multiply by `w` (broadcast) if given."""

    @abstractmethod
    def add(self, a, b):
        """Elementwise `a + b`; `b` may be a Weight (a bias) broadcast over rows."""

    @abstractmethod
    def mul(self, a, b):
        """Elementwise `a * b` with numpy broadcasting."""

    @abstractmethod
    def scale(self, x, s: float):
        ...

    @abstractmethod
    def rope(self, x, pos, n_rot: int, base: float, neox: bool, freq_scale: float = 1.0):
        """Rotary embedding on `[T, H, Dh]` (first `n_rot` dims of each head), ggml_rope_ext
        with ext_factor 0 and attn_factor 1. `neox` rotates pairs (i, i + n_rot/2) instead of
        (2i, 2i + 1)."""

    @abstractmethod
    def kv_store(self, cache, x, pos):
        """Write `x [T, H_kv, Dh]` into `cache [n_ctx, H_kv, Dh]` at slots `pos` (as F16)."""

    @abstractmethod
    def attention(self, q, k_cache, v_cache, pos, scale: float, window: int = 0):
        """Causal GQA softmax attention of queries `q [T, H, Dh]` at positions `pos` over
        cache slots `s <= pos[t]` (and `pos[t] - s < window` when window > 0). Head h reads
        KV head `h // (H / H_kv)`. Returns `[T, H * Dv]`."""

    @abstractmethod
    def swiglu(self, gate, up):
        """`silu(gate) * up`."""

    @abstractmethod
    def geglu(self, gate, up):
        """`gelu_tanh(gate) * up`."""

    @abstractmethod
    def softmax(self, x):
        """Softmax over the last axis."""

    @abstractmethod
    def topk(self, x, k: int):
        """Indices (int32 `[T, k]`, descending by value) and values of the k largest per row."""

    @abstractmethod
    def weighted_sum(self, y, w):
        """`y [T, k, D]`, `w [T, k]` → `sum_j w[:, j, None] * y[:, j]` → `[T, D]`."""

    @abstractmethod
    def take_rows(self, x, rows):
        """`x[rows]` (rows: int32 backend array)."""

    @abstractmethod
    def argmax(self, x):
        """Row-wise argmax, int32 `[T]` on the device (first maximum on ties)."""

    def synchronize(self):  # noqa: B027 (a no-op unless the backend queues work)
        """Wait for queued work (no-op on synchronous backends)."""

    # -- fused ops ----------------------------------------------------------------------------
    # Each is defined here by the primitive ops it stands for, in the order llama.cpp's graph
    # runs them; a backend may override one with a single kernel that computes the same
    # numbers (the conformance suite holds it to the composition's bounds).

    def add_rms_norm(self, a, b, w: Weight, eps: float, scale: Weight | None = None):
        """The residual add and the RMS norm that follows it: `(a + b, rms_norm(a + b, w))`.
        `b` None: `(a, rms_norm(a, w))` (the first layer's norm). `scale` (one value): the sum
        times it before the norm, `s = (a + b) * scale` (gemma4's layer_output_scale)."""
        s = a if b is None else self.add(a, b)
        if scale is not None:
            s = self.mul(s, scale)
        return s, self.rms_norm(s, w, eps)

    def moe_norms(self, x, w: Weight, w_router: Weight, factor: float, eps: float):
        """Gemma 4's two norms of a MoE layer's residual `x`: the routed experts' input
        `rms_norm(x, w)` and the router's `rms_norm(x) * factor * w_router` (a weightless norm,
        a scalar, a weight, in that order)."""
        r = self.mul(self.scale(self.rms_norm(x, None, eps), factor), w_router)
        return self.rms_norm(x, w, eps), r

    def matmul_many(self, x, ws: list):
        """`[matmul(x, w) for w in ws]`: projections of one input (q, k, v)."""
        return [self.matmul(x, w) for w in ws]

    def rope_store(self, q, k, v, pos, k_cache, v_cache, *, q_norm: Weight | None,
                   k_norm: Weight | None, eps: float, n_rot: int, base: float, neox: bool,
                   freq_scale: float = 1.0):
        """Per-head RMS norms of q and k (when given), rope of both, K and V written to the
        cache at slots `pos`. Returns the roped `(q, k)`."""
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)
        q = self.rope(q, pos, n_rot, base, neox, freq_scale)
        k = self.rope(k, pos, n_rot, base, neox, freq_scale)
        self.kv_store(k_cache, k, pos)
        self.kv_store(v_cache, v, pos)
        return q, k

    # Whether kv_store and attention take a sequence's layer in a block pool (engine/kv_cache.py
    # PagedLayer) as well as a contiguous cache: sessions are then paged (Model.new_cache), and
    # a server shares one pool among its sequences, with prefix caching.
    paged_kv = False

    # -- a batch of sequences, one token row each (batched decode) ----------------------------
    # Whether a batched step's kernels reach each row's KV cache through device tables of the
    # rows' cache addresses (bucket graphs need that: engine/batch.py BucketStep).
    row_tables = False

    # Set inside rows_independent(); a backend whose multi-row kernels sum in another order
    # than its single-row ones reads it and takes the single-row ones for the rows.
    _rows_independent = False

    @contextlib.contextmanager
    def rows_independent(self):
        """Context in which every row of an op's result is computed exactly as it would be
        alone (a batched decode step: a sequence's logits must not depend on which others
        share its step)."""
        before, self._rows_independent = self._rows_independent, True
        try:
            yield
        finally:
            self._rows_independent = before

    def rope_store_rows(self, q, k, v, pos, layers: list, **kw):
        """rope_store for rows that belong to different sequences: row r is written to the
        cache pair `layers[r] = (k_cache, v_cache)` at slot `pos[r]`. Returns `(q, k)`."""
        q_out = k_out = None
        for r, (k_cache, v_cache) in enumerate(layers):
            qr, kr = self.rope_store(q[r:r + 1], k[r:r + 1], v[r:r + 1], pos[r:r + 1],
                                     k_cache, v_cache, **kw)
            if q_out is None:
                q_out = self.empty((len(layers), *qr.shape[1:]))
                k_out = self.empty((len(layers), *kr.shape[1:]))
            q_out[r:r + 1] = qr
            k_out[r:r + 1] = kr
        return q_out, k_out

    def attention_rows(self, q, layers: list, pos, scale: float, window: int = 0):
        """attention for rows of different sequences: row r attends over its own cache pair
        `layers[r]` up to slot `pos[r]`. Returns `[T, H * Dv]`."""
        out = None
        for r, (k_cache, v_cache) in enumerate(layers):
            o = self.attention(q[r:r + 1], k_cache, v_cache, pos[r:r + 1], scale, window)
            if out is None:
                out = self.empty((len(layers), o.shape[-1]))
            out[r:r + 1] = o
        return out

    def ffn_glu(self, x, w_gate: Weight, w_up: Weight, gelu: bool = False):
        """`act(x @ W_gate.T) * (x @ W_up.T)`, act SiLU (SwiGLU) or GELU (GeGLU)."""
        up = self.matmul(x, w_up)
        gate = self.matmul(x, w_gate)
        return self.geglu(gate, up) if gelu else self.swiglu(gate, up)

    def moe_gate(self, x, w_router: Weight, k: int, norm: bool, scale: float):
        """A top-k MoE's router on `x [T, D]`: its logits `x W_router^T` and moe_route's
        `(probs, ids, weights)` of them, as `(logits, probs, ids, weights)`."""
        logits = self.matmul(x, w_router)
        return (logits, *self.moe_route(logits, k, norm, scale))

    def moe_route(self, logits, k: int, norm: bool, scale: float):
        """Router of a top-k MoE (llama.cpp's build_moe_ffn, softmax gating): `(probs, ids,
        weights)`, the weights renormalised to sum to one when `norm` (the sum clamped to
        F16's smallest normal, as ggml does) and multiplied by `scale` unless it is 0 or 1."""
        probs = self.softmax(logits)
        ids, weights = self.topk(probs, k)
        if norm:
            total = weights.sum(axis=-1, keepdims=True)
            weights = weights / total.clip(6.103515625e-5, None)
        if scale not in (0.0, 1.0):
            weights = self.scale(weights, scale)
        return probs, ids, weights

    def moe_ffn(self, x, w_gate: Weight, w_up: Weight | None, w_down: Weight, ids, weights,
                gelu: bool = False, down_scale: Weight | None = None):
        """The chosen experts' gated FFNs on `x [T, D]`, summed with `weights [T, k]`. With
        `w_up` None, `w_gate` is the experts' gate and up in one tensor `[E, 2F, D]` (each
        expert's gate rows, then its up rows: gemma4's ffn_gate_up_exps); `down_scale`: a
        factor per expert on its down projection's output, before the routing weight
        (gemma4's ffn_down_exps.scale)."""
        if w_up is None:
            gate_up = self.matmul_id(x, w_gate, ids)                     # [T, k, 2F]
            n_ff = gate_up.shape[-1] // 2
            gate, up = gate_up[..., :n_ff], gate_up[..., n_ff:]
        else:
            up = self.matmul_id(x, w_up, ids)
            gate = self.matmul_id(x, w_gate, ids)
        h = self.geglu(gate, up) if gelu else self.swiglu(gate, up)
        y = self.matmul_id(h, w_down, ids)
        if down_scale is not None:
            y = self.mul_expert_scale(y, down_scale, ids)
        return self.weighted_sum(y, weights)

    # -- recurrent (gated delta-net) layers: qwen35, qwen35moe -------------------------------
    # Elementwise functions and the two stateful ops a backend must provide itself; the others
    # are compositions. A backend without them refuses with one line (an architecture whose
    # ops a backend lacks lists the backends it runs on, BACKENDS, and is refused at load time
    # first, as gemma4 on CUDA).

    def _lacks(self, op: str, needed_by: str = "gated delta-net layers"):
        raise UnsupportedError(f"the {self.name} backend has no {op} op (needed by "
                               f"{needed_by}); use --backend numpy")

    def gated_residual(self, a, x, gate):
        """`a + x * sigmoid(gate)`, gate one logit a row `[T, 1]` (qwen35moe's shared expert
        added to the routed experts under its gate)."""
        return self.add(a, self.mul(x, self.sigmoid(gate)))

    def sigmoid(self, x):
        """`1 / (1 + exp(-x))` elementwise (ggml_sigmoid)."""
        self._lacks("sigmoid")

    def softplus(self, x):
        """`log(1 + exp(x))`, and `x` itself above 20 (ggml_softplus)."""
        self._lacks("softplus")

    def silu(self, x):
        """`x / (1 + exp(-x))` elementwise (ggml_silu)."""
        self._lacks("silu")

    def ssm_conv(self, x, conv_state, w: Weight, n_real=None):
        """Causal depthwise conv1d over time with a carried state (ggml_ssm_conv after the
        concat of llama.cpp's build_conv_state). `x [T, C]`, `conv_state [K-1, C]` (the last K-1
        inputs, oldest first), `w` numpy `(C, K)`: returns `c[t, ch] = sum_i X[t+i, ch] w[ch, i]`
        with `X = concat(conv_state, x)` (the sum in float32, i in order), and writes the last
        K-1 rows of X into conv_state. `n_real` (a one-element int32 array of the backend, or
        None: T): only the first n_real rows are the prompt's (a prompt graph of a length class
        pads the rest): the state written is the window after row n_real - 1."""
        self._lacks("ssm_conv")

    def ssm_conv_silu(self, x, conv_state, w: Weight, n_real=None):
        """`silu(ssm_conv(...))`: the delta-net's conv output as its q, k and v read it."""
        return self.silu(self.ssm_conv(x, conv_state, w, n_real=n_real))

    def gated_delta_net(self, q, k, v, g, beta, state, n_real=None):
        """The gated delta rule over T tokens in order (ggml_gated_delta_net): `q, k [T, Hk, D]`
        (L2-normed), `v [T, Hv, D]`, `g, beta [T, Hv]`, `state [Hv, D, D]` float32 holding S
        transposed as llama.cpp stores it (`state[h, j, i] = S_h[i, j]`), updated in place.
        Value head h reads key/query head `h % Hk` (tiled, not grouped). Per token and head:
        S ← exp(g) S;  δ = β (v − Sᵀk);  S ← S + k ⊗ δ;  o = (Sᵀq) / sqrt(D). Returns o `[T, Hv, D]`.
        `n_real` (as ssm_conv's): only the first n_real tokens update the state; the outputs of
        the rows after them are zero."""
        self._lacks("gated_delta_net")

    @staticmethod
    def l2_norm_terms(n: int, eps: float) -> tuple[float, float]:
        """l2_norm's rms_norm eps and scale for rows of n: eps / n and 1 / sqrt(n), in float32
        (one definition, for a backend that does l2_norm in one kernel gives its bits)."""
        nf = np.float32(n)
        return float(np.float32(eps) / nf), float(np.float32(1.0) / np.sqrt(nf))

    def l2_norm(self, x, eps: float):
        """`x / sqrt(sum(x²) + eps)` over the last axis, as llama.cpp's build_gdn_l2_norm
        computes it: rms_norm with eps / n, then times 1 / sqrt(n) (float32 throughout)."""
        eps_n, scale = self.l2_norm_terms(x.shape[-1], eps)
        return self.scale(self.rms_norm(x, None, eps_n), scale)

    def rms_norm_gated(self, x, w: Weight, z, eps: float):
        """`rms_norm(x, w) * silu(z)` (the delta-net's output norm, gated by z)."""
        return self.mul(self.rms_norm(x, w, eps), self.silu(z))

    def sigmoid_gate(self, x, gate):
        """`x * sigmoid(gate)` (qwen35's attention output gate, its shared-expert gate)."""
        return self.mul(x, self.sigmoid(gate))

    def delta_net_gates(self, beta, alpha, dt_bias: Weight, a: Weight):
        """The delta rule's per-head gates of `[T, Hv]` projections (qwen35.cpp): `sigmoid(beta)`
        and `softplus(alpha + dt_bias) * a`."""
        return self.sigmoid(beta), self.mul(self.softplus(self.add(alpha, dt_bias)), a)

    # -- gemma4 ------------------------------------------------------------------------------
    # Like the recurrent ops: not abstract, and a backend without them refuses in one line
    # (engine/arch/gemma4.py's BACKENDS keeps such backends from loading the model at all).

    def rope_ff(self, x, pos, n_rot: int, base: float, neox: bool, freq_factors: Weight,
                freq_scale: float = 1.0):
        """`rope` whose pair i turns by `θ_i / freq_factors[i]` (ggml_rope_ext with freq
        factors: ggml divides the angle by the factor, then multiplies by freq_scale). Gemma 4's
        full-attention layers rotate only the pairs whose factor is 1 this way: the others
        have 1e30, i.e. stay put ("proportional" rope)."""
        self._lacks("rope_ff", "gemma4's full-attention layers")

    def tanh(self, x):
        """`tanh(x)` elementwise (ggml_tanh)."""
        self._lacks("tanh", "gemma4's final logit softcap")

    def softcap(self, x, cap: float):
        """`cap · tanh(x / cap)`, as ggml computes it: scale by `1.0f / cap` (a float32
        quotient), tanh, scale by cap (gemma4's final logits)."""
        inv = float(np.float32(1) / np.float32(cap))
        return self.scale(self.tanh(self.scale(x, inv)), cap)

    def mul_expert_scale(self, y, s: Weight, ids):
        """`y[t, j, :] * s[ids[t, j]]`: the per-expert factor of an expert mat-mul's output
        (`y [T, k, N]`, `s` `(E,)`, `ids [T, k]`; llama.cpp's build_lora_mm_id with a scale,
        gemma4's ffn_down_exps.scale)."""
        self._lacks("mul_expert_scale", "gemma4's experts")

    # -- decoding on the device ---------------------------------------------------------------
    supports_graphs = False

    def capture(self, fn):
        """Record `fn()` as a replayable graph (backends with supports_graphs)."""
        raise NotImplementedError(f"the {self.name} backend does not capture graphs")
