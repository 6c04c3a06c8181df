#!/usr/bin/env python3
"""PyTorch eager peer of bench_model: the same measurements on the SAME weights.

Loads the checkpoint (original phi4mm layout, e.g. `areno init --preset small`)
into transformers' native port `transformers.models.phi4_multimodal`
(Phi4MultimodalForCausalLM): original names map to native ones by dropping
`.base_layer` from the four adapted projections (spec text.md 7.1); the LoRA
tensors are not loaded (the benchmark runs the base model, as bench_model does
with with_lora = false). The vision/audio towers are built tiny and left
random: they take no part in a text-only forward.

Prints one JSON line per measurement, same names as bench_model:
  load                     safetensors read + rename + load_state_dict into a
                           model built beforehand (construction not timed:
                           it runs a random init areno does not do)
  prefill_512_last_logits  no_grad forward of 512 tokens, logits_to_keep=1
  prefill_512_hidden       no_grad forward of the inner model (final-norm hidden states)
  train_fwd_bwd_512        forward, mean next-token cross-entropy, backward
  decode_bN                one step of N sequences with HF's DynamicCache
                           after a 32-token prompt (model(..., past_key_values,
                           use_cache=True) steps, greedy argmax)

usage: peer_torch.py CHECKPOINT_DIR [--reps N]   (THREADS env, default 2)
"""
import glob
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM


def emit(**kw):
    print(json.dumps(kw), flush=True)


def bench_ids(n, vocab, seed):
    """The same xorshift ids as bench_model.cpp's bench_ids."""
    mask = (1 << 64) - 1
    x = (0x9E3779B97F4A7C15 * (seed + 1)) & mask
    out = []
    for _ in range(n):
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        out.append(3 + x % (vocab - 3))
    return out


def best_ms(f, reps):
    f()  # warm-up
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def native_config(c):
    rs = c.get("rope_scaling") or {}
    rope = {"rope_type": "longrope" if rs else "default", "rope_theta": c.get("rope_theta", 10000.0),
            "partial_rotary_factor": c["partial_rotary_factor"]}
    if rs:
        rope.update(short_factor=rs["short_factor"], long_factor=rs["long_factor"],
                    original_max_position_embeddings=c["original_max_position_embeddings"])
    eos = c.get("eos_token_id", 2)
    cfg = Phi4MultimodalConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], max_position_embeddings=c["max_position_embeddings"],
        original_max_position_embeddings=c["original_max_position_embeddings"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_word_embeddings=True, rope_parameters=rope,
        partial_rotary_factor=c["partial_rotary_factor"], bos_token_id=c.get("bos_token_id", 1),
        eos_token_id=eos if isinstance(eos, list) else [eos], pad_token_id=c.get("pad_token_id", 0),
        sliding_window=None,
        # Towers are unused by a text-only forward; keep them tiny so construction is quick.
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2},
        audio_config={"hidden_size": 16, "intermediate_size": 32, "num_blocks": 1, "num_attention_heads": 2,
                      "nemo_conv_channels": 16, "depthwise_separable_out_channel": 16,
                      "ext_pw_out_channel": 16},
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def read_state(ckpt):
    """Text-model base tensors under native names (spec 7.1)."""
    state = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        for k, v in load_file(f).items():
            if ".lora_" in k or k.startswith("model.embed_tokens_extend.") or k == "lm_head.weight":
                continue
            state[k.replace(".base_layer.", ".")] = v
    return state


def load_into(model, state):
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("model.embed_tokens_extend.") and k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the native port: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    model.tie_weights()


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: peer_torch.py CHECKPOINT_DIR [--reps N]")
    ckpt = sys.argv[1]
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 5
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    with open(os.path.join(ckpt, "config.json")) as f:
        c = json.load(f)
    model = Phi4MultimodalForCausalLM(native_config(c)).float().eval()

    ms = best_ms(lambda: load_into(model, read_state(ckpt)), max(1, reps // 2))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    emit(bench="load", device="cpu", ms=round(ms, 3))

    V, T = c["vocab_size"], 512
    ids = torch.tensor([bench_ids(T, V, 0)])
    with torch.no_grad():
        ms = best_ms(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), reps)
        head = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1, :4].tolist()
        emit(bench="prefill_512_last_logits", device="cpu", ms=round(ms, 3), tok_s=round(T / ms * 1e3, 1),
             logits0_3=[round(v, 6) for v in head])
        ms = best_ms(lambda: model.model(input_ids=ids, use_cache=False), reps)
        emit(bench="prefill_512_hidden", device="cpu", ms=round(ms, 3), tok_s=round(T / ms * 1e3, 1))

    params = [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens_extend.")]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def train_step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        F.cross_entropy(logits[:-1], ids[0, 1:]).backward()

    ms = best_ms(train_step, max(1, reps // 2))
    emit(bench="train_fwd_bwd_512", device="cpu", ms=round(ms, 3), tok_s=round(T / ms * 1e3, 1))
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)

    prompt, steps = 32, 32
    with torch.no_grad():
        for batch in (1, 8):
            best, first = 1e30, None
            pids = torch.tensor([bench_ids(prompt, V, 100 + s) for s in range(batch)])
            for r in range(max(1, reps // 2) + 1):
                out = model(input_ids=pids, use_cache=True, logits_to_keep=1)
                pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                toks = [int(nxt[0, 0])]
                t0 = time.perf_counter()
                for _ in range(steps):
                    out = model(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)
                    pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    toks.append(int(nxt[0, 0]))
                ms = (time.perf_counter() - t0) * 1e3 / steps
                if r > 0:
                    best = min(best, ms)
                first = toks[:8]
            emit(bench=f"decode_b{batch}", device="cpu", ms=round(best, 3), tok_s=round(batch / best * 1e3, 1),
                 first_tokens=first)

    src = torch.ones(1 << 26)
    dst = torch.empty_like(src)
    ms = best_ms(lambda: dst.copy_(src), reps)
    emit(bench="copy_256MiB", device="cpu", ms=round(ms, 3), gbps=round(2 * src.numel() * 4 / ms / 1e6, 2))


if __name__ == "__main__":
    main()
