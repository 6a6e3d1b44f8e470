"""Damaged and inconsistent model files: each one either loads and runs or fails with one
BrassError naming the key or tensor, what was expected and what the file has (engine/validate.py)
— never a KeyError from the forward pass, a ValueError from a mat-mul, or a hang.

The fuzz mutates the synthetic models in golden/models/ (the mutations are in
conformance/harness/gguf_mutations.py; ci/fuzz_load.py runs them by the hundred thousand over
several processes)."""

import signal
from collections import Counter
from pathlib import Path

import pytest

from conformance.harness import gguf_mutations
from brass.errors import BrassError, GGUFError, UnsupportedError

MODELS = Path(__file__).resolve().parents[2] / "golden" / "models"
# ~7 ms a file here: a few thousand files in well under a minute on a 2-core runner.
N_FUZZ = 8000
# A file that takes longer than this is hung (the normal time is a few milliseconds).
CASE_LIMIT_S = 10.0


class Hung(Exception):
    pass


def _hung(signum, frame):
    raise Hung(f"still running after {CASE_LIMIT_S:g} s")


def test_fuzz_load_gives_success_or_brass_error(rng, tmp_path, record_property):
    seed = int(rng.integers(2**32))
    counts: Counter = Counter()
    failures = []
    previous = signal.signal(signal.SIGALRM, _hung)
    try:
        for case in range(N_FUZZ):
            # Hung is an Exception: check() reports it as "other", with the traceback of
            # where the file was stuck.
            signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
            try:
                kind, detail = gguf_mutations.check(seed, case, tmp_path)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            counts[kind] += 1
            if kind == "other":
                failures.append(f"{detail}\nreplay: python ci/fuzz_load.py --seed {seed} "
                                f"--case {case}")
    finally:
        signal.signal(signal.SIGALRM, previous)
    record_property("fuzz_counts", dict(counts))
    print(f"fuzz seed {seed}: {dict(counts)}")
    assert not failures, f"{len(failures)} of {N_FUZZ} mutated files raised something other " \
                         f"than BrassError; the first:\n" + "\n\n".join(failures[:3])
    # Both outcomes are common, or the mutations test nothing.
    assert counts["ok"] > N_FUZZ // 10 and counts["brass"] > N_FUZZ // 10, counts


# -- targeted: the message names the key or tensor, what was expected, what the file has --------

