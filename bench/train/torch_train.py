#!/usr/bin/env python3
"""PyTorch peer of bench_train: the same SFT steps with transformers + torch.optim.AdamW.

Model: the checkpoint `areno init --preset PRESET --seed S --dtype f32 --out DIR` writes
(the same weights bench_train builds in memory with init_phi4mm(PRESET, S)), loaded by
tests/reference/model/make_e2e_golden.py's `build` (imported, not copied): transformers'
Phi4MultimodalForCausalLM (5.24) at the checkpoint's sizes, towers included, the vision and
speech LoRAs added through peft, every checkpoint tensor mapped and checked. So both
processes hold the same parameters (text model, both LoRAs, both towers and projectors).

Rows, targets and loss as bench_train (see the top of bench_train.cpp): rows of --seq ids
from bench/model/peer_torch.py's `bench_ids` (seed 1000 + row, ids in [3, 199999));
targets on the second half (or every position with --targets all); loss = sum of the
step's target cross-entropies / its target tokens, micro-batches of --mini-bs rows (one
[mini_bs, L] forward each: the rows have equal lengths, so no padding), gradients
accumulated. The head runs on the target positions only (hidden states of the decoder,
then lm_head on the rows that have a target, as make_train_golden.py does), f32 logits,
F.cross_entropy(reduction="sum").

--lm-trainable all: peft's adapter layers disabled for the whole run (the base decoder,
as areno's rows without an adapter), every decoder parameter (embedding / tied head,
layers, final norm) and the LoRA weights require grad (the LoRA weights get none).
lora: the vision adapter active, only the LoRA weights train.
user: a third peft adapter "user" of rank --lora-rank R (lora_alpha 2R, the four projections)
alone active, only its weights train: areno's `train --lora-rank`. Its A is
sin(k + 1) / sqrt(in) (k the row-major index) and B is 0, as bench_train sets them.

Optimizer: torch.optim.AdamW (defaults: for-loop implementation on CPU) with areno's
groups: "lm" (tensors with at least two dimensions of size > 1, decayed) and "lm.no_decay";
constant lr, clip_grad_norm_(1.0), zero_grad(set_to_none=True) after the step.
Activation checkpointing: model.activation_checkpointing_enable() (transformers' default:
non-reentrant torch.utils.checkpoint per decoder layer), in training mode (no dropout:
the config's dropouts are 0).

Prints one JSON object with the keys bench_train prints (tokens_per_s, s_per_step,
losses, peak_rss_bytes = VmHWM, ru_maxrss_bytes).

usage: torch_train.py --checkpoint DIR [--seq 2048] [--batch-size 2] [--mini-bs 1]
  [--warmup 1] [--steps 3] [--activation-checkpointing on|off] [--lm-trainable all|lora|user]
  [--lora-rank 16] [--targets half|all] [--lr 1e-5] [--weight-decay 0.1] [--phases on|off]
  [--device cpu|cuda] [--dtype f32|bf16]   (THREADS env, default 2)
--device cuda: the model is moved to the GPU after it is built; every step and phase ends
with torch.cuda.synchronize(); peak_gpu_bytes = torch.cuda.max_memory_allocated().
--dtype bf16: the parameters stay f32 (the optimizer's master weights) and the forward runs
under torch.autocast(bfloat16), the usual mixed-precision recipe (areno's bf16 keeps f32
master weights too); the logits are f32 either way.
--phases on: after the steps (and after peak RSS is read), one micro-batch timed as forward
of the decoder, forward of the loss, backward, optimizer step, and the loss's own backward.
"""
import argparse
import importlib.util
import json
import os
import resource
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ID_LIMIT = 199999


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


e2e = load_module("make_e2e_golden", os.path.join(ROOT, "tests", "reference", "model", "make_e2e_golden.py"))
peer_model = load_module("bench_model_peer", os.path.join(ROOT, "bench", "model", "peer_torch.py"))


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def decays(p):
    """areno's train/param_groups.h `decays`: at least two dimensions of size > 1."""
    return sum(1 for d in p.shape if d > 1) >= 2


