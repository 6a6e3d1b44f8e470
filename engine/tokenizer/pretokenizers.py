"""Pre-tokenization: splitting text into words before BPE, as llama.cpp b11312 does it.

llama.cpp keeps one list of regexes per pre-tokenizer (`llm_tokenizer_bpe`, src/llama-vocab.cpp)
and applies them one after another, each splitting the pieces the previous one left
(`unicode_regex_split`, src/unicode.cpp). A few regexes have hand-written splitters; the others
run through std::regex, on a "collapsed" copy of the text where every non-ASCII code point is
replaced by one byte standing for its class (letter, number, ...). We do the same: the
hand-written splitters are ported line by line, and the std::regex ones run through Python's
`re` on the same collapsed text with the same collapsed pattern. Both use llama.cpp's code
point tables, so a code point is a letter here exactly when it is one there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnsupportedError
from . import unicode as uc

LETTER, NUMBER, WHITESPACE, ACCENT_MARK = uc.LETTER, uc.NUMBER, uc.WHITESPACE, uc.ACCENT_MARK

REGEX_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
REGEX_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
REGEX_QWEN2 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
               "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
REGEX_QWEN35 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|"
                "\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """One branch of llama.cpp's pre-tokenizer table and the vocabulary flags it sets."""
    regexes: tuple[str, ...]
    clean_spaces: bool = True     # BPE default; many pre-tokenizers turn it off
    ignore_merges: bool = False   # a whole word that is a token is taken as is
    add_bos: bool = False         # default before tokenizer.ggml.add_bos_token
    # SentencePiece-style BPE (Gemma 4): spaces become U+2581 before splitting, the merges run
    # on raw UTF-8 (no GPT-2 byte map), bytes fall back to <0xXX> tokens, and a word of
    # newlines that is itself a token is taken whole
    spm_style: bool = False


DEFAULT = PreTokenizer((
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    REGEX_GPT2,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
))
_LLAMA3 = PreTokenizer((REGEX_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = PreTokenizer((REGEX_GPT2,))
_STARCODER = PreTokenizer(("\\p{N}", REGEX_GPT2))
_QWEN2 = PreTokenizer((REGEX_QWEN2,), clean_spaces=False)

# tokenizer.ggml.pre -> branch. Only branches checked against llama.cpp (tests/test_tokenizer.py
# and the goldens) are listed; aliases share llama.cpp's branch and therefore its behaviour.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3),
    "deepseek-llm": PreTokenizer((
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ), clean_spaces=False),
    "deepseek-coder": PreTokenizer((
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}",
    ), clean_spaces=False),
    "falcon": PreTokenizer((
        "[\\p{P}\\$\\+<=>\\^~\\|`]+",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        "[0-9][0-9][0-9]",
    )),
    "mpt": _GPT2,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "command-r": PreTokenizer(_STARCODER.regexes, clean_spaces=False),
    "smollm": PreTokenizer(_STARCODER.regexes, clean_spaces=False),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "a.x-4.0", "mellum"), _GPT2),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2),
    "qwen35": PreTokenizer((REGEX_QWEN35,), clean_spaces=False),
    # set by tokenizer.ggml.model "gemma4" whatever tokenizer.ggml.pre says; only newlines are
    # split off (BPE merge lookup must not see them), add_bos forced on (llama.cpp #21500)
    "gemma4": PreTokenizer(("[^\\n]+|[\\n]+",), spm_style=True, add_bos=True),
}


def pre_tokenizer(name: str | None) -> PreTokenizer:
    if not name:
        # llama.cpp warns ("GENERATION QUALITY WILL BE DEGRADED") and uses the default.
        return DEFAULT
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        raise UnsupportedError(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}") from None


def split_words(text: str, regexes: tuple[str, ...]) -> list[str]:
    """unicode_regex_split without the byte encoding: the words of `text`, in order."""
    offsets = [len(text)]
    flags = None
    for regex in regexes:
        custom = _CUSTOM.get(regex)
        if custom is not None:
            if flags is None:
                flags = uc.flags_of(text)
            offsets = custom(text, flags, offsets)
        else:
            offsets = _split_std_regex(text, regex, offsets)
    words, start = [], 0
    for n in offsets:
        words.append(text[start:start + n])
        start += n
    return words


