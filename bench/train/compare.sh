#!/usr/bin/env bash
# Runs bench_train (areno) and torch_train.py (transformers + torch.optim.AdamW)
# alternately on the same weights and rows, and prints a table: tokens/s,
# seconds per step, peak RSS, the first-step loss of each (they must agree),
# the load average before each run, and per round the ratios against the
# issue's target (areno >= 1.25x torch's tokens/s at no more peak memory).
#
# usage: bench/train/compare.sh [builddir]
#   PRESET (small), SEED (1), SEQ (2048), WARMUP (1), STEPS (2), ROUNDS (2),
#   LM (all | lora | user), LORA_RANK (16: the user adapter's rank with LM=user), THREADS (2: OMP_NUM_THREADS for areno, torch.set_num_threads),
#   CONFIGS: space-separated "checkpointing:batch:mini_bs" (default
#   "on:2:1 on:2:2 off:2:1"), PY (python with torch, transformers, peft:
#   /work/venv/bin/python when present, else python3), OUT (a file that keeps
#   every JSON line; default a temp file).
# Each round runs areno then torch for every config, so contention from other
# work on the machine shows up in both. In round 1 both also time one
# micro-batch piece by piece (--phases on) and areno measures the GEMM peak.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
preset=${PRESET:-small} seed=${SEED:-1} seq=${SEQ:-2048} warmup=${WARMUP:-1} steps=${STEPS:-2}
rounds=${ROUNDS:-2} lm=${LM:-all} lora_rank=${LORA_RANK:-16}
configs=${CONFIGS:-"on:2:1 on:2:2 off:2:1"}
export THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
py=${PY:-}
if [[ -z "$py" ]]; then
  if [[ -x /work/venv/bin/python ]]; then py=/work/venv/bin/python; else py=python3; fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=${OUT:-$tmp/results.jsonl}
: > "$out"
ckpt=$tmp/$preset
"$build/app/areno" init --preset "$preset" --seed "$seed" --dtype f32 --out "$ckpt" >&2

load() { cut -d' ' -f1-3 /proc/loadavg; }
for round in $(seq 1 "$rounds"); do
  for c in $configs; do
    IFS=: read -r ac batch mini <<<"$c"
    common=(--seq "$seq" --batch-size "$batch" --mini-bs "$mini" --warmup "$warmup" --steps "$steps"
            --activation-checkpointing "$ac" --lm-trainable "$lm" --lora-rank "$lora_rank")
    for impl in areno torch; do
      before=$(load)
      echo "round $round, $impl, checkpointing $ac, batch $batch, mini-bs $mini (load $before)" >&2
      if [[ $impl == areno ]]; then
        # Phases and the GEMM peak once, in the first round.
        extra=(--phases off --gemm-peak off)
        [[ $round == 1 ]] && extra=(--phases on --gemm-peak on)
        j=$("$build/bench/train/bench_train" --preset "$preset" --seed "$seed" "${common[@]}" "${extra[@]}")
      else
        extra=(--phases off)
        [[ $round == 1 ]] && extra=(--phases on)
        j=$("$py" -W ignore bench/train/torch_train.py --checkpoint "$ckpt" "${common[@]}" "${extra[@]}" 2>/dev/null | tail -1)
      fi
      echo "{\"round\": $round, \"load_before\": \"$before\", \"load_after\": \"$(load)\", \"result\": $j}" >> "$out"
    done
  done
done

"$py" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
gib = 1 << 30
def key(r):
    j = r["result"]
    return (j["activation_checkpointing"], j["batch_size"], j["mini_bs"])
print(f"{'ckpt':>4} {'batch':>5} {'mini':>4} {'round':>5} {'impl':>5} {'load (1/5/15 min)':>17} "
      f"{'tok/s':>8} {'s/step':>8} {'peak RSS GiB':>12} {'loss step 1':>12}")
for r in rows:
    j = r["result"]
    print(f"{'on' if j['activation_checkpointing'] else 'off':>4} {j['batch_size']:>5} {j['mini_bs']:>4} "
          f"{r['round']:>5} {j['impl']:>5} {r['load_before']:>17} {j['tokens_per_s']:8.1f} {j['s_per_step']:8.2f} "
          f"{j['peak_rss_bytes'] / gib:12.2f} {j['losses'][0]:12.6f}")
print()
print("areno / torch per round (target: speed >= 1.25x, memory <= 1.00x):")
pairs = {}
for r in rows:
    pairs.setdefault((key(r), r["round"]), {})[r["result"]["impl"]] = r["result"]
for (k, rnd), p in sorted(pairs.items()):
    if "areno" in p and "torch" in p:
        a, t = p["areno"], p["torch"]
        dl = max(abs(x - y) for x, y in zip(a["losses"], t["losses"]))
        print(f"  ckpt {'on' if k[0] else 'off'}, batch {k[1]}, mini-bs {k[2]}, round {rnd}: "
              f"speed {a['tokens_per_s'] / t['tokens_per_s']:.2f}x, peak memory {a['peak_rss_bytes'] / t['peak_rss_bytes']:.2f}x, "
              f"max |loss difference| {dl:.1e}")
for r in rows:
    j = r["result"]
    if "phase_forward_layers_s" in j:
        print(f"{j['impl']} phases (ckpt {'on' if j['activation_checkpointing'] else 'off'}, {j['mini_bs']} row(s) of {j['seq']}): "
              f"forward layers {j['phase_forward_layers_s']:.2f} s, forward loss {j['phase_forward_loss_s']:.2f} s, "
              f"backward {j['phase_backward_s']:.2f} s (of it the loss {j['phase_loss_backward_s']:.2f} s), "
              f"optimizer {j['phase_optimizer_s']:.2f} s")
    if "gemm_peak_gflops" in j:
        print(f"  GEMM: model {j['model_gflop_per_step']:.0f} GFLOP/step (+{j['recompute_gflop_per_step']:.0f} recomputed), "
              f"achieved {j['model_gflops_achieved']:.1f} GFLOP/s; measured peak {j['gemm_peak_gflops']:.1f} GFLOP/s "
              f"(head shape {j['gemm_gflops_head_1024xVxH']:.1f}) -> model FLOPs {100 * j['model_flops_vs_gemm_peak']:.0f}% "
              f"of the peak, with recompute {100 * j['hardware_flops_vs_gemm_peak']:.0f}%")
PY
