#!/usr/bin/env python3
"""End-to-end multimodal logits goldens (tests/model/test_e2e.cpp, issues 5 and 6).

Reads the tiny checkpoint `areno init --preset tiny --seed 5 --dtype f32` writes (the
released original layout: text model with both LoRAs, SigLIP tower + projector, Conformer
encoder + both audio projectors, tower sizes in config.json under "img_processor" and
"audio_processor.config"), builds transformers' `Phi4MultimodalForCausalLM` with the same
sizes, adds the vision and speech LoRAs through peft, loads every weight under its
original name (spec text.md 7.1, vision.md 9.4, audio.md 8.3) and runs three prompts:

  a  two images of different crop counts: 896x448 (2x1 grid, 3 crops, 801 tokens) then
     448x448 (1x1, 2 crops, 545 tokens; its padding crop is processed and dropped)
     -> vision LoRA (input_mode 1)
  b  speech only: one 1.25 s chirp at 16 kHz (16 tokens) -> speech LoRA, speech projector
     (input_mode 2)
  c  audio then image in one user message: a 1.25 s two-tone clip at 8 kHz (fill-zero
     path, 16 tokens), then a 448x896 image (1x2 grid, 801 tokens) -> vision LoRA, vision
     audio projector (input_mode 3)

The checkpoint is not committed (the 200064 x 64 embedding alone is 51 MB): the C++ test
rebuilds it in memory with init_phi4mm("tiny", 5, f32), which is deterministic. Token ids
are written by hand (no tokenizer): text ids are fixed, placeholders are expanded to the
processors' counts (spec text.md 5.2). No media is committed either: the images come from
the spec's pixel formula (vision.md 12) at sizes that need neither resize nor padding, so
the released processor reduces to the few lines in `process_image` and the transformers
port and the released code agree (no padded patches, spec vision.md 4.4); the clips come
from the formulas in `clip_b` / `clip_c`, and their features from the numpy transcription
of the released extractor (tests/reference/audio/phi4mm_extractor.py; the port's
extractor differs by one mel-filter bin, spec audio.md). One clip per prompt, so the
encoder runs unmasked, where the port equals the released code (audio.md 5.6).

Attention: eager for the two towers (the port's SigLIP has is_causal = True, which SDPA
would honour when no mask is built; eager ignores it), SDPA for the text model.

Stored per prompt p (f32 unless noted), at a few selected positions P (inside and
around every media block, and the last rows):
  p.ids [S] i64            the whole prompt with expanded placeholders
  p.positions [P] i64      the rows stored below
  p.h0 [P, 64]             merged input embeddings (media rows at placeholders)
  p.logits [P, 1024]       logits, first 1024 vocabulary columns
  p.argmax [P] i64, p.max [P], p.lse [P]   over the whole 200064-column vocabulary
  p.media_row_sums [M]     sum over hidden of every media row, in prompt order
  p.media_row_abs [M]      same with |.|

Usage (from the repository root; about a minute on 2 cores):
    pip install torch transformers==5.24.0 peft safetensors numpy
    meson setup build-e2e -Dcuda=disabled && ninja -C build-e2e app/areno
    python3 tests/reference/model/make_e2e_golden.py --areno build-e2e/app/areno
  or, with a directory written by `areno init --preset tiny --seed 5 --dtype f32`:
    python3 tests/reference/model/make_e2e_golden.py --checkpoint DIR
"""
import argparse
import contextlib
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers
from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM
from peft import LoraConfig, get_peft_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "model", "e2e_golden.safetensors")
IMAGE_PREFIX = "model.embed_tokens_extend.image_embed."
AUDIO_PREFIX = "model.embed_tokens_extend.audio_embed."
PEFT_TARGETS = r"model\.layers\.\d+\.((self_attn\.(qkv|o)_proj)|(mlp\.(gate_up|down)_proj))"
IMG, AUD = 200010, 200011
USER, END, ASSISTANT = 200021, 200020, 200019
CROP, PATCH = 448, 14
COLS = 1024  # logits columns stored


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The released audio feature extractor (numpy, no side effects on import).
extractor = load_module("phi4mm_extractor", os.path.join(ROOT, "tests", "reference", "audio", "phi4mm_extractor.py"))


