#!/usr/bin/env bash
# Runs bench_core and the PyTorch peer in the same session and prints a table.
# usage: bench/core/run.sh [builddir]   (OMP_NUM_THREADS / THREADS default 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} THREADS=${THREADS:-2}
ours=$("$build/bench/core/bench_core")
peer=$(python3 bench/core/peer_torch.py)
python3 - "$ours" "$peer" <<'PY'
import json, sys
ours = {j["bench"]: j for j in map(json.loads, sys.argv[1].splitlines())}
peer = {j["bench"]: j for j in map(json.loads, sys.argv[2].splitlines())}
print(f"{'benchmark':28} {'areno ms':>10} {'torch ms':>10} {'areno/torch speed':>18}")
for k, o in ours.items():
    p = peer.get(k)
    if p:
        print(f"{k:28} {o['ms']:10.3f} {p['ms']:10.3f} {p['ms']/o['ms']:17.2f}x")
    else:
        extra = ", ".join(f"{a}={b}" for a, b in o.items() if a not in ("bench", "ms"))
        print(f"{k:28} {o['ms']:10.3f} {'-':>10}   {extra}")
PY
