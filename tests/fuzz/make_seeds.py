#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/<name>/).

Standard library only; the JPEG and PNG seeds come from a tiny C program
built against Debian's stb_image_write (cc must be on PATH). Run from the
repository root: python3 tests/fuzz/make_seeds.py. Corpora found by fuzzing
(scripts/fuzz.sh --merge) are added next to these seeds.
"""
import base64, io, json, math, os, struct, subprocess, tempfile, wave, zlib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(name, fname, data):
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def bmp(w, h):
    row = (w * 3 + 3) // 4 * 4
    px = b"".join(bytes([(x * 40) % 256, (y * 60) % 256, 128]) for y in range(h) for x in range(w))
    rows = b"".join(px[y * w * 3:(y + 1) * w * 3] + b"\0" * (row - w * 3) for y in range(h))
    hdr = b"BM" + struct.pack("<IHHI", 54 + len(rows), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, len(rows), 2835, 2835, 0, 0)
    return hdr + info + rows


def png(w, h):
    # one filter byte (0) per row
    raw = b"".join(b"\0" + b"".join(bytes([(x * 50) % 256, (y * 70) % 256, 30]) for x in range(w)) for y in range(h))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def jpeg(w, h):
    src = r'''
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#include <stdio.h>
static void out(void* c, void* d, int n) { fwrite(d, 1, n, stdout); }
int main(int argc, char** argv) {
  int w = %d, h = %d; unsigned char px[%d];
  for (int i = 0; i < w * h * 3; ++i) px[i] = (unsigned char)(i * 37);
  return !stbi_write_jpg_to_func(out, 0, w, h, 3, px, 80);
}''' % (w, h, w * h * 3)
    with tempfile.TemporaryDirectory() as d:
        c = os.path.join(d, "j.c")
        open(c, "w").write(src)
        subprocess.check_call(["cc", "-o", os.path.join(d, "j"), c, "-lm"])
        return subprocess.check_output([os.path.join(d, "j")])


def wav(seconds, rate, sampwidth=2, channels=1):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wv:
        wv.setnchannels(channels)
        wv.setsampwidth(sampwidth)
        wv.setframerate(rate)
        n = int(seconds * rate)
        amp = 2 ** (8 * sampwidth - 1) - 1
        def sample(i):
            v = int(amp * 0.3 * math.sin(2 * math.pi * 440 * i / rate))
            if sampwidth == 1:
                return (v + 128).to_bytes(1, "little")  # 8-bit WAV is unsigned
            return v.to_bytes(sampwidth, "little", signed=True)
        frames = b"".join(sample(i) * channels for i in range(n))
        wv.writeframes(frames)
    return buf.getvalue()


def float_wav(samples, rate=16000):
    data = b"".join(struct.pack("<f", s) for s in samples)
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


GIF = bytes.fromhex("47494638396101000100800000ffffff00000021f90401000000002c00000000010001000002024401003b")


def main():
    # images
    put("image", "tiny.bmp", bmp(3, 2))
    put("image", "tiny.png", png(5, 4))
    put("image", "tiny.jpg", jpeg(16, 9))
    put("image", "tiny.gif", GIF)
    put("image", "tiny.ppm", b"P6\n3 2\n255\n" + bytes(range(18)))
    put("image", "tiny.pgm", b"P5 2 2 255 " + bytes([0, 64, 128, 255]))
    put("image", "huge_declared.png", png(1, 1)[:16] + struct.pack(">II", 13000, 13000) + png(1, 1)[24:])
    # audio
    put("audio", "tone_16k.wav", wav(0.05, 16000))
    put("audio", "tone_8k_u8.wav", wav(0.06, 8000, sampwidth=1))
    put("audio", "tone_22k_stereo.wav", wav(0.03, 22050, channels=2))
    put("audio", "float_huge.wav", float_wav([1e30, -1e30] * 300))
    data = os.path.join(os.path.dirname(ROOT), "..", "data", "audio")
    for f, n in (("speech_16k_mono.ogg", 3000), ("speech_44k_mono.mp3", 3000), ("speech_22k_stereo.flac", 3000)):
        with open(os.path.join(data, f), "rb") as fh:
            put("audio", "head_" + f, fh.read(n))
    # requests
    img = "data:image/bmp;base64," + base64.b64encode(bmp(3, 2)).decode()
    aud = base64.b64encode(wav(0.05, 16000)).decode()
    reqs = {
        "chat_text.json": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|image_1|>"}],
                           "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "logit_bias": {"5": 2}},
        "chat_image_audio.json": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": img}}, {"type": "input_audio", "input_audio": {"data": aud, "format": "wav"}},
            {"type": "text", "text": "What is this?"}]}], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        "chat_tools.json": {"messages": [{"role": "user", "content": "weather?"},
                                         {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{\"c\": 1}"}}]},
                                         {"role": "tool", "content": "sunny"}],
                            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "integer"}}}}}]},
        "completion_ids.json": {"prompt": [[1, 2, 3], [200010, 5]], "max_tokens": 2, "echo": True, "logprobs": 2},
        "completion_text.json": {"prompt": "Once upon a time", "n": 2, "seed": 7, "min_tokens": 1, "max_tokens": 3},
        # Responses API bodies (serve/responses.h)
        "responses_items.json": {"input": [{"role": "developer", "content": "Use tools."},
                                           {"role": "user", "content": [{"type": "input_text", "text": "Add"},
                                                                        {"type": "input_image", "image_url": img}]},
                                           {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":1}"},
                                           {"type": "function_call_output", "call_id": "c1", "output": "1"},
                                           {"type": "reasoning"}],
                                 "instructions": "Be brief.", "max_output_tokens": 9,
                                 "tools": [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
                                 "tool_choice": {"type": "function", "name": "add"}},
        "responses_format.json": {"input": "Give JSON", "stream": True, "top_logprobs": 2, "metadata": {"k": "v"},
                                  "text": {"format": {"type": "json_schema", "name": "o", "strict": True,
                                                      "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
                                  "include": ["message.output_text.logprobs"]},
    }
    for k, v in reqs.items():
        put("request", k, json.dumps(v))
    put("request", "deep.json", "[" * 70 + "]" * 70)
    # safetensors
    for f in ("golden.safetensors", "written_by_areno.safetensors"):
        with open(os.path.join(data, "..", "io", f), "rb") as fh:
            put("safetensors", f, fh.read())
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "__metadata__": {"k": "v"}}).encode()
    put("safetensors", "small.safetensors", struct.pack("<Q", len(hdr)) + hdr + bytes(16))
    # tokenizer.json
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyzĠ!,.")}
    vocab.update({"ab": len(vocab), "abc": len(vocab) + 1})
    tj = {"version": "1.0", "normalizer": None, "added_tokens": [{"id": 40, "content": "<|user|>", "special": True}],
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": "\\s?\\p{L}+|\\s?\\p{N}{1,3}|\\s?[^\\s\\p{L}\\p{N}]+|\\s+"}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
          "decoder": {"type": "ByteLevel"},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False, "ignore_merges": False,
                    "vocab": vocab, "merges": ["a b", "ab c"]}}
    put("tokenizer_json", "tiny.json", json.dumps(tj, ensure_ascii=False))
    # regular expressions (guided_regex)
    patterns = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,3}\.", r".{5,40}",
                r'\{"a": \d+, "b": "[^"]*"\}', "(日本|中国)語?", r"^(?P<y>19|20)\d\d-(0[1-9]|1[0-2])$",
                r"[\u0400-\u04FF]+ [^\x00-\x7F]{2}", r"(a|b)*a(a|b){5}", r"a+?b*+c{2,}[]x-][^]a]", r"(?=a)b",
                r"[[:alpha:]]", r"a{1001}", r"(.{0,50}){20}", r"\w+@\w+\.(com|org)", ""]
    for i, p in enumerate(patterns):
        put("regex", "seed_%02d" % i, p)
    # context-free grammars (guided_grammar, GBNF)
    grammars = [
        'root ::= "[" item (", " item){0,3} "]"\nitem ::= [a-z]+ | "(" item ")"',
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
        'root ::= object\nobject ::= "{" (pair ("," pair)*)? "}"\npair ::= "\\"" [a-z]* "\\":" value\n'
        'value ::= object | [0-9]+ | "true"',
        'root ::= item*\nitem ::= "(" root ")" | "[" root "]"',
        'root ::= w{1,8} "."\nw ::= [a-z] | [a-z] [a-z]  # words',
        'root ::= [\\u3040-\\u309F]{2} "\\u00e9" [^\\x00-\\x7f]?',
        'root ::= ("x"?)*', 'root ::= a\na ::= a "b" | "c"', 'root ::= "a" root', 'root ::= x',
        'root ::= "a"{2,5} | "b"{3,} | .', "root: 'a'", 'root ::= "a" | "ab" | "abc"',
    ]
    for i, g in enumerate(grammars):
        put("cfg", "seed_%02d" % i, g)
    dataset_seeds(img, aud)


def dataset_seeds(img, aud):
    """Training dataset files (fuzz_dataset.cpp): the first byte picks the
    format (0 .json, 1 .jsonl, 2 .csv, 3 .tsv), the rest is the file."""
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "What is shown?"},
                                                      {"type": "image_url", "image_url": {"url": img}}]},
                         {"role": "assistant", "content": "A square."},
                         {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": aud, "format": "wav"}},
                                                      {"type": "text", "text": "And this?"}]},
                         {"role": "assistant", "content": "A tone."}]}
    pr = {"prompt": "What is 2 + 3?", "response": "5", "answer": "5"}
    dpo = {"prompt": [{"role": "user", "content": "What is 2 times 3?"}], "chosen": "6", "rejected": "5"}
    rows = [chat, pr, dpo, {"prompt": "x", "response": ""}, {"messages": []}]
    put("dataset", "rows.json", b"\x00" + json.dumps(rows).encode())
    put("dataset", "rows.jsonl", b"\x01" + "\n".join(json.dumps(r) for r in rows).encode() + b"\n{bad\n\n")
    csv = 'prompt,response\n"What is ""2 + 3""?",5\n"a, b",c\n"[{""role"": ""user"", ""content"": ""hi""}]",yo\n'
    put("dataset", "rows.csv", b"\x02" + csv.encode())
    put("dataset", "rows.tsv", b"\x03" + "messages\tanswer\n".encode() + json.dumps(chat["messages"][:3]).encode()
        + b"\t1\r\n\"unclosed\n")


if __name__ == "__main__":
    main()