# ---- names: transformers-native -> released (copied from the tower golden scripts;
# importing them would also install their attention patches, which are not wanted here:
# nothing is padded in these prompts) ----
def vision_released_name(n):
    """tests/reference/vision/make_vision_tower_golden.py: released_name (spec vision.md 9.4)."""
    for a, b in (("img_projection_up.", "img_projection.0."), ("img_projection_down.", "img_projection.2."),
                 ("global_img_feature_extensor", "glb_GN"), ("sub_img_feature_extensor", "sub_GN")):
        if n.startswith(a):
            return b + n[len(a):]
    return n


def audio_released_name(n):
    """tests/reference/audio/make_audio_encoder_golden.py: released_name (spec audio.md 8.3)."""
    n = n.replace("up_proj_for_speech", "audio_projection.speech.0")
    n = n.replace("down_proj_for_speech", "audio_projection.speech.2")
    n = n.replace("up_proj_for_vision_speech", "audio_projection.vision.0")
    n = n.replace("down_proj_for_vision_speech", "audio_projection.vision.2")
    n = n.replace(".gate_up_proj.", ".net.0.linear.").replace(".down_proj.", ".net.2.")
    for a, b in (("q_proj", "linear_q"), ("k_proj", "linear_k"), ("v_proj", "linear_v"), ("o_proj", "linear_out")):
        n = n.replace(f".self_attn.{a}.", f".self_attn.{b}.")
    return n


def released_name(peft_name):
    """peft-wrapped native model name -> original checkpoint name (None: not stored)."""
    n = peft_name.removeprefix("base_model.model.")
    if n == "lm_head.weight":
        return None  # tied to model.embed_tokens.weight
    if n.startswith(IMAGE_PREFIX):
        return IMAGE_PREFIX + vision_released_name(n[len(IMAGE_PREFIX):])
    if n.startswith(AUDIO_PREFIX):
        return AUDIO_PREFIX + audio_released_name(n[len(AUDIO_PREFIX):])
    # LM: peft's base_layer / lora_A.<adapter> names are the original ones (spec text.md 3.4a).
    return n


# ---- media ----
def synthetic(w, h):
    """Spec vision.md 12: R=(7x+3y), G=x^y, B=5(x+2y)+x*y, all mod 256; HWC uint8."""
    y, x = np.mgrid[0:h, 0:w].astype(np.int64)
    return np.stack([(7 * x + 3 * y) % 256, (x ^ y) % 256, (5 * (x + 2 * y) + x * y) % 256], -1).astype(np.uint8)


def process_image(w, h):
    """The released processor for sizes that are multiples of 448 (no resize, no padding)."""
    assert w % CROP == 0 and h % CROP == 0
    gw, gh = w // CROP, h // CROP
    x = torch.from_numpy(synthetic(w, h)).permute(2, 0, 1).float()
    x = ((x / 255.0) - 0.5) / 0.5
    thumb = torch.nn.functional.interpolate(x[None], size=(CROP, CROP), mode="bicubic", align_corners=False)[0]
    crops = [thumb] + [x[:, r * CROP:(r + 1) * CROP, c * CROP:(c + 1) * CROP] for r in range(gh) for c in range(gw)]
    tokens = (gh * gw + 1) * 256 + 1 + (gh + 1) * 16  # spec text.md 5.2, no padding
    return torch.stack(crops), (h, w), tokens


