"""What an OpenAI-style request to `brass serve` may hold: the request bodies as pydantic models.

The models are the API's schema (served at /openapi.json, shown at /docs) and its validation.
Fields are checked in the order they are declared and the first wrong one is reported, in
words a client can act on (`'max_tokens' must be an integer, got a string`) and with OpenAI's
`param` and `code`: every field's validator raises `FieldError` (not a ValueError, so pydantic
does not collect it but lets it through at once), and `validate` turns it into an `APIError`.
Range checks that need the model (context length, vocabulary, sampling values) come after, in
engine/server.py's App.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt,
                      StrictStr, ValidationError, ValidationInfo, WrapValidator)

from .api import APIError, json_type
from .logprobs import MAX_TOP_LOGPROBS

# OpenAI accepts at most 4 stop sequences.
MAX_STOP = 4
# Prompts of one completion request at most (a batch: each is a job in the queue).
MAX_PROMPTS = 64
ROLES = ("system", "user", "assistant")


class FieldError(Exception):
    """A field of a request body is wrong. `where` is its path inside the body
    (`messages[0].role`); `text` says what is wrong and follows the quoted path in the message.
    Raised inside pydantic validation, which it stops at the first wrong field."""

    def __init__(self, where: str, text: str, code: str = "invalid_type", status: int = 400,
                 message: str | None = None):
        super().__init__(text)
        self.where, self.text, self.code, self.status = where, text, code, status
        self.message = message      # the whole message, where the usual form does not fit

    def inside(self, outer: str) -> "FieldError":
        sep = "" if not self.where or self.where.startswith("[") else "."
        return FieldError(outer + sep + self.where, self.text, self.code, self.status, self.message)

    def api_error(self) -> APIError:
        return APIError(self.status, self.message or f"'{self.where}' {self.text}", code=self.code,
                        param=self.where)


def check_text(s: str, where: str) -> str:
    """JSON's \\ud800 escapes can give a string no UTF-8 can hold: refuse it here, not deep in
    the tokenizer."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(where, f"holds an unpaired UTF-16 surrogate ({s[e.start]!r} at character "
                                f"{e.start}), which is not text", code="invalid_value") from None
    return s


# --------------------------------------------------------------------------------------------
# Field types: the JSON type in the schema, and the message when a value is not of it. Null is
# the same as absent, as OpenAI takes it.


def _typed(kind: str, finite: bool = False):
    def check(v, handler, info: ValidationInfo):
        if v is None:
            return None
        try:
            out = handler(v)
        except ValidationError:
            out = None
        if out is not None and finite:     # a number: as a float, which it must fit
            try:
                out = float(out)
            except OverflowError:
                raise FieldError(info.field_name, f"is an integer of {v.bit_length()} bits, beyond the range of a "
                                                 "number", code="invalid_value") from None
            if not math.isfinite(out):      # 1e999 in JSON reads as infinity
                raise FieldError(info.field_name, f"must be a finite number, got {v}", code="invalid_value")
        if out is None:
            raise FieldError(info.field_name, f"must be {kind}, got {json_type(v)}")
        if isinstance(out, str):
            check_text(out, info.field_name)
        return out
    return WrapValidator(check)


Integer = Annotated[StrictInt | None, _typed("an integer")]
Number = Annotated[StrictInt | StrictFloat | None, _typed("a number", finite=True)]
Boolean = Annotated[StrictBool | None, _typed("a boolean")]
String = Annotated[StrictStr | None, _typed("a string")]


def _unsupported(*unused, hint: str = ""):
    """A field of OpenAI's API or llama-server's that Brass does not implement and whose value
    changes the answer (a sampling or stopping parameter, a format, tools): absent, null or a
    value that means "not used" passes; any other is refused, since an answer that ignored it
    would be wrong. (Fields whose neglect changes nothing, `user` say, are not declared: they
    are ignored, and the reply names them; see `ignored_fields`.)"""
    def check(v, handler, info: ValidationInfo):
        if v is not None and v not in unused:
            raise FieldError(info.field_name, f"is not supported by Brass{hint}",
                             code="unsupported_parameter")
        return v
    return WrapValidator(check)


