"""Tokenizer: text <-> token ids exactly as llama.cpp b11312 (src/llama-vocab.cpp).

`encode` is llama_tokenize, `decode` is llama_detokenize, `token_to_piece` is
llama_token_to_piece. Supported: SentencePiece vocabularies (tokenizer.ggml.model "llama":
scores, byte fallback, U+2581 for spaces), GPT-2 byte-level BPE ("gpt2") with the
pre-tokenizers listed in pretokenizers.PRE_TOKENIZERS, and Gemma 4's SentencePiece-style BPE
("gemma4": U+2581 for spaces, merges on raw UTF-8, <0xXX> byte fallback).
"""

from __future__ import annotations

import codecs
import functools
import operator
import re

from ..errors import BrassError
from . import unicode as uc
from .merges import bpe_merge, spm_merge
from .pretokenizers import split_words
from .vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
    load_vocab,
)

SPACE_ESCAPE = "\u2581"   # SentencePiece's "▁"
_C_SPACES = " \t\n\v\f\r"  # isspace() in the C locale, for LSTRIP/RSTRIP


class TokenizerError(BrassError):
    """Bad input to the tokenizer (an id outside the vocabulary, text that is not UTF-8)."""


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = v = vocab
        self.n_vocab = len(v.texts)
        self.bos_id = v.ids["bos"]
        self.eos_id = v.ids["eos"]
        self.eot_id = v.ids["eot"]
        self.add_bos = v.add_bos
        self.add_eos = v.add_eos
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        # words repeat; their BPE result is a pure function of the word
        self._bpe_word = functools.lru_cache(maxsize=1 << 16)(self._bpe_word_uncached)

    @classmethod
    def from_gguf(cls, gf) -> Tokenizer:
        """Read the tokenizer.ggml.* metadata of an open brass.gguf.GGUFFile."""
        return cls(load_vocab(gf))

    # -- encoding -------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize(vocab, text, add_special, parse_special).

        With parse_special False, control tokens written in the text (e.g. "<|im_start|>") are
        tokenized as ordinary text; user-defined tokens are always split out first."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode at character {e.start} "
                                 f"({text[e.start]!r} is a lone surrogate)") from None
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(self._required("bos"))
        fragments = self._split_special(text, parse_special) if text else []
        if v.model == "spm":
            prev_special = True   # a text at the start gets the space prefix too
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm(frag.replace(" ", SPACE_ESCAPE), out)
                prev_special = False
        else:
            spm_style = v.pre.spm_style
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                if spm_style:
                    frag = frag.replace(" ", SPACE_ESCAPE)
                for word in split_words(frag, v.pre.regexes):
                    out.extend(self._bpe_word(word if spm_style else uc.byte_encode(word)))
        if add_special and v.add_eos:
            out.append(self._required("eos"))
        return out

    def _required(self, role: str) -> int:
        tid = self.vocab.ids[role]
        if tid is None:
            raise TokenizerError(f"the vocabulary asks to add a {role.upper()} token but has none")
        return tid

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: cut special tokens out of the text, longest first; a token
        fragment is its id, a text fragment its str."""
        v = self.vocab
        fragments: list[str | int] = [text]
        skip = 0 if parse_special else ATTR_CONTROL | ATTR_UNKNOWN
        for tid in v.special_order:
            attr = v.attrs[tid]
            if attr & skip:
                continue
            token = v.texts[tid]
            if not any(isinstance(f, str) and token in f for f in fragments):
                continue
            result: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or token not in frag:
                    result.append(frag)
                    continue
                rest = frag
                while True:
                    at = rest.find(token)
                    if at < 0:
                        if rest:
                            result.append(rest)
                        break
                    left = rest[:at]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACES)
                    if left:
                        result.append(left)
                    result.append(tid)
                    rest = rest[at + len(token):]
                    if attr & ATTR_RSTRIP:
                        rest = rest.lstrip(_C_SPACES)
            fragments = result
        return fragments

    def _spm(self, text: str, out: list[int]) -> None:
        v = self.vocab
        for symbol in spm_merge(text, v.token_to_id, v.scores):
            tid = v.token_to_id.get(symbol)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in symbol.encode("utf-8"))

    def _byte_token(self, byte: int) -> int:
        """llama_vocab::byte_to_token for SentencePiece: <0xXX>, else the byte itself."""
        v = self.vocab
        tid = v.token_to_id.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = v.token_to_id.get(chr(byte) if byte < 0x80 else chr(0xDC00 + byte))
        if tid is None:
            raise TokenizerError(f"the vocabulary has no token for byte 0x{byte:02X} (no <0x{byte:02X}>)")
        return tid

    def _bpe_word_uncached(self, word: str) -> tuple[int, ...]:
        v = self.vocab
        spm_style = v.pre.spm_style
        if v.pre.ignore_merges and word in v.token_to_id:
            return (v.token_to_id[word],)
        if spm_style and word.strip("\n") == "" and word in v.token_to_id:
            return (v.token_to_id[word],)     # llama.cpp #21343: a run of newlines, whole
        out = []
        for symbol in bpe_merge(word, v.ranks):
            tid = v.token_to_id.get(symbol)
            if tid is not None:
                out.append(tid)
                continue
            # a symbol that is not a token falls back to one-byte tokens of its UTF-8 bytes
            # (<0xXX> in SentencePiece-style BPE); bytes without a token are dropped, as
            # llama.cpp drops them
            for b in symbol.encode("utf-8", "surrogateescape"):
                tid = v.token_to_id.get(f"<0x{b:02X}>" if spm_style else chr(b) if b < 0x80 else chr(0xDC00 + b))
                if tid is not None:
                    out.append(tid)
        return tuple(out)

    # -- decoding -------------------------------------------------------------------------
    def token_to_piece(self, id: int, special: bool = True) -> bytes:
        """llama_token_to_piece(vocab, id, buf, size, lstrip=0, special): the bytes of one
        token. With special False, control and unknown tokens render as nothing."""
        id = self._check_id(id)
        if not special and self.vocab.attrs[id] & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        piece = self._pieces[id]
        if piece is None:
            piece = self._pieces[id] = self._piece(id)
        return piece

    def _check_id(self, id) -> int:
        try:
            index = operator.index(id)
        except TypeError:
            raise TokenizerError(f"a token id is an integer, not {type(id).__name__}") from None
        if not 0 <= index < self.n_vocab:
            raise TokenizerError(f"token id {index} is not in the vocabulary [0, {self.n_vocab})")
        return index

    def _piece(self, id: int) -> bytes:
        v = self.vocab
        attr, text = v.attrs[id], v.texts[id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR_NORMAL:
            if v.model == "spm" or v.pre.spm_style:
                return text.replace(SPACE_ESCAPE, " ").encode("utf-8", "surrogateescape")
            return _byte_decode(text)
        if attr & ATTR_BYTE:
            # token_to_byte: the two hex digits of "<0xXX>" (strtol stops at the first non-digit)
            m = re.match(r"[0-9A-Fa-f]{0,2}", text[3:5])
            return bytes([int(m.group() or "0", 16)])
        return b""   # unused and undefined tokens

    def decode(self, ids, skip_special: bool = False) -> str:
        """llama_detokenize(vocab, ids, remove_special=skip_special, unparse_special=not skip_special).

        skip_special drops a leading BOS / trailing EOS the vocabulary adds and renders control
        tokens as nothing; otherwise they render as their text. Invalid UTF-8 (a sequence cut
        between byte tokens) becomes U+FFFD."""
        return self._detokenize(list(ids), skip_special).decode("utf-8", "replace")

    def _detokenize(self, ids: list[int], remove_special: bool) -> bytes:
        v = self.vocab
        strip_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == self.bos_id:
            strip_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.token_to_piece(i, not remove_special) for i in ids]
        if strip_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return clean_spaces(text) if v.clean_spaces else text

    def is_eog(self, id: int) -> bool:
        """llama_vocab_is_eog: end of generation (EOS, EOT, <|im_end|>, ... as llama.cpp finds them)."""
        return id in self.vocab.eog

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


def _byte_decode(text: str) -> bytes:
    """llama_decode_text: GPT-2 byte-level characters back to bytes; a character outside the
    byte map (never in a well-formed vocabulary) renders as llama.cpp renders it."""
    try:
        return bytes(uc.UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        pass
    out = bytearray()
    raw = text.encode("utf-8", "surrogateescape")
    for c in text:
        if c in uc.UNICODE_TO_BYTE:
            out.append(uc.UNICODE_TO_BYTE[c])
            continue
        # llama.cpp reads an invalid byte as U+FFFD
        utf8 = "\ufffd".encode() if 0xDC80 <= ord(c) <= 0xDCFF else c.encode("utf-8", "surrogatepass")
        out += b"[UNK_BYTE_0x" + utf8.hex().encode() + raw + b"]"
    return bytes(out)


# clean_up_tokenization_spaces, the three passes of llama_vocab::impl::detokenize: a space goes
# before ? ! . , ; " ' " becomes "'"; a space goes before 's 'm 're 've.
_CLEAN_1 = re.compile(rb" (?=[?!.,])")
_CLEAN_2 = re.compile(rb" ' ")
_CLEAN_3 = re.compile(rb" (?='(?:[sm]|re|ve))")


def clean_spaces(text: bytes) -> bytes:
    return _CLEAN_3.sub(b"", _CLEAN_2.sub(b"'", _CLEAN_1.sub(b"", text)))


class StreamDecoder:
    """Token-by-token text for streaming: the concatenation of every feed() and the final
    flush() equals Tokenizer.decode(all ids). feed() holds back what later tokens can still
    change: an incomplete UTF-8 sequence, the end of the text that space cleaning may touch,
    and a final EOS that decode(skip_special=True) would drop."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._remove_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = b""          # raw bytes not yet cleaned
        self._held_eos = False
        self._first = True
        self._strip_space = tokenizer.vocab.add_space_prefix

    def feed(self, id: int) -> str:
        tok, v = self._tok, self._tok.vocab
        id = tok._check_id(id)
        if self._first:
            self._first = False
            if self._remove_special and v.add_bos and id == tok.bos_id:
                self._strip_space = False
                return ""
        if self._held_eos:
            self._held_eos = False
            self._append(tok.eos_id)
        if self._remove_special and v.add_eos and id == tok.eos_id:
            self._held_eos = True
        else:
            self._append(id)
        return self._emit(final=False)

    def _append(self, id: int) -> None:
        piece = self._tok.token_to_piece(id, not self._remove_special)
        if self._strip_space:
            self._strip_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        self._pending += piece

    def _emit(self, final: bool) -> str:
        data = self._pending
        if self._tok.vocab.clean_spaces:
            # every cleaning pattern starts with a space and spans at most 4 bytes, so text
            # before a point with no space in the 3 bytes ahead of it is final
            cut = len(data)
            if not final:
                while cut > 0 and b" " in data[max(0, cut - 3):cut]:
                    cut -= 1
            ready, self._pending = clean_spaces(data[:cut]), data[cut:]
        else:
            ready, self._pending = data, b""
        return self._utf8.decode(ready, final)

    def flush(self) -> str:
        """The rest of the text; a final EOS held back is dropped, as decode drops it."""
        self._held_eos = False
        return self._emit(final=True)
