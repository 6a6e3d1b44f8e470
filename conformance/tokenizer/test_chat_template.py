"""Chat templates against llama.cpp's renderings of every catalog model's template
(golden/chat_templates/*.json, recorded by ci/record_chat_templates.py through
llama-cpp-python), and the properties any rendering must keep."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from brass import catalog
from brass.chat_template import CHATML, ChatTemplate, ChatTemplateError
from brass.gguf import GGUFFile

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "chat_templates"
FEATURES = json.loads((GOLDEN_DIR / "template_features.json").read_text(encoding="utf-8"))
GOLDENS = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(GOLDEN_DIR.glob("*.json"))
           if p.name != "template_features.json"}
CASES = [(name, i) for name, g in GOLDENS.items() for i in range(len(g["cases"]))]


def case_id(c):
    return f"{c[0]}-{GOLDENS[c[0]]['cases'][c[1]]['name']}"


@pytest.fixture(scope="module")
def loaded(real_model_path):
    """name → (GGUFFile, Tokenizer, ChatTemplate), each built once."""
    from brass.tokenizer import Tokenizer
    cache = {}

    def get(name):
        if name not in cache:
            gf = GGUFFile(real_model_path(name))
            tok = Tokenizer.from_gguf(gf)
            cache[name] = gf, tok, ChatTemplate.from_gguf(gf, tok)
        return cache[name]
    return get


def diff(a: str, b: str) -> str:
    return "\n".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "brass", "llama.cpp"))


def test_goldens_cover_the_catalog():
    assert set(GOLDENS) == set(catalog.CATALOG)


@pytest.mark.parametrize("name", GOLDENS)
def test_template_and_special_tokens_are_the_ggufs(loaded, name):
    g = GOLDENS[name]
    gf, tok, template = loaded(name)
    assert gf.get("tokenizer.chat_template") == g["chat_template"], "the GGUF's template changed: re-record"
    assert template.is_fallback == (g["chat_template"] is None)
    assert (template.bos_token, template.eos_token) == (g["bos_token"], g["eos_token"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rendering_matches_llamacpp(loaded, case):
    """The text Brass builds equals llama.cpp's: the Jinja rendering of the GGUF's template, or
    for a model without one the ChatML that llama_chat_apply_template falls back to."""
    name, i = case
    c = GOLDENS[name]["cases"][i]
    _, _, template = loaded(name)
    got = template.render(c["messages"], add_generation_prompt=c["add_generation_prompt"])
    want = c["jinja"] if c["jinja"] is not None else c["builtin"]
    assert got == want, diff(got, want)


@pytest.mark.parametrize("case", [c for c in CASES if GOLDENS[c[0]]["cases"][c[1]]["system_given"]
                                  or GOLDENS[c[0]]["chat_template"] is None], ids=case_id)
def test_rendering_matches_llamacpp_builtin_format(loaded, case):
    """llama.cpp's C formatter recognizes these templates as ChatML and ignores their default
    system prompts; with a system message given, its text and Brass's must be the same."""
    name, i = case
    c = GOLDENS[name]["cases"][i]
    _, _, template = loaded(name)
    got = template.render(c["messages"], add_generation_prompt=c["add_generation_prompt"])
    assert got == c["builtin"], diff(got, c["builtin"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prompt_tokens_match_llamacpp(loaded, case):
    """Rendered and tokenized with special tokens parsed and BOS added where the model wants it,
    as llama.cpp's server does: the very ids llama.cpp would prefill."""
    name, i = case
    c = GOLDENS[name]["cases"][i]
    _, tok, template = loaded(name)
    text = template.render(c["messages"], add_generation_prompt=c["add_generation_prompt"])
    assert tok.encode(text, add_special=True, parse_special=True) == c["tokens"]


@pytest.mark.parametrize("case", FEATURES["cases"], ids=lambda c: f"{c['template']}-{c['name']}")
def test_jinja_features_match_llamacpp(case):
    """Templates that lean on block trimming, loop controls, filters, tests, `tojson` and
    `raise_exception`: Brass renders them as llama-cpp-python's formatter does, or refuses the
    conversation with the template's own message."""
    t = FEATURES["templates"][case["template"]]
    template = ChatTemplate(t["source"], t["bos_token"], t["eos_token"])
    if "error" in case:
        with pytest.raises(ChatTemplateError, match=re.escape(case["error"])):
            template.render(case["messages"], case["add_generation_prompt"])
    else:
        got = template.render(case["messages"], case["add_generation_prompt"])
        assert got == case["jinja"], diff(got, case["jinja"])


# Characters that would break a renderer that evaluates, escapes, trims or re-encodes content.
ALPHABET = list("ab \n\t{}%#'\"\\<|>") + ["{{", "{%", "%}", "}}", "<|im_end|>", "é", "世", "🚀", "\u200b"]


def random_conversation(rng):
    n = int(rng.integers(1, 6))
    roles = ["system"] * bool(rng.integers(0, 2)) + ["user", "assistant"] * n
    return [{"role": r, "content": "".join(rng.choice(ALPHABET, size=int(rng.integers(0, 12))))}
            for r in roles[:int(rng.integers(1, len(roles) + 1))]]


@pytest.mark.parametrize("trial", range(50))
def test_content_passes_through_verbatim(trial, rng):
    """Random contents full of Jinja and special-token syntax come out exactly as ChatML
    places them: nothing evaluated, escaped, trimmed or dropped."""
    messages = random_conversation(rng)
    add = bool(rng.integers(0, 2))
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    want += "<|im_start|>assistant\n" if add else ""
    assert ChatTemplate(None).render(messages, add_generation_prompt=add) == want, messages


def test_chatml_fallback_is_llamacpps_builtin():
    """The fallback's text is the one llama.cpp's builtin ChatML produced for the Gemma goldens."""
    assert ChatTemplate(None).source == CHATML
    for c in GOLDENS["gemma3-270m"]["cases"]:
        assert ChatTemplate(None).render(c["messages"], c["add_generation_prompt"]) == c["builtin"]


BROKEN_TEMPLATES = {
    "syntax_error": ("{% for m in messages %}{{ m.content }", [{"role": "user", "content": "hi"}]),
    "raise_exception": ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start "
                        "with the user') }}{% endif %}", [{"role": "assistant", "content": "hi"}]),
    "sandbox_escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "hi"}]),
    "sandbox_mutation": ("{% set _ = messages.append({'role': 'user'}) %}", [{"role": "user", "content": "hi"}]),
    "no_messages": (GOLDENS["qwen2.5-coder-0.5b"]["chat_template"], []),
    "wrong_type_added": ("{{ messages[0].content + 1 }}", [{"role": "user", "content": "hi"}]),
}


@pytest.mark.parametrize("name", BROKEN_TEMPLATES)
def test_template_failures_are_clear_errors(name, snapshot):
    source, messages = BROKEN_TEMPLATES[name]
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render(messages)
    assert str(e.value) == snapshot
