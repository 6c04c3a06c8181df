#!/usr/bin/env python3
"""One GRPO step on the tiny model against PyTorch (issue 15, must-show 2), written to
tests/data/rl/grpo_grad_golden.safetensors.

Fixed "rollouts": three prompts of the SFT golden (text r0, audio r2, audio+image r3: every
adapter, both towers, both audio projectors) x 3 samples, hand-written completion ids of
different lengths, rewards, and rollout log-probabilities equal to the policy's own minus fixed
offsets (so the ratios are exp(offset): inside the clip range, beyond it on both sides, never
on a bound). In f32 torch on transformers' phi4_multimodal port: the per-token log-probabilities
of the completions, the group-normalized advantages, the token-level clipped loss aggregated
token_mean (docs/rl.md, GRPO), one backward, every parameter's gradient. Every group is
unfrozen, as in the SFT golden.

The model, the media, the row prompts, the gradient tensors and the embedding's reduction come
from tests/reference/train/make_train_golden.py (imported, not copied). See README.md here.

Usage (from the repository root, about 30 s):
    meson setup build -Dcuda=disabled && ninja -C build app/areno
    python3 tests/reference/rl/make_grpo_golden.py --areno build/app/areno
  or --checkpoint DIR (a directory from `areno init --preset tiny --seed 5 --dtype f32`).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "rl", "grpo_grad_golden.safetensors")


sys.path.insert(0, os.path.join(ROOT, "tests", "reference", "train"))
import make_train_golden as sft  # noqa: E402  (no side effects on import)

END = sft.END

PROMPT_ROWS = [0, 2, 3]  # of make_train_golden.make_rows(): text, audio (speech), audio+image (vision)
G = 3                     # samples per prompt
# Completion ids per sequence (prompt-major, G per prompt), lengths 1 to 6.
COMPLETIONS = [
    [4821, 13, 777, END], [4821, 2501, END], [30, 13, 318, 4440, 777, END],
    [1114, 2204, 1303, END], [1114, END], [8144, 420, 13, 30, 2579],
    [9712, 13, END], [9712], [3923, 374, 420, 30, END],
]
REWARDS = [0.25, 0.25, 0.25,  # text: all equal, advantages exactly 0 (its tokens still count)
           0.0, 1.0, 1.0,     # audio: two equal
           1.0, 0.0, 0.5]     # audio+image: distinct
# Fixed offsets: old_logp = logp - offset, so ratio = exp(offset). The clip range of 0.2 is
# log-ratio (-0.223, 0.182); every ratio stays at least 0.018 from a bound (checked).
OFFSETS = [
    [0.05, -0.1, 0.3, 0.0], [-0.3, 0.1, 0.02], [0.12, -0.05, 0.25, -0.15, 0.0, 0.08],
    [0.1, -0.35, 0.0, 0.05], [0.4, -0.07], [-0.12, 0.03, 0.5, -0.5, 0.09],
    [0.2, -0.2, 0.01], [0.06], [-0.04, 0.15, 0.0, -0.26, 0.11],
]
CLIP_EPS = 0.2
ADV_EPS = 1e-6


def group_advantages(rewards):
    """(r - mean) / (unbiased std + eps) per group of G, in float64; an equal group gives 0."""
    r = torch.tensor(rewards, dtype=torch.float64).reshape(-1, G)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADV_EPS)
    equal = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(equal, torch.zeros_like(a), a).reshape(-1)


def sequence_logp(pm, row, completion):
    """log softmax(logits)[completion[t]] at each completion position, [len] f32: the prompt and
    the completion but its last token are fed; the head runs on the completion positions."""
    ids = row["ids"][:row["ids"].index(sft.ASSISTANT) + 1] + completion[:-1]
    h = sft.row_hidden(pm, ids, row["inputs"], row["adapter"], torch.float32)
    first = len(ids) - len(completion)
    logits = pm.base_model.model.lm_head(h[first:]).float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def grpo_loss(logp, old, adv, mask):
    """token_mean of -min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(clamp(logp - old, -20, 20))."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    a = adv.to(logp.dtype).unsqueeze(1)
    per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS))
    return (per_token * mask).sum() / mask.sum(), ratio


