#!/usr/bin/env python3
"""Golden files for the Phi-4-multimodal audio encoder tests (tests/audio/test_audio_encoder.cpp).

Builds a TINY random-weight audio tower with the transformers-native port
(`transformers.models.phi4_multimodal`: Phi4MultimodalAudioEmbedding, which holds
Phi4MultimodalAudioModel and the speech / vision projectors), saves its weights under
the RELEASED checkpoint names (spec audio.md section 8.1, prefix
`model.embed_tokens_extend.audio_embed.`) and runs three cases:

  short  one clip, T = 97 feature frames (13 encoder frames), no mask
  long   one clip, T = 4100 (513 encoder frames: two 500-frame windows, the second
         padded with zero rows that are NOT masked, spec 5.5), no mask
  batch  three clips of 4020 / 61 / 130 frames padded to 4020, with the processor's
         audio_attention_mask (B > 1)

The port and the released code differ in the batched case (spec 5.6): the port adds
the boolean padding mask to the float T5 bias (+1 / +0) instead of masking padded
keys. This script follows the spec: it patches the attention mask to -inf at masked
keys and the attention to zero the probabilities of masked keys (the released
masked_softmax), so windows whose keys are all padding give zero attention.

Inputs are not stored: every feature value comes from a xorshift32 stream that the
C++ test regenerates exactly (`features(seed, T)` below): value = (q - 64) / 16 with
q = (state >> 8) % 129, in [-4, 4], exact in f32.

Usage (from the repository root):
    pip install torch transformers safetensors numpy   # transformers 5.24
    python3 tests/reference/audio/make_audio_encoder_golden.py
Writes tests/data/audio/encoder_tiny.safetensors (weights, released names),
tests/data/audio/encoder_tiny_config.json and tests/data/audio/encoder_golden.safetensors.
"""
import json
import math
import os

import numpy as np
import torch
from safetensors.torch import save_file

import transformers
import transformers.models.phi4_multimodal.modeling_phi4_multimodal as mm
from transformers import Phi4MultimodalConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "audio")
PREFIX = "model.embed_tokens_extend.audio_embed."

# Tiny sizes; every width differs from the others so a transposed weight cannot pass.
D, HEADS, FFN, BLOCKS, CONV_CH, MAXD, PROJ = 32, 4, 24, 2, 8, 64, 24


def xorshift_features(seed, t, f=80):
    """[t, f] float32 from xorshift32 (state != 0): x ^= x<<13; x ^= x>>17; x ^= x<<5."""
    x = seed & 0xFFFFFFFF
    out = np.empty(t * f, dtype=np.float32)
    for i in range(t * f):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        q = (x >> 8) % 129
        out[i] = (q - 64) / 16.0
    return out.reshape(t, f)


def original_config_json():
    """The audio part of the original (remote-code) config.json, tiny sizes."""
    return {
        "hidden_size": PROJ,
        "audio_processor": {"name": "cascades", "config": {
            "activation": "swish", "attention_dim": D, "attention_heads": HEADS, "batch_norm": False,
            "bias_in_glu": True, "causal": True, "chunk_size": -1, "cnn_layer_norm": True,
            "conv_activation": "swish", "conv_glu_type": "swish", "depthwise_multiplier": 1,
            "depthwise_seperable_out_channel": D, "dropout_rate": 0.0,
            "encoder_embedding_config": {"input_size": 80}, "ext_pw_kernel_size": 1,
            "ext_pw_out_channel": D, "input_layer": "nemo_conv", "input_size": 80, "kernel_size": 3,
            "left_chunk": 18, "linear_units": FFN, "nemo_conv_settings": {"conv_channels": CONV_CH},
            "num_blocks": BLOCKS, "relative_attention_bias_args": {"t5_bias_max_distance": MAXD, "type": "t5"},
            "time_reduction": 8}},
    }


