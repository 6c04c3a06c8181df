#!/usr/bin/env python3
"""A random LoRA adapter for the text decoder of an areno / Phi-4-multimodal
checkpoint, written twice from the same numbers: as a PEFT folder
(adapter_config.json + adapter_model.safetensors, what `areno serve
--lora-modules NAME=DIR` loads) and as a GGUF LoRA adapter for llama.cpp's
`phi3` graph (what `llama-server --lora FILE` loads). Dev tooling for
bench/peers/llama_server.sh --loras K.

Every decoder linear is adapted (qkv_proj, o_proj, gate_up_proj, down_proj,
the names llama.cpp's phi3 graph calls attn_qkv, attn_output, ffn_up and
ffn_down), rank R, lora_alpha 2R (scaling 2), A and B normal with std 0.02
from --seed. GGUF keeps PEFT's layouts (lora_a [r, in], lora_b [out, r], as
llama.cpp's convert_lora_to_gguf.py writes them) in --outtype (bf16: the f32
values rounded to nearest even, the bits areno's bf16 load gives too).

usage: random_lora.py CKPT_DIR PEFT_DIR OUT.gguf [--rank R] [--seed S] [--outtype f32|bf16]
"""
import argparse
import json
import struct
from pathlib import Path

import numpy as np
import gguf

from table import write_atomic
from to_gguf import as_bf16_bits, finish

TARGETS = [("self_attn.qkv_proj", "attn_qkv"), ("self_attn.o_proj", "attn_output"),
           ("mlp.gate_up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]


def write_safetensors(path: Path, tensors: dict):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    write_atomic(path, struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("peft_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()

    cfg = json.loads((a.ckpt / "config.json").read_text())
    hidden, ff, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"self_attn.qkv_proj": (hidden, (heads + 2 * kv) * head_dim), "self_attn.o_proj": (heads * head_dim, hidden),
              "mlp.gate_up_proj": (hidden, 2 * ff), "mlp.down_proj": (ff, hidden)}  # (in, out)
    r, alpha = a.rank, 2.0 * a.rank
    rng = np.random.default_rng(a.seed)

    peft, w = {}, gguf.GGUFWriter(str(a.out) + ".tmp", "phi3")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for i in range(layers):
        for module, gname in TARGETS:
            n_in, n_out = shapes[module]
            A = (rng.standard_normal((r, n_in)) * 0.02).astype(np.float32)
            B = (rng.standard_normal((n_out, r)) * 0.02).astype(np.float32)
            if a.outtype == "bf16":  # both engines then hold the same bf16 values
                A, B = [(as_bf16_bits("F32", x).astype(np.uint32) << 16).view(np.float32) for x in (A, B)]
            prefix = f"base_model.model.model.layers.{i}.{module}"
            peft[f"{prefix}.lora_A.weight"] = ("F32", A)
            peft[f"{prefix}.lora_B.weight"] = ("F32", B)
            for suffix, x in (("lora_a", A), ("lora_b", B)):
                name = f"blk.{i}.{gname}.weight.{suffix}"
                if a.outtype == "f32":
                    w.add_tensor(name, x)
                else:
                    bits = as_bf16_bits("F32", x)
                    w.add_tensor(name, bits.view(np.uint8).reshape(bits.shape[0], -1),
                                 raw_dtype=gguf.GGMLQuantizationType.BF16)

    a.peft_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(a.peft_dir / "adapter_model.safetensors", peft)
    modules = "|".join(m.replace(".", "\\.") for m, _ in TARGETS)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": f"model\\.layers\\.\\d+\\.({modules})", "bias": "none", "fan_in_fan_out": False,
              "use_dora": False, "use_rslora": False, "modules_to_save": None, "layers_to_transform": None,
              "init_lora_weights": True, "inference_mode": True, "task_type": None, "base_model_name_or_path": None}
    write_atomic(a.peft_dir / "adapter_config.json", (json.dumps(config, indent=2) + "\n").encode())

    finish(w, a.out)
    print(f"wrote {a.peft_dir} and {a.out} (rank {r}, {layers} layers, {a.outtype})")


if __name__ == "__main__":
    main()
