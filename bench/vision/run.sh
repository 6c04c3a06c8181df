#!/usr/bin/env bash
# Runs bench_vision and the PyTorch peer on the same random tower weights in
# one session and prints a table (areno ms, torch ms, speed ratio):
#   - SigLIP tower forward per 448x448 crop, f32, at the released widths with
#     LAYERS encoder layers (default 2), plus per-layer times and the
#     extrapolated 26-layer time (the image path's depth);
#   - preprocessing of a 1344x896 JPEG (quality 90, the spec's synthetic image)
#     to tensors: our decode_image + process_images vs PIL + transformers'
#     Phi4MultimodalImageProcessor.
# Each program reports the median of REPS runs (default 5) after a warm-up.
# usage: bench/vision/run.sh [builddir]
#   THREADS (default 2) sets OMP_NUM_THREADS for areno and torch's threads.
#   Needs python3 with torch, transformers, safetensors, numpy, pillow, torchvision.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
export THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
reps=${REPS:-5}
layers=${LAYERS:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/image.jpg" <<'PY'
import sys
import numpy as np
from PIL import Image
y, x = np.mgrid[0:896, 0:1344]
rgb = np.stack([(7 * x + 3 * y) % 256, (x ^ y) % 256, (5 * (x + 2 * y) + x * y) % 256], -1).astype(np.uint8)
Image.fromarray(rgb).save(sys.argv[1], quality=90)
PY
echo "load before: $(uptime)" >&2
ours=$("$build/bench/vision/bench_vision" --layers "$layers" --reps "$reps" --save-weights "$tmp/tower.safetensors" \
       --jpeg "$tmp/image.jpg")
peer=$(python3 -W ignore bench/vision/peer_torch.py "$tmp/tower.safetensors" --reps "$reps" --jpeg "$tmp/image.jpg" 2>/dev/null)
echo "load after:  $(uptime)" >&2
python3 - "$ours" "$peer" <<'PY'
import json, sys
ours = {j["bench"]: j for j in map(json.loads, sys.argv[1].splitlines())}
peer = {j["bench"]: j for j in map(json.loads, sys.argv[2].splitlines())}
print(f"{'benchmark':22} {'areno ms':>10} {'torch ms':>10} {'areno/torch speed':>18}")
for k, o in ours.items():
    p = peer.get(k, {}).get("ms")
    ratio = f"{p / o['ms']:17.2f}x" if p else f"{'-':>18}"
    print(f"{k:22} {o['ms']:10.1f} {p if p else '-':>10} {ratio}")
for n in (1, 4):
    a, b = ours[f"tower_b{n}"]["hidden0_3"], peer[f"tower_b{n}"]["hidden0_3"]
    diff = max(abs(x - y) for x, y in zip(a, b))
    print(f"tower_b{n} hidden[0, 0, 0:4] {'agree with' if diff < 1e-4 else 'WARNING: differ from'} torch "
          f"(max |diff| {diff:.1e})")
a, b = ours["preprocess_jpeg"], peer["preprocess_jpeg"]
print(f"preprocess: tokens areno {a['tokens']} torch {b['tokens']}, crops {a['crops']} / {b['crops']}")
PY
