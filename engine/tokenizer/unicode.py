"""Code point classes and the GPT-2 byte encoding, as llama.cpp's `src/unicode.cpp` has them.

The classes come from llama.cpp's own tables (`unicode_data.py`), not from Python's
`unicodedata` or the `regex` package: those follow other Unicode versions and other
definitions (Python's `str.isspace` counts U+001C..U+001F, llama.cpp does not), and a single
code point classified differently splits a word differently.
"""

from __future__ import annotations

import numpy as np

from . import unicode_data

# unicode_cpt_flags (src/unicode.h)
UNDEFINED = 0x0001
NUMBER = 0x0002
LETTER = 0x0004
SEPARATOR = 0x0008
ACCENT_MARK = 0x0010
PUNCTUATION = 0x0020
SYMBOL = 0x0040
CONTROL = 0x0080
CATEGORIES = 0x00FF
WHITESPACE = 0x0100

MAX_CODEPOINTS = 0x110000


def _flags_table() -> np.ndarray:
    starts = np.asarray(unicode_data.RANGE_STARTS, dtype=np.int64)
    flags = np.repeat(np.asarray(unicode_data.RANGE_FLAGS[:-1], dtype=np.uint16), np.diff(starts))
    flags[list(unicode_data.WHITESPACE)] |= WHITESPACE
    return flags


FLAGS = _flags_table()
assert len(FLAGS) == MAX_CODEPOINTS

_LOWER = dict(zip(unicode_data.LOWERCASE_TO_ASCII[::2], unicode_data.LOWERCASE_TO_ASCII[1::2]))


def tolower_ascii(cpt: int) -> int:
    """unicode_tolower, for the code points whose lowercase is ASCII (the only ones compared)."""
    return _LOWER.get(cpt, cpt)


def codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def flags_of(text: str) -> list[int]:
    """Flags of each code point of `text` (Python indexes a str by code point, as llama.cpp's
    splitters index their code point arrays)."""
    return FLAGS[codepoints(text)].tolist()


# The collapsed text of unicode_regex_split: ASCII stays, other code points become one byte
# standing for their class, so that std::regex can run on bytes.
COLLAPSED_CODE = {NUMBER: 0xD1, LETTER: 0xD2, PUNCTUATION: 0xD3, ACCENT_MARK: 0xD4, SYMBOL: 0xD5}


def _collapse_table() -> np.ndarray:
    cat = FLAGS & CATEGORIES
    out = np.full(MAX_CODEPOINTS, 0xD0, dtype=np.uint8)
    for flag, code in COLLAPSED_CODE.items():
        out[cat == flag] = code
    out[(FLAGS & WHITESPACE) != 0] = 0x0B
    out[:128] = np.arange(128)
    return out


_COLLAPSE: np.ndarray | None = None


def collapse(text: str) -> str:
    global _COLLAPSE
    if _COLLAPSE is None:
        _COLLAPSE = _collapse_table()
    return _COLLAPSE[codepoints(text)].tobytes().decode("latin-1")


def wide_text(text: str) -> str:
    """The text std::wregex sees: non-ASCII whitespace replaced by U+000B."""
    cpts = codepoints(text)
    if cpts.size and cpts.max() > 0x7F:
        ws = (cpts > 0x7F) & ((FLAGS[cpts] & WHITESPACE) != 0)
        if ws.any():
            cpts = np.where(ws, 0x0B, cpts).astype("<u4")
            return cpts.tobytes().decode("utf-32-le")
    return text


def _byte_to_unicode() -> list[str]:
    # unicode_byte_to_utf8_map: printable Latin-1 bytes stand for themselves, the rest are
    # shifted to U+0100 and up, in byte order.
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
_BYTE_ENCODE = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}


def byte_encode(word: str) -> str:
    """GPT-2 byte-level encoding of a word: one printable character per UTF-8 byte."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE)