def make_row(r, L, half):
    ids = peer_model.bench_ids(L, ID_LIMIT, 1000 + r)
    first = L // 2 - 1 if half else 0
    return ids, first  # positions first .. L-2 predict ids first+1 .. L-1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--mini-bs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--activation-checkpointing", choices=["on", "off"], default="on")
    ap.add_argument("--lm-trainable", choices=["all", "lora", "user"], default="all")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--targets", choices=["half", "all"], default="half")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--phases", choices=["on", "off"], default="off")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    threads = int(os.environ.get("THREADS", "2"))
    torch.set_num_threads(threads)

    t0 = time.perf_counter()
    pm, n_loaded = e2e.build(a.checkpoint)
    pm = pm.to(dev)
    sync()
    build_s = time.perf_counter() - t0
    inner = pm.base_model.model  # Phi4MultimodalForCausalLM with the LoRA layers injected
    lora = a.lm_trainable == "lora"
    user = a.lm_trainable == "user"
    if user:
        pm.add_adapter("user", e2e.LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0,
                                               target_modules=e2e.PEFT_TARGETS))
        with torch.no_grad():
            for k, p in pm.named_parameters():
                if ".lora_A.user." in k:
                    n, fan_in = p.numel(), p.shape[1]
                    v = torch.sin(torch.arange(1, n + 1, dtype=torch.float64)) / (fan_in ** 0.5)
                    p.copy_(v.reshape(p.shape).to(p.dtype))
                elif ".lora_B.user." in k:
                    p.zero_()
        pm.base_model.set_adapter(["user"])
    elif lora:
        pm.set_adapter("vision")
    else:
        pm.base_model.disable_adapter_layers()
    for p in pm.parameters():
        p.requires_grad_(False)
    trained = []  # (name, param), named_parameters order, areno's lm group
    for k, p in pm.named_parameters():
        name = e2e.released_name(k)
        in_lm = name.startswith("model.layers.") or name in ("model.embed_tokens.weight", "model.norm.weight")
        is_lora = ".lora_A." in name or ".lora_B." in name
        if user:
            train_it = ".lora_A.user." in name or ".lora_B.user." in name
        else:
            train_it = in_lm and (is_lora if lora else True)
        if train_it:
            p.requires_grad_(True)
            trained.append((name, p))
    groups = [{"params": [p for _, p in trained if decays(p)], "weight_decay": a.weight_decay},
              {"params": [p for _, p in trained if not decays(p)], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    if a.activation_checkpointing == "on":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inner.activation_checkpointing_enable()
    pm.train()
    rss_model = vm_hwm()

    half = a.targets == "half"
    L = a.seq
    n_rows = a.batch_size * (a.warmup + a.steps)
    rows = [make_row(r, L, half) for r in range(n_rows)]

    losses, seconds, norms = [], [], []
    tokens_step = a.batch_size * L
    for s in range(a.warmup + a.steps):
        t = time.perf_counter()
        batch = rows[s * a.batch_size:(s + 1) * a.batch_size]
        n_targets = sum(L - 1 - first for _, first in batch)
        total = 0.0
        for b in range(0, len(batch), a.mini_bs):
            micro = batch[b:b + a.mini_bs]
            ids = torch.tensor([r for r, _ in micro], dtype=torch.int64, device=dev)  # [B, L]
            first = micro[0][1]
            with autocast():
                h = inner.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, L, H]
                h = h[:, first:L - 1].reshape(-1, h.shape[-1])
                logits = inner.lm_head(h).float()
            tgt = ids[:, first + 1:L].reshape(-1)
            loss = F.cross_entropy(logits, tgt, reduction="sum") / n_targets
            total += loss.item()
            loss.backward()
            del h, logits, loss
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        seconds.append(time.perf_counter() - t)
        losses.append(total)
        norms.append(float(norm))
        print(f"torch_train: step {s + 1} loss {total:.6f} grad_norm {float(norm):.4f} {seconds[-1]:.2f} s"
              f"{' (warm-up)' if s < a.warmup else ''}", file=sys.stderr, flush=True)

    measured = sum(seconds[a.warmup:])
    out = {
        "impl": "torch", "torch": torch.__version__, "transformers": e2e.transformers.__version__,
        "seq": L, "batch_size": a.batch_size, "mini_bs": a.mini_bs,
        "activation_checkpointing": a.activation_checkpointing == "on", "lm_trainable": a.lm_trainable,
        "lora_rank": a.lora_rank if user else 0,
        "targets": a.targets, "threads": str(threads), "device": str(dev), "dtype": a.dtype, "warmup_steps": a.warmup, "steps": a.steps,
        "trained_params": sum(p.numel() for _, p in trained), "loaded_tensors": n_loaded,
        "target_tokens_per_step": n_targets,
        "tokens_per_s": round(tokens_step * a.steps / measured, 2),
        "target_tokens_per_s": round(n_targets * a.steps / measured, 2),
        "s_per_step": round(measured / a.steps, 3),
        "step_seconds": [round(x, 3) for x in seconds], "losses": [round(x, 6) for x in losses],
        "grad_norms": [round(x, 5) for x in norms],
        "peak_rss_bytes": vm_hwm(), "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_after_model_bytes": rss_model, "model_build_s": round(build_s, 2),
    }
    if cuda:
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
        out["gpu"] = torch.cuda.get_device_name(dev)
    if a.phases == "on":
        # One micro-batch timed piece by piece, as bench_train --phases on.
        micro = rows[:a.mini_bs]
        ids = torch.tensor([r for r, _ in micro], dtype=torch.int64, device=dev)
        first = micro[0][1]
        n_t = sum(L - 1 - f for _, f in micro)
        tgt = ids[:, first + 1:L].reshape(-1)

        def loss_of(h):
            hh = h[:, first:L - 1].reshape(-1, h.shape[-1])
            with autocast():
                logits = inner.lm_head(hh).float()
            return F.cross_entropy(logits, tgt, reduction="sum") / n_t

        t = time.perf_counter()
        with autocast():
            h = inner.model(input_ids=ids, use_cache=False).last_hidden_state
        sync()
        out["phase_forward_layers_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        loss = loss_of(h)
        loss.item()
        out["phase_forward_loss_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        loss.backward()
        sync()
        out["phase_backward_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        out["phase_optimizer_s"] = round(time.perf_counter() - t, 3)
        leaf = h.detach().requires_grad_(True)
        loss = loss_of(leaf)
        t = time.perf_counter()
        loss.backward()
        sync()
        out["phase_loss_backward_s"] = round(time.perf_counter() - t, 3)
        opt.zero_grad(set_to_none=True)
        out["phase_rows"] = a.mini_bs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
