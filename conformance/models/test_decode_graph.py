"""Decode steps replayed from a captured CUDA graph give what the eager path gives, on every
synthetic model (dense, MoE, sliding window, every weight type the kernels support).

The graph holds the same kernels with the same inputs as an eager step, so the comparison is
exact: the same tokens and bit-identical logits, not a tolerance. Also checked: greedy decoding
that runs ahead on the device stops where the consumer stops (the session's position stays
right for what follows), and two sessions keep their graphs apart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from brass.backends import cuda_available

pytestmark = pytest.mark.skipif(
    not cuda_available(),
    reason="no CUDA device here: decode-graph checks run on the GPU runner (ci/gpu.sh suite)")

SYNTH = Path(__file__).resolve().parents[2] / "golden" / "models"
MODELS = sorted(p.stem for p in SYNTH.glob("synth-*.gguf"))
N_GEN = 40          # more than two greedy chunks, so that chunks run ahead of the host


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    import brass
    from brass import arch
    from brass.gguf import GGUFFile
    gf = GGUFFile(SYNTH / f"{request.param}.gguf")
    name = gf.architecture
    gf.close()
    if "cuda" not in arch.backends(name):
        pytest.skip(f"{name} is not yet supported on the cuda backend")
    return brass.load(str(SYNTH / f"{request.param}.gguf"), backend="cuda", quiet=True)


def prompt(model, rng, n=9):
    return [int(t) for t in rng.integers(0, model.config.n_vocab, n)]


def eager_session(model, n_ctx=128):
    s = model.new_session(n_ctx)
    s.graphs = False
    return s


def test_graph_decode_logits_equal_eager(model, rng):
    ids = prompt(model, rng)
    follow = [int(t) for t in rng.integers(0, model.config.n_vocab, 6)]
    runs = []
    for graphs in (False, True):
        s = model.new_session(128)
        s.graphs = graphs
        s.prefill(ids)
        runs.append([model.backend.to_numpy(s.decode(t)).copy() for t in follow])
        assert s.n_past == len(ids) + len(follow)
    for i, (e, g) in enumerate(zip(*runs)):
        assert np.array_equal(e, g), f"decode step {i}: graph logits differ from eager ones " \
                                     f"(max |diff| {np.abs(e - g).max():.3g})"


def test_graph_greedy_tokens_equal_eager(model, rng):
    from brass.sampling import SamplingParams
    ids = prompt(model, rng)
    greedy = SamplingParams(temperature=0.0)
    eager = list(model.generate(ids, N_GEN, greedy, stop_at_eog=False, session=eager_session(model)))
    graph = list(model.generate(ids, N_GEN, greedy, stop_at_eog=False, session=model.new_session(128)))
    assert len(eager) == len(graph) == N_GEN
    assert graph == eager, f"graph tokens part from eager ones at {next(i for i, (a, b) in enumerate(zip(graph, eager)) if a != b)}"


def test_greedy_stops_where_the_consumer_stops(model, rng):
    ids = prompt(model, rng)
    s = model.new_session(128)
    first = int(model.backend.to_numpy(model.backend.argmax(s.prefill(ids, device_logits=True)))[-1])
    gen = s.greedy(first, 30)
    got = [next(gen) for _ in range(13)]          # the device has run ahead by then
    gen.close()
    assert s.n_past == len(ids) + 13
    # Continuing from there (eagerly) matches one uninterrupted eager run.
    more = list(s.greedy(got[-1], 5))
    e = eager_session(model)
    e.prefill(ids)
    want = list(e.greedy(first, 18))
    assert got + more == want


def test_two_sessions_keep_their_graphs_apart(model, rng):
    from brass.sampling import SamplingParams
    greedy = SamplingParams(temperature=0.0)
    a_ids, b_ids = prompt(model, rng), prompt(model, rng, 5)
    want_a = list(model.generate(a_ids, 12, greedy, stop_at_eog=False, session=eager_session(model)))
    want_b = list(model.generate(b_ids, 12, greedy, stop_at_eog=False, session=eager_session(model)))
    ga = model.generate(a_ids, 12, greedy, stop_at_eog=False, session=model.new_session(64))
    gb = model.generate(b_ids, 12, greedy, stop_at_eog=False, session=model.new_session(64))
    got_a, got_b = [], []
    for ta, tb in zip(ga, gb):                     # interleaved, as the server runs requests
        got_a.append(ta)
        got_b.append(tb)
    assert (got_a, got_b) == (want_a, want_b)


def test_sampled_decode_through_the_graph_matches_eager(model, rng):
    from brass.sampling import SamplingParams
    ids = prompt(model, rng)
    p = SamplingParams(temperature=0.9, top_k=20, seed=1234)
    eager = list(model.generate(ids, 16, p, stop_at_eog=False, session=eager_session(model)))
    graph = list(model.generate(ids, 16, p, stop_at_eog=False, session=model.new_session(128)))
    assert graph == eager
