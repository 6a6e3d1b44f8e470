"""Strings chosen to break tokenizers, grouped by what they probe.

Every tokenizer golden tokenizes all of them; each group is a place where a re-implementation
of llama.cpp's tokenizers has gone wrong before (pre-tokenizer regex classes, whitespace runs,
byte fallback, special-token partitioning, UTF-8 edge cases).
"""

WHITESPACE = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \n", "\n ", " \t \n ",
    "hello world", "hello  world", "hello   world", " hello", "  hello", "hello ", "hello  ",
    "\thello\tworld\t", "line one\nline two\n\nline four", "trailing spaces   \n   leading",
    "a\u00a0b", "a\u2009b", "a\u3000b", "a\u200bb", "a\u2028b", "a\u0085b", "    indented code",
    "\n\n\n\n\n\n\n\n", " " * 17, "x" + " " * 33 + "y",
]

DIGITS = [
    "0", "7", "42", "123", "1234", "12345", "1234567", "12345678901234567890", "3.14159",
    "-273.15", "1,000,000", "1e-10", "0x1F", "2024-03-17", "09:30:00", "v1.2.3", "$4.99",
    "50%", "1/2", "room 101b", "abc123def456", "１２３４５", "٣٤٥", "²³", "Ⅻ", "½ ¾",
]

CJK = [
    "中文", "你好，世界！", "今天天气很好", "日本語のテキスト", "ひらがなとカタカナ", "東京都",
    "한국어", "안녕하세요", "漢字とかなと English が混ざる", "《三国演义》", "𠀀𠀁",
]

EMOJI = [
    "🙂", "😀😀😀", "🎉 party", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇩🇪", "❤️", "☕️", "1️⃣",
    "👩🏾‍💻 codes", "🧑‍🚀", "emoji🙂inside", "🐍🐍", "ok👌", "🫠",
]

ACCENTS = [
    "café", "cafe\u0301", "naïve", "naı\u0308ve", "Ångström", "A\u030angstro\u0308m", "ñ", "n\u0303",
    "Zürich", "Straße", "ǅ", "ﬁnance", "Ᾰ", "ệ", "e\u0323\u0302", "à la carte", "Ελληνικά",
    "Русский текст", "עברית", "العربية", "हिन्दी", "ไทย", "ქართული", "Ꭰ", "z̴̢̛a̷l̸g̶o",
]

CODE = [
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {", "if (a != b && c <= d) return;",
    "x += 1; y -= 2; z *= 3;", "print(f\"{x!r:>10}\")", "#include <stdio.h>", "std::vector<int> v;",
    "a->b", "a::b", "a..b", "a...b", "i++", "--flag=value", "$HOME/.config", "C:\\Windows\\System32",
    "https://example.com/a?b=c&d=e#f", "user@example.com", "{\"key\": [1, 2, {\"x\": null}]}",
    "<div class=\"a\">text</div>", "SELECT * FROM t WHERE id = 1;", "lambda x: x**2",
    "    if True:\n        pass", "// comment", "/* block */", "# heading", "**bold** _it_ `code`",
    "```python\nprint(1)\n```", "a_b_c", "camelCaseName", "snake_case_name", "CONSTANT_NAME",
    "__init__", "0b1010", "!==", "=>", "...", "!!!???", "''", "\"\"\"", "(((", ")))",
]

CONTRACTIONS = [
    "I'm", "you're", "it's", "we've", "they'll", "he'd", "don't", "can't", "won't", "isn't",
    "I'M", "YOU'RE", "it’s", "John's", "'quoted'", "rock 'n' roll", "o'clock", "'s", "''s",
]

SPECIAL_LOOKALIKES = [
    "<s>", "</s>", "<unk>", "<pad>", "<mask>", "<s>hello</s>", "<|endoftext|>",
    "<|im_start|>", "<|im_end|>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>", "<|end_of_text|>", "<start_of_turn>user\nhi<end_of_turn>\n",
    "<end_of_turn>", "<think>", "</think>", "<tool_call>", "<|im_start", "|im_start|>",
    "< |im_start| >", "<|IM_START|>", "<<|im_end|>>", "<|im_end|><|im_end|>", "x<|im_end|>y",
    "[INST]", "<0x41>", "<0x0A>", "<|fim_prefix|>", "<|unknown_token|>", "<>", "<|>", "<|",
]

UTF8_EDGES = [
    "\ufeffBOM first", "\ufffd", "a\ufffdb", "\uffff", "\ufffe", "\U0010ffff", "\ue000", "\U000f0000",
    "\x7f", "\x01\x02\x03", "tab\x0bvt", "nul\x00byte", "\u00ad soft hyphen", "\u200d", "\u200e",
    "\u202e reversed", "\u0300 leading combining", "\U0001d400\U0001d401", "ꙮ", "\u2126 \u03a9",
]

MIXED = [
    "Hello, World!", "HELLO world", "The quick brown fox jumps over the lazy dog.",
    "It was 3:45pm on 12/05/2024 — exactly.", "Prices: €5, £4, ¥600, ₹80.",
    "Mr. Smith's car (a 1967 Mustang) isn't for sale!", "e.g. i.e. etc.", "A.B.C.",
    "ALLCAPS AND lowercase And Title", "supercalifragilisticexpialidocious",
    "antidisestablishmentarianism" * 3, "a" * 64, "ab" * 40, "🙂" * 12, "- item one\n- item two",
    "1. first\n2. second", "He said \"hi\" and left.", "Tab\tseparated\tvalues",
    "tokenizer's edge-cases: (1) [2] {3} <4>",
]

STRINGS: list[str] = (WHITESPACE + DIGITS + CJK + EMOJI + ACCENTS + CODE + CONTRACTIONS
                      + SPECIAL_LOOKALIKES + UTF8_EDGES + MIXED)

# add_special (BOS/EOS per the vocabulary's metadata), parse_special (special-token text
# becomes the special token instead of being tokenized as plain text).
MODES = [(False, False), (True, False), (True, True)]
