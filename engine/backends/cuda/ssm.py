"""The gated delta-net layers of the hybrid models (qwen35, qwen35moe): the elementwise
functions and the causal conv1d of kernels/ssm.cu, and the delta rule itself, token by token
(ssm.cu gated_delta_net_<D>, as llama.cpp runs it) or, for a prompt of a chunk or more with
the delta_chunked option, in chunks (kernels/delta_chunked.cu).

`n_real`: a device int32 word holding how many of the T rows are the prompt's (a prompt graph
of a length class pads the rest, engine/model.py); the carried states are then those after
exactly those rows. None: every row (the kernels read the backend's word of INT_MAX)."""

from __future__ import annotations

import cupy

from ...errors import BrassError, UnsupportedError
from ...gguf import GGMLType
from ..base import Backend
from .common import F32, CudaWeight, f32, grid_1d
from .compiler import define
from .params import pack

UNARY_THREADS = 256
UNARY_OPS = {"sigmoid": 0, "softplus": 1, "silu": 2}       # UnaryParams.op
# ssm_conv: a thread per (channel, SSM_CONV_TOKENS tokens), so its window has at most
# SSM_CONV_TOKENS + 1 taps (only the first token block reads the carried rows)
SSM_CONV_THREADS, SSM_CONV_TOKENS = define("ssm.cu", "SSM_CONV_THREADS"), define("ssm.cu", "SSM_CONV_TOKENS")
GDN_HEAD_DIMS = (32, 64, 128)        # gated_delta_net_<D>: state sizes the kernels take
# gated_delta_net_<D>: a block per (value head, GDN_ROWS state rows), each row on
# max(1, D / GDN_PART) threads
GDN_ROWS, GDN_PART = define("ssm.cu", "GDN_ROWS"), define("ssm.cu", "GDN_PART")
# gated_delta_net_chunked_<D>: a prompt's delta rule in chunks of GDN_CHUNK tokens, a block of
# GDN_CHUNK_THREADS threads per (value head, GDN_COLS state columns). Prompts of at least
# DELTA_CHUNKED_MIN_TOKENS tokens go there (the delta_chunked option): one chunk, below which
# the chunked kernel has no state steps to save.
GDN_CHUNK, GDN_CHUNK_THREADS, GDN_COLS = (define("delta_chunked.cu", n)
                                          for n in ("GDN_CHUNK", "GDN_CHUNK_THREADS", "GDN_COLS"))
DELTA_CHUNKED_MIN_TOKENS = GDN_CHUNK


def launched_kernels() -> list[tuple[str, str]]:
    ks = [("ssm.cu", "unary"), ("ssm.cu", "delta_net_gates"), ("ssm.cu", "ssm_conv")]
    ks += [("ssm.cu", f"gated_delta_net_{d}") for d in GDN_HEAD_DIMS]
    ks += [("delta_chunked.cu", f"gated_delta_net_chunked_{d}") for d in GDN_HEAD_DIMS]
    return ks