def main():
    args = sft.e2e.checkpoint_args(OUT)
    with sft.e2e.tiny_checkpoint(args, "areno_grpo_") as ckpt:
        write_golden(args.out, ckpt)
    return 0


def write_golden(out, ckpt):
    torch.manual_seed(0)
    pm, _ = sft.e2e.build(ckpt)
    pm.eval()  # dropout off, autograd on (as the SFT golden)
    params = sft.named_params(pm)
    rows = sft.make_rows()
    prompts = [rows[i] for i in PROMPT_ROWS]
    N, T = len(COMPLETIONS), max(len(c) for c in COMPLETIONS)
    assert N == G * len(prompts) and [len(o) for o in OFFSETS] == [len(c) for c in COMPLETIONS]

    sft.unfreeze(pm)
    pm.zero_grad(set_to_none=True)
    mask = torch.zeros(N, T)
    rows_lp = [sequence_logp(pm, prompts[i // G], c) for i, c in enumerate(COMPLETIONS)]
    logp = torch.stack([torch.nn.functional.pad(lp, (0, T - len(lp))) for lp in rows_lp])
    for i, c in enumerate(COMPLETIONS):
        mask[i, :len(c)] = 1.0
    offsets = torch.zeros(N, T, dtype=torch.float64)
    for i, o in enumerate(OFFSETS):
        offsets[i, :len(o)] = torch.tensor(o, dtype=torch.float64)
    old = ((logp.detach().double() - offsets) * mask).float()
    adv = group_advantages(REWARDS)
    loss, ratio = grpo_loss(logp, old, adv, mask)
    loss.backward()
    r = ratio.detach()[mask > 0]
    assert (r - (1 - CLIP_EPS)).abs().min() > 0.015 and (r - (1 + CLIP_EPS)).abs().min() > 0.015
    clipped = int(((r > 1 + CLIP_EPS) | (r < 1 - CLIP_EPS)).sum())
    print(f"loss {loss.item()!r}, advantages {adv.tolist()}, {int(mask.sum())} tokens, {clipped} outside the clip range")

    token_ids = [t for p in prompts for t in p["ids"]] + [t for c in COMPLETIONS for t in c]
    gold, grads32, no_grad, norms = sft.gradient_tensors(params, token_ids)
    gold["loss"] = loss.detach().double().reshape(())
    gold["advantages"] = adv
    gold["logp"] = logp.detach()
    gold["old_logp"] = old
    gold["mask"] = mask
    gold["rewards"] = torch.tensor(REWARDS, dtype=torch.float64)
    gold["completions"] = torch.tensor([c + [-1] * (T - len(c)) for c in COMPLETIONS], dtype=torch.int64)
    gold["prompts.ids"] = torch.tensor([t for p in prompts for t in p["ids"][:p["ids"].index(sft.ASSISTANT) + 1]])
    gold["prompts.lens"] = torch.tensor([p["ids"].index(sft.ASSISTANT) + 1 for p in prompts])
    gold["prompt_of"] = torch.tensor([PROMPT_ROWS[i // G] for i in range(N)], dtype=torch.int64)
    meta = {
        "generator": "tests/reference/rl/make_grpo_golden.py",
        "checkpoint": sft.CHECKPOINT_CMD,
        "transformers": sft.transformers.__version__, "torch": torch.__version__,
        "prompts": "make_train_golden rows " + ",".join(str(i) for i in PROMPT_ROWS) + " up to <|assistant|>",
        "group_size": str(G), "clip_eps": repr(CLIP_EPS), "adv_eps": repr(ADV_EPS), "agg": "token_mean",
        "unfrozen": "every parameter (all but the audio CMVN buffers)",
        "no_grad": ",".join(no_grad),
        "zero_by_math": ",".join(n for n in sorted(grads32) if sft.zero_by_math(n)),
        "clipped_tokens": str(clipped),
        "loss_repr": repr(loss.item()),
        "grad_norms": json.dumps({k: v ** 0.5 for k, v in norms.items()}),
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in gold.items()}, out, metadata=meta)
    os.chmod(out, 0o644)
    print(f"wrote {out} ({len(gold)} tensors, {os.path.getsize(out) / 1024:.0f} KiB)")


if __name__ == "__main__":
    sys.exit(main())
