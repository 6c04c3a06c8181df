#!/usr/bin/env python3
"""SFT trainer goldens (issue 14, must-show 1 and 2), written to tests/data/train/:

  grad_golden.safetensors   one mixed micro-batch (text, image, audio, image+audio rows) on
                            the tiny checkpoint in f32: token-mean cross-entropy loss and the
                            gradient of every trainable parameter, every group unfrozen
  optim_golden.safetensors  three AdamW steps, three learning-rate groups with decay /
                            no-decay sub-groups, warm-up + cosine or linear decay, global-norm
                            clipping: torch.optim.AdamW on small fake parameters

The model side reuses tests/reference/model/make_e2e_golden.py (imported, not copied): the
tiny checkpoint written by `areno init --preset tiny --seed 5 --dtype f32` is loaded into
transformers' Phi4MultimodalForCausalLM (5.24) with the vision and speech LoRAs added through
peft, every checkpoint tensor mapped and checked; the media (formula image, chirp, 8 kHz
clip) and their placeholder counts come from the same functions.

The tensors, the row layout, the loss and the checks are described in
tests/reference/train/README.md (the contract with tests/train/).

Usage (from the repository root; about 1.5 minutes on 2 cores, most of it the f64 self-check):
    pip install torch transformers==5.24.0 peft safetensors numpy
    meson setup build -Dcuda=disabled && ninja -C build app/areno
    python3 tests/reference/train/make_train_golden.py --areno build/app/areno
  or, with a directory written by `areno init --preset tiny --seed 5 --dtype f32`:
    python3 tests/reference/train/make_train_golden.py --checkpoint DIR
  `--only optim` writes only optim_golden.safetensors (no checkpoint needed);
  `--skip-f64-check` skips the float64 analytic / finite-difference self-check.
"""
import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
from transformers.models.phi4_multimodal import modeling_phi4_multimodal as mm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT_DIR = os.path.join(ROOT, "tests", "data", "train")
CHECKPOINT_CMD = "areno init --preset tiny --seed 5 --dtype f32"


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Model loading, name mapping, media and placeholder counts (no side effects on import).
e2e = load_module("make_e2e_golden", os.path.join(ROOT, "tests", "reference", "model", "make_e2e_golden.py"))

IMG, AUD = e2e.IMG, e2e.AUD
USER, END, ASSISTANT = e2e.USER, e2e.END, e2e.ASSISTANT
IMAGE_PREFIX, AUDIO_PREFIX = e2e.IMAGE_PREFIX, e2e.AUDIO_PREFIX
EMBED = "model.embed_tokens.weight"
# Checkpoint tensors that are buffers (never trained): the audio encoder's CMVN.
BUFFERS = {AUDIO_PREFIX + "encoder.encoder_embedding.global_mean",
           AUDIO_PREFIX + "encoder.encoder_embedding.global_invstd"}
FIXED_EMBED_ROWS = [0, 1, 2, 100, 1000, 50000, 100000, 150000, 199999, 200063]
ADAPTER_CODE = {"none": 0, "vision": 1, "speech": 2}


