#!/usr/bin/env python3
"""Encode throughput of tiktoken and HF tokenizers on the same corpus, one
thread, same output format as bench_tokenizer ("<impl> <mode> <MB/s>").

  python3 bench/tokenizer/peer_tokenizer.py CORPUS.jsonl RANK_FILE TOKENIZER_JSON

tiktoken: encode_ordinary per line (o200k_base from the local rank file).
tokenizers: Tokenizer.encode per line (added tokens matched), parallelism off.
Best of 5 passes; MB = 10^6 bytes of UTF-8 input.
"""
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import tiktoken  # noqa: E402
import tiktoken.load  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

PAT = json.load(open(os.path.join(os.path.dirname(__file__), "o200k_pattern.json")))["pat_str"]


def best(fn, nbytes, passes=5):
    out = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        out = max(out, nbytes / (time.perf_counter() - t0) / 1e6)
    return out


def main():
    corpus, rank_file, tok_json = sys.argv[1:4]
    lines = [json.loads(l) for l in open(corpus, encoding="utf-8")]
    nbytes = sum(len(l.encode()) for l in lines)
    enc = tiktoken.Encoding(name="o200k_base_local", pat_str=PAT,
                            mergeable_ranks=tiktoken.load.load_tiktoken_bpe(rank_file),
                            special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018})
    load_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        hf = Tokenizer.from_file(tok_json)
        load_s.append(time.perf_counter() - t0)
    print(f"# tokenizers tokenizer.json load {min(load_s):.3f} s (best of 3)")
    print(f"tiktoken ordinary {best(lambda: [enc.encode_ordinary(l) for l in lines], nbytes):.2f}")
    print(f"tokenizers full {best(lambda: [hf.encode(l, add_special_tokens=False) for l in lines], nbytes):.2f}")


if __name__ == "__main__":
    main()
