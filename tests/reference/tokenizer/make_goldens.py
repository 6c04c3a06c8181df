#!/usr/bin/env python3
"""Golden ids for tests/tokenizer from the reference tokenizers.

  tiktoken  : o200k_base from the repository's rank file (no download),
              encode_ordinary (no special tokens) -> the "ordinary" ids;
  tokenizers: Hugging Face `tokenizers` loading the tokenizer.json that
              areno writes (build/tests/tokenizer/write_phi4_tokenizer DIR)
              -> the full ids (added tokens matched, rstrip applied).

Writes into tests/data/tokenizer/:
  golden.tsv         per corpus line: n_ord, fnv1a64(ord ids), n_hf, fnv1a64(hf ids)
  golden_sample.jsonl full ids of every 25th line: {"line", "ord", "hf"}
  prompts.json       worked examples of spec 2.2 / 2.6 / 2.7: rendered text and ids

Usage:
  pip install tiktoken tokenizers
  build/tests/tokenizer/write_phi4_tokenizer /tmp/phi4tok
  python3 tests/reference/tokenizer/make_goldens.py /tmp/phi4tok/tokenizer.json
"""
import json
import re
import struct
import sys

import tiktoken
import tiktoken.load
from tokenizers import Tokenizer

DATA = "tests/data/tokenizer"
RANK_FILE = "models/phi4mm/tokenizer/o200k_base.tiktoken"
# tiktoken's own o200k pattern (explicit contraction cases instead of (?i:)),
# as in shared/data/o200k_base.meta.json.
O200K_PAT = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def fnv1a64(ids):
    h = 0xCBF29CE484222325
    for b in struct.pack(f"<{len(ids)}I", *ids):
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def expand(ids, counts):
    out, seen = [], {200010: 0, 200011: 0}
    for i in ids:
        if i in counts:
            out += [i] * counts[i][seen[i]]
            seen[i] += 1
        else:
            out.append(i)
    return out


def main():
    hf = Tokenizer.from_file(sys.argv[1])
    enc = tiktoken.Encoding(name="o200k_base_local", pat_str=O200K_PAT,
                            mergeable_ranks=tiktoken.load.load_tiktoken_bpe(RANK_FILE),
                            special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018})
    lines = [json.loads(l) for l in open(f"{DATA}/corpus.jsonl", encoding="utf-8")]
    assert enc.encode_ordinary("hello world") == [24912, 2375]
    assert hf.encode("hello world", add_special_tokens=False).ids == [24912, 2375]

    added = re.compile("|".join(re.escape(t) for t in sorted(
        [t.content for t in hf.get_added_tokens_decoder().values()], key=len, reverse=True)))
    n_same = n_plain = 0
    with open(f"{DATA}/golden.tsv", "w") as g, open(f"{DATA}/golden_sample.jsonl", "w") as s:
        for k, line in enumerate(lines):
            ord_ids = enc.encode_ordinary(line)
            hf_ids = hf.encode(line, add_special_tokens=False).ids
            if not added.search(line):
                n_plain += 1
                n_same += ord_ids == hf_ids
            g.write(f"{len(ord_ids)}\t{fnv1a64(ord_ids):016x}\t{len(hf_ids)}\t{fnv1a64(hf_ids):016x}\n")
            if k % 25 == 0:
                s.write(json.dumps({"line": k, "ord": ord_ids, "hf": hf_ids}) + "\n")
    print(f"{len(lines)} lines; lines without added tokens where tiktoken == tokenizers: {n_same}/{n_plain}")

    # Worked examples. Text = what the chat template renders (spec 2.1).
    examples = [
        {"name": "spec 2.2 system+user+assistant+user",
         "messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "What is 2+2?"}],
         "text": "<|system|>You are a helpful assistant.<|end|><|user|>Hi<|end|><|assistant|>Hello! How can I help?"
                 "<|end|><|user|>What is 2+2?<|end|><|assistant|>",
         "image_tokens": [], "audio_tokens": []},
        {"name": "spec 2.6 one image (1344x896) and one audio (10 s)",
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "Describe the image and transcribe the audio."},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}},
             {"type": "input_audio", "input_audio": {"data": "UklGR...", "format": "wav"}}]}],
         "text": "<|user|><|image_1|>\n<|audio_1|>\nDescribe the image and transcribe the audio.<|end|><|assistant|>",
         "image_tokens": [1841], "audio_tokens": [125]},
        {"name": "spec 2.7 ASR prompt (5 s audio)",
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "<|audio_1|>Transcribe the audio clip into text."},
             {"type": "input_audio", "input_audio": {"data": "UklGR...", "format": "wav"}}]}],
         "text": "<|user|><|audio_1|>Transcribe the audio clip into text.<|end|><|assistant|>",
         "image_tokens": [], "audio_tokens": [63]},
        {"name": "spec 2.7 vision+speech, model-card form, two images",
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "<|image_1|><|image_2|><|audio_1|>"},
             {"type": "image_url", "image_url": {"url": "a"}},
             {"type": "image_url", "image_url": {"url": "b"}},
             {"type": "audio_url", "audio_url": {"url": "c"}}]}],
         "text": "<|user|><|image_1|><|image_2|><|audio_1|><|end|><|assistant|>",
         "image_tokens": [545, 460], "audio_tokens": [13]},
        {"name": "spec 5.1 tools in the system turn",
         "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
         "tools": [{"type": "function", "function": {"name": "get_weather_updates", "description": "Get weather",
                                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
         "text": "<|system|>You are a helpful assistant with some tools.<|tool|>[{\"name\": \"get_weather_updates\", "
                 "\"description\": \"Get weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, "
                 "\"type\": \"object\"}}]<|/tool|><|end|><|user|>What is the weather like in Paris today?<|end|><|assistant|>",
         "image_tokens": [], "audio_tokens": []},
    ]
    for ex in examples:
        rewritten = re.sub(r"<\|image_\d+\|>", "<|endoftext10|>", ex["text"])
        rewritten = re.sub(r"<\|audio_\d+\|>", "<|endoftext11|>", rewritten)
        ids = hf.encode(rewritten, add_special_tokens=False).ids
        ex["ids"] = expand(ids, {200010: ex["image_tokens"], 200011: ex["audio_tokens"]})
    json.dump(examples, open(f"{DATA}/prompts.json", "w"), ensure_ascii=False, indent=1)
    print(f"{len(examples)} prompt examples")


if __name__ == "__main__":
    main()