# ================================================================ A: gradient golden ====
def make_rows():
    """The four rows of the micro-batch (each its own sequence, positions from 0)."""
    rows = []
    ids = [USER, 1008, 2501, 318, 4440, 30, END, ASSISTANT, 4821, 13, 777, END]
    rows.append(dict(name="r0", kind="text", adapter="none", ids=ids, inputs={}))

    pix, sizes, msk, toks = e2e.image_batch([(448, 448)])
    ids = [USER] + [IMG] * toks[0] + [3923, 374, 420, 30, END, ASSISTANT, 2579, 13, END]
    rows.append(dict(name="r1", kind="image", adapter="vision", ids=ids, inputs=dict(
        image_pixel_values=pix, image_sizes=sizes, image_attention_mask=msk)))

    feats, asz = e2e.audio_inputs(e2e.clip_b())
    ids = [USER] + [AUD] * int(asz[0]) + [8144, 420, END, ASSISTANT, 1114, 2204, 1303, END]
    rows.append(dict(name="r2", kind="audio", adapter="speech", ids=ids, inputs=dict(
        audio_input_features=feats, audio_embed_sizes=asz)))

    feats, asz = e2e.audio_inputs(e2e.clip_c())
    pix, sizes, msk, toks = e2e.image_batch([(448, 448)])
    ids = [USER] + [AUD] * int(asz[0]) + [IMG] * toks[0] + [3923, 30, END, ASSISTANT, 9712, 13, END]
    rows.append(dict(name="r3", kind="image+audio", adapter="vision", ids=ids, inputs=dict(
        image_pixel_values=pix, image_sizes=sizes, image_attention_mask=msk,
        audio_input_features=feats, audio_embed_sizes=asz)))

    for r in rows:
        ids = r["ids"]
        a = ids.index(ASSISTANT)
        assert ids.count(ASSISTANT) == 1 and ids[-1] == END
        # target[t] = ids[t+1] for t = a .. len-2 (the answer tokens and the final <|end|>)
        r["targets"] = [ids[t + 1] if a <= t <= len(ids) - 2 else -1 for t in range(len(ids))]
        r["n_targets"] = len(ids) - 1 - a
        r["n_image"] = ids.count(IMG)
        r["n_audio"] = ids.count(AUD)
    return rows


def unfreeze(pm):
    """Every parameter trainable. peft's set_adapter / disable_adapter set requires_grad on
    the LoRA layers (active adapter only), so this runs before every forward and the backward."""
    for p in pm.parameters():
        p.requires_grad_(True)


def row_hidden(pm, ids, inputs, adapter, dtype):
    """The decoder's final hidden states [T, C] of one sequence (its own batch of one, positions
    from 0) with its media inputs, under its adapter ("none": peft's adapters disabled)."""
    inner = pm.base_model.model  # Phi4MultimodalForCausalLM with the LoRA layers injected
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    ids = torch.tensor([ids], dtype=torch.int64)
    if adapter == "none":
        ctx = pm.disable_adapter()
    else:
        pm.set_adapter(adapter)
        ctx = contextlib.nullcontext()
    with ctx:
        unfreeze(pm)
        out = inner.model(input_ids=ids, **inputs, use_cache=False)
    unfreeze(pm)
    return out.last_hidden_state[0]


def row_loss(pm, row, dtype, full_logits):
    """Summed cross-entropy over the row's target positions (an f32 scalar for f32 weights).
    full_logits: the head runs on every position (the golden); otherwise only on the target
    positions (the float64 self-check; the same function of the parameters)."""
    inner = pm.base_model.model
    h = row_hidden(pm, row["ids"], row["inputs"], row["adapter"], dtype)
    tgt = torch.tensor(row["targets"], dtype=torch.int64)
    if not full_logits:
        keep = tgt >= 0
        h, tgt = h[keep], tgt[keep]
    logits = inner.lm_head(h)
    if dtype == torch.float32:
        logits = logits.float()
    return F.cross_entropy(logits, tgt, ignore_index=-1, reduction="sum")


def batch_loss(pm, rows, dtype=torch.float32, full_logits=True):
    """(sum over rows of the summed cross-entropy) / (number of target positions), the row sums
    in the model's dtype, their sum and the division in float64."""
    n = sum(r["n_targets"] for r in rows)
    sums = [row_loss(pm, r, dtype, full_logits) for r in rows]
    return torch.stack([s.double() for s in sums]).sum() / n, [s.item() for s in sums]


def group_of(name):
    if name == EMBED:
        return "embedding (tied head)"
    if name.startswith("model.layers.") or name == "model.norm.weight":
        if ".lora_A.vision." in name or ".lora_B.vision." in name:
            return "vision LoRA"
        if ".lora_A.speech." in name or ".lora_B.speech." in name:
            return "speech LoRA"
        return "text model"
    if name.startswith(IMAGE_PREFIX + "img_processor."):
        return "SigLIP tower"
    if name.startswith(IMAGE_PREFIX):
        return "image projector + GN"
    if name.startswith(AUDIO_PREFIX + "encoder."):
        return "Conformer encoder"
    if name.startswith(AUDIO_PREFIX + "audio_projection.speech."):
        return "audio projection speech"
    if name.startswith(AUDIO_PREFIX + "audio_projection.vision."):
        return "audio projection vision"
    raise ValueError(name)