def released_name(n):
    """transformers-native name -> released name (spec 8.3), without the prefix."""
    n = n.replace("up_proj_for_speech", "audio_projection.speech.0")
    n = n.replace("down_proj_for_speech", "audio_projection.speech.2")
    n = n.replace("up_proj_for_vision_speech", "audio_projection.vision.0")
    n = n.replace("down_proj_for_vision_speech", "audio_projection.vision.2")
    n = n.replace(".gate_up_proj.", ".net.0.linear.").replace(".down_proj.", ".net.2.")
    for a, b in (("q_proj", "linear_q"), ("k_proj", "linear_k"), ("v_proj", "linear_v"), ("o_proj", "linear_out")):
        n = n.replace(f".self_attn.{a}.", f".self_attn.{b}.")
    return n


# ---- spec 5.6 masking (the released masked_softmax) instead of the port's bool + bias ----
def spec_attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    p = torch.softmax(w, dim=-1, dtype=torch.float32)
    if attention_mask is not None:
        p = p.masked_fill(torch.isneginf(attention_mask), 0.0)  # all-masked rows: NaN -> 0
    o = torch.matmul(p.to(q.dtype), v)
    return o.transpose(1, 2).contiguous(), p


mm.simple_eager_attention_forward = spec_attention


def unfold_tensor_released(tensor, max_seq_len):
    """The released unfold_tensor: the port's version views a non-contiguous tensor and
    fails for B > 1 with more than one window; windows come out batch-major either way."""
    _, _, dim = tensor.shape
    tensor = tensor.transpose(-1, -2)
    tensor = torch.nn.functional.unfold(tensor[..., None, :], kernel_size=(1, max_seq_len), stride=(1, max_seq_len))
    new_bsz, _, slen = tensor.shape
    tensor = tensor.view(new_bsz, -1, max_seq_len, slen).permute(0, 3, 2, 1).contiguous()
    return tensor.view(-1, max_seq_len, dim)


mm.unfold_tensor = unfold_tensor_released
def run_encoder(model, feats, mask):
    """Encoder forward: the port's own code with the attention mask made spec-exact.

    The port builds `attention_mask = hs_mask.unsqueeze(1) + bias` (bool + float); we
    intercept the first layer call and rebuild it as bias masked with -inf."""
    enc = model.encoder
    captured = {}
    orig_calc = enc.calculate_hs_mask
    orig_fwd_emb = enc.forward_embeddings

    def fwd_emb(h, m):
        h, hs, m2 = orig_fwd_emb(h, m)
        captured["hs"] = hs
        return h, hs, m2

    def calc(h, dev, m):
        hs = orig_calc(h, dev, m)
        captured["hs"] = hs
        return hs

    enc.forward_embeddings = fwd_emb
    enc.calculate_hs_mask = calc
    layers = list(enc.encoders)
    orig_layer_fwds = [l.forward for l in layers]

    def make(l, f):
        def fwd(hidden_states, attention_mask):
            hs = captured["hs"]  # [N, L, L] bool, true = attend
            bias = attention_mask - hs.unsqueeze(1).to(attention_mask.dtype)  # undo the "+ bool"
            am = bias.masked_fill(~hs.unsqueeze(1), float("-inf"))
            return f(hidden_states, am)
        return fwd

    for l, f in zip(layers, orig_layer_fwds):
        l.forward = make(l, f)
    try:
        return enc(feats, mask)
    finally:
        enc.forward_embeddings = orig_fwd_emb
        enc.calculate_hs_mask = orig_calc
        for l, f in zip(layers, orig_layer_fwds):
            l.forward = f


def project(model, h, mode):
    up = model.up_proj_for_speech if mode == "speech" else model.up_proj_for_vision_speech
    down = model.down_proj_for_speech if mode == "speech" else model.down_proj_for_vision_speech
    return down(torch.nn.functional.gelu(up(h)))


