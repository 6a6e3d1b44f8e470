"""Decode speed of the numpy reference backend on SmolLM2-135M (`brass run`'s default):
the issue asks for ≥ 10 tokens/s on the 2-core CI machine. One benchmark round generates
32 greedy tokens after a short prompt; the figure excludes loading and prefill."""

import time

import pytest

from brass import catalog
from brass.model import Model

MODEL = "smollm2-135m"
N_TOKENS = 32
MIN_TOKENS_PER_S = 10.0


@pytest.fixture(scope="module")
def model(conformance_gate):
    conformance_gate(MODEL, "numpy")
    return Model(catalog.fetch(MODEL, quiet=True), backend="numpy", quiet=True)


def test_decode_tokens_per_second(benchmark, model):
    prompt = model.tokenizer.encode("The capital of France is", add_special=True, parse_special=True)
    rates = []

    def run():
        s = model.new_session()
        logits = s.prefill(prompt, device_logits=True)
        t0 = time.perf_counter()
        tok = int(logits.argmax())
        for _ in range(N_TOKENS):
            tok = int(s.decode(tok)[-1].argmax())
        rates.append(N_TOKENS / (time.perf_counter() - t0))

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    best = max(rates)
    benchmark.extra_info["tokens_per_s"] = round(best, 2)
    print(f"numpy decode: {best:.1f} tok/s (rounds: {', '.join(f'{r:.1f}' for r in rates)})")
    assert best >= MIN_TOKENS_PER_S, f"{best:.1f} tok/s < {MIN_TOKENS_PER_S}"
