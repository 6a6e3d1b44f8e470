"""The gated delta-net (qwen35, qwen35moe): the numpy reference's recurrent ops against plain
float64 formulas on fresh random inputs, and the recurrent state carried from one call to the
next in whole models (a prompt split into pieces, decode after prefill, a reset session).

The formulas are llama.cpp's (b11312: ggml-cpu/ops.cpp gated_delta_net and ssm_conv,
src/models/delta-net-base.cpp), written out as loops: value head h reads key/query head
h mod Hk (tiled), S ← exp(g)·S; δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq / sqrt(D).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conformance.harness import goldens
from brass.backends.base import Backend
from brass.backends.numpy_backend import NumpyBackend
from brass.errors import UnsupportedError
from brass.model import Model
from conformance.harness.fakes import ReplayingNumpy

b = NumpyBackend()
HYBRID = [m.name for m in goldens.models() if m.arch in ("qwen35", "qwen35moe")]


def unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def delta_rule_f64(q, k, v, g, beta, S0):
    """Per token and value head, in float64; S0[h] is S_h (not transposed)."""
    T, Hv, D = v.shape
    Hk = q.shape[1]
    S = S0.astype(np.float64).copy()
    out = np.zeros((T, Hv, D))
    for t in range(T):
        for h in range(Hv):
            j = h % Hk
            S[h] *= math.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ k[t, j])
            S[h] += np.outer(k[t, j], delta)
            out[t, h] = S[h].T @ q[t, j] / math.sqrt(D)
    return out, S


@pytest.mark.parametrize("T, Hk, Hv, D", [(1, 1, 1, 8), (7, 2, 4, 16), (9, 2, 6, 8), (5, 3, 6, 32)])
def test_gated_delta_net_matches_formula(rng, T, Hk, Hv, D):
    q = unit_rows(rng.normal(size=(T, Hk, D))).astype(np.float32)
    k = unit_rows(rng.normal(size=(T, Hk, D))).astype(np.float32)
    v = rng.normal(size=(T, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.05, 1.5, size=(T, Hv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(T, Hv)).astype(np.float32)
    S0 = rng.normal(size=(Hv, D, D)).astype(np.float32)       # a state carried in
    state = np.ascontiguousarray(S0.transpose(0, 2, 1))         # stored as llama.cpp: Sᵀ per head
    out = b.gated_delta_net(q, k, v, g, beta, state)
    ref, S = delta_rule_f64(q, k, v, g, beta, S0)
    assert out.shape == (T, Hv, D) and out.dtype == np.float32
    # float32 dot products of length D over a few steps: ~1e-6 relative
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(state, S.transpose(0, 2, 1), rtol=1e-4, atol=1e-5 * np.abs(S).max())


def test_gated_delta_net_in_pieces_equals_whole(rng):
    """The state the op leaves is the state it starts from next time: 3 + 1 + 4 tokens give
    what 8 give at once."""
    T, Hk, Hv, D = 8, 2, 4, 16
    q, k = (unit_rows(rng.normal(size=(T, Hk, D))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.05, 1.5, size=(T, Hv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(T, Hv)).astype(np.float32)
    whole_state = np.zeros((Hv, D, D), np.float32)
    whole = b.gated_delta_net(q, k, v, g, beta, whole_state)
    state = np.zeros((Hv, D, D), np.float32)
    parts = [b.gated_delta_net(q[s], k[s], v[s], g[s], beta[s], state)
             for s in (slice(0, 3), slice(3, 4), slice(4, 8))]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(state, whole_state)


@pytest.mark.parametrize("T", [1, 2, 6])
def test_ssm_conv_matches_formula(rng, T):
    C, K = 12, 4
    w = rng.normal(size=(C, K)).astype(np.float32)
    x = rng.normal(size=(T, C)).astype(np.float32)
    state = rng.normal(size=(K - 1, C)).astype(np.float32)
    X = np.concatenate([state, x]).astype(np.float64)
    ref = np.array([[sum(X[t + i, c] * w[c, i] for i in range(K)) for c in range(C)] for t in range(T)])
    out = b.ssm_conv(x, state, _Dense(w))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, X[T:].astype(np.float32))   # the last K-1 inputs


def test_elementwise_ops_match_formulas(rng):
    x = (rng.normal(size=(5, 40)) * 8).astype(np.float32)
    x[0, :3] = [25.0, -30.0, 20.5]                      # softplus is x itself above 20
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(b.sigmoid(x), 1 / (1 + np.exp(-x64)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(b.silu(x), x64 / (1 + np.exp(-x64)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(b.softplus(x), np.where(x64 > 20, x64, np.log1p(np.exp(x64))),
                               rtol=1e-6, atol=1e-6)
    assert b.softplus(x)[0, 0] == np.float32(25.0)
    eps = 1e-6
    y = x.reshape(5, 4, 10)
    ref = y / np.sqrt((y.astype(np.float64) ** 2).sum(axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(b.l2_norm(y, eps), ref, rtol=1e-6)
    # eps is inside the square root: a zero row stays zero, a tiny one is damped by it
    tiny = np.full((1, 10), 1e-4, np.float32)
    np.testing.assert_allclose(b.l2_norm(tiny, 1e-6), 1e-4 / math.sqrt(1e-7 + 1e-6), rtol=1e-5)
    z = rng.normal(size=(5, 4, 10)).astype(np.float32)
    w = rng.normal(size=10).astype(np.float32)
    rms = y / np.sqrt((y.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(b.rms_norm_gated(y, _Dense(w), z, eps),
                               rms * w * z / (1 + np.exp(-z.astype(np.float64))), rtol=1e-5, atol=1e-6)


def test_backend_without_the_ops_refuses_in_one_line():
    class Bare(NumpyBackend):
        name = "bare"
    bare = Bare()
    for op, args in (("sigmoid", (np.zeros(2),)), ("gated_delta_net", (None,) * 6),
                     ("ssm_conv", (None,) * 3)):
        with pytest.raises(UnsupportedError, match=f"^the bare backend has no {op} op") as e:
            getattr(Backend, op)(bare, *args)
        assert "\n" not in str(e.value)


class _Dense:
    """A float32 array standing in for a prepared weight."""

    def __init__(self, a):
        self.a = a

    def dense(self):
        return self.a


# -- whole models: the state is carried and reset -------------------------------------------------

@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request):
    return Model(goldens.model(request.param).path(), backend="numpy", quiet=True)


def _ids(model, rng, n):
    return [int(t) for t in rng.integers(0, model.config.n_vocab, n)]


# A prompt run in pieces does the same per-token arithmetic as in one piece, except that a
# mat-mul of one row sums in another order than one of several (~1e-7 relative). An activation
# near a Q8 rounding boundary turns that into a whole quantization step, and these small random
# models amplify it: over 300 random prompts x 13 positions the worst logits NMSE was 4.8e-3
# (argmax disagreements only below a margin of 1.0). A state that is not carried from one piece
# to the next gives NMSE ~2.5, and 250 of those positions disagree.
CARRY_NMSE = 5e-2
CARRY_MARGIN = 1.0
# A MoE router takes its top-k experts, and where two experts' router logits nearly tie, that
# rounding can pick the other one: the token's logits then differ by far more than CARRY_NMSE,
# and through the recurrent state so do the next tokens' (synth-qwen35moe, seed 1190637255:
# position 9 of 13, layer 2, top logits 0.0087 apart, NMSE 0.12; seed 1236: layer 1 at
# position 9, 0.003 apart, then layer 2 there too, NMSE 0.33, and 2-3e-2 after it). Over 300
# random prompts the two runs' router logits differed by at most 0.18 where every expert
# agreed so far, and 3 of 3,900 positions took others. So a prompt whose routing parts is
# drawn again (at most TRIES prompts), once its first parting is shown to be such a tie:
# router logits within ROUTER_DIFF (about 3x that 0.18). A state not carried from piece to
# piece parts the routing with router logits ~2 apart (checked).
ROUTER_DIFF = 0.5
TRIES = 3


def _close(a, b, what):
    err = float(((a.astype(np.float64) - b) ** 2).sum() / (b.astype(np.float64) ** 2).sum())
    assert err <= CARRY_NMSE, f"{what}: logits NMSE {err:.3g}"
    top2 = np.sort(b)[-2:]
    assert top2[1] - top2[0] < CARRY_MARGIN or a.argmax() == b.argmax(), what


def _routes(store, offset=0):
    """A trace callback that keeps each position's router logits and experts by MoE layer."""
    def keep(name, x):
        if name.startswith(("ffn_moe_logits-", "ffn_moe_topk-")):
            a = np.asarray(x)
            for i in range(a.shape[0]):
                store[(offset + i, name)] = a[i]
    return keep


