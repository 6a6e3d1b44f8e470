"""Regenerate `unicode_data.py` from llama.cpp's `src/unicode-data.cpp`.

llama.cpp classifies code points with its own tables (generated from the Unicode data of the
day it was written), not with the C library or Python's `unicodedata`. Pre-tokenization must
use the very same tables to split text where llama.cpp splits it, so we copy them:

    python -m brass.tokenizer.gen_unicode_data path/to/llama.cpp/src/unicode-data.cpp

The goldens are recorded with llama.cpp b11312 (vendored in llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

TARGET = Path(__file__).with_name("unicode_data.py")


def _table(src: str, name: str) -> str:
    m = re.search(name + r"\s*=\s*\{(.*?)\n\};", src, re.DOTALL)
    if m is None:
        raise SystemExit(f"{name} not found")
    return m.group(1)


def _wrap(values: list[int]) -> str:
    return textwrap.fill(", ".join(f"0x{v:X}" for v in values), 96,
                         initial_indent="    ", subsequent_indent="    ")


def main(path: str) -> None:
    src = Path(path).read_text()
    ranges = [(int(a, 16), int(b, 16))
              for a, b in re.findall(r"\{(0x[0-9A-F]+), (0x[0-9A-F]+)\}", _table(src, "unicode_ranges_flags"))]
    whitespace = [int(v, 16) for v in re.findall(r"0x[0-9A-F]+", _table(src, "unicode_set_whitespace"))]
    lower = [(int(a, 16), int(b, 16))
             for a, b in re.findall(r"\{(0x[0-9A-F]+), (0x[0-9A-F]+)\}", _table(src, "unicode_map_lowercase"))]
    # Only lowercase targets in ASCII matter: the contraction rules compare unicode_tolower(c) with
    # ASCII letters.
    to_ascii = [(a, b) for a, b in lower if b < 0x80 and a != b]
    TARGET.write_text(f'''"""Code point tables copied from llama.cpp b11312 `src/unicode-data.cpp` (generated; do not edit).

Regenerate with `python -m brass.tokenizer.gen_unicode_data <unicode-data.cpp>`.
"""

# unicode_ranges_flags: the flags of code point c are RANGE_FLAGS[i] for the last i with
# RANGE_STARTS[i] <= c; the final start is 0x110000.
RANGE_STARTS = (
{_wrap([a for a, _ in ranges])}
)
RANGE_FLAGS = (
{_wrap([b for _, b in ranges])}
)

# unicode_set_whitespace
WHITESPACE = (
{_wrap(whitespace)}
)

# the entries of unicode_map_lowercase whose lowercase is ASCII: (code point, lowercase)
LOWERCASE_TO_ASCII = (
{_wrap([v for pair in to_ascii for v in pair])}
)
''')
    print(f"wrote {TARGET}: {len(ranges)} ranges, {len(whitespace)} whitespace, {len(to_ascii)} lowercase pairs")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
