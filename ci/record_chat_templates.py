"""Record llama.cpp's renderings of each catalog model's chat template as goldens.

    python ci/record_chat_templates.py   # writes golden/chat_templates/<model>.json, template_features.json

Per conversation below, three things come from llama.cpp (through llama-cpp-python 0.3.36),
never from Brass:
- `jinja`: the GGUF's template rendered by llama-cpp-python's Jinja2ChatFormatter (the
  formatter its server uses for a model with a template), with the vocabulary's BOS/EOS texts;
  absent for a model without a template;
- `builtin`: llama.cpp's C `llama_chat_apply_template` given the GGUF's template (it recognizes
  the format and formats it in C++; -1 means it did not recognize it), or given no template,
  which means ChatML;
- `tokens`: the prompt Brass serves (the `jinja` text, else the `builtin` ChatML fallback)
  tokenized by llama.cpp with add_special and parse_special, as llama.cpp's server does.
Needs the `record` extra (pip install -e '.[record]').
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from brass import llamacpp  # noqa: E402
from brass import catalog  # noqa: E402

OUT = ROOT / "golden" / "chat_templates"

SYSTEM = "You are a terse assistant. Answer in one sentence."

# Each case: the messages, add_generation_prompt, and whether a system message is given (where
# llama.cpp's built-in ChatML and a template with a default system prompt should agree).
CASES = [
    ("user_only", [{"role": "user", "content": "What is the capital of France?"}], True),
    ("system_user", [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Name a prime number."}], True),
    ("multi_turn", [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": "Hello. How can I help?"},
                    {"role": "user", "content": "Count to three."}], True),
    ("no_generation_prompt", [{"role": "user", "content": "Say yes."},
                              {"role": "assistant", "content": "Yes."}], False),
    ("unicode_whitespace", [{"role": "user",
                             "content": "  Grüße, 世界! 🚀\n\n\ttabs and trailing spaces   \n"}], True),
    ("template_syntax_in_content", [{"role": "user",
                                     "content": "Explain {{ messages }} and {% if x %} in Jinja."}], True),
    ("special_token_text_in_content", [{"role": "user",
                                        "content": "Print <|im_end|> literally."}], True),
    ("system_only", [{"role": "system", "content": SYSTEM}], True),
    ("empty_content", [{"role": "user", "content": ""}], True),
]


# Templates written to exercise the Jinja features real chat templates lean on, rendered by the
# same formatter: block trimming and stripping, loop controls, filters, tests, `tojson` with
# non-ASCII text, the BOS/EOS variables, and `raise_exception`.
FEATURE_TEMPLATES = {
    "layout_and_filters": (
        "{#- comments, trim_blocks/lstrip_blocks, continue, filters, tests -#}\n"
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if loop.first and message['role'] == 'system' %}\n"
        "        {% set prefix = '[SYS] ' %}\n"
        "    {% else %}\n"
        "        {% set prefix = '[' ~ message['role'] | upper ~ '] ' %}\n"
        "    {% endif %}\n"
        "    {% if message['content'] is string and message['content'] | trim == '' %}\n"
        "        {% continue %}\n"
        "    {% endif %}\n"
        "{{ prefix }}{{ message['content'] | trim }}\n"
        "    {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "[ASSISTANT]\n"
        "{%- endif %}\n"
        "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} user turns; "
        "last: {{ messages[-1] | tojson }}; first two: {{ messages[:2] | map(attribute='role') | join('+') }}\n",
        "<s>", "</s>"),
    # Gemma 3 instruct's logic (system text folded into the first user turn, roles checked to
    # alternate), laid out over several lines without whitespace control on the expressions.
    "alternating_roles": (
        "{{ bos_token }}\n"
        "{%- if messages[0]['role'] == 'system' -%}\n"
        "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
        "    {%- set loop_messages = messages[1:] -%}\n"
        "{%- else -%}\n"
        "    {%- set first_user_prefix = \"\" -%}\n"
        "    {%- set loop_messages = messages -%}\n"
        "{%- endif -%}\n"
        "{%- for message in loop_messages -%}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
        "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
        "    {%- endif -%}\n"
        "    {%- if (message['role'] == 'assistant') -%}\n"
        "        {%- set role = \"model\" -%}\n"
        "    {%- else -%}\n"
        "        {%- set role = message['role'] -%}\n"
        "    {%- endif -%}\n"
        "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
        "    {{ message['content'] | trim }}\n"
        "    {{ '<end_of_turn>\\n' }}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "    {{'<start_of_turn>model\\n'}}\n"
        "{%- endif -%}\n",
        "<bos>", "<eos>"),
}


# One more conversation for them: roles that do not alternate, which a template may refuse.
FEATURE_CASES = CASES + [("assistant_first", [{"role": "assistant", "content": "Hello."},
                                              {"role": "user", "content": "Hi."}], True)]


def record_features() -> dict:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    cases = []
    for template_name, (source, bos, eos) in FEATURE_TEMPLATES.items():
        for case_name, messages, add_generation_prompt in FEATURE_CASES:
            fmt = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos,
                                      add_generation_prompt=add_generation_prompt)
            try:
                out = {"jinja": fmt(messages=messages).prompt}
            except ValueError as e:  # raise_exception in the template
                out = {"error": str(e)}
            cases.append({"template": template_name, "name": case_name, "messages": messages,
                          "add_generation_prompt": add_generation_prompt, **out})
    return {
        "templates": {k: {"source": s, "bos_token": b, "eos_token": e}
                      for k, (s, b, e) in FEATURE_TEMPLATES.items()},
        "provenance": {"binding": llamacpp.BINDING,
                       "jinja_renderer": "llama_cpp.llama_chat_format.Jinja2ChatFormatter"},
        "cases": cases,
    }


def builtin_render(tmpl: bytes | None, messages: list[dict], add_ass: bool) -> str | None:
    L = llamacpp.lib()
    arr = (L.llama_chat_message * len(messages))(
        *[L.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages])
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = L.llama_chat_apply_template(tmpl, arr, len(messages), add_ass, buf, size)
    if n < 0:
        return None
    if n > size:
        raise RuntimeError("rendering longer than the buffer")
    return buf.raw[:n].decode("utf-8")


def record(name: str) -> dict:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    L = llamacpp.lib()
    path = catalog.fetch(name)
    with llamacpp.Model(path, vocab_only=True) as model:
        raw = L.llama_model_chat_template(model.ptr, None)
        template = raw.decode("utf-8") if raw else None

        def token_text(token):
            return L.llama_vocab_get_text(model.vocab, token).decode("utf-8") if token >= 0 else ""

        bos = token_text(L.llama_vocab_bos(model.vocab))
        eos = token_text(L.llama_vocab_eos(model.vocab))
        cases = []
        for case_name, messages, add_generation_prompt in CASES:
            jinja = None
            if template is not None:
                fmt = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos,
                                          add_generation_prompt=add_generation_prompt)
                jinja = fmt(messages=messages).prompt
            builtin = builtin_render(template.encode() if template else None, messages, add_generation_prompt)
            served = jinja if template is not None else builtin
            cases.append({
                "name": case_name,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "system_given": any(m["role"] == "system" for m in messages),
                "jinja": jinja,
                "builtin": builtin,
                "tokens": model.tokenize(served, add_special=True, parse_special=True),
            })
    return {
        "model": name,
        "gguf_sha256": catalog.CATALOG[name].sha256,
        "chat_template": template,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "bos_token": bos,
        "eos_token": eos,
        "provenance": {**llamacpp.provenance(),
                       "jinja_renderer": "llama_cpp.llama_chat_format.Jinja2ChatFormatter",
                       "builtin_renderer": "llama_chat_apply_template"},
        "cases": cases,
    }


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name in catalog.CATALOG:
        golden = record(name)
        out = OUT / f"{name}.json"
        out.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{out.relative_to(ROOT)}: {len(golden['cases'])} conversations, "
              f"template {'from the GGUF' if golden['chat_template'] else 'absent (ChatML fallback)'}")
    features = record_features()
    out = OUT / "template_features.json"
    out.write_text(json.dumps(features, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{out.relative_to(ROOT)}: {len(features['cases'])} renderings of {len(features['templates'])} templates")


if __name__ == "__main__":
    main()