def _routing_parts(whole, part, positions) -> bool:
    """Whether the two runs took other experts at any of the positions (in any MoE layer);
    the first such (position, layer) checked to be a near tie: router logits within
    ROUTER_DIFF. Later ones follow from it and are not checked."""
    for t in positions:
        for name in sorted((n for (pos, n) in whole if pos == t and n.startswith("ffn_moe_topk-")),
                           key=lambda n: int(n.rsplit("-", 1)[1])):
            if set(whole[(t, name)].tolist()) != set(part[(t, name)].tolist()):
                logits = name.replace("topk", "logits")
                diff = float(np.abs(whole[(t, logits)] - part[(t, logits)]).max())
                assert diff <= ROUTER_DIFF, f"position {t}, {name}: other experts, router logits {diff:.3g} apart"
                return True
    return False


def test_decode_after_prefill_equals_one_prefill(hybrid, rng):
    """Prefill N tokens then decode one gives the logits of a single prefill of N + 1."""
    for _ in range(TRIES):
        ids = _ids(hybrid, rng, 11)
        whole_routes, step_routes = {}, {}
        whole = hybrid.new_session(32).prefill(ids, all_logits=True, trace=_routes(whole_routes))
        s = hybrid.new_session(32)
        s.prefill(ids[:10], trace=_routes(step_routes))
        got = hybrid.backend.to_numpy(s.decode(ids[10]))[-1]
        # the decode step's experts, from a twin session: numpy's decode is this one-token prefill
        twin = hybrid.new_session(32)
        twin.prefill(ids[:10])
        twin.prefill(ids[10:], trace=_routes(step_routes, 10))
        if not _routing_parts(whole_routes, step_routes, range(11)):
            _close(got, whole[-1], "decode of token 10")
            return
    pytest.fail(f"the routing parted in each of {TRIES} random prompts")


