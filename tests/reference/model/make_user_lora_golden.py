#!/usr/bin/env python3
"""Golden file for the user adapter (`areno train --lora-rank`, config "user_lora"):
tests/data/model/user_lora_golden.safetensors, read by tests/model/test_user_lora.cpp.

The oracle is the tiny text model of make_golden.py (imported, not copied: its
build_model() rebuilds the committed tests/data/model/tiny/ checkpoint, checked
tensor by tensor) with a third peft adapter, "user", added beside the "vision" and
"speech" ones on qkv_proj and down_proj (r 3, lora_alpha 4.5: scaling 1.5, not a
power of two), its A and B filled from a fixed seed. A row runs with peft's active
adapters [row's adapter, "user"] (["user"] alone for a text row), the sum areno's
LoraLinear computes.

Written: the user adapter's weights under areno's names
(model.layers.N.<module>.lora_{A,B}.user.weight), the logits of ids_a with each row
adapter (`user_logits_a_<none|vision|speech>`) and of ids_b (24 tokens: the long
LongRoPE table) with speech, and the loss and gradients of make_golden's next-token
loss on ids_a with [speech, user] active (every user weight, and the qkv base of
layer 0). And the adapter alone as peft saves it, in tests/data/model/user_peft/
(adapter_config.json + adapter_model.safetensors), which `--lora DIR` loads.

Usage (from the repository root, a few seconds):
    pip install torch transformers==5.24.0 peft safetensors
    python3 tests/reference/model/make_user_lora_golden.py
"""
import importlib.util
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

import transformers
from peft import LoraConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "model", "user_lora_golden.safetensors")
PEFT_OUT = os.path.join(ROOT, "tests", "data", "model", "user_peft")

spec = importlib.util.spec_from_file_location("make_golden", os.path.join(os.path.dirname(__file__), "make_golden.py"))
mg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mg)

USER_R, USER_ALPHA = 3, 4.5
USER_TARGETS = r"model\.layers\.\d+\.((self_attn\.qkv_proj)|(mlp\.down_proj))"


def committed_state():
    state = {}
    for f in sorted(os.listdir(mg.TINY)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(mg.TINY, f)))
    return state


def logits_of(pm, ids, adapters):
    pm.base_model.set_adapter(adapters)
    with torch.no_grad():
        return pm(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def main():
    torch.set_num_threads(1)
    pm, _ = mg.build_model()
    # The rebuilt model is the committed checkpoint, bit for bit.
    state, want = mg.original_state(pm), committed_state()
    assert sorted(state) == sorted(want), "tensor names differ from tests/data/model/tiny"
    for k in state:
        assert torch.equal(state[k], want[k]), f"{k} differs from tests/data/model/tiny"

    pm.add_adapter("user", LoraConfig(r=USER_R, lora_alpha=USER_ALPHA, lora_dropout=0.0, target_modules=USER_TARGETS))
    g = torch.Generator().manual_seed(11)
    gold, user = {}, {}
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".user." not in name:
                continue
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
            ours = name.removeprefix("base_model.model.")
            user[ours] = p
            gold[ours] = p.detach().clone()
    assert len(user) == 2 * 2 * mg.LAYERS, sorted(user)
    pm.eval()

    gg = torch.Generator().manual_seed(99)  # make_golden's ids
    ids_a = torch.randint(3, mg.VOCAB, (12,), generator=gg).tolist()
    ids_b = torch.randint(3, mg.VOCAB, (24,), generator=gg).tolist()
    gold["ids_a"] = torch.tensor(ids_a, dtype=torch.int64)
    gold["ids_b"] = torch.tensor(ids_b, dtype=torch.int64)
    for row in ("none", "vision", "speech"):
        gold[f"user_logits_a_{row}"] = logits_of(pm, ids_a, ["user"] if row == "none" else [row, "user"])
    gold["user_logits_b_speech"] = logits_of(pm, ids_b, ["speech", "user"])
    # The adapter matters: the logits move well past rounding.
    pm.base_model.set_adapter("vision")
    with torch.no_grad():
        plain = pm(input_ids=torch.tensor([ids_a]), use_cache=False).logits[0].float()
    moved = ((plain - gold["user_logits_a_vision"]).abs().max() / plain.abs().max()).item()
    assert moved > 1e-2, moved

    # Gradients of the next-token loss with [speech, user] active.
    pm.base_model.set_adapter(["speech", "user"])
    params = dict(pm.named_parameters())
    for p in pm.parameters():
        p.requires_grad_(False)
        p.grad = None
    qkv0 = "base_model.model.model.layers.0.self_attn.qkv_proj.base_layer.weight"
    wanted = {"grad_qkv_base_0": qkv0}
    for ours in user:
        wanted["grad_" + ours] = "base_model.model." + ours
    for key in wanted.values():
        params[key].requires_grad_(True)
    x = torch.tensor([ids_a])
    logits = pm(input_ids=x, use_cache=False).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:])
    loss.backward()
    gold["grad_loss"] = loss.detach().reshape(1)
    for gk, pk in wanted.items():
        gold[gk] = params[pk].grad.detach().clone()

    # The adapter as peft saves it (adapter_config.json + adapter_model.safetensors), for
    # `--lora DIR`: the folder peft writes for a named adapter, copied without its subfolder.
    with tempfile.TemporaryDirectory() as tmp:
        pm.save_pretrained(tmp, selected_adapters=["user"])
        os.makedirs(PEFT_OUT, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(os.path.join(tmp, "user", f), os.path.join(PEFT_OUT, f))

    gold = {k: v.contiguous() for k, v in gold.items()}
    save_file(gold, OUT, metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                                   "user_lora": f"r={USER_R} lora_alpha={USER_ALPHA} targets=qkv_proj,down_proj"})
    print("wrote", OUT, "tensors:", len(gold), "loss", loss.item(), "moved", moved)


if __name__ == "__main__":
    sys.exit(main())
