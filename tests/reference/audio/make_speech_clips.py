#!/usr/bin/env python3
"""Speech clips and golden features for the audio decoding tests (tests/audio/test_audio_io.cpp).

Synthesises three short English sentences with espeak-ng (22.05 kHz mono), converts
them with sox / lame to the committed test files and computes golden log-mel
features with the numpy transcription of the released extractor
(phi4mm_extractor.py, checked against the spec's golden vectors):

  speech_16k_mono.wav      WAV PCM_16, 16 kHz, mono
  speech_22k_stereo.flac   FLAC 16-bit, 22.05 kHz, stereo (right channel = 0.5 x a different
                           sentence, so the mix-down matters)
  speech_16k_mono.ogg      OGG/Vorbis, 16 kHz, mono
  speech_44k_mono.mp3      MP3 (lame 64 kbit/s), 44.1 kHz, mono (decimated by 2 in the extractor)

The features are computed from `soundfile.read` (PyPI soundfile, which bundles its own
libsndfile), as the model card reads audio: float64, channels averaged.

Usage (from the repository root; Debian: apt-get install espeak-ng sox libsox-fmt-all lame):
    python3 tests/reference/audio/make_speech_clips.py
Writes the clips and tests/data/audio/speech_golden.safetensors.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
import soundfile
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import phi4mm_extractor  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "audio")
TEXTS = ["Transcribe the audio clip.", "Hello world, one two three.", "The quick brown fox."]


def run(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def mono(x):
    return x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]


def main():
    os.makedirs(OUT, exist_ok=True)
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = []
        for i, text in enumerate(TEXTS):
            p = os.path.join(tmp, f"s{i}.wav")
            run("espeak-ng", "-v", "en", "-s", "170", "-w", p, text)
            raw.append(p)
        # 1. WAV 16 kHz mono PCM_16
        wav = os.path.join(OUT, "speech_16k_mono.wav")
        run("sox", "-D", raw[0], "-r", "16000", "-b", "16", "-c", "1", wav)
        # 2. FLAC 22.05 kHz stereo: left = sentence 1, right = 0.5 x sentence 2
        flac = os.path.join(OUT, "speech_22k_stereo.flac")
        run("sox", "-D", "-M", raw[1], "-v", "0.5", raw[2], "-b", "16", flac)
        # 3. OGG/Vorbis 16 kHz mono (sentence 3)
        ogg = os.path.join(OUT, "speech_16k_mono.ogg")
        run("sox", "-D", raw[2], "-r", "16000", "-c", "1", "-C", "2", ogg)
        # 4. MP3 44.1 kHz mono (sentence 1), through lame
        mid = os.path.join(tmp, "s0_44k.wav")
        run("sox", "-D", raw[0], "-r", "44100", "-b", "16", mid)
        mp3 = os.path.join(OUT, "speech_44k_mono.mp3")
        run("lame", "--quiet", "-b", "64", "--resample", "44.1", mid, mp3)

    # Golden features exactly as the model card's pipeline: soundfile.read (float64,
    # [N, C]) -> mean over channels -> the released extractor.
    for path in (wav, flac, ogg, mp3):
        x, sr = soundfile.read(path, dtype="float64", always_2d=True)
        name = os.path.basename(path)
        golden[f"{name}.features"] = torch.from_numpy(phi4mm_extractor.extract(mono(x), sr))
        golden[f"{name}.samples"] = torch.tensor([x.shape[0], sr, x.shape[1]], dtype=torch.int64)
    for k, v in golden.items():
        print(k, tuple(v.shape), v.flatten()[:3].tolist())
    save_file(golden, os.path.join(OUT, "speech_golden.safetensors"))
    for name in os.listdir(OUT):
        os.chmod(os.path.join(OUT, name), 0o644)


if __name__ == "__main__":
    main()