def test_prompt_in_pieces_equals_whole(hybrid, rng):
    """Pieces shorter and longer than the conv window (K - 1 = 3 rows of state) in a row."""
    for _ in range(TRIES):
        ids = _ids(hybrid, rng, 13)
        whole_routes, piece_routes, pieces = {}, {}, []
        whole = hybrid.new_session(32).prefill(ids, all_logits=True, trace=_routes(whole_routes))
        s = hybrid.new_session(32)
        start = 0
        for n in (5, 1, 2, 1, 4):
            pieces.append((start, s.prefill(ids[start:start + n], all_logits=True,
                                            trace=_routes(piece_routes, start))))
            start += n
        if _routing_parts(whole_routes, piece_routes, range(len(ids))):
            continue
        for start, got in pieces:
            for i in range(len(got)):
                _close(got[i], whole[start + i], f"position {start + i} (piece of {len(got)})")
        return
    pytest.fail(f"the routing parted in each of {TRIES} random prompts")


def test_reset_zeroes_the_state(hybrid, rng):
    a, c = _ids(hybrid, rng, 9), _ids(hybrid, rng, 6)
    fresh = hybrid.new_session(32).prefill(c)
    s = hybrid.new_session(32)
    s.prefill(a)
    s.reset()
    np.testing.assert_array_equal(s.prefill(c), fresh)


def test_kv_cache_only_for_attention_layers(hybrid):
    s = hybrid.new_session(16)
    cfg = hybrid.config
    for il in range(cfg.n_layer):
        k, v = s.cache.layer(il)
        assert (k is None) == cfg.is_recurrent(il) == (v is None)
    rs = s.cache.recurrent
    assert rs.layers == [il for il in range(cfg.n_layer) if cfg.is_recurrent(il)]
    conv, ssm = rs.layer(rs.layers[0])
    assert conv.shape == (cfg.ssm_d_conv - 1, cfg.ssm_conv_channels)
    assert ssm.shape == (cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_state)
    assert conv.dtype == ssm.dtype == np.float32