def named_params(pm):
    """Our (checkpoint) name -> parameter, through make_e2e_golden's mapping."""
    out = {}
    for k, p in pm.named_parameters():  # the tied lm_head appears once, as embed_tokens
        ours = e2e.released_name(k)
        assert ours is not None and ours not in out, k
        out[ours] = p
    return out


# ---- float64 self-check: the port forces a few f32 casts, which would put f32 rounding
# noise into a float64 finite difference. Promote them instead (identity on f32 inputs).
@contextlib.contextmanager
def f64_patches():
    rms_fwd = mm.Phi4MultimodalRMSNorm.forward
    eager = mm.simple_eager_attention_forward

    def rms_forward(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)

    def eager_attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
        w = torch.matmul(q, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    mm.Phi4MultimodalRMSNorm.forward = rms_forward
    mm.simple_eager_attention_forward = eager_attention
    try:
        yield
    finally:
        mm.Phi4MultimodalRMSNorm.forward = rms_fwd
        mm.simple_eager_attention_forward = eager


FD_TENSORS = [
    EMBED,
    "model.layers.0.self_attn.qkv_proj.base_layer.weight",
    "model.layers.1.mlp.down_proj.base_layer.weight",
    "model.layers.0.mlp.gate_up_proj.lora_A.vision.weight",
    "model.layers.1.self_attn.o_proj.lora_B.speech.weight",
    "model.norm.weight",
    IMAGE_PREFIX + "img_processor.embeddings.patch_embedding.weight",
    IMAGE_PREFIX + "img_processor.encoder.layers.1.self_attn.q_proj.weight",
    IMAGE_PREFIX + "glb_GN",
    IMAGE_PREFIX + "sub_GN",
    IMAGE_PREFIX + "img_projection.0.weight",
    AUDIO_PREFIX + "encoder.embed.conv.0.weight",
    AUDIO_PREFIX + "encoder.encoders.1.self_attn.linear_k.weight",
    AUDIO_PREFIX + "encoder.relative_attention_bias_layer.bias_values.weight",
    AUDIO_PREFIX + "audio_projection.speech.0.weight",
    AUDIO_PREFIX + "audio_projection.vision.2.bias",
]


FD_STEPS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)


def zero_by_math(name):
    """Attention key biases: q.(k + b) shifts every score of a query by the same q.b, which the
    softmax cancels, so their exact gradient is 0 and torch's f32 values are rounding noise."""
    return name.endswith(".self_attn.k_proj.bias") or name.endswith(".self_attn.linear_k.bias")


def row_depends(row, name):
    """Whether the row's loss depends on the tensor (our name)."""
    grp = group_of(name)
    if grp in ("embedding (tied head)", "text model"):
        return True
    if grp == "vision LoRA":
        return row["adapter"] == "vision"
    if grp == "speech LoRA":
        return row["adapter"] == "speech"
    if grp in ("SigLIP tower", "image projector + GN"):
        return row["n_image"] > 0
    if grp == "Conformer encoder":
        return row["n_audio"] > 0
    if grp == "audio projection speech":
        return row["n_audio"] > 0 and row["n_image"] == 0
    if grp == "audio projection vision":
        return row["n_audio"] > 0 and row["n_image"] > 0
    raise ValueError(name)