def image_batch(sizes):
    per = [process_image(w, h) for (w, h) in sizes]
    nmax = max(len(c) for c, _, _ in per)
    pix = torch.zeros(len(per), nmax, 3, CROP, CROP)
    msk = torch.ones(len(per), nmax, CROP // PATCH, CROP // PATCH)
    for i, (c, _, _) in enumerate(per):
        pix[i, :len(c)] = c
    return pix, torch.tensor([s for _, s, _ in per], dtype=torch.int64), msk, [t for _, _, t in per]


def clip_b():
    """1.25 s linear chirp 200 -> 3200 Hz at 16 kHz: 0.5 sin(2 pi (200 t + 1200 t^2))."""
    t = np.arange(20000, dtype=np.float64) / 16000.0
    return np.sin(2 * np.pi * (200.0 * t + 1200.0 * t * t)) * 0.5, 16000


def clip_c():
    """1.25 s at 8 kHz: 0.3 sin(2 pi 440 t) + 0.2 sin(2 pi 1250 t)."""
    t = np.arange(10000, dtype=np.float64) / 8000.0
    return 0.3 * np.sin(2 * np.pi * 440.0 * t) + 0.2 * np.sin(2 * np.pi * 1250.0 * t), 8000


def audio_inputs(clip):
    wav, fs = clip
    f = extractor.extract(wav, fs)  # [T, 80] f32
    return torch.from_numpy(f)[None], torch.tensor([math.ceil(f.shape[0] / 8)], dtype=torch.int64)


# ---- model ----
def read_checkpoint(d):
    state = {}
    for path in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                state[k] = f.get_tensor(k)
    return state


def build(ckpt_dir):
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    rs = c["rope_scaling"]
    # null in the released config: the SigLIP-so400m sizes (spec 1.1; areno's config.cpp)
    vp = c.get("img_processor") or dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                        num_attention_heads=16, image_size=448, patch_size=14,
                                        layer_norm_eps=1e-6, layer_idx=-2)
    ap = c["audio_processor"]["config"]
    cfg = Phi4MultimodalConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], max_position_embeddings=c["max_position_embeddings"],
        original_max_position_embeddings=c["original_max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": c["rope_theta"],
                         "partial_rotary_factor": c["partial_rotary_factor"],
                         "short_factor": rs["short_factor"], "long_factor": rs["long_factor"],
                         "original_max_position_embeddings": c["original_max_position_embeddings"]},
        partial_rotary_factor=c["partial_rotary_factor"], bos_token_id=c["bos_token_id"],
        eos_token_id=[c["eos_token_id"]], pad_token_id=c["pad_token_id"],
        sliding_window=None,  # 262144 in config.json: no effect at these lengths
        embd_pdrop=0.0,
        vision_config=dict(hidden_size=vp["hidden_size"], intermediate_size=vp["intermediate_size"],
                           num_hidden_layers=vp["num_hidden_layers"], num_attention_heads=vp["num_attention_heads"],
                           image_size=vp["image_size"], patch_size=vp["patch_size"],
                           layer_norm_eps=vp["layer_norm_eps"], feature_layer=vp["layer_idx"], crop_size=CROP),
        audio_config=dict(hidden_size=ap["attention_dim"], intermediate_size=ap["linear_units"],
                          num_blocks=ap["num_blocks"], num_attention_heads=ap["attention_heads"],
                          ext_pw_out_channel=ap["ext_pw_out_channel"],
                          depthwise_separable_out_channel=ap["depthwise_seperable_out_channel"],
                          nemo_conv_channels=ap["nemo_conv_settings"]["conv_channels"],
                          bias_max_distance=ap["relative_attention_bias_args"]["t5_bias_max_distance"],
                          input_size=ap["input_size"], time_reduction=ap["time_reduction"],
                          kernel_size=ap["kernel_size"], left_chunk=ap["left_chunk"],
                          chunk_size=ap["chunk_size"]),
    )
    cfg._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "eager"
    cfg.audio_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Phi4MultimodalForCausalLM(cfg).eval()
    img = model.model.embed_tokens_extend.image_embed
    assert img.img_processor.config._attn_implementation == "eager", img.img_processor.config._attn_implementation
    assert model.model.embed_tokens_extend.audio_embed.encoder.config._attn_implementation == "eager"

    lora = {}
    for name in ("vision", "speech"):
        lc = c[f"{name}_lora"]
        lora[name] = LoraConfig(r=int(lc["r"]), lora_alpha=lc["lora_alpha"], lora_dropout=0.0,
                                target_modules=PEFT_TARGETS)
    pm = get_peft_model(model, lora["vision"], adapter_name="vision")
    pm.add_adapter("speech", lora["speech"])

    state = read_checkpoint(ckpt_dir)
    used = set()
    with torch.no_grad():
        for k, p in pm.state_dict(keep_vars=True).items():
            orig = released_name(k)
            if orig is None:
                continue
            assert orig in state, f"{k} -> {orig} not in the checkpoint"
            src = state[orig]
            assert tuple(src.shape) == tuple(p.shape), f"{orig}: {tuple(src.shape)} vs {tuple(p.shape)}"
            p.copy_(src.to(p.dtype))
            used.add(orig)
    left = sorted(set(state) - used)
    assert not left, f"checkpoint tensors not loaded: {left[:8]}"
    assert pm.base_model.model.lm_head.weight.data_ptr() == pm.base_model.model.model.embed_tokens.weight.data_ptr()
    pm.eval()
    return pm, len(used)