@pytest.mark.parametrize("name", HYBRID)
def test_generate_cli_on_numpy(name):
    """`brass generate MODEL --backend numpy` greedily: llama.cpp's tokens for the same prompt."""
    path = goldens.model(name).path()
    p = next(p for p in goldens.prompts(name) if p.name == "digits")
    r = subprocess.run([sys.executable, "-m", "brass", "generate", str(path), "--backend", "numpy",
                        "--prompt", p.text, "--max-tokens", "8", "--temperature", "0", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["backend"] == "numpy" and doc["prompt_tokens"] == p.prompt_ids
    margin = p.step_top_logits[:8, 0] - p.step_top_logits[:8, 1]
    n = int(np.argmax(margin < 0.25)) if (margin < 0.25).any() else 8     # up to a near-tie
    assert n >= 4 and doc["tokens"][:n] == p.generated_ids[:n]


# -- configuration: which layers are recurrent, what a file may not say ----------------------------

def _config(name: str, **changes):
    """qwen35's config from a committed file's metadata with `changes` (key suffix → value,
    None deletes the key)."""
    from types import SimpleNamespace

    from brass import arch as arch_registry
    from brass.config import read_config
    from brass.gguf import GGUFFile
    gf = GGUFFile(goldens.model(name).path())
    a = gf.architecture
    md = dict(gf.metadata)
    for key, value in changes.items():
        if value is None:
            md.pop(f"{a}.{key}", None)
        else:
            md[f"{a}.{key}"] = value
    view = SimpleNamespace(metadata=md, tensors=gf.tensors, path=gf.path)
    return arch_registry.get(a).configure(read_config(view, a), view)


def test_recurrent_layer_pattern():
    assert _config("synth-qwen35").recurrent_layers == [True, True, True, False]      # default 4
    assert _config("synth-qwen35moe").recurrent_layers == [True, False, True]         # interval 2
    cfg = _config("synth-qwen35", full_attention_interval=np.uint32(2))
    assert cfg.recurrent_layers == [True, False, True, False]
    # a per-layer array wins over the interval; block_count counts the MTP block, which the
    # main pass skips (llama.cpp: n_layer = block_count - nextn_predict_layers)
    cfg = _config("synth-qwen35", block_count=np.uint32(5), nextn_predict_layers=np.uint32(1),
                  full_attention_interval=np.uint32(2),
                  **{"attention.recurrent_layers": np.array([False, True, True, True, False])})
    assert (cfg.n_layer, cfg.n_layer_all) == (4, 5)
    assert cfg.recurrent_layers == [False, True, True, True]
    assert [cfg.is_recurrent(il) for il in range(4)] == [False, True, True, True]


@pytest.mark.parametrize("changes, error, message", [
    (dict(full_attention_interval=np.uint32(0)), "GGUFError", "full_attention_interval is 0, expected >= 1"),
    ({"rope.dimension_sections": None}, "GGUFError", "rope.dimension_sections is missing"),
    ({"rope.dimension_sections": np.array([0, 0, 0, 4], np.int32)}, "GGUFError", "one of the first three > 0"),
    # 3 t-pairs, no h or w: pairs 1, 2 of the 8 take the fourth stream (unrotated for text)
    ({"rope.dimension_sections": np.array([3, 0, 0, 0], np.int32)}, "UnsupportedError", "rope pairs [1, 2"),
    ({"ssm.time_step_rank": np.uint32(3)}, "GGUFError", "ssm.time_step_rank is 3, expected a multiple"),
    ({"ssm.inner_size": np.uint32(96)}, "GGUFError", "ssm.inner_size is 96, expected ssm.time_step_rank"),
    ({"attention.recurrent_layers": np.array([True, False])}, "GGUFError", "has 2 flags, expected block_count = 4"),
    ({"nextn_predict_layers": np.uint32(4)}, "GGUFError", "nextn_predict_layers is 4, expected in [0, block_count = 4)"),
])
def test_bad_hybrid_metadata_is_named(changes, error, message):
    import brass.errors
    with pytest.raises(getattr(brass.errors, error)) as e:
        _config("synth-qwen35", **changes)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_stopped_early_leaves_the_state_at_the_last_token(name, rng):
    """Greedy decoding on a graph backend issues steps ahead of the consumer; a consumer that
    stops early (an end-of-generation token) discards them. A KV cache does not mind (those
    slots are rewritten), a recurrent state would be advanced past the last token kept, and the
    next request on the session would continue from a wrong state (found on the H200: the
    continuation parted at its first token). Continuing after a stop must equal one run."""
    m = goldens.load_synthetic(name, "numpy")
    m.backend = ReplayingNumpy()
    ids = [int(t) for t in rng.integers(0, m.config.n_vocab, 12)]
    s = m.new_session(64)
    assert s.graphs
    first = int(np.argmax(s.prefill(ids)[-1]))
    gen = s.greedy(first, 20)
    got = [next(gen) for _ in range(5)]
    gen.close()
    assert s.n_past == len(ids) + 5
    more = list(s.greedy(got[-1], 4))
    e = m.new_session(64)
    e.graphs = False
    e.prefill(ids)
    assert got + more == list(e.greedy(first, 9))
