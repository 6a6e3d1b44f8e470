"""The numpy reference backend: runs anywhere, and is the oracle the CUDA kernels answer to.

It reproduces where llama.cpp's CPU path rounds (docs/design.md, "Numerics"), so that the
per-layer comparison with the goldens can be tight:
- activations are rounded to the weight type's vec_dot_type before a mat-mul (`act_mode="cpu"`),
  or to Q8_1 blocks as llama.cpp's CUDA mat-vec does (`act_mode="q8_1"`, the kernels' oracle);
- the KV cache holds float16; K·Q sees Q rounded to float16 and V·softmax sees the softmax
  rounded to float16 (the non-flash attention path with an F16 cache);
- rope angles come from the same float32 recurrence ggml uses (theta *= theta_scale);
- GELU goes through float16 as ggml's lookup table does.
"""

from __future__ import annotations


import numpy as np

from .. import quants
from ..gguf import GGMLType
from ..kv_cache import PagedLayer
from .base import Backend, Weight, uses_f16_gemm, uses_mmq_id

F16, F32 = np.float16, np.float32
_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
# Affine block types (w = d·q + m) dot Q8_1 activations as d_w·d_x·Σq_w q_x + m·s_x, where
# s_x is the activation block's sum stored as float16: that rounding is not in d_x·q_x, so
# these types are multiplied as two products (the scaled quants, then mins × block sums).
# llama.cpp's CUDA kernels treat Q4_0/Q5_0 the same way (w = d·q_unsigned − 8d or − 16d, the
# constant against s), while its CPU path multiplies their signed quants exactly.
_AFFINE_Q8_1 = {"cpu": (GGMLType.Q4_1, GGMLType.Q5_1),
                "q8_1": (GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.Q5_0)}
_OFFSET = {GGMLType.Q4_0: 8.0, GGMLType.Q5_0: 16.0}


