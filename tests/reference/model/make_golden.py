#!/usr/bin/env python3
"""Golden files for the Phi-4-multimodal language model tests (tests/model/).

Builds a TINY random-weight model with the transformers-native port
(`transformers.models.phi4_multimodal`), adds the vision and speech LoRA
adapters through peft (adapter names "vision" and "speech", which gives the
original checkpoint's `base_layer` / `lora_A.vision` names), saves the text
model in the ORIGINAL (`phi4mm`) layout (spec text.md section 7.1) as two
shards plus an index, and writes golden logits, greedy continuations and
gradients to tests/data/model/golden.safetensors.

Usage (from the repository root):
    pip install torch transformers peft safetensors
    python3 tests/reference/model/make_golden.py

The C++ tests read only the committed files; they never run Python.
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

import transformers
from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM
from peft import LoraConfig, get_peft_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "model")
TINY = os.path.join(OUT, "tiny")

# ---- tiny text config (spec section 1.1 keys, shrunk) ----
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS                     # 8
PARTIAL = 0.75                                 # rotary dims 6, 3 frequencies
ORIG_MAX, MAX_POS = 16, 64                     # LongRoPE switch after 16 tokens, mscale sqrt(1.5)
N_FREQ = int(HEAD_DIM * PARTIAL) // 2
SHORT = [1.0, 1.25, 1.5][:N_FREQ]
LONG = [1.0, 2.5, 7.75][:N_FREQ]
VISION_R, VISION_ALPHA = 8, 16                 # scaling 2
SPEECH_R, SPEECH_ALPHA = 4, 12                 # scaling 3 (differs on purpose: catches alpha/r mistakes)

VISION_REGEX = "layers.*((self_attn\\.(qkv_proj|o_proj))|(mlp\\.(gate_up|down)_proj))"
SPEECH_REGEX = "((layers.*self_attn\\.(qkv|o)_proj)|(layers.*mlp\\.(gate_up|down)_proj))"
PEFT_TARGETS = r"model\.layers\.\d+\.((self_attn\.(qkv|o)_proj)|(mlp\.(gate_up|down)_proj))"


def original_config():
    """config.json in the original remote-code layout (spec 1.1), tiny sizes."""
    return {
        "_name_or_path": "areno-tiny-golden",
        "architectures": ["Phi4MMForCausalLM"],
        "model_type": "phi4mm",
        "auto_map": {"AutoConfig": "configuration_phi4mm.Phi4MMConfig",
                     "AutoModelForCausalLM": "modeling_phi4mm.Phi4MMForCausalLM",
                     "AutoTokenizer": "Xenova/gpt-4o"},
        "torch_dtype": "float32",
        "transformers_version": "4.46.1",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": MAX_POS,
        "original_max_position_embeddings": ORIG_MAX,
        "rope_theta": 10000.0,
        "partial_rotary_factor": PARTIAL,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "attention_bias": False,
        "mlp_bias": False,
        "lm_head_bias": False,
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "full_attn_mod": 1,
        "interpolate_factor": 1,
        "img_processor": None,
        "embd_layer": {
            "embedding_cls": "image_audio",
            "image_embd_layer": {"crop_size": 448, "embedding_cls": "tune_image",
                                 "enable_gradient_checkpointing": True, "hd_transform_order": "sub_glb",
                                 "image_token_compression_cls": "avg_pool_2d", "projection_cls": "mlp",
                                 "use_hd_transform": True, "with_learnable_separator": True},
            "audio_embd_layer": {"compression_rate": 8, "downsample_rate": 1, "embedding_cls": "audio",
                                 "enable_gradient_checkpointing": True, "projection_cls": "mlp",
                                 "use_conv_downsample": False, "use_qformer": False},
        },
        "audio_processor": {"name": "cascades", "config": {
            "activation": "swish", "attention_dim": 1024, "attention_heads": 16, "batch_norm": False,
            "bias_in_glu": True, "causal": True, "chunk_size": -1, "cnn_layer_norm": True,
            "conv_activation": "swish", "conv_glu_type": "swish", "depthwise_multiplier": 1,
            "depthwise_seperable_out_channel": 1024, "dropout_rate": 0.0,
            "encoder_embedding_config": {"input_size": 80}, "ext_pw_kernel_size": 1,
            "ext_pw_out_channel": 1024, "input_layer": "nemo_conv", "input_size": 80, "kernel_size": 3,
            "left_chunk": 18, "linear_units": 1536, "nemo_conv_settings": {"conv_channels": 1024},
            "num_blocks": 24, "relative_attention_bias_args": {"t5_bias_max_distance": 500, "type": "t5"},
            "time_reduction": 8}},
        "vision_lora": {"dp": 0.0, "layer": VISION_REGEX, "lora_alpha": VISION_ALPHA, "r": VISION_R},
        "speech_lora": {"dp": 0.01, "layer": SPEECH_REGEX, "lora_alpha": SPEECH_ALPHA, "r": SPEECH_R},
    }


def build_model():
    cfg = Phi4MultimodalConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG_MAX, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL,
                         "short_factor": SHORT, "long_factor": LONG,
                         "original_max_position_embeddings": ORIG_MAX},
        partial_rotary_factor=PARTIAL, bos_token_id=1, eos_token_id=[2], pad_token_id=0,
        sliding_window=None,
        # Towers are not part of this golden; keep them small so the port constructs quickly.
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2},
        audio_config={"hidden_size": 16, "intermediate_size": 32, "num_blocks": 1, "num_attention_heads": 2,
                      "nemo_conv_channels": 16, "depthwise_separable_out_channel": 16,
                      "ext_pw_out_channel": 16},
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = Phi4MultimodalForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "lm_head must be tied"
    # Weights with real magnitude, so the logits differ clearly between adapters.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if name.startswith("embed_tokens_extend"):
                continue
            if name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                # Larger residual-branch outputs, so the layers (not the tied
                # embedding identity) decide the next token.
                gain = 3.0 if ("o_proj" in name or "down_proj" in name) else 1.5
                bound = gain / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
    vision = LoraConfig(r=VISION_R, lora_alpha=VISION_ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS)
    speech = LoraConfig(r=SPEECH_R, lora_alpha=SPEECH_ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS)
    pm = get_peft_model(model, vision, adapter_name="vision")
    pm.add_adapter("speech", speech)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name:
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[1]))
            elif ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    pm.eval()
    return pm, model


def original_state(pm):
    """Text-model tensors under their original (phi4mm) names."""
    out = {}
    for k, v in pm.state_dict().items():
        k = k.removeprefix("base_model.model.")
        if k.startswith("model.embed_tokens_extend.") or k == "lm_head.weight":
            continue
        out[k] = v.detach().clone().contiguous()
    return out


def logits_of(pm, ids, adapter):
    x = torch.tensor([ids])
    with torch.no_grad():
        if adapter == "none":
            with pm.disable_adapter():
                return pm(input_ids=x, use_cache=False).logits[0].float()
        pm.set_adapter(adapter)
        return pm(input_ids=x, use_cache=False).logits[0].float()


def greedy(pm, prompt, n, adapter):
    # Full recompute each step (no cache): the LongRoPE table follows the
    # running length exactly as HF's re-prefill does. Returns the new ids and
    # the last-row logits of every step.
    ids, last = list(prompt), []
    for _ in range(n):
        row = logits_of(pm, ids, adapter)[-1]
        last.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], torch.stack(last)


def main():
    assert hasattr(transformers.models, "phi4_multimodal"), "transformers without phi4_multimodal"
    os.makedirs(TINY, exist_ok=True)
    pm, model = build_model()
    state = original_state(pm)

    # ---- checkpoint in the original layout: two shards + index ----
    names = sorted(state)
    first = [n for n in names if n.startswith("model.embed_tokens") or n.startswith("model.layers.0.")]
    second = [n for n in names if n not in first]
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map, total = {}, 0
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, os.path.join(TINY, fname), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = fname
            total += state[k].numel() * state[k].element_size()
    with open(os.path.join(TINY, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(TINY, "config.json"), "w") as f:
        json.dump(original_config(), f, indent=2)
    with open(os.path.join(TINY, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0,
                   "transformers_version": "4.46.1"}, f, indent=2)
    # The native config of the same model (spec 7.2), for the config parser tests.
    native = model.config.to_dict()
    for k in ["vision_config", "audio_config"]:
        native.pop(k, None)
    with open(os.path.join(OUT, "config_native.json"), "w") as f:
        json.dump(native, f, indent=2, sort_keys=True)

    # ---- goldens ----
    g = torch.Generator().manual_seed(99)
    ids_a = torch.randint(3, VOCAB, (12,), generator=g).tolist()      # short regime (12 <= 16)
    ids_b = torch.randint(3, VOCAB, (24,), generator=g).tolist()      # long regime (24 > 16)
    gold = {
        "ids_a": torch.tensor(ids_a, dtype=torch.int64),
        "ids_b": torch.tensor(ids_b, dtype=torch.int64),
        "logits_a_none": logits_of(pm, ids_a, "none"),
        "logits_a_vision": logits_of(pm, ids_a, "vision"),
        "logits_a_speech": logits_of(pm, ids_a, "speech"),
        # the first 16 tokens of B still use the short table; all 24 use the long one
        "logits_b16_none": logits_of(pm, ids_b[:16], "none"),
        "logits_b_none": logits_of(pm, ids_b, "none"),
        "logits_b_speech": logits_of(pm, ids_b, "speech"),
    }
    prompt = ids_a[:4]
    gold["greedy_prompt"] = torch.tensor(prompt, dtype=torch.int64)
    for adapter in ["none", "vision"]:
        new, last = greedy(pm, prompt, 32, adapter)
        gold[f"greedy_{adapter}"] = torch.tensor(new, dtype=torch.int64)
        gold[f"greedy_{adapter}_last_logits"] = last

    # ---- gradients of a next-token loss (vision adapter active) ----
    pm.set_adapter("vision")
    params = dict(pm.named_parameters())
    pre = "base_model.model.model."
    wanted = {
        "grad_embed_tokens": pre + "embed_tokens.weight",
        "grad_qkv_base_0": pre + "layers.0.self_attn.qkv_proj.base_layer.weight",
        "grad_lora_A_vision_down_1": pre + "layers.1.mlp.down_proj.lora_A.vision.weight",
        "grad_lora_B_vision_qkv_0": pre + "layers.0.self_attn.qkv_proj.lora_B.vision.weight",
    }
    for p in pm.parameters():
        p.requires_grad_(False)
        p.grad = None
    for key in wanted.values():
        params[key].requires_grad_(True)
    x = torch.tensor([ids_a])
    logits = pm(input_ids=x, use_cache=False).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:])
    loss.backward()
    gold["grad_loss"] = loss.detach().reshape(1)
    for gk, pk in wanted.items():
        gold[gk] = params[pk].grad.detach().clone()

    # ---- bf16 (weights and activations), text only and vision ----
    # Eager attention: bf16 QK^T, scaled in bf16, softmax in f32, probabilities
    # cast to bf16 (spec 2.8) -- the rounding points of areno's attention op.
    model.set_attn_implementation("eager")
    pm.to(torch.bfloat16)
    gold["logits_a_none_bf16"] = logits_of(pm, ids_a, "none")
    gold["logits_a_vision_bf16"] = logits_of(pm, ids_a, "vision")

    gold = {k: v.contiguous() for k, v in gold.items()}
    save_file(gold, os.path.join(OUT, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print("wrote", OUT, "tensors:", len(state), "golden:", len(gold))


if __name__ == "__main__":
    sys.exit(main())
