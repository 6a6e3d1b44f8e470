"""The gated delta rule over a prompt in chunks: matrix products instead of a loop over tokens.

llama.cpp runs a prompt through its fused GATED_DELTA_NET op, one token after another, and the
numpy backend's `gated_delta_net` does the same (its goldens are recorded that way). A GPU
cannot afford that loop for a 512-token prompt: this is the chunked form (Yang et al., "Gated
Delta Networks", 2024; llama.cpp's unused build_delta_net_chunking) that a tensor-core prefill
kernel computes, written out in numpy as that kernel's twin and checked against the
sequential op (conformance/models/test_delta_net.py).

Within a chunk of n tokens starting from state S (Dk × Dv), with γ_t the cumulative sum of the
log-decays g and Γ_t = exp(γ_t):

    δ = (I + A)⁻¹ B,  A[s, r] = β_s exp(γ_s − γ_r) k_sᵀk_r  (r < s),  B_s = β_s (v_s − Γ_s Sᵀk_s)
    o_t = (Γ_t Sᵀq_t + Σ_{s ≤ t} exp(γ_t − γ_s) (k_sᵀq_t) δ_s) / sqrt(D)
    S ← Γ_n S + Σ_s exp(γ_n − γ_s) k_s δ_sᵀ

which unrolls S_t = exp(g_t) S_{t-1} + k_t δ_tᵀ, δ_t = β_t (v_t − exp(g_t) S_{t-1}ᵀ k_t), the
sequential rule. Only differences of γ are exponentiated (g ≤ 0, so every factor is ≤ 1).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
CHUNK = 64


def gated_delta_net_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same contract as Backend.gated_delta_net (q, k [T, Hk, D]; v [T, Hv, D]; g, beta [T, Hv];
    state [Hv, D, D] holding Sᵀ, updated in place; value head h reads key head h % Hk), in
    float32 matrix products over chunks of `chunk` tokens."""
    q, k, v = (np.asarray(a, F32) for a in (q, k, v))
    g, beta = np.asarray(g, F32), np.asarray(beta, F32)
    T, Hv, D = v.shape
    head = np.arange(Hv) % q.shape[1]
    scale = F32(1) / np.sqrt(F32(D))
    S = np.ascontiguousarray(state.transpose(0, 2, 1))          # [Hv, Dk, Dv]
    out = np.empty((T, Hv, D), F32)
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        n = sl.stop - sl.start
        K = k[sl][:, head].transpose(1, 0, 2)                   # [Hv, n, D]
        Q = q[sl][:, head].transpose(1, 0, 2)
        V = v[sl].transpose(1, 0, 2)
        b = beta[sl].T                                          # [Hv, n]
        G = np.cumsum(g[sl], axis=0, dtype=F32).T               # [Hv, n]
        diff = G[:, :, None] - G[:, None, :]                    # γ_t − γ_s  [Hv, t, s]
        causal = np.tril(np.ones((n, n), bool))
        decay = np.where(causal, np.exp(np.where(causal, diff, 0)), 0).astype(F32)
        strict = np.tril(np.ones((n, n), bool), -1)
        A = np.where(strict, b[:, :, None] * decay * (K @ K.transpose(0, 2, 1)), 0).astype(F32)
        B = b[:, :, None] * (V - np.exp(G)[:, :, None] * (K @ S))
        delta = np.empty_like(B)
        for s in range(n):                                      # forward substitution, (I + A) δ = B
            delta[:, s] = B[:, s] - np.einsum("hr,hrd->hd", A[:, s, :s], delta[:, :s])
        O = np.exp(G)[:, :, None] * (Q @ S) + (decay * (Q @ K.transpose(0, 2, 1))) @ delta  # noqa: E741 (the name the kernel and the math use)
        out[sl] = (O * scale).transpose(1, 0, 2)
        tail = np.exp(G[:, -1:] - G)                            # exp(γ_n − γ_s)  [Hv, n]
        S = np.exp(G[:, -1])[:, None, None] * S + (K * tail[:, :, None]).transpose(0, 2, 1) @ delta
    state[...] = S.transpose(0, 2, 1)
    return out