def _served_model(v, handler, info: ValidationInfo):
    name = _typed("a string").func(v, handler, info)
    served = (info.context or {}).get("model_id")
    if name is not None and served is not None and name != served:
        raise FieldError("model", "does not exist", code="model_not_found", status=404,
                         message=f"the model {name!r} does not exist; this server serves {served!r}")
    return name


def _stop(v, handler, info: ValidationInfo):
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop", f"must be a string or an array of strings, got {json_type(v)}")
    if len(stops) > MAX_STOP:
        raise FieldError("stop", f"holds {len(stops)} strings; at most {MAX_STOP} are allowed",
                         code="invalid_value")
    if any(s == "" for s in stops):
        raise FieldError("stop", "strings must not be empty", code="invalid_value")
    return [check_text(s, "stop") for s in stops]


def _stream_options(v, handler, info: ValidationInfo):
    if v is None or not info.data.get("stream"):
        return None         # only read with "stream": true, as before
    if not isinstance(v, dict):
        raise FieldError("stream_options", f"must be an object, got {json_type(v)}")
    try:
        return StreamOptions.model_validate(v)
    except FieldError as e:
        raise e.inside("stream_options") from None


def _max_tokens(v, handler, info: ValidationInfo):
    if info.data.get("max_completion_tokens") is not None:
        return None         # the newer name wins; the older one is not read
    return _typed("an integer").func(v, handler, info)


def _top_count(v, handler, info: ValidationInfo):
    """A number of alternatives a token's logprobs list: an integer in [0, MAX_TOP_LOGPROBS]
    (for completions' logprobs, false is off, as clients that send the chat form do)."""
    if v is False and info.field_name == "logprobs":
        return None
    n = _typed("an integer").func(v, handler, info)
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise FieldError(info.field_name, f"must be between 0 and {MAX_TOP_LOGPROBS}, got {n}",
                         code="invalid_value")
    return n


def _chat_logprobs(v, handler, info: ValidationInfo):
    if type(v) is int and v == 0:       # 0 for off, as completions' clients send it
        return False
    return _typed("a boolean").func(v, handler, info)


def _chat_top_logprobs(v, handler, info: ValidationInfo):
    n = _top_count(v, handler, info)
    if n is not None and not info.data.get("logprobs"):
        raise FieldError("top_logprobs", "needs 'logprobs': true", code="invalid_value")
    return n


def _echo(v, handler, info: ValidationInfo):
    return _typed("a boolean").func(v, handler, info)


# --------------------------------------------------------------------------------------------
# The request bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Boolean = Field(None, description="Send a last chunk with the token counts "
                                                     "(`usage`) and no choices.")


