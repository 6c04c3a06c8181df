#!/usr/bin/env python3
"""Dev-time check (issue 14, must-show 5, second half): a checkpoint `areno train` saves in
the released ("original") layout, converted with the transformers port's own conversion
script, gives the same logits in the port as areno gives on the step folder.

Not run in CI (CI has no Python). Usage, from the repository root (about a minute on 2 cores):

    pip install torch transformers==5.24.0 peft safetensors numpy
    meson setup build -Dcuda=disabled && ninja -C build app/areno
    python3 tests/reference/train/check_port_conversion.py --areno build/app/areno \\
        --convert-script PATH/convert_phi4_multimodal_weights_to_hf.py

The conversion script is not in the transformers wheel or sdist (both leave out every
`convert_*` script); it is `src/transformers/models/phi4_multimodal/
convert_phi4_multimodal_weights_to_hf.py` of the transformers source tree at the tag of the
installed version. The check runs it as is (a subprocess on the step folder); only where
that run fails does it run it again in-process with the documented work-arounds below, and
it reports every failure, so a gap in what areno writes shows up as a failed first run.

What it does:
  1. `areno init --preset tiny --seed 5 --dtype f32`, then `areno train` for 2 steps
     (batch 2, lr 1e-3, every group trainable: the whole decoder, both LoRAs, projectors,
     both towers) on 4 rows: two text rows, one 448x448 image row (vision LoRA) and one
     1.25 s 16 kHz audio row (speech LoRA); the media are generated here. It checks that
     the step folder's tensors moved in every group (LoRA, towers, projectors, decoder).
  2. The conversion script on SAVE/step-2 -> CONV (CONV/model.safetensors + config.json,
     processor files, CONV/vision-lora and CONV/speech-lora PEFT adapters).
  3. Phi4MultimodalForCausalLM.from_pretrained(CONV) and, as the port's documentation
     says, model.load_adapter(CONV, adapter_name=..., adapter_kwargs={"subfolder":
     "<name>-lora"}) for both adapters.
  4. Round trip: every tensor of the loaded model (with the adapters injected, so peft's
     names are the original base_layer / lora_A.<adapter> names), mapped back with the
     tower renames of tests/reference/model/make_e2e_golden.py (`released_name`, the
     mapping the e2e golden checks areno's towers against), equals the step folder's
     tensor of that name bit for bit; every step-folder tensor is used; lm_head is tied.
  5. Logits: three token-id prompts (8, 40 and 100 tokens: short and long LongRoPE
     table) with adapter none / vision / speech, every row, in the port against
     `areno logits --model-path SAVE/step-2 --token-ids ... --adapter ... --rows all`;
     and two media prompts (the training image, the training clip) through
     `areno logits --messages` (the adapter follows the media) against the port fed the
     ids areno built and the released processors' pixels / features, on the last 16 rows.
     Error: max |port - areno| / max |port|, per prompt and adapter; pass below 1e-5.

Work-arounds (each applied only when the as-is run fails, each reported):
  * tower sizes: the script builds Phi4MultimodalVisionConfig from `crop_size` only (the
    released config.json has no SigLIP sizes; the released code hard-codes SigLIP-so400m,
    which are the port's defaults) and passes the audio key `depthwise_seperable_out_channel`
    (released spelling), which the port ignores (its default 1024 is the released value).
    For the tiny checkpoint the run injects the sizes of config.json `img_processor` and
    `audio_processor.config` into the two config classes the script calls (only the values
    that differ from the port's defaults; nothing for a released-size checkpoint).
  * optimizer.safetensors: the script reads every *.safetensors file of the input folder
    as weights, so areno's optimizer state beside the weights would come in as model keys
    (and the moments of LoRA tensors as adapter keys). If that run fails, the input is a
    staged copy of the step folder (symlinks) without optimizer.safetensors.
  * LoRA ranks: the script writes fixed adapter configs (speech r 320 / alpha 640, vision
    r 256 / alpha 512: the released model's). If config.json's speech_lora / vision_lora
    differ, CONV/<name>-lora/adapter_config.json gets their r and lora_alpha.
"""
import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
import wave