def f64_check(pm, rows, loss32, grads32):
    """Float64 copy of the model: the loss and the analytic gradient in float64 (the f32 golden
    against them, per tensor), and central finite differences at the largest-gradient entry of a
    few tensors, over a sweep of steps (the estimate kept is the one at the larger step of the two
    neighbouring steps that agree best, among steps that move the loss by more than 1e-11 of
    itself: rounding noise grows at small steps, curvature and the ReLU kinks of the Conformer's
    conv subsampling at large ones)."""
    pm64 = copy.deepcopy(pm).double()
    inner = pm64.base_model.model
    assert inner.lm_head.weight.data_ptr() == inner.model.embed_tokens.weight.data_ptr()
    params = named_params(pm64)
    report = {}
    with f64_patches():
        unfreeze(pm64)
        pm64.zero_grad(set_to_none=True)
        loss64, _ = batch_loss(pm64, rows, torch.float64, full_logits=False)
        loss64.backward()
        report["loss_f64"] = loss64.item()
        report["loss_rel_f32_vs_f64"] = abs(loss32 - loss64.item()) / abs(loss64.item())
        # Three measures of the f32 golden's own error against float64: per tensor
        # max|d| / max|g64| and ||d|| / ||g64||, and per group max|d| / max|g64| over the group.
        per, per_l2, groups, gdiff, gscale, zero = {}, {}, {}, {}, {}, {}
        gmax = max(params[n].grad.abs().max().item() for n in grads32)
        for name, g32 in grads32.items():
            g64 = params[name].grad
            d = g32.double() - g64
            grp = group_of(name)
            gdiff[grp] = max(gdiff.get(grp, 0.0), d.abs().max().item())
            gscale[grp] = max(gscale.get(grp, 0.0), g64.abs().max().item())
            if zero_by_math(name):
                assert g64.abs().max().item() < 1e-12 * gmax, name
                zero[name] = dict(f32_absmax=g32.abs().max().item(), f64_absmax=g64.abs().max().item())
                continue
            per[name] = d.abs().max().item() / g64.abs().max().item()
            per_l2[name] = (d.norm() / g64.norm()).item()
            groups[grp] = max(groups.get(grp, 0.0), per[name])
        report["grad_rel_f32_vs_f64_worst"] = sorted(per.items(), key=lambda kv: -kv[1])[:6]
        report["grad_rel_l2_f32_vs_f64_worst"] = sorted(per_l2.items(), key=lambda kv: -kv[1])[:6]
        report["grad_rel_f32_vs_f64_per_group"] = groups
        report["grad_rel_f32_vs_f64_group_scale"] = {k: gdiff[k] / gscale[k] for k in gdiff}
        report["zero_by_math"] = zero
        fd = []
        with torch.no_grad():
            for name in FD_TENSORS:
                p = params[name]
                g64 = p.grad
                flat = int(g64.abs().argmax())
                idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g64.shape))
                orig = p[idx].item()
                # Only the rows that depend on the tensor: the others' terms are constant and
                # cancel in the difference (the divisor stays the whole batch's target count).
                dep = [r for r in rows if row_depends(r, name)]
                n = sum(r["n_targets"] for r in rows)
                est, usable = [], []
                for h in FD_STEPS:
                    vals = []
                    for sgn in (1, -1):
                        p[idx] = orig + sgn * h
                        vals.append(sum(row_loss(pm64, r, torch.float64, False).item() for r in dep) / n)
                    p[idx] = orig
                    est.append((vals[0] - vals[1]) / (2 * h))
                    # a difference of a few thousand ulps of the loss is rounding, not slope
                    usable.append(abs(vals[0] - vals[1]) >= 1e-11 * abs(vals[0]))
                pairs = [j for j in range(len(est) - 1) if usable[j] and usable[j + 1]]
                i = min(pairs, key=lambda j: abs(est[j] - est[j + 1]) / abs(est[j + 1]))
                d, h = est[i], FD_STEPS[i]
                a64 = g64[idx].item()
                a32 = grads32[name][idx].item()
                fd.append(dict(name=name, index=list(idx), step=h, fd=d, f64=a64, f32=a32,
                               rel_fd_vs_f64=abs(d - a64) / abs(d), rel_fd_vs_f32=abs(d - a32) / abs(d),
                               sweep=dict(zip([repr(x) for x in FD_STEPS], est))))
                print(f"  fd {name}{list(idx)} (step {h:g}): fd {d:.9e} f64 {a64:.9e} f32 {a32:.9e} "
                      f"rel(fd,f64) {fd[-1]['rel_fd_vs_f64']:.2e} rel(fd,f32) {fd[-1]['rel_fd_vs_f32']:.2e}")
        report["fd"] = fd
    return report