def main():
    torch.manual_seed(1234)
    cfg = Phi4MultimodalConfig(
        hidden_size=PROJ,
        audio_config=dict(hidden_size=D, intermediate_size=FFN, num_blocks=BLOCKS, num_attention_heads=HEADS,
                          ext_pw_out_channel=D, depthwise_separable_out_channel=D, nemo_conv_channels=CONV_CH,
                          bias_max_distance=MAXD, input_size=80, time_reduction=8, kernel_size=3))
    cfg.audio_config._attn_implementation = "eager"
    model = mm.Phi4MultimodalAudioEmbedding(cfg).eval().float()

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("global_mean"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
            elif name.endswith("global_invstd"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "bias_values" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "layer_norm" in name:
                p.copy_((1.0 if leaf == "weight" else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("b1", "b2"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.numel() // p.shape[0] if p.dim() > 1 else None
                if fan_in is None:  # a bias: use its weight's fan-in
                    w = dict(model.named_parameters())[name[: -len("bias")] + "weight"]
                    fan_in = w.numel() // w.shape[0]
                bound = 1.0 / math.sqrt(fan_in)
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)

    state = {PREFIX + released_name(k): v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    os.makedirs(OUT, exist_ok=True)
    save_file(state, os.path.join(OUT, "encoder_tiny.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "encoder_tiny_config.json"), "w") as f:
        json.dump(original_config_json(), f, indent=1)
        f.write("\n")

    golden = {}
    cases = {
        "short": ([97], 101),
        "long": ([4100], 202),
        "batch": ([4020, 61, 130], 303),
    }
    with torch.no_grad():
        for case, (lens, seed) in cases.items():
            tmax = max(lens)
            feats = np.zeros((len(lens), tmax, 80), dtype=np.float32)
            for i, t in enumerate(lens):
                feats[i, :t] = xorshift_features(seed + i, t)
            x = torch.from_numpy(feats)
            mask = None
            if len(lens) > 1:  # the processor's audio_attention_mask exists only for B > 1
                mask = torch.arange(tmax)[None, :] < torch.tensor(lens)[:, None]
            h = run_encoder(model, x, mask)
            sizes = [math.ceil(t / 8) for t in lens]
            rows = torch.cat([h[i, : sizes[i]] for i in range(len(lens))], 0)
            golden[f"{case}.encoder"] = rows.contiguous()
            # Both projectors for the short clip; one each for the others (keeps the file small).
            if case in ("short", "long"):
                golden[f"{case}.speech"] = project(model, rows, "speech").contiguous()
            if case in ("short", "batch"):
                golden[f"{case}.vision"] = project(model, rows, "vision").contiguous()
            golden[f"{case}.lengths"] = torch.tensor(lens, dtype=torch.int64)
            golden[f"{case}.seeds"] = torch.tensor([seed + i for i in range(len(lens))], dtype=torch.int64)
            print(case, "T'", sizes, "rows", tuple(rows.shape))
        # The same long clip with the port's own (unpatched) code path, as a check
        # that the single-clip path needs no patch (no mask -> bias + 1 everywhere).
        feats = torch.from_numpy(xorshift_features(202, 4100))[None]
        port = model.encoder(feats, None)
        assert torch.allclose(port[0], golden["long.encoder"], atol=1e-5), "port differs on the unmasked path"
        # Ones at padded keys vs -inf: the batch case is where the port differs (spec 5.6).
        lens = [4020, 61, 130]
        feats = torch.zeros(3, 4020, 80)
        for i, t in enumerate(lens):
            feats[i, :t] = torch.from_numpy(xorshift_features(303 + i, t))
        mask = torch.arange(4020)[None, :] < torch.tensor(lens)[:, None]
        port = model.encoder(feats, mask)
        d = (port[2, :17] - golden["batch.encoder"][503 + 8:]).abs().max().item()
        print(f"port vs spec on the batch (clip 2): max abs diff {d:.3g}")
        golden["batch.port_encoder_clip2"] = port[2, :17].contiguous()

    save_file(golden, os.path.join(OUT, "encoder_golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    for name in ("encoder_golden.safetensors", "encoder_tiny.safetensors"):
        os.chmod(os.path.join(OUT, name), 0o644)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