def pick_positions(ids):
    """Rows to store: the first two, the edges and a few inner rows of every media block
    (the first rows of each image block are sub-crop rows, the block's last 17 rows the
    global rows + separators), the row after each block, and the last four."""
    s = len(ids)
    pos = {0, 1, s - 4, s - 3, s - 2, s - 1}
    i = 0
    while i < s:
        if ids[i] in (IMG, AUD):
            j = i
            while j < s and ids[j] == ids[i]:
                j += 1
            n = j - i
            for off in (0, 1, n // 3, n // 2, n - 18, n - 17, n - 2, n - 1):
                if 0 <= off < n:
                    pos.add(i + off)
            if j < s:
                pos.add(j)
            i = j
        else:
            i += 1
    return sorted(pos)


def run(pm, prompt, adapter):
    inner = pm.base_model.model  # Phi4MultimodalForCausalLM with the LoRA layers injected
    captured = {}
    hook = inner.model.embed_tokens_extend.register_forward_hook(lambda m, a, out: captured.setdefault("h0", out))
    try:
        with torch.no_grad():
            if adapter == "none":
                with pm.disable_adapter():
                    out = inner.model(**prompt["inputs"], use_cache=False)
            else:
                pm.set_adapter(adapter)
                out = inner.model(**prompt["inputs"], use_cache=False)
    finally:
        hook.remove()
    pos = torch.tensor(prompt["positions"])
    h = out.last_hidden_state[0, pos]
    logits = inner.lm_head(h).float()
    return captured["h0"][0].float(), logits


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def checkpoint_args(out_default):
    """The command line of a golden script that needs the tiny checkpoint: --areno or
    --checkpoint, and --out. Also fixes torch's thread count (the goldens' last bits depend on it)."""
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--areno", help="the areno binary: runs `init --preset tiny --seed 5 --dtype f32`")
    g.add_argument("--checkpoint", help="a directory written by `areno init --preset tiny --seed 5 --dtype f32`")
    ap.add_argument("--out", default=out_default)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return args


@contextlib.contextmanager
def tiny_checkpoint(args, prefix):
    """The checkpoint directory: args.checkpoint, or one `args.areno init` writes to a temporary
    directory removed afterwards."""
    if not args.areno:
        yield args.checkpoint
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        ckpt = os.path.join(tmp, "tiny")
        subprocess.run([args.areno, "init", "--preset", "tiny", "--out", ckpt, "--seed", "5", "--dtype", "f32"],
                       check=True)
        yield ckpt


def main():
    args = checkpoint_args(OUT)
    with tiny_checkpoint(args, "areno_e2e_") as ckpt:
        return write_golden(args, ckpt)


def write_golden(args, ckpt):
    pm, n_loaded = build(ckpt)
    print(f"loaded {n_loaded} tensors from {ckpt}")

    prompts = {}
    # (a) two images, 3 and 2 crops (the second padded to 3 in the batch)
    pix, sizes, msk, toks = image_batch([(896, 448), (448, 448)])
    ids = [USER, 9125, 220] + [IMG] * toks[0] + [198, 3436, 220] + [IMG] * toks[1] + [23719, 13, END, ASSISTANT]
    prompts["a"] = dict(adapter="vision", ids=ids, inputs=dict(
        image_pixel_values=pix, image_sizes=sizes, image_attention_mask=msk))
    # (b) speech only
    feats, asz = audio_inputs(clip_b())
    ids = [USER] + [AUD] * int(asz[0]) + [4827, 495, 13, END, ASSISTANT]
    prompts["b"] = dict(adapter="speech", ids=ids, inputs=dict(
        audio_input_features=feats, audio_embed_sizes=asz))
    # (c) audio then image in one message
    feats, asz = audio_inputs(clip_c())
    pix, sizes, msk, toks = image_batch([(448, 896)])
    ids = [USER, 12194, 220] + [AUD] * int(asz[0]) + [326, 220] + [IMG] * toks[0] + [13, END, ASSISTANT]
    prompts["c"] = dict(adapter="vision", ids=ids, inputs=dict(
        image_pixel_values=pix, image_sizes=sizes, image_attention_mask=msk,
        audio_input_features=feats, audio_embed_sizes=asz))

    gold, meta = {}, {"transformers": transformers.__version__, "torch": torch.__version__,
                      "checkpoint": "areno init --preset tiny --seed 5 --dtype f32", "columns": str(COLS)}
    for key, p in prompts.items():
        ids = p["ids"]
        p["inputs"]["input_ids"] = torch.tensor([ids])
        p["positions"] = pick_positions(ids)
        h0, logits = run(pm, p, p["adapter"])
        media = torch.tensor([t in (IMG, AUD) for t in ids])
        rows = h0[media]
        top2 = logits.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).min().item()
        gold[f"{key}.ids"] = torch.tensor(ids, dtype=torch.int64)
        gold[f"{key}.positions"] = torch.tensor(p["positions"], dtype=torch.int64)
        gold[f"{key}.h0"] = h0[p["positions"]].contiguous()
        gold[f"{key}.logits"] = logits[:, :COLS].contiguous()
        gold[f"{key}.argmax"] = logits.argmax(-1).to(torch.int64)
        gold[f"{key}.max"] = logits.max(-1).values.contiguous()
        gold[f"{key}.lse"] = torch.logsumexp(logits, -1).contiguous()
        gold[f"{key}.media_row_sums"] = rows.sum(-1).contiguous()
        gold[f"{key}.media_row_abs"] = rows.abs().sum(-1).contiguous()
        # How far the other adapters are: the tolerance must separate them.
        others = [a for a in ("none", "vision", "speech") if a != p["adapter"]]
        sep = {a: rel(run(pm, p, a)[1], logits) for a in others}
        meta[f"{key}.adapter"] = p["adapter"]
        meta[f"{key}.other_adapters_rel"] = json.dumps(sep)
        meta[f"{key}.min_top2_gap"] = f"{gap:.6g}"
        print(f"{key}: {len(ids)} tokens, {int(media.sum())} media rows, {len(p['positions'])} stored rows, "
              f"adapter {p['adapter']}, other adapters rel {sep}, min top-2 gap {gap:.3g}, "
              f"logit scale {logits.abs().max().item():.3g}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in gold.items()}, args.out, metadata=meta)
    os.chmod(args.out, 0o644)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")


if __name__ == "__main__":
    sys.exit(main())