class _Request(BaseModel):
    """The fields both completion endpoints take, in the order they are checked."""

    model_config = ConfigDict(extra="ignore")
    # the body's fields this model does not read (set by App.prepare; see ignored_fields)
    _ignored: list[str] = PrivateAttr(default_factory=list)
    # the request's jobs, one per prompt (set by App.prepare)
    _jobs: list = PrivateAttr(default_factory=list)

    model: Annotated[StrictStr | None, WrapValidator(_served_model)] = Field(
        None, description="The served model's id (GET /v1/models); may be left out.")
    n: Annotated[int | None, _unsupported(1)] = Field(None, description="Only 1.")
    best_of: Annotated[int | None, _unsupported(1)] = Field(None, description="Only 1.")
    suffix: Annotated[str | None, _unsupported("")] = Field(None, description="Only empty.")
    logit_bias: Annotated[dict | None, _unsupported({})] = Field(None, description="Not supported.")
    frequency_penalty: Annotated[float | None, _unsupported(0)] = Field(
        None, description="Only 0; see repetition_penalty.")
    presence_penalty: Annotated[float | None, _unsupported(0)] = Field(
        None, description="Only 0; see repetition_penalty.")
    tools: Annotated[list | None, _unsupported([])] = Field(None, description="Not supported.")
    tool_choice: Annotated[Any, _unsupported("none")] = Field(None, description="Only \"none\".")
    functions: Annotated[list | None, _unsupported([])] = Field(None, description="Not supported.")
    function_call: Annotated[Any, _unsupported("none")] = Field(None, description="Only \"none\".")
    response_format: Annotated[dict | None, _unsupported({"type": "text"})] = Field(
        None, description="Only {\"type\": \"text\"}.")
    modalities: Annotated[Any, _unsupported(["text"])] = Field(None, description="Only [\"text\"].")
    audio: Annotated[Any, _unsupported()] = Field(None, description="Not supported.")
    web_search_options: Annotated[Any, _unsupported()] = Field(None, description="Not supported.")
    # llama-server's own sampling and stopping parameters, each with the value that disables it
    n_predict: Annotated[Any, _unsupported(-1, hint="; use max_tokens")] = Field(
        None, description="Only -1; use max_tokens.")
    repeat_penalty: Annotated[Any, _unsupported(1, hint="; use repetition_penalty")] = Field(
        None, description="Only 1; use repetition_penalty.")
    repeat_last_n: Annotated[Any, _unsupported(64)] = Field(
        None, description="Only 64: the repetition penalty looks at the last 64 tokens.")
    ignore_eos: Annotated[Any, _unsupported(False)] = Field(None, description="Only false.")
    min_keep: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    typical_p: Annotated[Any, _unsupported(1)] = Field(None, description="Only 1.")
    tfs_z: Annotated[Any, _unsupported(1)] = Field(None, description="Only 1.")
    top_n_sigma: Annotated[Any, _unsupported(-1)] = Field(None, description="Only -1.")
    mirostat: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    dynatemp_range: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    xtc_probability: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    dry_multiplier: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    samplers: Annotated[Any, _unsupported()] = Field(None, description="Not supported.")
    grammar: Annotated[Any, _unsupported("")] = Field(None, description="Only empty.")
    json_schema: Annotated[Any, _unsupported({})] = Field(None, description="Only {}.")
    n_probs: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    t_max_predict_ms: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    n_indent: Annotated[Any, _unsupported(0)] = Field(None, description="Only 0.")
    lora: Annotated[Any, _unsupported([])] = Field(None, description="Not supported.")
    chat_template_kwargs: Annotated[Any, _unsupported({})] = Field(None, description="Not supported.")
    stream: Boolean = Field(None, description="Send the reply as server-sent events, a chunk per "
                                              "piece of text, ending with `data: [DONE]`.")
    stream_options: Annotated[StreamOptions | None, WrapValidator(_stream_options)] = None
    max_completion_tokens: Integer = Field(None, description="Tokens to generate at most (default: "
                                                             "what fits in the context).")
    max_tokens: Annotated[StrictInt | None, WrapValidator(_max_tokens)] = Field(
        None, description="The older name of max_completion_tokens.")
    temperature: Number = Field(None, description="0 is greedy (default 0.8).")
    top_p: Number = Field(None, description="In (0, 1] (default 0.95).")
    top_k: Integer = Field(None, description="0 disables it (default 40).")
    min_p: Number = Field(None, description="In [0, 1] (default 0.05).")
    repetition_penalty: Number = Field(None, description="> 0; 1 disables it (default 1).")
    seed: Integer = Field(None, description="For sampling; -1 or absent is random.")
    stop: Annotated[str | list[str] | None, WrapValidator(_stop)] = Field(
        None, description=f"Up to {MAX_STOP} strings; the reply ends before the first to appear.")


