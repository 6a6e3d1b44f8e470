"""The vocabulary as llama.cpp b11312 loads it from `tokenizer.ggml.*` (llama_vocab::impl::load).

Besides the token list this decides, as llama.cpp does: the token attributes (which tokens are
control, user-defined, byte...), the special token ids with their defaults, add-BOS/EOS, the
end-of-generation set, and the order in which special tokens are split out of text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GGUFError, UnsupportedError
from . import libstdcxx
from .pretokenizers import PreTokenizer, pre_tokenizer

# llama_token_attr
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# llama_token_type (tokenizer.ggml.token_type) -> attribute; anything else is UNDEFINED
_TYPE_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
              4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

# Tokens llama.cpp finds by their text when the metadata does not name them. The first token of
# a list met while walking its token hash map wins (libstdcxx.py).
_ROLE_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))

# metadata key -> role, in llama.cpp's order (the deprecated keys come last and win)
_ID_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"),
)


@dataclass
class Vocab:
    model: str                   # "spm" (tokenizer.ggml.model "llama") or "bpe" ("gpt2")
    texts: list[str]             # token texts; invalid UTF-8 bytes as surrogate escapes
    token_to_id: dict[str, int]
    attrs: list[int]
    scores: list[float]          # SentencePiece only
    ranks: dict[str, int]        # BPE only: "left right" -> merge rank
    pre: PreTokenizer | None     # BPE only
    ids: dict[str, int | None]   # bos, eos, eot, eom, unk, sep, pad, mask, fim_*
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog: frozenset[int]
    special_order: list[int]     # tokens split out of text first, longest first


def _meta_bool(md: dict, key: str, default: bool, path) -> bool:
    value = md.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, int, np.integer)):
        raise GGUFError(f"{path}: {key} is {type(value).__name__} {value!r:.40}, expected a bool")
    return bool(value)


def _strings(value) -> bool:
    """Whether a metadata value is an array of strings (not numbers, not nested arrays)."""
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def load_vocab(gf) -> Vocab:
    md = gf.metadata
    path = gf.path

    def key(name: str) -> str:
        return "tokenizer.ggml." + name

    model = md.get(key("model"))
    if model is None:
        raise GGUFError(f"{path}: no tokenizer (tokenizer.ggml.model is missing)")
    if not isinstance(model, str):
        raise GGUFError(f"{path}: tokenizer.ggml.model is {type(model).__name__} {model!r:.40}, "
                        "expected a string")
    pre = None
    ranks: dict[str, int] = {}
    ids: dict[str, int | None] = dict.fromkeys(
        ("bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask",
         "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"))
    if model == "llama":
        kind = "spm"
        ids.update(bos=1, eos=2, unk=0)
        add_space_prefix, clean_spaces, add_bos = True, False, True
    elif model in ("gpt2", "gemma4"):
        kind = "bpe"
        merges = md.get(key("merges"))
        if not isinstance(merges, list):
            raise GGUFError(f"{path}: BPE tokenizer without tokenizer.ggml.merges")
        if not _strings(merges):
            raise GGUFError(f"{path}: tokenizer.ggml.merges must be an array of strings")
        # std::unordered_map::emplace keeps the first rank of a repeated merge: fill backwards
        ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        if model == "gpt2":
            ids.update(bos=11, eos=11)
        pre_name = "gemma4" if model == "gemma4" else md.get(key("pre"))
        if pre_name is not None and not isinstance(pre_name, str):
            raise GGUFError(f"{path}: tokenizer.ggml.pre is {type(pre_name).__name__} "
                            f"{pre_name!r:.40}, expected a string")
        pre = pre_tokenizer(pre_name)
        add_space_prefix, clean_spaces, add_bos = False, pre.clean_spaces, pre.add_bos
    else:
        raise UnsupportedError(f"{path}: tokenizer model {model!r} is not supported "
                               "(supported: 'llama' SentencePiece, 'gpt2' BPE, 'gemma4' SentencePiece-style BPE)")
    add_eos = False
    add_space_prefix = _meta_bool(md, key("add_space_prefix"), add_space_prefix, path)

    tokens = md.get(key("tokens"))
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    if not _strings(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    n = len(tokens)
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    token_to_id = dict(zip(texts, range(n)))
    if len(token_to_id) != n:
        raise GGUFError(f"{path}: the vocabulary repeats token texts ({n - len(token_to_id)} duplicates)")

    scores: list[float] = []
    raw_scores = md.get(key("scores"))
    if raw_scores is not None:
        if not isinstance(raw_scores, np.ndarray) or raw_scores.dtype.kind not in "if" or len(raw_scores) < n:
            raise GGUFError(f"{path}: tokenizer.ggml.scores must hold {n} int32/float32 values")
        scores = raw_scores[:n].astype(np.float32).tolist()
    elif kind == "spm":
        scores = [0.0] * n
    types = md.get(key("token_type"))
    if types is None:
        attrs = [ATTR_NORMAL] * n
    else:
        if not isinstance(types, np.ndarray) or types.dtype != np.int32 or len(types) < n:
            raise GGUFError(f"{path}: tokenizer.ggml.token_type must hold {n} int32 values")
        attrs = [_TYPE_ATTR.get(t, ATTR_UNDEFINED) for t in types[:n].tolist()]

    for role, name in _ID_KEYS:
        if ids[role] is not None and ids[role] >= n:
            ids[role] = None
        value = md.get(key(name))
        if isinstance(value, (int, np.integer)) and 0 <= value < n:
            ids[role] = int(value)
    add_bos = _meta_bool(md, key("add_bos_token"), add_bos, path)
    if pre is not None and pre.spm_style:
        add_bos = True      # llama.cpp overrides a false add_bos_token for Gemma 4
    add_eos = _meta_bool(md, key("add_eos_token"), add_eos, path)

    _find_roles_by_text(ids, texts, token_to_id, attrs)

    eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
    for text in _EOG_TEXTS:
        tid = token_to_id.get(text)
        if tid is not None:
            eog.add(tid)
            attrs[tid] |= ATTR_CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        tid = token_to_id.get(text)
        if tid is not None:
            attrs[tid] = ATTR_USER_DEFINED   # gpt-oss: always rendered
    eog |= {ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None}
    eog_texts = {texts[t]: t for t in eog}
    # o200k_harmony / solar-open: there "<|end|>" ends a message, not the generation
    if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
                                   or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts) and "<|flush|>" in eog_texts)):
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 and plamo have a normal "</s>"
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = ATTR_NORMAL

    special = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
    # longest first, by std::sort: equal lengths stay in the order libstdc++'s unstable sort
    # leaves them, which matters when two of them overlap in a text
    special = libstdcxx.sort(special, key=lambda i: -len(texts[i].encode("utf-8", "surrogateescape")))

    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        for i in special:
            attrs[i] |= ATTR_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            tid = token_to_id.get(text)
            if tid is None:
                raise GGUFError(f"{path}: Phi-3 vocabulary without the token {text!r}")
            attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP

    return Vocab(kind, texts, token_to_id, attrs, scores, ranks, pre, ids, add_bos, add_eos,
                 add_space_prefix, clean_spaces, frozenset(eog), special)


def _find_roles_by_text(ids: dict, texts: list[str], token_to_id: dict[str, int], attrs: list[int]) -> None:
    """The first listed text met in llama.cpp's hash map order fills each role left empty."""
    present = {role: [token_to_id[t] for t in cands if t in token_to_id]
               for role, cands in _ROLE_TEXTS.items() if ids[role] is None}
    present = {role: found for role, found in present.items() if found}
    if not present:
        return
    if any(len(found) > 1 for found in present.values()):
        keys = [t.encode("utf-8", "surrogateescape") for t in texts]
        rank = np.empty(len(keys), dtype=np.int64)
        rank[libstdcxx.iteration_order(keys)] = np.arange(len(keys))
        first = {role: min(found, key=lambda t: rank[t]) for role, found in present.items()}
    else:
        first = {role: found[0] for role, found in present.items()}
    for role, tid in first.items():
        ids[role] = tid
        attrs[tid] |= ATTR_CONTROL