class NumpyWeight(Weight):
    """A GGUF tensor, dequantized to float32 on first use and kept."""

    def __init__(self, gf, name: str):
        info = gf.tensors[name]
        self.name, self.type = name, info.type
        self.shape = tuple(reversed(info.shape))
        self._gf, self._info = gf, info
        self._dense = None

    @property
    def nbytes(self) -> int:
        """Host bytes held for it: the float32 arrays dequantized so far (the raw bytes are the
        file's memory map, not held)."""
        held = [self._dense] + list(getattr(self, "_affine", None) or ())
        return sum(a.nbytes for a in held if a is not None)

    @property
    def raw(self) -> np.ndarray:
        return self._gf.tensor_bytes(self.name)

    def dense(self) -> np.ndarray:
        if self._dense is None and getattr(self, "_affine", None) is not None:
            # made anew on each call (a prompt's float16 GEMM): the mins broadcast over their
            # blocks, so no repeated copy of them is made beside the sum
            dq, mins = self._affine
            out = np.empty(dq.shape, F32)
            np.add(dq.reshape(*mins.shape, 32), mins[..., None], out=out.reshape(*mins.shape, 32))
            return out
        if self._dense is None:
            self._dense = quants.dequantize(self.raw, self.type, self._info.shape)
        return self._dense

    def affine_parts(self):
        """(d·q part `(..., N, K)`, per-block constant `(..., N, K/32)`) of a Q4_1/Q5_1 tensor
        (the constant is the min m) or a Q4_0/Q5_0 one (−8d, −16d)."""
        if getattr(self, "_affine", None) is None:
            from ..gguf import BLOCK_SIZES
            _, nbytes = BLOCK_SIZES[self.type]
            blocks = self.raw.reshape(-1, nbytes)
            if self.type in _OFFSET:
                d = blocks[:, 0:2].copy().view(F16).astype(F32)
                mins = (F32(-_OFFSET[self.type]) * d).reshape(*self.shape[:-1], -1)
            else:
                mins = blocks[:, 2:4].copy().view(F16).astype(F32).reshape(*self.shape[:-1], -1)
            dense = self.dense()
            dq = np.empty(dense.shape, F32)
            np.subtract(dense.reshape(*mins.shape, 32), mins[..., None], out=dq.reshape(*mins.shape, 32))
            self._affine = (dq, mins)
            # The two parts replace the dense copy; dense() gives it back as dq + min, exactly:
            # for Q4_0/Q5_0 both d·(q − 8) (− 16) and d·q are products of an 11-bit float16
            # scale and a quant of at most 5 bits, exact in float32, and so are the sum and
            # difference with −8d (−16d); only a zero's sign can differ (−0 from d < 0, q = 8;
            # +0 back), which no product sum that is not exactly zero sees. Keeping both held
            # qwen2.5-coder-0.5b's Q5_0 weights at twice their float32 size in q8_1 mode.
            self._dense = None
        return self._affine

    def rows(self, ids: np.ndarray) -> np.ndarray:
        if self._dense is not None:
            return self._dense[ids]
        return quants.dequantize_rows(self.raw, self.type, self._info.shape[0], ids)


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self, act_mode: str = "cpu", moe_mmq: bool = True):
        if act_mode not in ("cpu", "q8_1"):
            raise ValueError(f"act_mode must be 'cpu' or 'q8_1', not {act_mode!r}")
        self.act_mode = act_mode
        # q8_1 mode: a prompt's expert mat-muls rounded as the CUDA backend with the same
        # option computes them (on: its int8 tiles, the mat-vec's rounding; off: its float16
        # GEMMs)
        self.moe_mmq = bool(moe_mmq)
        # rows_independent (base): BLAS sums a gemm's rows in another order than a gemv's,
        # so the rows are multiplied one by one, as alone (_mm's by_row).

    # -- memory -----------------------------------------------------------------------------
    def weight(self, gf, name):
        return NumpyWeight(gf, name)

    def asarray(self, a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype)

    def to_numpy(self, a):
        return np.asarray(a)

    def empty(self, shape, dtype=F32):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype=F32):
        return np.zeros(shape, dtype)

    # -- linear algebra ---------------------------------------------------------------------
    def _round_act(self, x, wtype):
        """The activation values the reference dot product effectively multiplies."""
        if self.act_mode == "q8_1":
            if wtype in _FLOAT_TYPES:
                return x
            return quants.dequantize_q8_1(*quants.quantize_q8_1_cuda(x))
        return quants.round_activations(x, quants.VEC_DOT_TYPE[wtype])

    def embed(self, table, ids):
        return table.rows(np.asarray(ids, dtype=np.int64)).astype(F32, copy=False)

    def _linear(self, x, w, expert=None, f16=None):
        """`x [R, K] @ W.T` (W = expert `expert` of a 3-D tensor if given). `f16`: round both
        operands to float16 (default: as the CUDA backend does for R rows, in q8_1 mode)."""
        if f16 is None:
            f16 = self.act_mode == "q8_1" and not self._rows_independent and uses_f16_gemm(*x.shape, w.type)
        if f16:
            # The CUDA backend's prompt GEMM: both operands rounded to float16, products
            # (exact in float32) summed in float32.
            dense = w.dense() if expert is None else w.dense()[expert]
            return _mm_f16(quants.round_to_f16(x), dense, self._rows_independent)
        if w.type in _AFFINE_Q8_1[self.act_mode]:
            qb = quants.quantize_q8_1(x) if self.act_mode == "cpu" else quants.quantize_q8_1_cuda(x)
            xq = qb.qs.astype(F32) * np.repeat(qb.d.astype(F32), 32, axis=-1)
            dq, mins = w.affine_parts()
            if expert is not None:
                dq, mins = dq[expert], mins[expert]
            by_row = self._rows_independent
            return _mm(xq, dq, by_row) + _mm(qb.s.astype(F32), mins, by_row)
        dense = w.dense() if expert is None else w.dense()[expert]
        return _mm(self._round_act(x, w.type), dense, self._rows_independent)

    def matmul(self, x, w):
        return self._linear(np.ascontiguousarray(x, F32), w)

    def matmul_id(self, x, w, ids):
        T, k = ids.shape
        x = np.ascontiguousarray(x, F32)
        out = np.empty((T, k, w.shape[1]), F32)
        # The CUDA backend multiplies a prompt's experts on int8 tiles against Q8_1 (as the
        # mat-vec), or with moe_mmq off as GEMMs (rows of T tokens).
        f16 = (self.act_mode == "q8_1" and not self._rows_independent and uses_f16_gemm(T, x.shape[-1], w.type)
               and not (self.moe_mmq and uses_mmq_id(T, x.shape[-1], w.type)))
        for e in np.unique(ids):
            tt, jj = np.nonzero(ids == e)
            out[tt, jj] = self._linear(x[tt, jj] if x.ndim == 3 else x[tt], w, int(e), f16=f16)
        return out

    # -- elementwise ------------------------------------------------------------------------
    def rms_norm(self, x, w, eps):
        x = np.asarray(x, F32)
        # ggml: float32 squares summed in double, mean rounded to float, 1/sqrtf(mean + eps).
        mean = (np.einsum("...i,...i->...", x, x, dtype=np.float64) / x.shape[-1]).astype(F32)
        scale = (F32(1.0) / np.sqrt(mean + F32(eps))).astype(F32)
        y = x * scale[..., None]
        if w is not None:
            y = y * w.dense()
        return y

    def add(self, a, b):
        return np.add(a, b.dense() if isinstance(b, Weight) else b, dtype=F32)

    def mul(self, a, b):
        return np.multiply(a, b.dense() if isinstance(b, Weight) else b, dtype=F32)

    def scale(self, x, s):
        return np.multiply(x, F32(s), dtype=F32)

    def rope(self, x, pos, n_rot, base, neox, freq_scale=1.0):
        return self._rope(x, pos, n_rot, base, neox, freq_scale)

    def rope_ff(self, x, pos, n_rot, base, neox, freq_factors, freq_scale=1.0):
        return self._rope(x, pos, n_rot, base, neox, freq_scale, freq_factors.dense())

    def _rope(self, x, pos, n_rot, base, neox, freq_scale=1.0, freq_factors=None):
        x = np.asarray(x, F32)
        cos, sin = rope_cos_sin(np.asarray(pos), n_rot, base, freq_scale, freq_factors)  # [T, n_rot/2]
        cos, sin = cos[:, None, :], sin[:, None, :]
        y = x.copy()
        if neox:
            half = n_rot // 2
            x0, x1 = x[..., :half], x[..., half:n_rot]
            y[..., :half] = x0 * cos - x1 * sin
            y[..., half:n_rot] = x0 * sin + x1 * cos
        else:
            x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            y[..., 0:n_rot:2] = x0 * cos - x1 * sin
            y[..., 1:n_rot:2] = x0 * sin + x1 * cos
        return y

    # A cache is a contiguous `[n_ctx, H_kv, Dh]` array or a sequence's layer in a block pool
    # (engine/kv_cache.py PagedLayer): slots are written through the block table, and read back
    # gathered into the contiguous `[S, H_kv, Dh]` the attention below computes on, the same
    # values in the same order, so a paged cache gives the bits of a contiguous one.
    paged_kv = True

    def kv_store(self, cache, x, pos):
        x = np.asarray(x).astype(F16)
        if isinstance(cache, PagedLayer):
            blocks, off = cache.slots(pos)
            cache.pool[blocks, off] = x
        else:
            cache[np.asarray(pos)] = x

    def attention(self, q, k_cache, v_cache, pos, scale, window=0):
        q = np.asarray(q, F32)
        pos = np.asarray(pos)
        T, H, Dh = q.shape
        Hkv = k_cache.shape[1]
        g = H // Hkv
        S = int(pos.max()) + 1
        k = k_cache[:S].astype(F32)            # [S, Hkv, Dh] (a paged layer: gathered)
        v = v_cache[:S].astype(F32)            # [S, Hkv, Dv]
        # K·Q with Q rounded to F16 (ggml converts src1 to the F16 cache's vec_dot_type).
        q16 = q.astype(F16).astype(F32).reshape(T, Hkv, g, Dh)
        kq = np.einsum("thgd,shd->hgts", q16, k, optimize=True)       # [Hkv, g, T, S]
        s_idx = np.arange(S)
        visible = s_idx[None, :] <= pos[:, None]
        if window:
            visible &= (pos[:, None] - s_idx[None, :]) < window
        logits = kq * F32(scale) + np.where(visible, F32(0), F32(-np.inf))
        logits = logits - logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        p = (p / p.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)
        p16 = p.astype(F16).astype(F32)       # softmax rounded to F16 for V·softmax
        out = np.einsum("hgts,shd->thgd", p16, v, optimize=True)     # [T, Hkv, g, Dv]
        return np.ascontiguousarray(out.reshape(T, H * v.shape[-1]), F32)

    def swiglu(self, gate, up):
        gate = np.asarray(gate, F32)
        # exp(-gate) overflows to inf for gate < -88: gate / inf is -0, silu's limit (as silu)
        with np.errstate(over="ignore"):
            return (gate / (F32(1) + np.exp(-gate))) * up

    def geglu(self, gate, up):
        return gelu_f16_table(np.asarray(gate, F32)) * up

    def softmax(self, x):
        x = np.asarray(x, F32)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)

    def topk(self, x, k):
        # Stable sort on the negated values: ties keep the lower index first.
        idx = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k].astype(np.int32)
        return idx, np.take_along_axis(x, idx, axis=-1)

    def weighted_sum(self, y, w):
        y = np.asarray(y, F32) * np.asarray(w, F32)[..., None]
        out = y[:, 0].copy()
        for j in range(1, y.shape[1]):      # ggml adds the expert outputs one after another
            out += y[:, j]
        return out

    def take_rows(self, x, rows):
        return np.asarray(x)[np.asarray(rows)]

    # -- recurrent layers (ggml-cpu/unary-ops.cpp, ops.cpp: ssm_conv, gated_delta_net) ---------
    def sigmoid(self, x):
        x = np.asarray(x, F32)
        with np.errstate(over="ignore"):
            return F32(1) / (F32(1) + np.exp(-x))

    def softplus(self, x):
        x = np.asarray(x, F32)
        with np.errstate(over="ignore"):
            return np.where(x > F32(20), x, np.log(F32(1) + np.exp(x))).astype(F32)

    def silu(self, x):
        x = np.asarray(x, F32)
        with np.errstate(over="ignore"):
            return x / (F32(1) + np.exp(-x))

    def ssm_conv(self, x, conv_state, w, n_real=None):
        x = np.asarray(x, F32)
        K1 = conv_state.shape[0]
        X = np.concatenate([conv_state, x], axis=0)             # [K-1+T, C]
        wd = w.dense()                                          # (C, K)
        T = x.shape[0]
        out = X[0:T] * wd[:, 0]
        for i in range(1, K1 + 1):                              # float32 sum, taps in order
            out = out + X[i:i + T] * wd[:, i]
        n = _real_rows(n_real, T)
        conv_state[...] = X[n:n + K1]
        return out

    def gated_delta_net(self, q, k, v, g, beta, state, n_real=None):
        q, k, v = (np.asarray(a, F32) for a in (q, k, v))
        T, Hv, D = v.shape
        n = _real_rows(n_real, T)
        head = np.arange(Hv) % q.shape[1]                       # tiled: value head h → h mod Hk
        decay = np.exp(np.asarray(g, F32))                      # [T, Hv]
        beta = np.asarray(beta, F32)
        scale = F32(1) / np.sqrt(F32(D))
        out = np.zeros((T, Hv, D), F32)                         # padding rows (t >= n): zero
        M = state                                               # M[h, j, i] = S_h[i, j]
        for t in range(n):
            kt, qt = k[t, head], q[t, head]                     # [Hv, D]
            M *= decay[t, :, None, None]
            u = np.einsum("hji,hi->hj", M, kt)                  # Sᵀk
            delta = (v[t] - u) * beta[t, :, None]
            M += delta[:, :, None] * kt[:, None, :]
            out[t] = np.einsum("hji,hi->hj", M, qt) * scale
        return out

    # -- gemma4 ---------------------------------------------------------------------------------
    def tanh(self, x):
        return np.tanh(np.asarray(x, F32))

    def mul_expert_scale(self, y, s, ids):
        return np.multiply(y, s.dense()[np.asarray(ids)][..., None], dtype=F32)

    def argmax(self, x):
        return np.argmax(np.asarray(x), axis=-1).astype(np.int32)


