#!/usr/bin/env python3
"""PyTorch eager peer of bench_vision: the same measurements on the SAME weights.

Tower: transformers' `Phi4MultimodalVisionModel` (transformers 5.24, the SigLIP
module of the phi4_multimodal port) at the released widths with the number of
layers bench_vision wrote, loaded from its --save-weights file (checkpoint
names; the `model.embed_tokens_extend.image_embed.img_processor.` prefix is
dropped). Timed as bench_vision does: embeddings, one encoder layer, and
embeddings + all layers, per crop, median of --reps runs after a warm-up.
Attention runs through SDPA with no mask. The port's vision attention sets
`is_causal = True`, which transformers' SDPA path honours when no mask is
given (an unpadded crop would get causal attention); it is switched off here
so both sides compute the same bidirectional attention (checked through
hidden0_3 by run.sh).

Preprocessing: PIL decode + convert('RGB') of the JPEG bytes in memory, then
`Phi4MultimodalImageProcessor` (torchvision backend) to tensors.

usage: peer_torch.py WEIGHTS.safetensors [--reps N] [--jpeg FILE]   (THREADS env, default 2)
"""
import io
import json
import os
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file

from transformers import Phi4MultimodalVisionConfig
from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalVisionModel

PREFIX = "model.embed_tokens_extend.image_embed.img_processor."


def emit(**kw):
    print(json.dumps(kw), flush=True)


def median_ms(f, reps):
    f()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append((time.perf_counter() - t0) * 1e3)
    return sorted(t)[len(t) // 2]


def bench_crops(n):
    """bench_vision's crops: the spec's synthetic formula, crop k shifted by 448 k columns."""
    y, x = np.mgrid[0:448, 0:448].astype(np.int64)
    out = []
    for k in range(n):
        xx = x + 448 * k
        ch = [(7 * xx + 3 * y) % 256, (xx ^ y) % 256, (5 * (xx + 2 * y) + xx * y) % 256]
        v = torch.from_numpy(np.stack(ch).astype(np.float32))
        out.append(((v / 255.0) - 0.5) / 0.5)
    return torch.stack(out)


def main():
    args = sys.argv[1:]
    weights = args[0]
    reps = int(args[args.index("--reps") + 1]) if "--reps" in args else 5
    jpeg = args[args.index("--jpeg") + 1] if "--jpeg" in args else None
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))

    sd = {k[len(PREFIX):]: v for k, v in load_file(weights).items() if k.startswith(PREFIX)}
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers."))
    cfg = Phi4MultimodalVisionConfig(num_hidden_layers=layers)
    cfg._attn_implementation = "sdpa"
    model = Phi4MultimodalVisionModel(cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    for mod in model.modules():
        if hasattr(mod, "is_causal"):
            mod.is_causal = False

    with torch.no_grad():
        for n in (1, 4):
            crops = bench_crops(n)
            mask = torch.ones(n, 32, 32, dtype=torch.bool)
            h0 = model.embeddings(crops, patch_attention_mask=mask)
            embed = median_ms(lambda: model.embeddings(crops, patch_attention_mask=mask), reps) / n
            per = [median_ms(lambda: layer(h0, None), reps) / n for layer in model.encoder.layers]
            layer_ms = sum(per) / len(per)

            def tower():
                h = model.embeddings(crops, patch_attention_mask=mask)
                for layer in model.encoder.layers:
                    h = layer(h, None)
                return h

            h = tower()
            all_ms = median_ms(tower, reps) / n
            emit(bench=f"tower_embed_b{n}", ms=round(embed, 3))
            emit(bench=f"tower_layer_b{n}", ms=round(layer_ms, 3))
            emit(bench=f"tower_b{n}", ms=round(all_ms, 3), layers=layers, hidden0_3=[float(v) for v in h[0, 0, :4]])
            emit(bench=f"tower_full_est_b{n}", ms=round(embed + 26 * layer_ms, 1), layers=26)

    if jpeg:
        from PIL import Image
        from transformers import Phi4MultimodalImageProcessor
        proc = Phi4MultimodalImageProcessor()
        data = open(jpeg, "rb").read()
        box = {}

        def run():
            im = Image.open(io.BytesIO(data)).convert("RGB")
            box["out"] = proc(images=[im], return_tensors="pt")

        ms = median_ms(run, reps * 2)
        out = box["out"]
        emit(bench="preprocess_jpeg", ms=round(ms, 3), tokens=int(out["num_img_tokens"][0]),
             crops=int(out["image_pixel_values"].shape[1]))


if __name__ == "__main__":
    main()
