"""A numpy transcription of the released Phi4MMAudioFeatureExtractor (processing_phi4mm.py)
as shared/spec/audio.md sections 2-3 describe it: sample-rate rule, framing, in-frame
pre-emphasis, x32768, symmetric Hamming, float64 rFFT rounded to complex64, power,
the speechlib mel bank (80 filters, 0-7690 Hz, bins 1..245), floor 1.0, natural log.

No scipy: resample_poly (Kaiser beta 5 FIR, zero edges) is written out with numpy for
the decimation case the reference uses (up = 1)."""
import math

import numpy as np


def speechlib_mel(sr=16000, n_fft=512, n_mels=80, fmin=0.0, fmax=7690.0):
    mel = lambda f: 1127.0 * np.log(1.0 + f / 700.0)
    bin2mel = lambda k: 1127.0 * np.log(1.0 + k * sr / (n_fft * 700.0))
    f2bin = lambda f: int(math.floor(f * n_fft / sr + 0.5))
    klo = f2bin(fmin) + 1
    khi = max(f2bin(fmax), klo)
    mlo, mhi = mel(fmin), mel(fmax)
    centers = np.linspace(mlo, mhi, n_mels + 2)
    ms = (mhi - mlo) / (n_mels + 1)
    W = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for m in range(n_mels):
        for k in range(klo, khi):
            b = bin2mel(k)
            if centers[m] < b < centers[m + 2]:
                W[m, k] = 1.0 - abs(centers[m + 1] - b) / ms
    return W


def resample_down(x, q):
    """scipy.signal.resample_poly(x, 1, q) in float64."""
    if q == 1:
        return x.copy()
    half = 10 * q
    L = 2 * half + 1
    m = np.arange(L) - half
    fc = 1.0 / q
    h = fc * np.sinc(fc * m)
    w = np.kaiser(L, 5.0)
    h = h * w
    h = h / h.sum()
    n_out = -(-len(x) // q)
    xp = np.concatenate([np.zeros(half), x, np.zeros(half + q)])
    y = np.empty(n_out)
    for i in range(n_out):
        seg = xp[i * q: i * q + L]  # x[i*q + half - j] for j = 0..L-1, reversed
        y[i] = np.dot(h, seg[::-1])
    return y


def extract(wav, fs):
    """Log-mel features [T, 80] float32 of mono float64 samples at fs (spec 2.2-3.9)."""
    wav = np.asarray(wav, dtype=np.float64)
    if fs > 16000:
        wav = resample_down(wav, fs // 16000)
        fs = 16000
    elif 8000 < fs < 16000:
        fs = 8000  # down = fs // 8000 = 1: a copy
    elif fs < 8000:
        raise ValueError("Unsupported sample rate")
    if fs == 8000:
        win, hop, n_fft = 200, 80, 256
    else:
        win, hop, n_fft = 400, 160, 512
    n_frames = (len(wav) - win) // hop + 1
    if n_frames < 1:
        raise ValueError("too short")
    idx = np.arange(win)[None, :] + hop * np.arange(n_frames)[:, None]
    frames = wav[idx].astype(np.float32)
    prev = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    e = (frames - np.float32(0.97) * prev) * np.float32(32768)
    e = e.astype(np.float32)
    window = np.hamming(win)  # symmetric, float64
    u = e * window  # float64
    spec = np.fft.rfft(u, n_fft).astype(np.complex64)
    mag = np.abs(spec).astype(np.float32)
    if fs == 8000:
        full = np.zeros((n_frames, 257), dtype=np.float32)
        full[:, :128] = mag[:, :128]
        mag = full
    power = (mag * mag).astype(np.float32)
    W = speechlib_mel()
    M = power @ W.T
    return np.log(np.maximum(M, np.float32(1.0))).astype(np.float32)
