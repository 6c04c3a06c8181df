#!/usr/bin/env bash
# Runs bench_model and the PyTorch peer on the same `small` checkpoint in one
# session and prints a table (areno ms, torch ms, speed ratio) plus the
# memory-bandwidth bound of decode.
# usage: bench/model/run.sh [builddir] [checkpoint_dir]
#   builddir defaults to build; without a checkpoint dir the `small` preset
#   (f32, seed 1) is written to a temp dir with `areno init` and removed after.
#   THREADS (default 2) sets OMP_NUM_THREADS for areno and torch's threads; REPS (default 3).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
ckpt=${2:-}
export THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
reps=${REPS:-3}
if [[ -z "$ckpt" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  ckpt=$tmp/small
  "$build/app/areno" init --preset small --out "$ckpt" --seed 1 --dtype f32 >&2
fi
echo "load before: $(uptime)" >&2
ours=$("$build/bench/model/bench_model" "$ckpt" --reps "$reps")
peer=$(python3 -W ignore bench/model/peer_torch.py "$ckpt" --reps "$reps" 2>/dev/null)
echo "load after:  $(uptime)" >&2
python3 - "$ours" "$peer" <<'PY'
import json, sys
ours = {j["bench"]: j for j in map(json.loads, sys.argv[1].splitlines())}
peer = {j["bench"]: j for j in map(json.loads, sys.argv[2].splitlines())}
print(f"{'benchmark':26} {'areno ms':>10} {'torch ms':>10} {'areno/torch speed':>18} {'areno tok/s':>12} {'torch tok/s':>12}")
for k, o in ours.items():
    p = peer.get(k, {})
    pm = p.get("ms")
    ratio = f"{pm / o['ms']:17.2f}x" if pm else f"{'-':>18}"
    print(f"{k:26} {o['ms']:10.3f} {pm if pm else '-':>10} {ratio} {o.get('tok_s', '-'):>12} {p.get('tok_s', '-'):>12}")
o, p = ours.get("prefill_512_last_logits", {}), peer.get("prefill_512_last_logits", {})
if "logits0_3" in o and "logits0_3" in p:
    diff = max(abs(a - b) for a, b in zip(o["logits0_3"], p["logits0_3"]))
    status = "agree with" if diff < 1e-3 else "WARNING: differ from"
    print(f"prefill last-row logits[0:4] {status} torch (max |diff| {diff:.2e}): areno {o['logits0_3']}")
for k in ("decode_b1", "decode_b8"):
    if k in ours and k in peer and ours[k].get("first_tokens") != peer[k].get("first_tokens"):
        print(f"WARNING: {k} greedy tokens differ: areno {ours[k]['first_tokens']} torch {peer[k]['first_tokens']}")
    elif k in ours and k in peer:
        print(f"{k}: first greedy tokens agree with torch: {ours[k]['first_tokens']}")
# Decode reads every weight once per step (the tied 200064 x H head dominates),
# so the step time is at least weight bytes / memory bandwidth. The copy
# bandwidth counts read + write bytes.
wb = ours["load"]["weight_bytes"]
bw = ours["copy_256MiB"]["gbps"]
bound_ms = wb / (bw * 1e9) * 1e3
print(f"decode bound: {wb / 1e6:.1f} MB of weights per step (f32; embedding gather excluded: ~0), "
      f"copy bandwidth {bw:.2f} GB/s -> >= {bound_ms:.1f} ms/step, "
      f"<= {1e3 / bound_ms:.1f} tok/s at batch 1, <= {8e3 / bound_ms:.1f} tok/s at batch 8")
for k in ("decode_b1", "decode_b8"):
    if k in ours:
        print(f"  {k}: areno {ours[k]['ms']:.1f} ms/step = {bound_ms / ours[k]['ms'] * 100:.0f}% of the bound")
PY