def gradient_tensors(params, token_ids):
    """The golden's gradient tensors after a backward: `grad.<name>` for every parameter but the
    embedding, which is reduced to the rows of `token_ids` (the batch's ids and targets, media
    placeholders left out) and FIXED_EMBED_ROWS, its column sums and its sum of squares (the
    full [200064, C] gradient would be megabytes). Returns (gold, grads32 by name, names without
    a gradient, squared gradient norm per group)."""
    gold, grads32, no_grad = {}, {}, []
    for name in sorted(params):
        p = params[name]
        if p.grad is None:
            no_grad.append(name)
            continue
        g = p.grad.detach().clone()
        if name != EMBED:
            assert g.dtype == torch.float32 and tuple(g.shape) == tuple(p.shape)
            gold[f"grad.{name}"] = g
        grads32[name] = g
    norms = {}
    for name, g in grads32.items():
        norms.setdefault(group_of(name), 0.0)
        norms[group_of(name)] += g.double().pow(2).sum().item()
    for k, v in norms.items():
        print(f"  grad norm {k}: {math.sqrt(v):.6g}")
    print(f"  no gradient: {no_grad}")

    ge = grads32[EMBED]
    erows = sorted(set(t for t in token_ids if t not in (IMG, AUD)) | set(FIXED_EMBED_ROWS))
    gold["embed_grad.rows"] = torch.tensor(erows, dtype=torch.int64)
    gold["embed_grad.values"] = ge[erows].contiguous()
    gold["embed_grad.colsum"] = ge.double().sum(0)
    gold["embed_grad.sqsum"] = ge.double().pow(2).sum()
    return gold, grads32, no_grad, norms


