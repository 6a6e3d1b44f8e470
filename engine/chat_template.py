"""Chat templates: a GGUF's `tokenizer.chat_template` rendered with Jinja2.

The environment is the one Hugging Face transformers renders chat templates with, which
llama-cpp-python copies and llama.cpp's own Jinja engine imitates: a sandbox, `trim_blocks` and
`lstrip_blocks`, the loop-control extension, `raise_exception`, `strftime_now`, and a `tojson`
that keeps non-ASCII text as it is. `bos_token` and `eos_token` are the vocabulary's token texts.

A model without a template (Gemma 3 270M is a base model) gets ChatML, the fallback llama.cpp's
`llama_chat_apply_template` uses when it is given no template; `ChatTemplate.is_fallback` says
so, and the server and `brass chat` print it once. Such a model has no end-of-turn token for
ChatML's `<|im_end|>`, so it can only write it as text: `stop_strings` ends a reply there.
"""

from __future__ import annotations

from datetime import datetime
import json

from .errors import BrassError

# llama.cpp's built-in "chatml" format, written as a Jinja template.
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ChatTemplateError(BrassError):
    """The template does not compile, or refuses the conversation (`raise_exception`)."""


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """`ChatTemplate(source, bos_token, eos_token).render(messages)` → the prompt text.

    `messages` are dicts with string `role` and `content`, as OpenAI's chat API sends them."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.is_fallback = source is None
        self.source = CHATML if source is None else source
        self.stop_strings = ["<|im_end|>"] if self.is_fallback else []
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: line {e.lineno}: {e.message}") from None

    @classmethod
    def from_gguf(cls, gguf, tokenizer) -> "ChatTemplate":
        """The GGUF's own template, or ChatML when it has none."""
        tokens = gguf.get("tokenizer.ggml.tokens") or []

        def text(token_id):
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""

        return cls(gguf.get("tokenizer.chat_template"), text(tokenizer.bos_id), text(tokenizer.eos_id))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            # A template indexing messages[0] on an empty list, or adding a missing field: the
            # conversation does not have the shape the template expects.
            raise ChatTemplateError(f"the chat template failed on this conversation: "
                                    f"{type(e).__name__}: {e}") from None