# --- hand-written splitters (unicode_regex_split_custom_*), ported line by line -------------
# `pos` walks code points of one piece [ini, end); outside it a code point reads as "" and its
# flags as 0, as llama.cpp's OUT_OF_RANGE and empty flags.

_LOWER = {chr(c): chr(lo) for c, lo in uc._LOWER.items()}


def _split_gpt2(text: str, flags: list[int], offsets: list[int]) -> list[int]:
    out: list[int] = []
    start = 0
    for n in offsets:
        ini, end = start, start + n
        start = end
        pos = ini
        while pos < end:
            cpt = text[pos]
            f = flags[pos]
            if cpt == "'" and pos + 1 < end:
                nxt = text[pos + 1]
                if nxt in "stmd":
                    out.append(2)
                    pos += 2
                    continue
                if pos + 2 < end and nxt + text[pos + 2] in ("re", "ve", "ll"):
                    out.append(3)
                    pos += 3
                    continue
            f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else f
            first = pos
            if f2 & LETTER:
                pos += cpt == " "
                while f2 & LETTER:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                out.append(pos - first)
                continue
            if f2 & NUMBER:
                pos += cpt == " "
                while f2 & NUMBER:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                out.append(pos - first)
                continue
            if not f2 & (WHITESPACE | LETTER | NUMBER) and f2:
                pos += cpt == " "
                while not f2 & (WHITESPACE | LETTER | NUMBER) and f2:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                out.append(pos - first)
                continue
            n_ws = 0
            while pos + n_ws < end and flags[pos + n_ws] & WHITESPACE:
                n_ws += 1
            if n_ws > 1 and pos + n_ws < end:       # \s+(?!\S)
                pos += n_ws - 1
            elif n_ws > 0:                            # \s+
                pos += n_ws
            else:                                     # no match
                pos += 1
            out.append(pos - first)
    return out


def _llama3_family(numbers: int, marks: bool):
    """unicode_regex_split_custom_{llama3,qwen2,qwen35}: `numbers` digits per word at most,
    `marks`: combining marks join letter runs (qwen35)."""
    word = LETTER | ACCENT_MARK if marks else LETTER

    def split(text: str, flags: list[int], offsets: list[int]) -> list[int]:
        out: list[int] = []
        start = 0
        for n in offsets:
            ini, end = start, start + n
            start = end
            pos = ini
            while pos < end:
                cpt = text[pos]
                f = flags[pos]
                first = pos
                if cpt == "'" and pos + 1 < end:
                    nxt = _LOWER.get(text[pos + 1], text[pos + 1])
                    if nxt in "stmd":
                        out.append(2)
                        pos += 2
                        continue
                    if pos + 2 < end:
                        nn = _LOWER.get(text[pos + 2], text[pos + 2])
                        if nxt + nn in ("re", "ve", "ll"):
                            out.append(3)
                            pos += 3
                            continue
                # [^\r\n\p{L}\p{N}]?\p{L}+
                if not (cpt == "\r" or cpt == "\n" or f & NUMBER):
                    if f & word or (pos + 1 < end and flags[pos + 1] & word):
                        pos += 1
                        while pos < end and flags[pos] & word:
                            pos += 1
                        out.append(pos - first)
                        continue
                # \p{N}{1,3} (llama3) or \p{N} (qwen2)
                if f & NUMBER:
                    run = pos
                    while pos < end and flags[pos] & NUMBER:
                        pos += 1
                        if pos - run >= numbers:
                            out.append(pos - run)
                            run = pos
                    if pos > run:
                        out.append(pos - run)
                    continue
                # <space>?[^\s\p{L}\p{N}]+[\r\n]*
                f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else f
                if not f2 & (WHITESPACE | word | NUMBER) and f:
                    pos += cpt == " "
                    while not f2 & (WHITESPACE | word | NUMBER) and f2:
                        pos += 1
                        f2 = flags[pos] if pos < end else 0
                    while pos < end and text[pos] in "\r\n":
                        pos += 1
                    out.append(pos - first)
                    continue
                n_ws = 0
                last_newline = 0
                while pos + n_ws < end and flags[pos + n_ws] & WHITESPACE:
                    if text[pos + n_ws] in "\r\n":
                        last_newline = pos + n_ws + 1
                    n_ws += 1
                if last_newline > 0:                     # \s*[\r\n]+
                    pos = last_newline
                elif n_ws > 1 and pos + n_ws < end:      # \s+(?!\S)
                    pos += n_ws - 1
                elif n_ws > 0:                           # \s+
                    pos += n_ws
                else:                                    # no match
                    pos += 1
                out.append(pos - first)
        return out

    return split


