"""The `brass` command line as a user runs it (a subprocess): JSON shapes (snapshots: ours to
define), tokens against llama.cpp's goldens, and a one-line error with exit status 2 for
every bad input — never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conformance import goldens, tolerances
from brass.backends import cuda_available

BACKENDS = ["numpy", pytest.param("cuda", marks=pytest.mark.skipif(
    not cuda_available(), reason="CUDA backend: no GPU on this machine"))]


def brass(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "brass", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def _shape(obj):
    """The JSON's structure with values replaced by their type names (for snapshots)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(obj[0])] if obj else []
    return type(obj).__name__


@pytest.mark.skipif(not cuda_available(), reason="CUDA backend: no GPU on this machine")
@pytest.mark.parametrize("name", [m.name for m in goldens.models() if m.arch in ("qwen35", "qwen35moe", "gemma4")])
def test_generate_on_cuda_runs_the_seed_catalog(name):
    """`brass generate MODEL --backend cuda` runs the hybrids and Gemma 4 (their kernels and
    forward are held to the oracle and the goldens by test_kernels*.py and test_models.py)."""
    r = brass("generate", goldens.model(name).path(), "--backend", "cuda", "--prompt", "The harbour",
              "--max-tokens", 8, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text generated"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["smollm2-135m", "synth-qwen3moe"])
def test_generate_gives_llama_cpp_tokens(name, backend, real_model_path):
    """`brass generate MODEL --prompt TEXT --max-tokens 16 --temperature 0 --json`: the
    prompt tokens are llama.cpp's, and the generated tokens equal llama.cpp's greedy tokens
    up to its first near-tie (tolerances.STREAM_EPS)."""
    gm = goldens.model(name)
    model = real_model_path(name) if gm.kind == "real" else gm.path()
    p = goldens.prompts(name)[0]
    r = brass("generate", model, "--prompt", p.text, "--max-tokens", 16, "--temperature", 0,
              "--backend", backend, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == backend and out["text"]
    assert out["prompt_tokens"] == p.prompt_ids
    eps = tolerances.STREAM_EPS[gm.kind]
    margin = np.minimum(p.step_top_logits[:16, 0] - p.step_top_logits[:16, 1],
                        p.tf_margin[len(p.prompt_ids) - 1:][:16])
    n = int(np.argmax(margin < eps)) if (margin < eps).any() else 16
    assert n >= 4, f"near-tie at token {n}: too early to compare anything"
    assert out["tokens"][:n] == p.generated_ids[:n]
    assert len(out["tokens"]) == 16 or p.stop == "eog"


def test_generate_json_shape(snapshot):
    r = brass("generate", goldens.model("synth-llama").path(), "--prompt", "a", "--max-tokens", 2,
              "--temperature", 0, "--backend", "numpy", "--json")
    assert r.returncode == 0, r.stderr
    assert _shape(json.loads(r.stdout)) == snapshot


def test_tokenize_text_and_jsonl(real_model_path, tmp_path, snapshot):
    cases = [c for c in goldens.tokenizer_cases("smollm2") if c["add_special"] and c["parse_special"]]
    path = real_model_path("smollm2-135m")
    r = brass("tokenize", path, "--text", cases[5]["text"], "--add-special", "--parse-special", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"tokens": cases[5]["ids"]}
    lines = tmp_path / "strings.jsonl"
    lines.write_text("".join(json.dumps(c["text"]) + "\n" for c in cases), encoding="utf-8")
    r = brass("tokenize", path, "--jsonl", lines, "--add-special", "--parse-special")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert got == [c["ids"] for c in cases]


def test_score_is_teacher_forcing(snapshot):
    """`brass score` prints, per position, the top-k [id, logit] predicting the next token:
    its argmax agrees with llama.cpp's teacher-forced pass where the margin is clear."""
    gm = goldens.model("synth-llama")
    p = goldens.prompts(gm.name)[1]
    r = brass("score", gm.path(), "--tokens", json.dumps(p.tf_ids), "--top-k", 4,
              "--backend", "numpy", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert _shape(out) == snapshot
    assert out["tokens"] == p.tf_ids and len(out["top_k"]) == len(p.tf_ids)
    top1 = np.array([row[0][0] for row in out["top_k"]])
    clear = p.tf_margin > tolerances.ARGMAX_EPS[("cpu", gm.kind)]
    assert clear.sum() > 10 and (top1[clear] == p.tf_argmax[clear]).all()
    logits = np.array([[v for _, v in row] for row in out["top_k"]])
    assert (np.diff(logits, axis=1) <= 0).all()


BAD_INPUTS = {
    "unknown-model": ["generate", "no-such-model", "--prompt", "x", "--json"],
    "missing-file": ["generate", "/nonexistent/model.gguf", "--prompt", "x"],
    "negative-max-tokens": ["generate", "{synth}", "--prompt", "x", "--max-tokens", "-3"],
    "negative-temperature": ["generate", "{synth}", "--prompt", "x", "--temperature", "-1"],
    "beyond-context": ["generate", "{synth}", "--prompt", "x", "--max-tokens", "100000"],
    "empty-prompt-no-bos": ["generate", "{synth_nobos}", "--prompt", "", "--max-tokens", "4"],
    "not-a-gguf": ["generate", "{notgguf}", "--prompt", "x"],
    "token-out-of-range": ["score", "{synth}", "--tokens", "[1, 2, 99999999]"],
    "tokens-not-json": ["score", "{synth}", "--tokens", "not json"],
    "tokens-not-ints": ["score", "{synth}", "--tokens", "[1, 2.5]"],
    "tokens-empty": ["score", "{synth}", "--tokens", "[]"],
    "top-k-zero": ["score", "{synth}", "--tokens", "[1, 2]", "--top-k", "0"],
    "tokenize-no-input": ["tokenize", "{synth}"],
    "jsonl-not-strings": ["tokenize", "{synth}", "--jsonl", "{badjsonl}"],
    "jsonl-missing": ["tokenize", "{synth}", "--jsonl", "/nonexistent/strings.jsonl"],
    "max-tokens-zero": ["generate", "{synth}", "--prompt", "x", "--max-tokens", "0"],
    "seed-below-minus-one": ["generate", "{synth}", "--prompt", "x", "--seed", "-2"],
    "serve-port-out-of-range": ["serve", "{synth}", "--port", "99999"],
    "serve-port-negative": ["serve", "{synth}", "--port", "-1"],
    "run-beyond-context": ["run", "{synth}", "hi", "--max-tokens", "100000"],
    "model-is-a-directory": ["generate", "{tmpdir}", "--prompt", "x"],
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_error(case, tmp_path, snapshot):
    args = BAD_INPUTS[case]
    notgguf = tmp_path / "notgguf.gguf"
    notgguf.write_bytes(b"this is not a model" * 10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"not": "a string"}\n')
    fill = {"{synth}": str(goldens.model("synth-llama").path()), "{notgguf}": str(notgguf),
            "{synth_nobos}": str(goldens.model("synth-qwen3moe").path()), "{badjsonl}": str(bad),
            "{tmpdir}": str(tmp_path) + "/"}
    r = brass(*[fill.get(a, a) for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    # the error is one line, the last; before it only progress bars (e.g. weight upload)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("brass: error: ")]
    assert len(lines) == 1 and r.stderr.strip().splitlines()[-1] == lines[0], r.stderr
    msg = lines[0].replace(str(tmp_path), "<tmp>")
    assert msg == snapshot
    # Nothing is printed before an input is known to be good (run echoes its prompt after).
    assert r.stdout == "", r.stdout


def test_version():
    from brass import __version__
    r = brass("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"brass {__version__}"


def test_help_shows_the_defaults():
    r = brass("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for default in ("default: 128", "default: 0.8", "default: 40", "default: 0.95", "default: 0.05",
                    "-1 or unset: random", "The three most useful things"):
        assert default in text, f"{default!r} missing from brass run --help"


def test_eog_ends_the_stream_and_is_not_printed(real_model_path):
    """The golden stream that llama.cpp ended with end-of-generation (qwen2.5-coder-0.5b's
    chat prompt): Brass ends at exactly the same token, reports stop "eog", and prints none of
    that token's text (llama.cpp's CLI prints nothing for it)."""
    name = "qwen2.5-coder-0.5b"
    prompts = [p for p in goldens.prompts(name) if p.stop == "eog"]
    assert prompts, "the goldens hold no stream that ends in end-of-generation"
    p = prompts[0]
    n = len(p.generated_ids)
    margin = np.minimum(p.step_top_logits[:n, 0] - p.step_top_logits[:n, 1],
                        p.tf_margin[len(p.prompt_ids) - 1:][:n])
    assert (margin >= tolerances.NUMPY_STREAM_EPS).all(), "a near-tie: the stream is not a fair check"
    model = real_model_path(name)
    r = brass("generate", model, "--prompt", p.text, "--max-tokens", 32, "--temperature", 0,
              "--backend", "numpy", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == p.generated_ids, "the stream does not end where llama.cpp's ended"
    assert out["stop"] == "eog"
    eog_text = goldens_tokenizer_piece(model, p.generated_ids[-1])
    assert eog_text and eog_text not in out["text"]
    t = out["timings"]
    assert t["prompt_n"] == len(p.prompt_ids) and t["predicted_n"] == len(p.generated_ids) - 1
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    r = brass("generate", model, "--prompt", p.text, "--max-tokens", 32, "--temperature", 0,
              "--backend", "numpy")
    assert r.returncode == 0 and eog_text not in r.stdout
    assert out["text"] in r.stdout and "tok/s" in r.stderr
    # The Python API ends the stream there too: the end-of-generation token is the last one.
    import brass as api         # (a plain `import brass` made the CLI helper brass() a local)
    m = api.load(model, backend="numpy", quiet=True)
    assert list(m.generate(p.prompt_ids, 32, api.SamplingParams(temperature=0))) == p.generated_ids


def goldens_tokenizer_piece(model, token_id: int) -> str:
    from brass.gguf import GGUFFile
    from brass.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(model)).decode([token_id])


def test_models_lists_the_catalog():
    r = brass("models")
    assert r.returncode == 0
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"):
        assert name in r.stdout
    assert "\narchitectures: llama, qwen2, qwen3, qwen3moe, gemma3, qwen35, qwen35moe, gemma4\n" in r.stdout


@pytest.mark.parametrize("tty", [True, False], ids=["stderr-terminal", "stderr-pipe"])
def test_progress_follows_stderr_not_json(monkeypatch, tty):
    """Download and upload progress goes to stderr whenever stderr is a terminal, --json or
    not (it never mixes with stdout), and stays out of pipes and logs."""
    from brass import cli, model
    seen = {}

    class FakeModel:
        def __init__(self, name, backend=None, n_ctx=None, quiet=False):
            seen["quiet"] = quiet

    monkeypatch.setattr(model, "Model", FakeModel)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    for json_flag in (True, False):
        args = cli.build_parser().parse_args(["generate", "m.gguf", "--prompt", "x"] + (["--json"] if json_flag else []))
        cli._load(args)
        assert seen["quiet"] is (not tty)