import numpy as np
import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
SCRIPT_REL = os.path.join("models", "phi4_multimodal", "convert_phi4_multimodal_weights_to_hf.py")
USER, END, ASSISTANT, IMG, AUD = 200021, 200020, 200019, 200010, 200011
TOL = 1e-5
MEDIA_ROWS = 16


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_tensors(d, pattern="model*.safetensors"):
    out = {}
    for path in sorted(glob.glob(os.path.join(d, pattern))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


# ---------------------------------------------------------------- conversion (in-process)
def size_overrides(config):
    """Tower sizes of an areno config.json that the conversion script does not carry over,
    as (vision kwargs, audio kwargs), only where they differ from the port's defaults."""
    from transformers import Phi4MultimodalAudioConfig, Phi4MultimodalVisionConfig
    vis, aud = {}, {}
    vp = config.get("img_processor") or {}
    want = {"hidden_size": vp.get("hidden_size"), "intermediate_size": vp.get("intermediate_size"),
            "num_hidden_layers": vp.get("num_hidden_layers"), "num_attention_heads": vp.get("num_attention_heads"),
            "image_size": vp.get("image_size"), "patch_size": vp.get("patch_size"),
            "layer_norm_eps": vp.get("layer_norm_eps"), "hidden_act": vp.get("hidden_act"),
            "feature_layer": vp.get("layer_idx")}
    dv = Phi4MultimodalVisionConfig()
    for k, v in want.items():
        if v is not None and getattr(dv, k) != v:
            vis[k] = v
    ap = (config.get("audio_processor") or {}).get("config") or {}
    v = ap.get("depthwise_seperable_out_channel")
    if v is not None and Phi4MultimodalAudioConfig().depthwise_separable_out_channel != v:
        aud["depthwise_separable_out_channel"] = v
    return vis, aud


def convert_in_process(script, in_dir, out_dir):
    """The conversion script's own three steps (model, processor, adapters), as its main()
    runs them, with two work-arounds: the tiny tower sizes injected into the two config
    classes it calls, and a failure of the processor step (which writes no weights)
    reported instead of stopping the run. Runs in a child process (see --_convert)."""
    mod = load_module("convert_phi4_multimodal_weights_to_hf", script)
    with open(os.path.join(in_dir, "config.json")) as f:
        vis, aud = size_overrides(json.load(f))
    vc, ac = mod.Phi4MultimodalVisionConfig, mod.Phi4MultimodalAudioConfig
    mod.Phi4MultimodalVisionConfig = lambda **kw: vc(**{**vis, **kw})
    mod.Phi4MultimodalAudioConfig = lambda **kw: ac(**{**kw, **aud})
    print(f"note: tower sizes injected: vision {vis}, audio {aud}", flush=True)
    mod.convert_and_write_model(in_dir, out_dir)
    try:
        mod.convert_and_save_processor(in_dir, out_dir)
    except Exception as e:
        print(f"note: processor step failed (skipped; it writes no weights): {summary(traceback.format_exc())}",
              flush=True)
    mod.extract_adapters_data(in_dir, out_dir)


def summary(text):
    """One line for a failed run: the exception line (with its first detail line when it ends
    in ':'), or for load_state_dict's size mismatches their count and the first one."""
    lines = [l.strip() for l in text.strip().splitlines()]
    mismatches = [l for l in lines if l.startswith("size mismatch")]
    if mismatches:
        return f"load_state_dict: {len(mismatches)} size mismatches, first: {mismatches[0]}"
    idx = [i for i, l in enumerate(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", l)]
    if not idx:
        return lines[-1][:240] if lines else ""
    i = idx[-1]
    s = lines[i]
    if s.endswith(":") and i + 1 < len(lines):
        s += " " + lines[i + 1]
    return s if len(s) <= 240 else s[:240] + " ..."


def run_conversion(script, in_dir, out_dir, mode):
    """mode 'as-is': python SCRIPT IN OUT; 'patched': convert_in_process in a child.
    Returns (ok, error summary, notes)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    if mode == "as-is":
        cmd = [sys.executable, script, in_dir, out_dir]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--_convert", script, in_dir, out_dir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    text = r.stdout + r.stderr
    notes = [l[len("note: "):] for l in text.splitlines() if l.startswith("note: ")]
    return r.returncode == 0, ("" if r.returncode == 0 else summary(text)), notes


# ---------------------------------------------------------------- data and training
def write_ppm(path, w, h, e2e):
    with open(path, "wb") as f:
        f.write(f"P6\n{w} {h}\n255\n".encode())
        f.write(e2e.synthetic(w, h).tobytes())


def write_wav16(path, samples, fs):
    pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(fs)
        w.writeframes(pcm.tobytes())
    return pcm.astype(np.float64) / 32768.0  # what a PCM16 decoder gives back


def make_dataset(d, e2e):
    os.makedirs(d, exist_ok=True)
    write_ppm(os.path.join(d, "pic.ppm"), 448, 448, e2e)
    wav, fs = e2e.clip_b()
    samples = write_wav16(os.path.join(d, "clip.wav"), wav, fs)
    img = {"type": "image_url", "image_url": {"url": "pic.ppm"}}
    aud = {"type": "audio_url", "audio_url": {"url": "clip.wav"}}
    rows = [
        {"messages": [{"role": "user", "content": "What is two plus two?"},
                      {"role": "assistant", "content": "Four."}]},
        {"messages": [{"role": "user", "content": [img, {"type": "text", "text": "What is in the picture?"}]},
                      {"role": "assistant", "content": "Stripes."}]},
        {"prompt": "Name a colour.", "response": "Blue."},
        {"messages": [{"role": "user", "content": [aud, {"type": "text", "text": "Transcribe."}]},
                      {"role": "assistant", "content": "A rising tone."}]},
    ]
    path = os.path.join(d, "data.jsonl")
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for name, part, text in (("img.json", img, "Describe it."), ("aud.json", aud, "What do you hear?")):
        with open(os.path.join(d, name), "w") as f:
            json.dump({"messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}]}, f)
    return path, (samples, fs)


def group_of(name):
    if "lora_A" in name or "lora_B" in name:
        return "lora." + ("vision" if ".vision." in name else "speech")
    if name.startswith("model.embed_tokens_extend.image_embed.img_processor."):
        return "siglip"
    if name.startswith("model.embed_tokens_extend.audio_embed.encoder."):
        return "conformer"
    if name.startswith("model.embed_tokens_extend."):
        return "projectors"
    return "decoder"


def moved_per_group(before, after):
    out = {}
    for k, a in after.items():
        g = group_of(k)
        n, m = out.get(g, (0, 0))
        out[g] = (n + 1, m + int(not torch.equal(before[k], a)))
    return out


# ---------------------------------------------------------------- port
def load_port(conv):
    from transformers import Phi4MultimodalForCausalLM
    model, info = Phi4MultimodalForCausalLM.from_pretrained(conv, dtype=torch.float32, output_loading_info=True)
    for name in ("vision", "speech"):
        model.load_adapter(conv, adapter_name=name, adapter_kwargs={"subfolder": f"{name}-lora"})
    # As tests/reference/model/make_e2e_golden.py: eager in the towers (the port's SigLIP
    # sets is_causal, which SDPA honours when it builds no mask), SDPA in the text model.
    model.config._attn_implementation = "sdpa"
    model.config.vision_config._attn_implementation = "eager"
    model.config.audio_config._attn_implementation = "eager"
    model.eval()
    return model, info


def select_adapter(model, name):
    """model.set_adapter(name) / model.disable_adapters() of transformers' PEFT integration, done
    on the peft layers directly: transformers 5.24 requires peft >= 0.22 for those two calls,
    and 0.21.2 is the newest release (load_adapter has no such check). Same loop as theirs."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    n = 0
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            if name == "none":
                module.enable_adapters(False)
            else:
                module.enable_adapters(True)
                module.set_adapter(name)
            n += 1
    assert n > 0, "no LoRA layers in the model"


def port_logits(model, adapter, **inputs):
    select_adapter(model, adapter)
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    return out.logits[0].float()


def areno_logits(areno, step, out, token_ids=None, adapter=None, messages=None, rows="all"):
    cmd = [areno, "logits", "--model-path", step, "--out", out, "--rows", rows]
    if messages:
        cmd += ["--messages", messages]
    else:
        cmd += ["--token-ids", ",".join(map(str, token_ids)), "--adapter", adapter]
    subprocess.run(cmd, check=True, capture_output=True)
    with safe_open(out, "pt") as f:
        meta = f.metadata() or {}
        return f.get_tensor("logits"), f.get_tensor("rows"), f.get_tensor("token_ids"), meta.get("adapter")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--areno", required=True, help="the areno binary")
    ap.add_argument("--convert-script", help="convert_phi4_multimodal_weights_to_hf.py (default: next to the "
                    "installed transformers' phi4_multimodal package, where it normally is not)")
    ap.add_argument("--step-dir", help="check this step folder (a tiny f32 checkpoint) instead of training one")
    ap.add_argument("--keep", help="work in this folder and keep it (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    import transformers
    # Quiet: load_adapter's report lists as MISSING every model key holding the adapter's name
    # or "lora" that its file lacks (the other adapter, the audio projections *_for_speech /
    # *_for_vision_speech); nothing is re-initialized (the round trip below checks every
    # value). from_pretrained's own report is checked through output_loading_info.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
    script = args.convert_script or os.path.join(os.path.dirname(transformers.__file__), SCRIPT_REL)
    if not os.path.exists(script):
        sys.exit(f"no conversion script at {script}: the transformers wheel leaves out convert_* scripts; pass "
                 f"--convert-script with src/transformers/{SCRIPT_REL} from the transformers {transformers.__version__} "
                 "source tree")
    areno = os.path.abspath(args.areno)
    e2e = load_module("make_e2e_golden", os.path.join(ROOT, "tests", "reference", "model", "make_e2e_golden.py"))
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="areno_port_conv_")
    os.makedirs(work, exist_ok=True)
    failures = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; conversion script {script}; "
          f"work folder {work}")

    # 1. dataset, init, train
    data = os.path.join(work, "data")
    dataset, clip = make_dataset(data, e2e)
    if args.step_dir:
        step = os.path.abspath(args.step_dir)
    else:
        init, save = os.path.join(work, "init"), os.path.join(work, "save")
        shutil.rmtree(save, ignore_errors=True)
        subprocess.run([areno, "init", "--preset", "tiny", "--seed", "5", "--dtype", "f32", "--out", init],
                       check=True, capture_output=True)
        r = subprocess.run([areno, "train", "--dataset-path", dataset, "--ckpt", init, "--max-steps", "2",
                            "--batch-size", "2", "--lr", "1e-3", "--no-shuffle", "--lm-trainable", "all",
                            "--unfreeze-mm-projector", "--unfreeze-mm-tower", "--save-path", save],
                           check=True, capture_output=True, text=True)
        print("areno train:", " | ".join(l for l in r.stdout.splitlines() if l.startswith(("step", "saved"))))
        step = os.path.join(save, "step-2")
        moved = moved_per_group(read_tensors(init), read_tensors(step))
        print("tensors changed by training, per group:",
              ", ".join(f"{g} {m}/{n}" for g, (n, m) in sorted(moved.items())))
        for g, (n, m) in moved.items():
            if m == 0:
                failures.append(f"training changed no tensor of group {g}")
    print(f"step folder {step}: {sorted(os.listdir(step))}")

    # 2. conversion: as is first, then with the work-arounds the failures call for
    conv = os.path.join(work, "converted")
    attempts = [("as is, on the step folder", *run_conversion(script, step, conv, "as-is"))]
    if not attempts[-1][1]:
        attempts.append(("work-arounds, on the step folder", *run_conversion(script, step, conv, "patched")))
    if not attempts[-1][1]:
        staged = os.path.join(work, "staged")
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        for f in os.listdir(step):
            if f != "optimizer.safetensors":
                os.symlink(os.path.join(step, f), os.path.join(staged, f))
        attempts.append(("work-arounds, on a copy without optimizer.safetensors",
                         *run_conversion(script, staged, conv, "patched")))
    for what, good, err, notes in attempts:
        print(f"conversion ({what}): {'ok' if good else 'FAILED: ' + err}")
        for n in notes:
            print(f"    {n}")
    if not attempts[-1][1]:
        sys.exit("conversion failed; see above")
    with open(os.path.join(step, "config.json")) as f:
        cfg = json.load(f)
    for name in ("vision", "speech"):
        p = os.path.join(conv, f"{name}-lora", "adapter_config.json")
        with open(p) as f:
            ac = json.load(f)
        lc = cfg[f"{name}_lora"]
        if ac["r"] != int(lc["r"]) or float(ac["lora_alpha"]) != float(lc["lora_alpha"]):
            print(f"{name}-lora/adapter_config.json: r {ac['r']} alpha {ac['lora_alpha']} (the script's fixed "
                  f"released values) -> r {int(lc['r'])} alpha {lc['lora_alpha']} (config.json {name}_lora)")
            ac["r"], ac["lora_alpha"] = int(lc["r"]), lc["lora_alpha"]
            with open(p, "w") as f:
                json.dump(ac, f, indent=2)
    print(f"converted folder: {sorted(os.listdir(conv))}")

    # 3. load as documented
    model, info = load_port(conv)
    bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        failures.append(f"from_pretrained: {bad}")

    # 4. round trip of every tensor
    state = read_tensors(step)
    used, diff = set(), []
    for k, p in model.state_dict().items():
        orig = e2e.released_name(k)
        if orig is None:
            continue
        if orig not in state:
            diff.append(f"{k} -> {orig}: not in the step folder")
            continue
        if tuple(state[orig].shape) != tuple(p.shape) or not torch.equal(state[orig], p.to(state[orig].dtype)):
            diff.append(f"{orig}: differs")
        used.add(orig)
    unused = sorted(set(state) - used)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_lora = sum(1 for k in used if "lora_" in k)
    print(f"round trip: {len(used)} of {len(state)} step-folder tensors in the converted model + adapters "
          f"({n_lora} LoRA), {len(diff)} differ, {len(unused)} unused, lm_head tied: {tied}")
    if diff or unused or not tied:
        failures.append(f"round trip: differ {diff[:5]}, unused {unused[:5]}, tied {tied}")

    # 5. logits
    prompts = {
        "p8": [USER, 1008, 2501, 318, 4440, 30, END, ASSISTANT],
        "p40": [USER] + [(i * 7919 + 11) % 199000 + 100 for i in range(37)] + [END, ASSISTANT],
        "p100": [USER] + [(i * 104729 + 5) % 199000 + 100 for i in range(97)] + [END, ASSISTANT],
    }
    worst = {}
    results = []
    for key, ids in prompts.items():
        port = {a: port_logits(model, a, input_ids=torch.tensor([ids])) for a in ("none", "vision", "speech")}
        for a in ("none", "vision", "speech"):
            out = os.path.join(work, f"logits_{key}_{a}.safetensors")
            lg, _, tid, _ = areno_logits(areno, step, out, token_ids=ids, adapter=a)
            assert tid.tolist() == ids
            e = rel(lg, port[a])
            sep = min(rel(port[b], port[a]) for b in port if b != a)
            am = (lg.argmax(-1) == port[a].argmax(-1)).float().mean().item()
            results.append((key, len(ids), a, e, sep, am))
            worst[a] = max(worst.get(a, 0.0), e)
    for name, msg_file in (("image", "img.json"), ("audio", "aud.json")):
        out = os.path.join(work, f"logits_{name}.safetensors")
        _, _, tid, _ = areno_logits(areno, step, out, messages=os.path.join(data, msg_file), rows="last")
        ids = tid.tolist()
        s = len(ids)
        lg, rows, _, adapter = areno_logits(areno, step, out, messages=os.path.join(data, msg_file),
                                            rows=f"{s - MEDIA_ROWS}:{s}")
        inputs = {"input_ids": torch.tensor([ids])}
        if name == "image":
            pix, sizes, msk, toks = e2e.image_batch([(448, 448)])
            assert ids.count(IMG) == toks[0], (ids.count(IMG), toks)
            inputs.update(image_pixel_values=pix, image_sizes=sizes, image_attention_mask=msk)
        else:
            feats, asz = e2e.audio_inputs(clip)
            assert ids.count(AUD) == int(asz[0]), (ids.count(AUD), asz)
            inputs.update(audio_input_features=feats, audio_embed_sizes=asz)
        port = {a: port_logits(model, a, **inputs)[rows] for a in ("none", "vision", "speech")}
        e = rel(lg, port[adapter])
        sep = min(rel(port[b], port[adapter]) for b in port if b != adapter)
        am = (lg.argmax(-1) == port[adapter].argmax(-1)).float().mean().item()
        results.append((f"{name} ({s} tokens, last {MEDIA_ROWS} rows)", s, adapter, e, sep, am))
        worst[f"{adapter} ({name})"] = e
    print(f"{'prompt':34} {'tokens':>6} {'adapter':8} {'max rel err':>12} {'other adapters':>15} {'argmax':>7}")
    for key, n, a, e, sep, am in results:
        print(f"{key:34} {n:6d} {a:8} {e:12.3e} {sep:15.3e} {am:7.3f}")
        if not e < TOL:
            failures.append(f"logits {key} {a}: {e:.3e} >= {TOL}")
        if not sep > 100 * TOL:
            failures.append(f"logits {key} {a}: the other adapters are only {sep:.3e} away")
    print("worst per adapter:", ", ".join(f"{a} {e:.3e}" for a, e in worst.items()))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("OK")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_convert":
        try:
            convert_in_process(*sys.argv[2:5])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    sys.exit(main())
