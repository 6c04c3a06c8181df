#!/usr/bin/env bash
# Runs bench_audio and the PyTorch peer on the same weights in one session and
# prints a table (areno ms, torch ms, speed ratio; medians), plus the 24-block
# 24-block estimate of the encoder: front end + 24 x one block (both timed alone).
# usage: bench/audio/run.sh [builddir]
#   THREADS (default 2) sets OMP_NUM_THREADS and torch's threads; REPS (default 5);
#   BLOCKS (default 3) Conformer blocks at the released width (24 in the release).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
export THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
reps=${REPS:-5}
blocks=${BLOCKS:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
w=$tmp/audio.safetensors
echo "load before: $(uptime)" >&2
ours=$("$build/bench/audio/bench_audio" "$w" --reps "$reps" --blocks "$blocks")
peer=$(python3 -W ignore bench/audio/peer_torch.py "$w" --reps "$reps" --blocks "$blocks" 2>/dev/null)
echo "load after:  $(uptime)" >&2
python3 - "$ours" "$peer" "$blocks" <<'PY'
import json, sys
ours = {j["bench"]: j for j in map(json.loads, sys.argv[1].splitlines())}
peer = {j["bench"]: j for j in map(json.loads, sys.argv[2].splitlines())}
nb = int(sys.argv[3])
print(f"{'benchmark (median)':24} {'areno ms':>10} {'torch ms':>10} {'areno/torch speed':>18}")
for k, o in ours.items():
    p = peer.get(k, {}).get("ms")
    print(f"{k:24} {o['ms']:10.1f} {p if p is None else round(p, 1):>10} {(p / o['ms']) if p else 0:17.2f}x")
est = lambda d: d["frontend_30s"]["ms"] + 24 * d["block_30s"]["ms"]
a, t = est(ours), est(peer)
print(f"{'encoder_30s_24b (est.)':24} {a:10.1f} {t:10.1f} {t / a:17.2f}x")
o, p = ours[f"encoder_30s_{nb}b"].get("out0_3"), peer[f"encoder_30s_{nb}b"].get("out0_3")
print(f"encoder row 0 [0:4]: areno {o} torch {p} (inputs differ by the port's one mel bin, spec 3.13)")
PY