class TextPart(BaseModel):
    type: str = Field(description='Only "text": Brass serves text.')
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(description="system, user or assistant.")
    content: str | list[TextPart] = Field(description="Text, or text parts (joined by newlines).")

    @classmethod
    def read(cls, m, where: str) -> dict:
        if not isinstance(m, dict):
            raise FieldError(where, f"must be an object, got {json_type(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise FieldError(f"{where}.role", f"must be a string, got {json_type(role)}")
        if role not in ROLES:
            raise FieldError(f"{where}.role", f"is {role!r}; Brass takes {', '.join(ROLES)}",
                             code="invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise FieldError(f"{where}.content[{j}]", 'must be {"type": "text", "text": string}; '
                                     "Brass serves text only", code="invalid_value")
                texts.append(part["text"])
            content = "\n".join(texts)      # llama.cpp's server joins a message's text parts so
        elif not isinstance(content, str):
            raise FieldError(f"{where}.content", f"must be a string or an array of text parts, got "
                                                 f"{json_type(content)}")
        return {"role": role, "content": check_text(content, f"{where}.content")}


def _messages(v, handler, info: ValidationInfo):
    if v is None:
        raise FieldError("messages", "is required", code="missing_field")
    if not isinstance(v, list) or not v:
        raise FieldError("messages", "must be a non-empty array, got "
                         + ("an empty array" if v == [] else json_type(v)))
    return [ChatMessage.read(m, f"messages[{i}]") for i, m in enumerate(v)]


def _one_prompt(v, where: str, n_vocab):
    if isinstance(v, str):
        return check_text(v, where)
    if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        if n_vocab is not None and not all(0 <= i < n_vocab for i in v):
            raise FieldError(where, f"token ids must be in [0, {n_vocab})", code="invalid_value")
        return list(v)
    return None


def _prompt(v, handler, info: ValidationInfo):
    if v is None:
        raise FieldError("prompt", "is required", code="missing_field")
    n_vocab = (info.context or {}).get("n_vocab")
    one = _one_prompt(v, "prompt", n_vocab)
    if one is not None:
        return one
    # a batch: a list of strings or of token-id lists (lm-eval sends them so)
    if isinstance(v, list) and v and any(isinstance(p, (str, list)) for p in v):
        if len(v) > MAX_PROMPTS:
            raise FieldError("prompt", f"holds {len(v)} prompts; at most {MAX_PROMPTS} are allowed",
                             code="invalid_value")
        out = []
        for i, p in enumerate(v):
            got = _one_prompt(p, f"prompt[{i}]", n_vocab)
            if got is None:
                raise FieldError(f"prompt[{i}]", f"must be a string or a non-empty array of token ids, "
                                                 f"got {json_type(p)}")
            out.append(got)
        if info.data.get("stream"):
            raise FieldError("prompt", "holds several prompts, which Brass does not stream; send "
                                       "them one a request, or without stream", code="unsupported_parameter")
        return Batch(out)
    raise FieldError("prompt", "must be a string, a non-empty array of token ids, or a non-empty "
                               f"array of either (a batch), got {json_type(v)}")


class Batch(list):
    """Several prompts of one completion request."""


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions"""

    model_config = ConfigDict(json_schema_extra={"required": ["messages"]})

    messages: Annotated[list[ChatMessage] | None, WrapValidator(_messages)] = Field(
        None, validate_default=True, description="The conversation so far; the reply continues it.")
    logprobs: Annotated[StrictBool | None, WrapValidator(_chat_logprobs)] = Field(None, description="true: each generated token's logprob (the log-softmax "
                                                "of the logits it was picked from, before penalties) in "
                                                "choices[].logprobs.content.")
    top_logprobs: Annotated[StrictInt | None, WrapValidator(_chat_top_logprobs)] = Field(
        None, description=f"0-{MAX_TOP_LOGPROBS}: the most likely alternatives at each token; needs "
                          "logprobs: true.")
    echo: Annotated[bool | None, _unsupported(False)] = Field(None, description="Only false.")


class CompletionRequest(_Request):
    """POST /v1/completions"""

    model_config = ConfigDict(json_schema_extra={"required": ["prompt"]})

    prompt: Annotated[str | list | None, WrapValidator(_prompt)] = Field(
        None, validate_default=True, description=f"Text, or token ids; or a batch: an array of up to "
                                                 f"{MAX_PROMPTS} of either (not with stream), one "
                                                 "choice each, with its index.")

    def prompts(self) -> list:
        """The prompts: one, or the batch's."""
        return list(self.prompt) if isinstance(self.prompt, Batch) else [self.prompt]
    logprobs: Annotated[StrictInt | None, WrapValidator(_top_count)] = Field(
        None, description=f"0-{MAX_TOP_LOGPROBS}: each token's logprob and this many most likely "
                          "alternatives, in OpenAI's legacy form (tokens, token_logprobs, top_logprobs, "
                          "text_offset).")
    echo: Annotated[StrictBool | None, WrapValidator(_echo)] = Field(
        None, description="true: the reply's text and logprobs begin with the prompt's (the first "
                          "token's logprob null); max_tokens may then be 0. Streamed: the prompt's text and "
                          "logprobs are the first chunk.")
    top_logprobs: Annotated[int | None, _unsupported(0, hint="; use logprobs")] = Field(
        None, description="Only 0; use logprobs.")


class TokenizeRequest(BaseModel):
    """POST /tokenize: llama-server's fields (content, add_special, with_pieces) or vLLM's
    (prompt, add_special_tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[StrictStr | None, WrapValidator(_served_model)] = Field(
        None, description="The served model's id (vLLM sends it); may be left out.")
    content: String = Field(None, description="The text (llama-server's name).")
    prompt: String = Field(None, description="The text (vLLM's name); one of content or prompt.")
    add_special: Boolean = Field(None, description="Add the model's BOS/EOS as it does for a prompt "
                                                   "(default: false, as llama-server).")
    add_special_tokens: Boolean = Field(None, description="vLLM's name of add_special (default there: true).")
    with_pieces: Boolean = Field(None, description="Give each token as {id, piece}: its text, or its "
                                                   "bytes where they are not UTF-8 alone.")

    def text(self) -> str:
        if self.content is None and self.prompt is None:
            raise FieldError("content", "is required (or vLLM's 'prompt')", code="missing_field").api_error()
        return self.content if self.content is not None else self.prompt


def _token_ids(v, handler, info: ValidationInfo):
    if v is None:
        raise FieldError("tokens", "is required", code="missing_field")
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise FieldError("tokens", f"must be an array of token ids, got {json_type(v)}")
    n_vocab = (info.context or {}).get("n_vocab")
    if n_vocab is not None and not all(0 <= i < n_vocab for i in v):
        raise FieldError("tokens", f"token ids must be in [0, {n_vocab})", code="invalid_value")
    return list(v)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (llama-server's and vLLM's: tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[StrictStr | None, WrapValidator(_served_model)] = Field(
        None, description="The served model's id (vLLM sends it); may be left out.")
    tokens: Annotated[list[int] | None, WrapValidator(_token_ids)] = Field(
        None, validate_default=True, description="Token ids.")


def validate(cls: type[_Request], body: dict, model_id: str | None = None, n_vocab: int | None = None):
    """The request as `cls`, or the first wrong field as an APIError."""
    try:
        return cls.model_validate(body, context={"model_id": model_id, "n_vocab": n_vocab})
    except FieldError as e:
        raise e.api_error() from None
    except ValidationError as e:    # a check without a FieldError of its own: still a 400
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"'{where}': {err['msg']}", code="invalid_value", param=where or None) from None


def ignored_fields(cls: type[_Request], body: dict) -> list[str]:
    """The fields of `body` that `cls` does not read, in the body's order: unknown ones (a typo
    such as `max_token`), and known ones whose neglect changes nothing in the answer (OpenAI's
    `user`, llama-server's `cache_prompt`, `n_keep`, ...). They are not an error, as in OpenAI's
    API and llama-server, but the server says which they are (a warning in its log, and the
    reply's X-Brass-Ignored-Fields header) so that a misspelt parameter does not go unnoticed."""
    return [k for k in body if k not in cls.model_fields]