def grad_golden(ckpt, out_path, do_f64):
    torch.manual_seed(0)
    pm, n_loaded = e2e.build(ckpt)
    pm.eval()  # dropout off (the speech LoRA's dp 0.01 is a training-mode dropout); autograd on
    params = named_params(pm)
    state_names = set(e2e.read_checkpoint(ckpt))
    assert set(params) == state_names - BUFFERS, (sorted(set(params) ^ (state_names - BUFFERS)))[:8]
    print(f"loaded {n_loaded} tensors from {ckpt}; {len(params)} parameters trainable "
          f"(all but {sorted(BUFFERS)})")

    rows = make_rows()
    for r in rows:
        print(f"{r['name']} ({r['kind']}, adapter {r['adapter']}): {len(r['ids'])} tokens, "
              f"{r['n_image']} image + {r['n_audio']} audio placeholders, {r['n_targets']} targets")

    unfreeze(pm)
    pm.zero_grad(set_to_none=True)
    loss, row_sums = batch_loss(pm, rows, torch.float32, full_logits=True)
    loss.backward()
    n_tgt = sum(r["n_targets"] for r in rows)
    print(f"loss {loss.item():.17g} ({n_tgt} targets; row sums {row_sums})")

    all_ids = [t for r in rows for t in r["ids"]]
    all_tgt = [t for r in rows for t in r["targets"] if t >= 0]
    gold, grads32, no_grad, norms = gradient_tensors(params, all_ids + all_tgt)

    lens = [len(r["ids"]) for r in rows]
    gold["batch.ids"] = torch.tensor(all_ids, dtype=torch.int64)
    gold["batch.cu_seqlens"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
    gold["batch.targets"] = torch.tensor([t for r in rows for t in r["targets"]], dtype=torch.int64)
    gold["batch.adapters"] = torch.tensor([ADAPTER_CODE[r["adapter"]] for r in rows], dtype=torch.int64)
    gold["loss"] = loss.detach().to(torch.float64).reshape(())

    meta = {
        "generator": "tests/reference/train/make_train_golden.py",
        "checkpoint": CHECKPOINT_CMD,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "no_grad": ",".join(no_grad),
        "rows": json.dumps([dict(name=r["name"], kind=r["kind"], adapter=r["adapter"], tokens=len(r["ids"]),
                                 image_tokens=r["n_image"], audio_tokens=r["n_audio"], targets=r["n_targets"],
                                 audio_projector=("vision" if r["n_image"] else "speech") if r["n_audio"] else "",
                                 rope_table="long" if len(r["ids"]) > 64 else "short")
                            for r in rows]),
        "row_tokens": ",".join(str(n) for n in lens),
        "row_targets": ",".join(str(r["n_targets"]) for r in rows),
        "targets_total": str(n_tgt),
        "row_loss_sums": json.dumps(row_sums),
        "loss_repr": repr(loss.item()),
        "buffers_not_trained": ",".join(sorted(BUFFERS)),
        "embed_fixed_rows": ",".join(str(i) for i in FIXED_EMBED_ROWS),
        "grad_norms": json.dumps({k: math.sqrt(v) for k, v in norms.items()}),
        "dropout": "off (eval mode), autograd on",
        "zero_by_math": ",".join(n for n in sorted(grads32) if zero_by_math(n)),
    }
    if do_f64:
        rep = f64_check(pm, rows, loss.item(), grads32)
        print(f"  f64: loss {rep['loss_f64']!r}, f32 loss rel {rep['loss_rel_f32_vs_f64']:.3g}")
        for k, v in rep["grad_rel_f32_vs_f64_per_group"].items():
            print(f"    f32 vs f64 gradient, worst tensor of {k}: {v:.3g} (max |diff| / max |g64|)")
        print(f"    worst tensors: {rep['grad_rel_f32_vs_f64_worst']}")
        print(f"    worst tensors, l2: {rep['grad_rel_l2_f32_vs_f64_worst']}")
        print(f"    per group, group scale: {rep['grad_rel_f32_vs_f64_group_scale']}")
        print(f"    zero by math (key biases): {rep['zero_by_math']}")
        meta["f64_check"] = json.dumps(rep)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in gold.items()}, out_path, metadata=meta)
    os.chmod(out_path, 0o644)
    print(f"wrote {out_path} ({len(gold)} tensors, {os.path.getsize(out_path) / 1024:.0f} KiB)")


# ================================================================ B: optimizer golden ====
OPT_SEED = 1414
OPT_GROUPS = [  # (group, lr, [(name, shape)])
    ("lm", 1e-2, [("model.layers.0.mlp.down_proj.base_layer.weight", (4, 3)),
                  ("model.layers.0.input_layernorm.weight", (3,))]),
    ("projector", 5e-3, [(IMAGE_PREFIX + "img_projection.0.weight", (3, 4)),
                         (IMAGE_PREFIX + "img_projection.0.bias", (3,)),
                         (IMAGE_PREFIX + "glb_GN", (1, 1, 3))]),
    ("tower", 2e-3, [(IMAGE_PREFIX + "img_processor.encoder.layers.0.mlp.fc1.weight", (5, 3)),
                     (IMAGE_PREFIX + "img_processor.encoder.layers.0.mlp.fc1.bias", (5,))]),
]
OPT_WD = 0.1
OPT_BETAS = (0.9, 0.95)
OPT_EPS = 1e-8
OPT_MAX_NORM = 1.0
OPT_STEPS = 3
OPT_GRAD_SCALE = [3.0, 0.05, 0.5]  # step 0 clipped, step 1 not, step 2 clipped
WARMUP, DECAY, MIN_RATIO = 2, 3, 0.1
# With W = 2, D = 3 the three steps use factors 0, 0.5, 1 (progress 0 at step 2), so `cos.*` and
# `lin.*` are identical. The extra `cos_alt.*` / `lin_alt.*` trajectories (same init, gradients
# and clipping) use W = 1, D = 4: factors 0, 1, then 0.775 (cosine) vs 0.7 (linear) at p = 1/3.
ALT_WARMUP, ALT_DECAY = 1, 4
TRAJECTORIES = [("cos", "cos", WARMUP, DECAY), ("lin", "lin", WARMUP, DECAY),
                ("cos_alt", "cos", ALT_WARMUP, ALT_DECAY), ("lin_alt", "lin", ALT_WARMUP, ALT_DECAY)]


