#!/usr/bin/env python3
"""PyTorch eager peer of bench_audio: the same measurements on the SAME weights and input.

  features_30s    transformers' Phi4MultimodalFeatureExtractor (numpy/torch STFT) on the
                  same 30 s signal (formula as bench_audio.cpp), return_tensors="pt"
  frontend_30s    model.embed(model.encoder_embedding(features)) of transformers'
                  Phi4MultimodalAudioModel at the released widths, weights read from
                  bench_audio's file (released names -> native names); the input is the port
                  extractor's output (one mel bin differs from the released one, spec 3.13,
                  which does not change the work done)
  block_30s       model.encoders[0] on the 375 rows with a [1, 16, 375, 375] additive bias
  encoder_30s_NB  the whole Phi4MultimodalAudioModel (eager attention) with N blocks
  project_30s     up_proj_for_speech -> GELU -> down_proj_for_speech on the 375 rows

Timing: median of REPS after one warm-up; torch.set_num_threads(THREADS).
usage: peer_torch.py WEIGHTS.safetensors [--reps N] [--blocks N]
"""
import json
import math
import os
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import Phi4MultimodalAudioConfig, Phi4MultimodalFeatureExtractor
from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalAudioModel

PREFIX = "model.embed_tokens_extend.audio_embed."


def emit(**kw):
    print(json.dumps(kw), flush=True)


def median_min_ms(f, reps):
    f()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return t[len(t) // 2], t[0]


def signal_30s():
    t = np.arange(480000, dtype=np.float64) / 16000.0
    v = 0.3 * np.sin(2 * np.pi * (200.0 * t + (3800.0 / 60.0) * t * t)) + 0.2 * np.sin(2 * np.pi * 440.0 * t)
    return np.rint(v * 32767.0) / 32768.0


def native_name(n):
    n = n.replace(".net.0.linear.", ".gate_up_proj.").replace(".net.2.", ".down_proj.")
    for a, b in (("q_proj", "linear_q"), ("k_proj", "linear_k"), ("v_proj", "linear_v"), ("o_proj", "linear_out")):
        n = n.replace(f".self_attn.{b}.", f".self_attn.{a}.")
    return n


def main():
    path = sys.argv[1]
    reps, blocks = 5, 3
    args = sys.argv[2:]
    for i in range(0, len(args) - 1, 2):
        if args[i] == "--reps":
            reps = int(args[i + 1])
        if args[i] == "--blocks":
            blocks = int(args[i + 1])
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))

    x = signal_30s()
    fe = Phi4MultimodalFeatureExtractor()
    out = {}
    ms, mn = median_min_ms(lambda: out.__setitem__("f", fe(x, sampling_rate=16000, return_tensors="pt")), reps)
    feats = out["f"]["audio_input_features"]
    emit(bench="features_30s", ms=ms, min_ms=mn, frames=int(feats.shape[1]))

    state = load_file(path)
    cfg = Phi4MultimodalAudioConfig(num_blocks=blocks, bias_max_distance=500)
    cfg._attn_implementation = "eager"
    model = Phi4MultimodalAudioModel(cfg).eval()
    sd = {native_name(k[len(PREFIX + "encoder."):]): v for k, v in state.items() if k.startswith(PREFIX + "encoder.")}
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ms, mn = median_min_ms(lambda: out.__setitem__("e", model.embed(model.encoder_embedding(feats), None)[0]), reps)
        h = out["e"]
        emit(bench="frontend_30s", ms=ms, min_ms=mn, rows=int(h.shape[1]))
        g = torch.Generator().manual_seed(2)
        bias = torch.randn(1, cfg.num_attention_heads, h.shape[1], h.shape[1], generator=g)
        ms, mn = median_min_ms(lambda: model.encoders[0](h, bias), reps)
        emit(bench="block_30s", ms=ms, min_ms=mn)
        ms, mn = median_min_ms(lambda: out.__setitem__("h", model(feats, None)), max(1, reps // 2))
    h = out["h"]
    emit(bench=f"encoder_30s_{blocks}b", ms=ms, min_ms=mn, rows=int(h.shape[1]),
         out0_3=[round(float(v), 6) for v in h[0, 0, :4]])
    up_w, up_b = state[PREFIX + "audio_projection.speech.0.weight"], state[PREFIX + "audio_projection.speech.0.bias"]
    dn_w, dn_b = state[PREFIX + "audio_projection.speech.2.weight"], state[PREFIX + "audio_projection.speech.2.bias"]
    rows = h[0]
    F = torch.nn.functional
    with torch.no_grad():
        ms, mn = median_min_ms(lambda: F.linear(F.gelu(F.linear(rows, up_w, up_b)), dn_w, dn_b), reps)
    emit(bench="project_30s", ms=ms, min_ms=mn)


if __name__ == "__main__":
    main()