def _mm(x: np.ndarray, w: np.ndarray, by_row: bool = False) -> np.ndarray:
    """`x @ w.T`. A single row goes through gemv (`w @ x`): OpenBLAS's gemm with one row
    and a transposed operand is ~8x slower, and decode is all single rows. `by_row`: every
    row through gemv, so that each equals what it would be alone."""
    if x.shape[0] == 1:
        return (w @ x[0])[None]
    if by_row:
        return np.stack([w @ r for r in x]) if x.shape[0] else x @ w.T
    return x @ w.T


# Weight elements rounded to float16 at a time by _mm_f16 (16 MiB of float32); a block holds
# at least this many. OpenBLAS multiplies a small product (M·N·K <= 1e6 on SkylakeX) with
# other kernels that sum in another order, so a block is never small where the whole is not
# (with blocks of 64 rows of 96 the sums moved by an ulp). Whether a column's sum keeps its
# order in a block of the product is up to BLAS: OpenBLAS's SkylakeX kernels keep it, its
# Haswell and Zen kernels move some columns by an ulp or a few (test_numpy_weights.py).
_F16_WEIGHT_CHUNK = 1 << 22


def _mm_f16(x16: np.ndarray, w: np.ndarray, by_row: bool = False) -> np.ndarray:
    """`x16 @ round_to_f16(w).T`, the weight rounded a block of rows at a time rather than as
    a whole copy beside it (the output matrix of a 150k-token vocabulary is 0.5 GiB of
    float32). Each output column is one weight row's dot product of the same float16 values;
    BLAS may sum it in another order in a block than in the whole (the last block takes the
    ragged rest; conformance/kernels/test_numpy_weights.py holds the blocked product to the
    whole one within any order's bound, and bit for bit for one block). The blocks depend on
    the weight's shape only, so a model's products are the same from run to run."""
    n_out, k = w.shape
    step = max(1, _F16_WEIGHT_CHUNK // max(k, 1))
    n_blocks = n_out // step
    if n_blocks <= 1:
        return _mm(x16, quants.round_to_f16(w), by_row)
    out = np.empty((x16.shape[0], n_out), F32)
    for b in range(n_blocks):
        i, j = b * step, (n_out if b == n_blocks - 1 else (b + 1) * step)
        out[:, i:j] = _mm(x16, quants.round_to_f16(w[i:j]), by_row)
    return out


def rope_cos_sin(pos: np.ndarray, n_rot: int, base: float, freq_scale: float = 1.0,
                 freq_factors: np.ndarray | None = None):
    """cos/sin `[T, n_rot/2]` of the rope angles, computed like ggml_rope_cache_init: the
    angle of pair i is pos * theta_scale**i built by repeated float32 multiplication (not
    pow), so long positions carry the same rounding as llama.cpp's; with freq factors it is
    divided by factor i before the frequency scale is applied (rope_yarn(theta / ff, ...))."""
    theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
    theta = pos.astype(F32)
    angles = np.empty((pos.shape[0], n_rot // 2), F32)
    for i in range(n_rot // 2):
        angles[:, i] = theta
        theta = (theta * theta_scale).astype(F32)
    if freq_factors is not None:
        angles = angles / np.asarray(freq_factors, F32)[:n_rot // 2]
    angles = angles * F32(freq_scale)
    return np.cos(angles), np.sin(angles)


_GELU_TABLE = None


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU: tanh approximation looked up through float16 (GGML_GELU_FP16),
    identity above 10 and zero below -10."""
    global _GELU_TABLE
    if _GELU_TABLE is None:
        h = np.arange(1 << 16, dtype=np.uint16).view(F16).astype(F32)
        with np.errstate(over="ignore", invalid="ignore"):
            g = F32(0.5) * h * (F32(1) + np.tanh(F32(0.79788456080286535587989211986876) * h
                                                 * (F32(1) + F32(0.044715) * h * h)))
        _GELU_TABLE = g.astype(F16).astype(F32)
    y = _GELU_TABLE[x.astype(F16).view(np.uint16)]
    y = np.where(x >= 10, x, y)
    return np.where(x <= -10, F32(0), y).astype(F32)


def _real_rows(n_real, T: int) -> int:
    """The rows of T that are the prompt's (Backend.ssm_conv's n_real; None: all of them)."""
    return T if n_real is None else max(0, min(T, int(np.asarray(n_real).reshape(-1)[0])))