def gdn_threads(d: int) -> int:
    """Threads per block of gated_delta_net_<d> (its __launch_bounds__)."""
    return GDN_ROWS * max(1, d // GDN_PART)


def gdn_chunked_smem(d: int) -> int:
    """Bytes of dynamic shared memory of gated_delta_net_chunked_<d> (GDN_CHUNK_SMEM_FLOATS)."""
    C = GDN_CHUNK
    return 4 * (2 * C * (d + 1) + d * (GDN_COLS + 1) + 2 * C * (C + 1) + C * GDN_COLS
                + 3 * C + GDN_CHUNK_THREADS)


def unary(b, x, what: str):
    """sigmoid, softplus or silu of x, elementwise."""
    x = f32(x, what)
    y = b._out(x.shape)
    if x.size:
        b.launch("ssm.cu", "unary", grid_1d(x.size, UNARY_THREADS), UNARY_THREADS, x, y,
                 params=pack("UnaryParams", n=x.size, op=UNARY_OPS[what]))
    return y


def delta_net_gates(b, beta, alpha, dt_bias, a):
    """base.delta_net_gates (sigmoid; add, softplus, mul) in one launch, the same bits; another
    layout than [T, H] projections with [H] vectors goes through the composition."""
    beta, alpha = f32(beta, "delta_net_gates beta"), f32(alpha, "delta_net_gates alpha")
    bias, av = f32(dt_bias.dense, "delta_net_gates dt_bias"), f32(a.dense, "delta_net_gates a")
    H = alpha.shape[-1] if alpha.ndim else 0
    if beta.shape != alpha.shape or bias.shape != (H,) or av.shape != (H,):
        return Backend.delta_net_gates(b, beta, alpha, dt_bias, a)
    beta_out, g = b._out(beta.shape), b._out(alpha.shape)
    if alpha.size:
        b.launch("ssm.cu", "delta_net_gates", grid_1d(alpha.size, UNARY_THREADS), UNARY_THREADS, beta, alpha, bias, av,
                 beta_out, g, params=pack("DeltaGatesParams", n=alpha.size, n_heads=H))
    return beta_out, g


def state(a, shape: tuple, what: str):
    """A recurrent state the kernel updates in place: it must be that array itself."""
    if not (isinstance(a, cupy.ndarray) and a.dtype == F32 and a.flags.c_contiguous and a.shape == shape):
        raise BrassError(f"{what}: the state must be a contiguous float32 device array of "
                         f"shape {shape}, got {getattr(a, 'shape', type(a).__name__)}")
    return a


def real_rows(b, n_real):
    """The device word the kernels read the real row count from (module docstring)."""
    if n_real is None:
        return b._all_rows
    if not (isinstance(n_real, cupy.ndarray) and n_real.dtype == cupy.int32 and n_real.size == 1):
        raise BrassError(f"n_real must be one device int32, got {getattr(n_real, 'shape', type(n_real).__name__)}")
    return n_real


def ssm_conv(b, x, conv_state, w, n_real=None, silu=False):
    """The causal conv1d with its carried window; silu: its output through silu, as unary's."""
    x = f32(x, "ssm_conv")
    if x.ndim != 2 or not isinstance(w, CudaWeight) or w.type != GGMLType.F32 or len(w.shape) != 2:
        raise BrassError(f"ssm_conv: expected x [T, C] and an F32 weight (C, K), got x "
                         f"{x.shape} and {getattr(w, 'name', w)}")
    T, C = x.shape
    if w.shape[0] != C or not 2 <= w.shape[1] <= SSM_CONV_TOKENS + 1:
        raise BrassError(f"ssm_conv: weight {w.name} has shape {w.shape}, x has {C} channels "
                         f"(the kernel takes windows of 2 to {SSM_CONV_TOKENS + 1} taps)")
    K = w.shape[1]
    state(conv_state, (K - 1, C), "ssm_conv")
    y = b._out((T, C))
    if T and C:
        grid = (-(-C // SSM_CONV_THREADS), -(-T // SSM_CONV_TOKENS))
        b.launch("ssm.cu", "ssm_conv", grid, SSM_CONV_THREADS, x, conv_state, w.data, y, real_rows(b, n_real),
                 params=pack("SsmConvParams", n_tokens=T, n_channels=C, kernel=K, silu=int(silu)))
    return y


def gdn_args(q, k, v, g, beta, st):
    """The checked float32 inputs of gated_delta_net and (T, Hv, Hk, D)."""
    q, k, v = f32(q, "gated_delta_net q"), f32(k, "gated_delta_net k"), f32(v, "gated_delta_net v")
    g, beta = f32(g, "gated_delta_net g"), f32(beta, "gated_delta_net beta")
    if v.ndim != 3 or q.shape != k.shape or q.ndim != 3 or q.shape[0] != v.shape[0] \
            or q.shape[2] != v.shape[2]:
        raise BrassError(f"gated_delta_net: q {q.shape}, k {k.shape}, v {v.shape} do not "
                         f"match ([T, Hk, D] and [T, Hv, D])")
    T, Hv, D = v.shape
    Hk = q.shape[1]
    if Hv % Hk or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise BrassError(f"gated_delta_net: {Hv} value heads over {Hk} key heads, g "
                         f"{g.shape}, beta {beta.shape}")
    if D not in GDN_HEAD_DIMS:
        raise UnsupportedError(f"gated_delta_net: state size {D} is not supported on the "
                               f"cuda backend (supported: {', '.join(map(str, GDN_HEAD_DIMS))})")
    state(st, (Hv, D, D), "gated_delta_net")
    return q, k, v, g, beta, (T, Hv, Hk, D)


def gated_delta_net(b, q, k, v, g, beta, st, n_real=None):
    """The delta rule over T tokens: in chunks for a prompt of a chunk or more (the
    delta_chunked option, and the chunked kernel's shared memory fits), else token by token."""
    q, k, v, g, beta, (T, Hv, Hk, D) = gdn_args(q, k, v, g, beta, st)
    if b.options.delta_chunked and T >= DELTA_CHUNKED_MIN_TOKENS and gdn_chunked_smem(D) <= b.smem_optin_limit:
        return _chunked(b, q, k, v, g, beta, st, T, Hv, Hk, D, n_real)
    out = b._out((T, Hv, D))
    if T:
        b.launch("ssm.cu", f"gated_delta_net_{D}", (Hv, D // GDN_ROWS), gdn_threads(D), q, k, v, g, beta, st, out,
                 real_rows(b, n_real), params=pack("GatedDeltaNetParams", n_tokens=T, n_v_heads=Hv, n_k_heads=Hk, head_dim=D))
    return out


def gated_delta_net_chunked(b, q, k, v, g, beta, st, n_real=None):
    """gated_delta_net by the chunked kernel whatever the option and T say (the tests call it
    directly): the same checks, contract and state update."""
    q, k, v, g, beta, (T, Hv, Hk, D) = gdn_args(q, k, v, g, beta, st)
    return _chunked(b, q, k, v, g, beta, st, T, Hv, Hk, D, n_real)


def _chunked(b, q, k, v, g, beta, st, T, Hv, Hk, D, n_real=None):
    out = b._out((T, Hv, D))
    if T:
        b.launch("delta_chunked.cu", f"gated_delta_net_chunked_{D}", (Hv, D // GDN_COLS), GDN_CHUNK_THREADS,
                 q, k, v, g, beta, st, out, real_rows(b, n_real),
                 params=pack("GatedDeltaNetParams", n_tokens=T, n_v_heads=Hv, n_k_heads=Hk, head_dim=D),
                 smem=gdn_chunked_smem(D))
    return out
