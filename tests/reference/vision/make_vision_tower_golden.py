#!/usr/bin/env python3
"""Golden files for the SigLIP tower, pooling, separator layout and projector
(tests/vision/test_vision_tower.cpp).

Builds a TINY random-weight image embedding with the transformers-native port
(`transformers.models.phi4_multimodal.Phi4MultimodalImageEmbedding`, eager
attention), saves its weights under the RELEASED checkpoint names (spec
vision.md section 9, prefix `model.embed_tokens_extend.image_embed.` kept) and
writes, for three image batches, the tower output of layer -2, the pooled
features, the projector input (layout with sub_GN / glb_GN) and the projected
rows to tests/data/vision/tower_golden.safetensors.

Inputs are synthetic images (the spec's section 12 pixel formula) whose sizes
need no resize (one side fills the canvas at scale 1), so the released
processor reduces to white padding, float32 normalisation, the torch bicubic
thumbnail and the patch masks; those few lines are reproduced below. The C++
test rebuilds the same pixel tensors with our processor and checks them
against the per-crop sums stored here, so no pixel tensor is committed.

Where the transformers port differs from the released code the spec is
followed (vision.md 4.4): padded queries get a zero attention output (the
released flash-attention-2 behaviour), implemented by wrapping the eager
attention function. Rows of batch (c) are also written with the port's own
convention (padded queries attend) under the `_attend` names.

Weights are drawn in float32, rounded to bfloat16 and stored as bfloat16, so
the f32 and bf16 C++ models hold exactly the same values.

Usage (from the repository root):
    pip install torch transformers==5.24.0 safetensors numpy
    python3 tests/reference/vision/make_vision_tower_golden.py
"""
import json
import math
import os

import numpy as np
import torch
from safetensors.torch import save_file

import transformers
from transformers import Phi4MultimodalConfig
from transformers.models.phi4_multimodal import modeling_phi4_multimodal as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "vision")
PREFIX = "model.embed_tokens_extend.image_embed."

# ---- tiny sizes: the released structure (448 crops, 14-pixel patches, 32x32
# patches, 2x2 pooling to 16x16, layer -2 of the stored layers), narrow widths ----
WIDTH, HEADS, INTER, LAYERS = 16, 2, 40, 3   # head_dim 8; layers 0,1 used, layer 2 stored only
TEXT_HIDDEN = 12                              # projector 16 -> 12 -> 12
CROP, PATCH = 448, 14
EPS = 1e-6

# (W, H) of the images of each batch: no resize needed for any of them.
BATCHES = {
    "a": [(896, 448)],               # one image, 2x1 grid (even-g thumbnail), no padding
    "b": [(448, 448), (896, 290)],   # 2 and 3 crops (image 0 gets a padding crop); rows masked in image 1
    "c": [(290, 448), (896, 730)],   # masked columns (21 valid); 2x2 grid with 53 valid rows; 3 padding crops
}


