#!/usr/bin/env python3
"""Write the text decoder of an areno / Phi-4-multimodal checkpoint as a GGUF
`phi3` model for llama.cpp (issue 16, must-show 1). Dev tooling only.

The decoder is Phi-4-mini: llama.cpp's phi3 graph with a fused qkv, a fused
gate_up (gate rows first, as both HF and llama.cpp's SWIGLU split them), tied
embeddings (no `output` tensor: llama.cpp reuses token_embd), partial rotary
(rope.dimension_count = head_dim * partial_rotary_factor) and LongRoPE
(rope_factors_long/short, attn_factor). Only the `base_layer` weights are
written: the vision and speech LoRA branches are not part of text serving.

Tensors are read with a small safetensors parser over a memory map (bf16
included, which numpy cannot name), so the `full` preset (11 GB in bf16)
converts without holding two copies. --outtype f32 widens bf16, bf16 keeps
bf16 bits as they are (f32 input is rounded to nearest even), q8_0 uses the
gguf package's reference quantizer (llama-quantize gives the same blocks).

The gguf package is the one vendored with the llama.cpp source being measured
(bench/peers/llama_cpp.sh puts it on PYTHONPATH).

usage: to_gguf.py CKPT_DIR OUT.gguf [--outtype f32|bf16]
"""
import argparse
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import gguf

ST_DTYPES = {"F32": (np.float32, 4), "BF16": (np.uint16, 2), "F16": (np.float16, 2)}


class Safetensors:
    """Tensors of every shard of a checkpoint, by name, as (dtype, array) on a memmap."""

    def __init__(self, ckpt: Path):
        index = ckpt / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.entries = {}
        for name in files:
            path = ckpt / name
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            mm = np.memmap(path, dtype=np.uint8, mode="r")
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in ST_DTYPES:
                    sys.exit(f"{path}: tensor {key}: dtype {meta['dtype']} not supported")
                npdt, size = ST_DTYPES[meta["dtype"]]
                b, e = meta["data_offsets"]
                arr = mm[8 + n + b: 8 + n + e].view(npdt).reshape(meta["shape"])
                self.entries[key] = (meta["dtype"], arr)

    def get(self, name):
        if name not in self.entries:
            sys.exit(f"checkpoint has no tensor {name}")
        return self.entries[name]


def as_f32(dtype, arr):
    if dtype == "F32":
        return np.asarray(arr)
    if dtype == "BF16":
        return (np.asarray(arr).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr).astype(np.float32)


def as_bf16_bits(dtype, arr):
    if dtype == "BF16":
        return np.asarray(arr)
    x = as_f32(dtype, arr).view(np.uint32)
    rounded = x + np.uint32(0x7FFF) + ((x >> 16) & np.uint32(1))  # round to nearest even (no NaN in weights)
    return (rounded >> 16).astype(np.uint16)


def finish(w, out: Path):
    """Writes the GGUFWriter opened on OUT.tmp, syncs it and renames it to OUT."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(str(out) + ".tmp", "rb+") as f:
        os.fsync(f.fileno())
    os.replace(str(out) + ".tmp", out)


def vocab(ckpt: Path, n_vocab: int):
    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj["model"]
    if model.get("type") != "BPE":
        sys.exit(f"{ckpt}/tokenizer.json: model.type {model.get('type')} (BPE expected)")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for t in tj.get("added_tokens", []):
        i = int(t["id"])
        if i < n_vocab:
            tokens[i] = t["content"]
            types[i] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()

    cfg = json.loads((a.ckpt / "config.json").read_text())
    st = Safetensors(a.ckpt)
    n_embd, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_layer, n_ff, n_vocab = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = n_embd // n_head
    rope_dims = int(cfg.get("partial_rotary_factor", 1.0) * head_dim)
    max_pos, orig_pos = cfg["max_position_embeddings"], cfg["original_max_position_embeddings"]

    w = gguf.GGUFWriter(str(a.out) + ".tmp", "phi3")
    w.add_name(cfg.get("_name_or_path", a.ckpt.name))
    w.add_context_length(max_pos)
    w.add_rope_scaling_orig_ctx_len(orig_pos)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if a.outtype == "f32" else gguf.LlamaFileType.MOSTLY_BF16)

    rs = cfg.get("rope_scaling") or {}
    if rs.get("long_factor"):
        scale = max_pos / orig_pos
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig_pos)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            f = np.asarray(rs[f"{kind}_factor"], dtype=np.float32)
            if f.shape != (rope_dims // 2,):
                sys.exit(f"config.json: rope_scaling.{kind}_factor has {f.size} entries, {rope_dims // 2} expected")
            w.add_tensor(f"rope_factors_{kind}.weight", f)

    tokens, types, merges = vocab(a.ckpt, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 199999))
    w.add_eos_token_id(cfg.get("eos_token_id", 199999))
    w.add_pad_token_id(cfg.get("pad_token_id", 199999))
    w.add_add_bos_token(False)

    def put(gname, hname):
        dtype, arr = st.get(hname)
        if a.outtype == "f32" or arr.ndim == 1:  # norms stay f32, as llama.cpp's converter keeps them
            w.add_tensor(gname, as_f32(dtype, arr))
        else:
            bits = as_bf16_bits(dtype, arr)
            # raw bytes: the writer derives the element shape from the byte shape
            w.add_tensor(gname, bits.view(np.uint8).reshape(bits.shape[0], -1),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    def base(prefix):  # the released names carry base_layer; a plain checkpoint does not
        return f"{prefix}.base_layer.weight" if f"{prefix}.base_layer.weight" in st.entries else f"{prefix}.weight"

    put("token_embd.weight", "model.embed_tokens.weight")
    if not cfg.get("tie_word_embeddings", True):
        put("output.weight", "lm_head.weight")
    put("output_norm.weight", "model.norm.weight")
    for i in range(n_layer):
        p = f"model.layers.{i}"
        put(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight")
        put(f"blk.{i}.attn_qkv.weight", base(f"{p}.self_attn.qkv_proj"))
        put(f"blk.{i}.attn_output.weight", base(f"{p}.self_attn.o_proj"))
        put(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
        put(f"blk.{i}.ffn_up.weight", base(f"{p}.mlp.gate_up_proj"))
        put(f"blk.{i}.ffn_down.weight", base(f"{p}.mlp.down_proj"))

    finish(w, a.out)
    print(f"wrote {a.out} ({a.outtype}, {n_layer} layers, n_embd {n_embd}, vocab {n_vocab})")


if __name__ == "__main__":
    main()