_CUSTOM = {
    REGEX_GPT2: _split_gpt2,
    REGEX_LLAMA3: _llama3_family(3, False),
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+":
        _llama3_family(3, False),
    REGEX_QWEN2: _llama3_family(1, False),
    REGEX_QWEN35: _llama3_family(1, True),
}


# --- std::regex on the collapsed text ----------------------------------------------------

_UCAT = {"\\p{N}": uc.NUMBER, "\\p{L}": uc.LETTER, "\\p{P}": uc.PUNCTUATION, "\\p{M}": uc.ACCENT_MARK,
         "\\p{S}": uc.SYMBOL, "\\p{Lu}": uc.LETTER, "\\p{Ll}": uc.LETTER, "\\p{Lt}": uc.LETTER,
         "\\p{Lm}": uc.LETTER, "\\p{Lo}": uc.LETTER}
# the ASCII members of each class (k_ucat_map), which the collapsed text keeps as they are
_UCAT_ASCII = {
    uc.NUMBER: "\x30-\x39",
    uc.LETTER: "\x41-\x5A\x61-\x7A",
    uc.PUNCTUATION: "\x21-\x23\x25-\x2A\x2C-\x2F\x3A-\x3B\x3F-\x40\\\x5B-\\\x5D\x5F\\\x7B\\\x7D",
    uc.ACCENT_MARK: "",
    uc.SYMBOL: "\\\x24\\\x2B\x3C-\x3E\x5E\x60\\\x7C\\\x7E",
}


def _collapse_regex(regex: str) -> str:
    out = []
    inside = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "[" and (i == 0 or regex[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and regex[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if c == "\\" and i + 3 < len(regex) and regex[i + 1] == "p" and regex[i + 2] == "{":
            close = regex.find("}", i + 3)
            if close != -1 and close <= i + 10 and regex[i:close + 1] in _UCAT:
                flag = _UCAT[regex[i:close + 1]]
                body = chr(uc.COLLAPSED_CODE[flag]) + _UCAT_ASCII[flag]
                out.append(body if inside else "[" + body + "]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


_COMPILED: dict[str, tuple[bool, re.Pattern]] = {}


def _compile(regex: str) -> tuple[bool, re.Pattern]:
    hit = _COMPILED.get(regex)
    if hit is None:
        collapsed = any(cat in regex for cat in _UCAT)
        pattern = _collapse_regex(regex) if collapsed else regex
        # ECMAScript's `$` (no multiline) matches only at the end; Python's also before a
        # final newline. In both, \s is ASCII whitespace only (C locale; re.ASCII).
        if pattern.endswith("$") and not pattern.endswith("\\$"):
            pattern = pattern[:-1] + "\\Z"
        hit = _COMPILED[regex] = (collapsed, re.compile(pattern, re.ASCII))
    return hit


def _split_std_regex(text: str, regex: str, offsets: list[int]) -> list[int]:
    """unicode_regex_split_stl: matches and the gaps between them each become a word."""
    collapsed, pattern = _compile(regex)
    subject = uc.collapse(text) if collapsed else uc.wide_text(text)
    out: list[int] = []
    start = 0
    for n in offsets:
        end = start + n
        prev = start
        for m in pattern.finditer(subject, start, end):
            if m.start() > prev:
                out.append(m.start() - prev)
            out.append(m.end() - m.start())
            prev = m.end()
        if prev < end:
            out.append(end - prev)
        start = end
    return out
