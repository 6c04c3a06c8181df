#!/usr/bin/env python3
"""Hugging Face `generate` on the same weights as `areno serve` (issue 7 benchmark peer).

Loads a checkpoint in the original phi4mm layout (e.g. `areno init --preset small`)
into transformers' native `Phi4MultimodalForCausalLM` (text model only, as
bench/model/peer_torch.py does) and runs `model.generate` on the chat prompts of
bench/serve/load.py: for each concurrency c, batches of c prompts (left padded),
sampling at temperature 1 (top_k off, top_p 1), exactly `--max-tokens` new tokens
each (EOS ignored through min_new_tokens, as the load test sets ignore_eos).
Batches run back to back for at least `--duration` seconds (and at least once).

Per-token times come from a logits processor that stamps each decoding step:
time to first token = first stamp - batch start (one prefill for the whole
batch), inter-token latency = differences between stamps (shared by the batch).
Prints one JSON object per concurrency, with the same keys as load.py.

usage: peer_hf_generate.py CHECKPOINT_DIR [--clients 1,8,32] [--max-tokens 64] [--duration 30]
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
from tokenizers import Tokenizer
from transformers import LogitsProcessor, LogitsProcessorList, Phi4MultimodalForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer = load_module("peer_torch", os.path.join(HERE, "..", "model", "peer_torch.py"))
load = load_module("load", os.path.join(HERE, "load.py"))


class Stamps(LogitsProcessor):
    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=30.0)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        c = json.load(f)
    model = Phi4MultimodalForCausalLM(peer.native_config(c)).float().eval()
    peer.load_into(model, peer.read_state(args.checkpoint))
    tok = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    pad = 199999
    for clients in [int(x) for x in args.clients.split(",")]:
        ttft, itl, tokens, batches = [], [], 0, 0
        t0 = time.perf_counter()
        while batches == 0 or time.perf_counter() - t0 < args.duration:
            prompts = [load.PROMPTS[(i + batches) % len(load.PROMPTS)] for i in range(clients)]
            ids = [tok.encode(f"<|user|>{p}<|end|><|assistant|>", add_special_tokens=False).ids for p in prompts]
            n = max(len(x) for x in ids)
            input_ids = torch.tensor([[pad] * (n - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in ids])
            stamps = Stamps()
            torch.manual_seed(batches)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                                     min_new_tokens=args.max_tokens, pad_token_id=pad,
                                     logits_processor=LogitsProcessorList([stamps]))
            end = time.perf_counter()
            new = out.shape[1] - n
            tokens += clients * new
            ttft += [stamps.t[0] - start] * clients
            gaps = [b - a for a, b in zip(stamps.t, stamps.t[1:])] + [end - stamps.t[-1]]
            itl += gaps[: new - 1] * clients
            batches += 1
        elapsed = time.perf_counter() - t0
        print(json.dumps({
            "peer": "hf_generate", "clients": clients, "duration_s": round(elapsed, 2),
            "max_tokens": args.max_tokens, "requests_ok": batches * clients, "generated_tokens": tokens,
            "throughput_tok_s": round(tokens / elapsed, 1),
            "ttft_p50_ms": round(1e3 * load.percentile(ttft, 50), 1), "ttft_p99_ms": round(1e3 * load.percentile(ttft, 99), 1),
            "itl_p50_ms": round(1e3 * load.percentile(itl, 50), 2), "itl_p99_ms": round(1e3 * load.percentile(itl, 99), 2),
        }), flush=True)


if __name__ == "__main__":
    main()
