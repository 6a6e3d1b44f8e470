"""Fused ops (kernels/fused.cu), each defined in base.py by the ops it replaces: the residual
add with the norm after it (add_rms_norm, which also writes the Q8_1 blocks the next
mat-vecs read), Gemma 4's two MoE norms, the q/k norms, rope and cache writes of a layer
(rope_store), a MoE router's softmax and top-k (moe_route), and a decode step's token and
position on the device (decode_set, decode_advance)."""

from __future__ import annotations

import numpy as np

from ...errors import BrassError
from ..base import Weight
from . import quantize, rope, router
from .attention import no_direct_cache, paged, row_tables
from .common import F32, Q8_1_BLOCK_BYTES, f32, i32
from .compiler import define
from .params import pack

FUSED_NORM_THREADS = 1024
ROPE_STORE_THREADS = 128
# moe_route's block, read from the source so that a variant of the kernel compiled with
# another size (a tuning run's variant) is launched with its own
ROUTE_THREADS = define("fused.cu", "ROUTE_THREADS")
KERNELS = ("add_rms_norm", "moe_norms", "rope_store", "moe_route", "decode_advance", "decode_set")


def launched_kernels() -> list[tuple[str, str]]:
    return [("fused.cu", k) for k in KERNELS]


def add_rms_norm(b, a, r, w, eps, scale=None):
    """(s, rms_norm(s) * w) with s = (a + r) * scale (r, scale optional)."""
    a = f32(a, "add_rms_norm")
    if r is not None:
        r = f32(r, "add_rms_norm")
        if r.shape != a.shape:
            raise BrassError(f"add_rms_norm: {a.shape} and {r.shape} differ in shape")
    D = a.shape[-1]
    if w is None or tuple(w.shape) != (D,):
        raise BrassError(f"add_rms_norm: the weight must have shape ({D},)")
    sc = None
    if scale is not None:
        sc = f32(scale.dense if isinstance(scale, Weight) else scale, "add_rms_norm scale")
        if sc.size != 1:
            raise BrassError(f"add_rms_norm: the scale must be one value, got shape {sc.shape}")
    rows = a.size // D if D else 0
    s = b._out(a.shape) if r is not None or sc is not None else a
    y = b._out(a.shape)
    write_q8 = D % 32 == 0
    yq = b._out((rows, D // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else y
    if rows:
        b.launch("fused.cu", "add_rms_norm", rows, FUSED_NORM_THREADS, a, a if r is None else r,
                 w.dense, a if sc is None else sc, s, y, yq,
                 params=pack("AddNormParams", n_rows=rows, n_cols=D, eps=eps, has_residual=int(r is not None),
                             write_q8=int(write_q8), has_scale=int(sc is not None)))
        if write_q8:
            quantize.remember(b, y, yq)
    return s, y


def moe_norms(b, x, w, w_router, factor, eps):
    x = f32(x, "moe_norms")
    D = x.shape[-1]
    for v, what in ((w, "weight"), (w_router, "router weight")):
        if v is None or tuple(v.shape) != (D,):
            raise BrassError(f"moe_norms: the {what} must have shape ({D},)")
    rows = x.size // D if D else 0
    h, r = b._out(x.shape), b._out(x.shape)
    write_q8 = D % 32 == 0
    hq = b._out((rows, D // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else h
    if rows:
        b.launch("fused.cu", "moe_norms", rows, FUSED_NORM_THREADS, x, w.dense, w_router.dense, h, hq, r,
                 params=pack("MoeNormsParams", n_rows=rows, n_cols=D, eps=eps, factor=factor,
                             write_q8=int(write_q8)))
        if write_q8:
            quantize.remember(b, h, hq)
    return h, r


def _rope_store_checked(q, k, v, pos, k_cache, v_cache, q_norm, k_norm, n_rot, base):
    """rope_store's inputs checked: (q, k, v, pos, theta_scale)."""
    what = "rope_store"
    q, k, v = f32(q, f"{what} q"), f32(k, f"{what} k"), f32(v, f"{what} v")
    pos = i32(pos, f"{what} pos")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or pos.shape != (q.shape[0],):
        raise BrassError(f"{what}: expected q/k/v [T, H, Dh] and pos [T], got {q.shape}, "
                         f"{k.shape}, {v.shape}, {pos.shape}")
    T, H, Dh = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    if k.shape != (T, Hkv, Dh) or v.shape[:2] != (T, Hkv):
        raise BrassError(f"{what}: k {k.shape} / v {v.shape} do not match q {q.shape}")
    for cache, d in ((k_cache, Dh), (v_cache, Dv)):
        pool, _, _ = paged(cache, what)
        if pool.shape[2:] != (Hkv, d):
            raise BrassError(f"{what}: pool {pool.shape} does not hold rows of [{Hkv}, {d}]")
    if v_cache.cache is not k_cache.cache:
        raise BrassError(f"{what}: keys and values of different sequences")
    if n_rot % 2 or not 0 < n_rot <= Dh:
        raise BrassError(f"{what}: n_rot {n_rot} must be even and in (0, {Dh}]")
    for nw, which in ((q_norm, "q"), (k_norm, "k")):
        if nw is not None and tuple(nw.shape) != (Dh,):
            raise BrassError(f"{what}: the {which} norm weight must have shape ({Dh},)")
    return q, k, v, pos, rope.theta_scale(base, n_rot)


def rope_store(b, q, k, v, pos, k_cache, v_cache, *, q_norm, k_norm, eps, n_rot, base, neox,
               freq_scale=1.0, row_caches=None):
    """q/k norms, rope of both and the K/V cache writes in one kernel: the roped (q, k)."""
    q, k, v, pos, theta_scale = _rope_store_checked(q, k, v, pos, k_cache, v_cache, q_norm, k_norm, n_rot, base)
    T, H, Dh = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    q_out, k_out = b._out(q.shape), b._out(k.shape)
    kp, table, capacity = paged(k_cache, "rope_store")
    vp, _, _ = paged(v_cache, "rope_store")
    stride = 0
    if row_caches is None:
        no_direct_cache(b, "rope_store")
    else:
        rows = row_tables(b, row_caches, "rope_store")
        if rows is None:
            raise BrassError("rope_store: the rows' sequences are not in one block pool")
        kp, vp, table, stride, capacity = rows
    if T:
        b.launch("fused.cu", "rope_store", (H + 2 * Hkv, T), ROPE_STORE_THREADS,
                 q, k, v, q if q_norm is None else q_norm.dense, k if k_norm is None else k_norm.dense,
                 pos, q_out, k_out, kp, vp, table,
                 params=pack("RopeStoreParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=Dh,
                             head_dim_v=Dv, n_rot=n_rot, theta_scale=theta_scale,
                             freq_scale=freq_scale, neox=int(bool(neox)),
                             q_norm=int(q_norm is not None), k_norm=int(k_norm is not None),
                             eps=eps, capacity=capacity, write_k=1, per_row=int(row_caches is not None),
                             table_stride=stride),
                 smem=4 * Dh)
    return q_out, k_out


def moe_route(b, logits, k, norm, scale):
    x, E, R = router.rows(logits, "moe_route")
    if not 0 < k <= min(E, 64):
        raise BrassError(f"moe_route: k = {k} must be in [1, {min(E, 64)}]")
    probs = b._out(x.shape)
    ids = b._out((*x.shape[:-1], k), np.int32)
    weights = b._out((*x.shape[:-1], k), F32)
    if R:
        b.launch("fused.cu", "moe_route", R, ROUTE_THREADS, x, probs, ids, weights,
                 params=pack("MoeRouteParams", n_rows=R, n_experts=E, k=k, norm=int(bool(norm)),
                             scale=1.0 if scale in (0.0, 1.0) else scale))
    return probs, ids, weights


def decode_set(b, tok, pos, token: int, position: int):
    """tok[0] = token, pos[0] = position, queued on the stream (as launch parameters)."""
    b.launch("fused.cu", "decode_set", 1, 32, tok, pos,
             params=pack("DecodeSetParams", tok=int(token), pos=int(position)))


def decode_advance(b, next_ids, tok, pos, history):
    """Greedy step on the device: tok = next_ids[0], pos += 1, history[pos] = tok."""
    b.launch("fused.cu", "decode_advance", 1, 32, next_ids, tok, pos, history,
             params=pack("AdvanceParams", capacity=history.shape[0]))