def _error(tmp_path, data: bytes, kind=BrassError) -> str:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    with pytest.raises(kind) as e:
        gguf_mutations.run(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


def _model(name: str) -> bytes:
    return (MODELS / f"synth-{name}.gguf").read_bytes()


def test_the_unmutated_models_run(tmp_path):
    for path in sorted(MODELS.glob("*.gguf")):
        gguf_mutations.run(path)


def test_missing_tensor_is_named(tmp_path):
    data = gguf_mutations.rename_tensor(_model("llama"), "blk.0.ffn_up.weight", "blk.0.ffn_uq.weight")
    msg = _error(tmp_path, data, GGUFError)
    assert "tensor blk.0.ffn_up.weight is missing; llama needs it with shape " \
           "[256 (embedding_length), 256 (feed_forward_length)]" in msg


@pytest.mark.parametrize("model, edit, expected", [
    # the metadata disagrees with the tensors
    ("qwen3", ("qwen3.attention.head_count", 2),
     "tensor blk.0.attn_q.weight has shape [256, 256], expected [256 (embedding_length), "
     "128 (head_count × key_length)]"),
    ("llama", ("llama.feed_forward_length", 512),
     "tensor blk.0.ffn_up.weight has shape [256, 256], expected [256 (embedding_length), "
     "512 (feed_forward_length)]"),
    ("qwen3moe", ("qwen3moe.expert_feed_forward_length", 32),
     "tensor blk.0.ffn_up_exps.weight has shape [256, 64, 8], expected [256 (embedding_length), "
     "32 (expert_feed_forward_length), 8 (expert_count)]"),
    ("gemma3", ("gemma3.attention.key_length", 32),
     "tensor blk.0.attn_q.weight has shape [256, 256], expected [256 (embedding_length), "
     "128 (head_count × key_length)]"),
    # a tensor disagrees with the metadata
    ("llama", ("ne[1] of tensor blk.1.attn_k.weight", 64),
     "tensor blk.1.attn_k.weight has shape [256, 64], expected [256 (embedding_length), "
     "128 (head_count_kv × key_length)]"),
    ("qwen3", ("ne[0] of tensor blk.0.attn_q_norm.weight", 32),
     "tensor blk.0.attn_q_norm.weight has shape [32], expected [64 (key_length)]"),
])
def test_shape_disagreeing_with_metadata_is_named(tmp_path, model, edit, expected):
    msg = _error(tmp_path, gguf_mutations.set_value(_model(model), *edit), GGUFError)
    assert expected in msg, msg


def test_swapped_tensors_are_named(tmp_path):
    data = gguf_mutations.rename_tensor(_model("llama"), "blk.0.attn_q.weight", "blk.0.attn_X.weight")
    data = gguf_mutations.rename_tensor(data, "blk.0.attn_k.weight", "blk.0.attn_q.weight")
    data = gguf_mutations.rename_tensor(data, "blk.0.attn_X.weight", "blk.0.attn_k.weight")
    assert "tensor blk.0.attn_q.weight has shape [256, 128], expected [256 (embedding_length), " \
           "256 (head_count × key_length)]" in _error(tmp_path, data, GGUFError)


@pytest.mark.parametrize("model, key, value, expected", [
    ("qwen3moe", "qwen3moe.expert_used_count", 0,
     "metadata key qwen3moe.expert_used_count is 0, expected in [1, expert_count = 8]"),
    ("qwen3moe", "qwen3moe.expert_used_count", 9,
     "metadata key qwen3moe.expert_used_count is 9, expected in [1, expert_count = 8]"),
    ("qwen3moe", "qwen3moe.expert_count", 0,
     "metadata key qwen3moe.expert_count is 0 (or missing), expected >= 1"),
    ("qwen3moe", "qwen3moe.expert_count", 4,
     "tensor blk.0.ffn_gate_inp.weight has shape [256, 8], expected [256 (embedding_length), "
     "4 (expert_count)]"),
    ("llama", "llama.block_count", 0, "metadata key llama.block_count is 0, expected >= 1"),
    ("llama", "llama.block_count", 2**31 - 1,
     "metadata key llama.block_count is 2147483647, expected <= 21"),
    ("llama", "llama.block_count", 3, "tensor blk.2.attn_norm.weight is missing"),
    ("qwen3", "qwen3.attention.head_count", 0,
     "metadata key qwen3.attention.head_count is 0, expected >= 1"),
    ("qwen3", "qwen3.attention.head_count_kv", 3,
     "metadata key qwen3.attention.head_count_kv is 3, expected a divisor of "
     "attention.head_count (4)"),
    ("llama", "llama.attention.head_count_kv", 2**32 - 1,
     "metadata key llama.attention.head_count_kv is 4294967295, expected a divisor"),
    ("gemma3", "gemma3.attention.key_length", 0,
     "metadata key gemma3.attention.key_length is 0, expected >= 1"),
    ("gemma3", "gemma3.attention.head_count_kv", 0,
     "metadata key gemma3.attention.head_count_kv is 0, expected a divisor"),
    ("llama", "llama.context_length", 0, "metadata key llama.context_length is 0, expected >= 1"),
    ("llama", "llama.embedding_length", 0, "metadata key llama.embedding_length is 0, expected >= 1"),
    ("llama", "llama.rope.freq_base", float("nan"),
     "metadata key llama.rope.freq_base is nan, expected a finite number > 0"),
    ("qwen3", "qwen3.attention.layer_norm_rms_epsilon", -1.0,
     "metadata key qwen3.attention.layer_norm_rms_epsilon is -1.0, expected a finite number >= 0"),
])
def test_count_out_of_range_is_named(tmp_path, model, key, value, expected):
    msg = _error(tmp_path, gguf_mutations.set_value(_model(model), key, value), GGUFError)
    assert expected in msg, msg


def test_odd_rope_dimensions_are_named(tmp_path):
    """rope turns pairs of dimensions: an odd count (here from a key_length of 63 with no
    rope.dimension_count key) cannot be rotated."""
    data = gguf_mutations.set_value(_model("llama"), "llama.attention.key_length", 63)
    assert "metadata key llama.rope.dimension_count is 63, expected an even number in " \
           "[2, attention.key_length = 63]" in _error(tmp_path, data, GGUFError)


def test_unsupported_tensor_type_is_named(tmp_path):
    data = gguf_mutations.set_value(_model("llama"), "type of tensor blk.0.ffn_up.weight", 10)  # Q2_K
    msg = _error(tmp_path, data, UnsupportedError)
    assert "tensor blk.0.ffn_up.weight has type Q2_K, which Brass does not run" in msg, msg


@pytest.mark.parametrize("where", ["header", "tokens", "tensor directory", "data", "last byte"])
def test_truncated_file_is_named(tmp_path, where):
    data = _model("qwen3")
    lay = gguf_mutations.layout(data)
    cut = {"header": 20, "tokens": lay.keys[-5].pos - 1000, "tensor directory": lay.header_end - 10,
           "data": (lay.header_end + len(data)) // 2, "last byte": len(data) - 1}[where]
    msg = _error(tmp_path, data[:cut], GGUFError)
    assert "truncated" in msg, msg


def test_backends_support_the_same_types():
    """The load-time check uses the numpy backend's list of types (the CUDA backend cannot be
    imported without CuPy); the CUDA backend must run the same ones."""
    pytest.importorskip("cupy")
    from brass import quants
    from brass.backends.cuda import backend
    assert set(backend.SUPPORTED_TYPES) == set(quants.SUPPORTED_TYPES)
