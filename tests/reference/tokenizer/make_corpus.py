#!/usr/bin/env python3
"""Writes tests/data/tokenizer/corpus.jsonl: a deterministic >= 1 MB corpus,
one JSON string per line (so lines may hold \\n and \\r).

Covers: Latin prose, contractions in all cases, CJK, Hangul, Arabic with
harakat, Devanagari with vowel signs, Cyrillic, Greek, emoji (ZWJ, skin tones,
flags), combining marks, code, long digit runs, whitespace runs (incl. NBSP,
U+3000, U+0085, U+2028, U+180E), mixed newlines, every Phi-4 added token
inside text (followed by spaces/newlines, which rstrip swallows), near-miss
token strings, and Unicode categories Lt/Lm/Nl/No.

Usage: python3 tests/reference/tokenizer/make_corpus.py [OUT]
"""
import json
import random
import sys

SEED = 20260412
TARGET_BYTES = 1_150_000

ADDED = ["<|endoftext|>", "<|endoftext10|>", "<|endoftext11|>", "<|endofprompt|>",
         "<|assistant|>", "<|end|>", "<|user|>", "<|system|>", "<|tool|>", "<|/tool|>",
         "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>"]
NEAR_MISS = ["<|end", "<|endoftext1|>", "<|image_1|>", "<|audio_2|>", "<|USER|>", "<||>", "|>", "<|",
             "<|endoftext12|>", "< |end|>", "<|tool_calls|>"]

LATIN_WORDS = ("the quick brown fox jumps over lazy dog tokenizer language model café naïve résumé "
               "Straße über Müller façade coöperate jalapeño São Paulo Zürich Ærøskøbing Łódź "
               "HTTP HTTPServer camelCase snake_case XMLHttpRequest iPhone McDonald O'Neil "
               "ǅemal ǈubljana ʰaspirated ʷlabial ǲ").split()
CONTRACTIONS = ["don't", "DON'T", "Don'T", "it's", "IT'S", "It'S", "we're", "WE'RE", "We'Re", "you've",
                "YOU'VE", "I'm", "I'M", "i'M", "they'll", "THEY'LL", "They'Ll", "he'd", "HE'D",
                "can't", "won't", "'s", "'S", "'re", "'ll", "rock'n'roll", "l'homme", "o'clock",
                "it’s", "don’t", "'tis", "''quoted''", "x's", "7's", "café's", "ÉCOLE'S"]
EMOJI = ["😀", "😂", "🤖", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇫🇷", "❤️", "✨", "🔥", "🧑🏿‍🚀",
         "☕", "⌚", "🀄", "𝄞", "𝕳𝖊𝖑𝖑𝖔", "🫠", "🪐"]
COMBINING = ["e\u0301", "a\u0308\u0304", "n\u0303", "o\u0328\u0301", "Z\u0351\u0354\u0339",
             "i\u0307\u0301", "\u0301alone", "q\u0323\u0307", "ऩ", "क़", "ที่", "ก็"]
NUMERIC = ["½", "²³", "Ⅻ", "ⅷ", "①②③", "٣٤٥", "१२३४५", "߀߁", "〇", "𝟙𝟚", "3.14159", "1,000,000",
           "0x7FFF", "1e-9", "-42", "+7", "2026-12-02", "12:30:45"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\u00a0", "\u3000", "\u2009", "\u202f", "\u0085", "\u2028",
          "\u2029", "\u180e", "\u200b", "\u1680", " \u00a0 ", "\u000b", "\u000c"]
NEWLINES = ["\n", "\r\n", "\r", "\n\n", "\r\n\r\n", "\n\r", " \n", "  \n ", "\t\n", "\n\n\n", "\r\r"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "const auto it = std::find_if(v.begin(), v.end(), [](auto& p) { return p.second > 0; });",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2, 3]}}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<div class=\"row\"><a href=\"https://example.com/a/b?c=1&d=2\">link</a></div>",
    "x = [i for i in range(100) if i % 3 == 0]\r\nprint(x)\r\n",
    "if err != nil {\n\t\treturn fmt.Errorf(\"open %s: %w\", path, err)\n\t}",
    "#include <vector>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n",
    "    \n        pass\n\n\n",
    "path/to/file.txt // comment ///\n",
    "a+=b;c-=d;e*=f;g/=h;i%=j;k<<=1;l>>=2;m&=n;o|=p;q^=r;",
    "$ grep -rn 'TODO' src/ | wc -l\n",
    "λx.λy.x  ∀ε>0 ∃δ>0: |x−y|<δ ⇒ |f(x)−f(y)|<ε",
]
ARABIC_SAMPLE = "مرحبا بالعالم، هذا نص عربي مع أرقام ١٢٣ وتشكيل: كَتَبَ الوَلَدُ الدَّرْسَ."
HINDI_SAMPLE = "नमस्ते दुनिया! यह हिन्दी का एक वाक्य है, जिसमें मात्राएँ और संयुक्ताक्षर क्ष त्र ज्ञ हैं।"
CJK_SAMPLE = "日本語の文章とEnglishが混ざったテキスト。中文句子，包括标点符号！한국어 문장도 있습니다."