def decays(shape):
    """Weight decay for tensors with at least two dimensions of size > 1."""
    return sum(1 for d in shape if d > 1) >= 2


def lr_factor(style, w=WARMUP, d=DECAY, r=MIN_RATIO):
    def f(s):
        if s < w:
            return s / w
        p = min(1.0, (s - w) / max(1, d - w))
        if style == "cos":
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
        return r + (1.0 - r) * (1.0 - p)
    return f


def adamw_by_hand(gold, names, shapes, prefix, style, w, d):
    """Self-check: the trajectory re-done in plain f32 arithmetic from the formulas in the README
    (must equal torch bit for bit)."""
    lr0 = {n: lr for _, lr, ps in OPT_GROUPS for n, _ in ps}
    b1, b2 = OPT_BETAS
    f = lr_factor(style, w, d)
    p = {n: gold[f"init.{n}"].clone() for n in names}
    m = {n: torch.zeros(shapes[n]) for n in names}
    v = {n: torch.zeros(shapes[n]) for n in names}
    for k in range(OPT_STEPS):
        g = {n: gold[f"grad.{k}.{n}"] for n in names}
        norm = torch.stack([g[n].norm() for n in names]).norm()  # f32
        assert norm.item() == gold[f"{prefix}.norms"][k].item()
        coef = torch.clamp(OPT_MAX_NORM / (norm + 1e-6), max=1.0)  # f32
        step = k + 1
        for n in names:
            lr = lr0[n] * f(k)  # python double, as LambdaLR
            gn = g[n] * coef
            p[n] = p[n] * (1 - lr * (OPT_WD if decays(shapes[n]) else 0.0))
            m[n] = m[n] + (gn - m[n]) * (1 - b1)
            v[n] = v[n] * b2 + (1 - b2) * gn * gn
            denom = v[n].sqrt() / math.sqrt(1 - b2 ** step) + OPT_EPS
            p[n] = p[n] - (lr / (1 - b1 ** step)) * (m[n] / denom)
            assert torch.equal(p[n], gold[f"{prefix}.{k}.{n}"]), (prefix, k, n)