def synthetic(w, h):
    """Spec section 12: R=(7x+3y), G=x^y, B=5(x+2y)+x*y, all mod 256; HWC uint8."""
    y, x = np.mgrid[0:h, 0:w].astype(np.int64)
    r = (7 * x + 3 * y) % 256
    g = (x ^ y) % 256
    b = (5 * (x + 2 * y) + x * y) % 256
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def process(w, h):
    """The released processor (spec section 1) for sizes that need no resize."""
    gw, gh = math.ceil(w / CROP), math.ceil(h / CROP)
    assert gw * gh <= 36
    wc, hc = CROP * gw, CROP * gh
    rw, rh = wc / w, hc / h
    if rw < rh:
        new_w, new_h, pad_w, pad_h = wc, int(h * rw), 0, hc - int(h * rw)
    else:
        new_w, new_h, pad_w, pad_h = int(w * rh), hc, wc - int(w * rh), 0
    assert (new_w, new_h) == (w, h), "choose sizes that need no resize"
    canvas = np.full((hc, wc, 3), 255, np.uint8)
    canvas[:h, :w] = synthetic(w, h)
    x = torch.from_numpy(canvas).permute(2, 0, 1).float()
    x = x / 255.0
    x = x - 0.5
    x = x / 0.5
    thumb = torch.nn.functional.interpolate(x[None], size=(CROP, CROP), mode="bicubic", align_corners=False)[0]
    crops = [thumb] + [x[:, r * CROP:(r + 1) * CROP, c * CROP:(c + 1) * CROP] for r in range(gh) for c in range(gw)]
    p = CROP // PATCH
    mask = torch.ones(p * gh, p * gw)
    mask[p * gh - pad_h // PATCH:, :] = 0
    mask[:, p * gw - pad_w // PATCH:] = 0
    masks = [torch.ones(p, p)] + [mask[r * p:(r + 1) * p, c * p:(c + 1) * p] for r in range(gh) for c in range(gw)]
    valid_cols, valid_rows = p * gw - pad_w // PATCH, p * gh - pad_h // PATCH
    uw, uh = (valid_cols + 1) // 2, (valid_rows + 1) // 2
    tokens = 273 + uh * (uw + 1)
    return torch.stack(crops), torch.stack(masks), (hc, wc), tokens


def process_batch(sizes):
    per = [process(w, h) for (w, h) in sizes]
    nmax = max(len(c) for c, _, _, _ in per)
    pix = torch.zeros(len(per), nmax, 3, CROP, CROP)
    msk = torch.ones(len(per), nmax, CROP // PATCH, CROP // PATCH)
    for i, (c, m, _, _) in enumerate(per):
        pix[i, :len(c)] = c
        msk[i, :len(m)] = m
    image_sizes = torch.tensor([s for _, _, s, _ in per], dtype=torch.int64)
    return pix, msk, image_sizes, [t for _, _, _, t in per], [len(c) for c, _, _, _ in per]


# ---- the released padded-query convention (spec 4.4) on top of eager attention ----
_eager = mp.simple_eager_attention_forward
CONVENTION = {"zero_padded_queries": True}


def reference_attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
    out, w = _eager(module, q, k, v, attention_mask, scaling, dropout, **kwargs)  # out [B, T, H, D]
    if CONVENTION["zero_padded_queries"] and attention_mask is not None:
        # The mask is [B, 1, Tq, Tk] additive; query t is padded iff key t is.
        key_ok = attention_mask[:, 0, 0, :] > -1.0  # [B, T]
        out = out * key_ok[:, :, None, None].to(out.dtype)
    return out, w


mp.simple_eager_attention_forward = reference_attention


def build():
    torch.manual_seed(1234)
    cfg = Phi4MultimodalConfig(
        vocab_size=64, hidden_size=TEXT_HIDDEN, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, embd_pdrop=0.0,
        vision_config=dict(hidden_size=WIDTH, intermediate_size=INTER, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, image_size=CROP, patch_size=PATCH,
                           layer_norm_eps=EPS, crop_size=CROP, feature_layer=-2),
    )
    cfg.vision_config._attn_implementation = "eager"
    emb = mp.Phi4MultimodalImageEmbedding(cfg).eval()
    # Random weights that exercise everything: biases and norms not at their defaults.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in emb.named_parameters():
            if name.endswith("layer_norm1.weight") or name.endswith("layer_norm2.weight") or "layernorm.weight" in name:
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif "position_embedding" in name or "extensor" in name or "probe" in name:
                v = 0.5 * torch.randn(p.shape, generator=g)
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            else:
                fan_in = p[0].numel()
                v = torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(fan_in))
            p.copy_(v.to(torch.bfloat16).float())
    return cfg, emb


def check_bucketing(emb):
    """The port's position ids equal floor(32 i / n) (spec 4.3) for every n: read
    them back through an embedding whose first channel holds the position."""
    e = emb.img_processor.embeddings
    saved = {k: v.clone() for k, v in e.state_dict().items()}
    p = CROP // PATCH
    with torch.no_grad():
        e.patch_embedding.weight.zero_()
        e.patch_embedding.bias.zero_()
        e.position_embedding.weight.zero_()
        e.position_embedding.weight[:, 0] = torch.arange(p * p, dtype=torch.float32)
        for n in range(1, p + 1):
            mask = torch.zeros(1, p, p, dtype=torch.bool)
            mask[0, :n, :n] = True
            pos = e(torch.zeros(1, 3, CROP, CROP), mask)[0, :, 0].reshape(p, p)
            want = torch.tensor([[(p * i // n) * p + (p * j // n) if i < n and j < n else 0 for j in range(p)]
                                 for i in range(p)], dtype=torch.float32)
            assert torch.equal(pos, want), f"position bucketing differs from floor(32 i / n) for n = {n}"
        e.load_state_dict(saved)


def released_name(hf_name):
    """transformers-native -> released names (spec 9.4)."""
    for a, b in (("img_projection_up.", "img_projection.0."), ("img_projection_down.", "img_projection.2."),
                 ("global_img_feature_extensor", "glb_GN"), ("sub_img_feature_extensor", "sub_GN")):
        if hf_name.startswith(a):
            return b + hf_name[len(a):]
    return hf_name


def run(emb, pix, msk, sizes, tokens):
    """All stages for one batch."""
    n = sum(tokens)
    captured = []
    hook = emb.img_projection_up.register_forward_pre_hook(lambda m, args: captured.append(args[0][0].clone()))
    with torch.no_grad():
        ids = torch.full((1, n), cfg.vision_config.image_token_id)
        rows = emb(ids, torch.zeros(1, n, TEXT_HIDDEN), pix, image_sizes=sizes, image_attention_mask=msk)[0]
        flat_mask = msk.flatten(0, 1).bool()
        out = emb.img_processor(pix.flatten(0, 1), patch_attention_mask=flat_mask, output_hidden_states=True)
        hidden = out.hidden_states[-2]                     # [n * Nmax, 1024, W]
        pooled = emb.get_img_features(pix.flatten(0, 1), attention_mask=flat_mask)  # [n * Nmax, 256, W]
    hook.remove()
    return hidden, pooled, torch.cat(captured, 0), rows


if __name__ == "__main__":
    cfg, emb = build()
    check_bucketing(emb)
    weights = {PREFIX + released_name(k): v.detach().to(torch.bfloat16).contiguous()
               for k, v in emb.state_dict().items()}
    os.makedirs(OUT, exist_ok=True)
    save_file(weights, os.path.join(OUT, "tower_tiny.safetensors"), metadata={"format": "pt"})

    gold = {}
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "width": str(WIDTH), "heads": str(HEADS), "intermediate": str(INTER), "layers": str(LAYERS),
            "text_hidden": str(TEXT_HIDDEN)}
    for key, sizes in BATCHES.items():
        pix, msk, image_sizes, tokens, crops = process_batch(sizes)
        nmax = pix.shape[1]
        gold[f"{key}_wh"] = torch.tensor(sizes, dtype=torch.int64)
        gold[f"{key}_image_sizes"] = image_sizes
        gold[f"{key}_num_tokens"] = torch.tensor(tokens, dtype=torch.int64)
        gold[f"{key}_crop_counts"] = torch.tensor(crops, dtype=torch.int64)
        # Per-crop sums of the pixel tensor (f64), to check the C++ processor gives the same input.
        gold[f"{key}_pixel_sums"] = pix.double().sum(dim=(2, 3, 4))
        gold[f"{key}_pixel_abs_sums"] = pix.double().abs().sum(dim=(2, 3, 4))
        gold[f"{key}_mask_sums"] = msk.double().sum(dim=(2, 3))
        hidden, pooled, tokens_in, rows = run(emb, pix, msk, image_sizes, tokens)
        real = [i * nmax + k for i, c in enumerate(crops) for k in range(c)]
        gold[f"{key}_rows"] = rows.contiguous()
        if key == "a":
            gold["a_pooled"] = pooled[real].contiguous()
            gold["a_tokens"] = tokens_in.contiguous()
        if key == "c":
            # Tower output of the two partly masked crops only (image 0 crop 1: columns;
            # image 1 crop 3: rows), to keep the file small.
            gold["c_hidden_index"] = torch.tensor([1, nmax + 3], dtype=torch.int64)
            gold["c_hidden"] = hidden[[1, nmax + 3]].contiguous()
            CONVENTION["zero_padded_queries"] = False
            _, _, _, rows_att = run(emb, pix, msk, image_sizes, tokens)
            CONVENTION["zero_padded_queries"] = True
            gold["c_rows_attend"] = rows_att.contiguous()
    save_file({k: v.contiguous() for k, v in gold.items()}, os.path.join(OUT, "tower_golden.safetensors"),
              metadata=meta)
    for f in ("tower_tiny.safetensors", "tower_golden.safetensors"):
        os.chmod(os.path.join(OUT, f), 0o644)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in ("tower_tiny.safetensors", "tower_golden.safetensors"))
    print(f"wrote tower_tiny.safetensors and tower_golden.safetensors ({total / 1024:.0f} KiB)")
    for key in BATCHES:
        print(key, "tokens", gold[f"{key}_num_tokens"].tolist(), "crops", gold[f"{key}_crop_counts"].tolist())