def rand_chars(rng, lo, hi, n, skip=()):
    out = []
    while len(out) < n:
        c = rng.randint(lo, hi)
        if c not in skip:
            out.append(chr(c))
    return "".join(out)


def word(rng):
    kind = rng.randrange(12)
    if kind <= 3:
        w = rng.choice(LATIN_WORDS)
        r = rng.random()
        return w.upper() if r < 0.1 else w.capitalize() if r < 0.3 else w
    if kind == 4:
        return rand_chars(rng, 0x4E00, 0x9FA5, rng.randint(1, 6))
    if kind == 5:
        return rand_chars(rng, 0xAC00, 0xD7A3, rng.randint(1, 4)) if rng.random() < 0.5 else \
            rand_chars(rng, 0x3041, 0x3093, rng.randint(1, 5)) + rand_chars(rng, 0x30A1, 0x30F3, rng.randint(0, 3))
    if kind == 6:  # Arabic letters with optional harakat
        return "".join(chr(rng.randint(0x0628, 0x064A)) + (chr(rng.randint(0x064B, 0x0652)) if rng.random() < 0.4 else "")
                       for _ in range(rng.randint(2, 7)) if True).replace("\u063b", "ب")
    if kind == 7:  # Devanagari consonant + vowel sign / virama
        return "".join(chr(rng.randint(0x0915, 0x0939)) + rng.choice(["", "\u093e", "\u093f", "\u0940", "\u0947", "\u094b", "\u094d", "\u0902"])
                       for _ in range(rng.randint(1, 5)))
    if kind == 8:
        return rand_chars(rng, 0x0410, 0x044F, rng.randint(2, 9))
    if kind == 9:
        return rand_chars(rng, 0x0391, 0x03C9, rng.randint(2, 8), skip={0x03A2})
    if kind == 10:
        return rng.choice(CONTRACTIONS)
    return rng.choice(EMOJI + COMBINING + NUMERIC)


def sep(rng):
    r = rng.random()
    if r < 0.70:
        return " "
    if r < 0.80:
        return rng.choice([", ", ". ", "! ", "? ", "; ", ": ", " - ", " (", ") ", "\"", "'", "...", "—", "、", "。", "،"])
    if r < 0.90:
        return rng.choice(SPACES)
    return rng.choice(NEWLINES)


def fragment(rng):
    kind = rng.randrange(20)
    if kind < 10:
        return "".join(word(rng) + sep(rng) for _ in range(rng.randint(3, 30)))
    if kind < 12:
        return rng.choice(CODE)
    if kind == 12:  # long digit run
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 400)))
    if kind == 13:  # whitespace run
        return "".join(rng.choice(SPACES + NEWLINES) for _ in range(rng.randint(1, 40))) + rng.choice(["", "x", "word", "\n"])
    if kind == 14:  # added token inside text, often followed by whitespace
        tok = rng.choice(ADDED)
        return rng.choice(["", " ", "a", "\n"]) + tok + rng.choice(["", " ", "  ", "\n", "\n\n", "\t x", "Hi", " Hi", "\u3000y", "\r\n"])
    if kind == 15:
        return rng.choice(NEAR_MISS) + rng.choice(["", " ", "x"])
    if kind == 16:
        return rng.choice([ARABIC_SAMPLE, HINDI_SAMPLE, CJK_SAMPLE])
    if kind == 17:
        return " " * rng.randint(1, 300) + rng.choice(["", "a", "\n"])  # long space runs
    if kind == 18:
        return rng.choice(["!!!", "???", "...", "----", "====", "////", "\\\\", "***", "''", "\"\"", "(((", ")))"]) * rng.randint(1, 30)
    return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 12)))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/tokenizer/corpus.jsonl"
    rng = random.Random(SEED)
    lines = [
        "hello world",
        " 日本語とEnglish 12345!\n",
        "\u001ca",
        "a\n\n",
        "a\ufffdb",
        "<|endoftext|>",
        "<|system|>You are a helpful assistant.<|end|><|user|>Hi<|end|><|assistant|>",
        "".join(ADDED),
        " ".join(ADDED),
        "\n".join(ADDED) + "\n",
    ]
    total = sum(len(s.encode()) for s in lines)
    while total < TARGET_BYTES:
        s = "".join(fragment(rng) for _ in range(rng.randint(1, 12)))
        lines.append(s)
        total += len(s.encode())
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for s in lines:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    print(f"{out}: {len(lines)} lines, {total} bytes of text")


if __name__ == "__main__":
    main()