def optim_golden(out_path):
    g = torch.Generator().manual_seed(OPT_SEED)
    names = [n for _, _, ps in OPT_GROUPS for n, _ in ps]
    shapes = {n: s for _, _, ps in OPT_GROUPS for n, s in ps}
    gold = {}
    init = {n: torch.randn(shapes[n], generator=g) for n in names}
    grads = [{n: torch.randn(shapes[n], generator=g) * OPT_GRAD_SCALE[k] for n in names} for k in range(OPT_STEPS)]
    for n in names:
        gold[f"init.{n}"] = init[n].clone()
        for k in range(OPT_STEPS):
            gold[f"grad.{k}.{n}"] = grads[k][n].clone()

    for prefix, style, w, d in TRAJECTORIES:
        params = {n: init[n].clone().requires_grad_() for n in names}
        groups, group_of_sub = [], []
        for gname, lr, ps in OPT_GROUPS:
            for dec in (True, False):
                sub = [params[n] for n, s in ps if decays(s) == dec]
                if sub:
                    groups.append({"params": sub, "lr": lr, "weight_decay": OPT_WD if dec else 0.0})
                    group_of_sub.append(gname)
        opt = torch.optim.AdamW(groups, betas=OPT_BETAS, eps=OPT_EPS, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(style, w, d))
        lrs, norms = [], []
        for k in range(OPT_STEPS):
            for n in names:
                params[n].grad = grads[k][n].clone()
            norms.append(torch.nn.utils.clip_grad_norm_([params[n] for n in names], OPT_MAX_NORM).item())
            step_lrs = {}
            for gname, grp in zip(group_of_sub, opt.param_groups):
                assert step_lrs.setdefault(gname, grp["lr"]) == grp["lr"]
            lrs.append([step_lrs[gname] for gname, _, _ in OPT_GROUPS])
            opt.step()
            sched.step()
            for n in names:
                gold[f"{prefix}.{k}.{n}"] = params[n].detach().clone()
        gold[f"{prefix}.lrs"] = torch.tensor(lrs, dtype=torch.float64)
        gold[f"{prefix}.norms"] = torch.tensor(norms, dtype=torch.float64)
        adamw_by_hand(gold, names, shapes, prefix, style, w, d)
        clipped = [nm > OPT_MAX_NORM for nm in norms]
        assert any(clipped) and not all(clipped), norms
        print(f"{prefix} ({style}, W {w}, D {d}): norms {norms} (clipped {clipped}), lrs {lrs}")

    meta = {
        "generator": "tests/reference/train/make_train_golden.py",
        "torch": torch.__version__,
        "seed": str(OPT_SEED),
        "groups": json.dumps([dict(name=gname, lr=lr, params=[n for n, _ in ps]) for gname, lr, ps in OPT_GROUPS]),
        "weight_decay": str(OPT_WD),
        "decay_rule": "weight_decay for tensors with >= 2 dimensions of size > 1, 0 otherwise",
        "decayed": ",".join(n for n in names if decays(shapes[n])),
        "betas": json.dumps(list(OPT_BETAS)), "eps": repr(OPT_EPS),
        "max_norm": repr(OPT_MAX_NORM), "steps": str(OPT_STEPS),
        "grad_scale": json.dumps(OPT_GRAD_SCALE),
        "warmup_steps": str(WARMUP), "decay_steps": str(DECAY), "min_ratio": repr(MIN_RATIO),
        "alt.warmup_steps": str(ALT_WARMUP), "alt.decay_steps": str(ALT_DECAY),
        "trajectories": json.dumps([dict(prefix=p, style=st, warmup_steps=w, decay_steps=d, min_ratio=MIN_RATIO)
                                    for p, st, w, d in TRAJECTORIES]),
        "schedule": "factor(s) = s/W for s < W; else p = min(1, (s-W)/max(1, D-W)); "
                    "cos: r + (1-r)*0.5*(1+cos(pi p)); lin: r + (1-r)*(1-p); lr = base_lr * factor(step)",
        "torch_call": "AdamW(groups, betas, eps, foreach=False); LambdaLR(one lambda); per step: "
                      "clip_grad_norm_(all, max_norm) -> step -> sched.step",
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in gold.items()}, out_path, metadata=meta)
    os.chmod(out_path, 0o644)
    print(f"wrote {out_path} ({len(gold)} tensors, {os.path.getsize(out_path)} bytes)")


def main():
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--areno", help="the areno binary: runs `init --preset tiny --seed 5 --dtype f32`")
    g.add_argument("--checkpoint", help="a directory written by `areno init --preset tiny --seed 5 --dtype f32`")
    ap.add_argument("--out-dir", default=OUT_DIR)
    ap.add_argument("--only", choices=["grad", "optim"])
    ap.add_argument("--skip-f64-check", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if args.only != "grad":
        optim_golden(os.path.join(args.out_dir, "optim_golden.safetensors"))
    if args.only == "optim":
        return 0
    if not (args.areno or args.checkpoint):
        ap.error("--areno or --checkpoint is needed for the gradient golden")
    tmp = None
    if args.areno:
        tmp = tempfile.TemporaryDirectory(prefix="areno_train_")
        ckpt = os.path.join(tmp.name, "tiny")
        subprocess.run([args.areno, "init", "--preset", "tiny", "--out", ckpt, "--seed", "5", "--dtype", "f32"],
                       check=True)
    else:
        ckpt = args.checkpoint
    grad_golden(ckpt, os.path.join(args.out_dir, "grad_golden.safetensors"), not args.skip_f64_check)
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
