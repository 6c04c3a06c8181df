#!/usr/bin/env bash
# Rebuilds the embedded demo model's weights (docs/demo.md): generates the
# synthetic set, trains the tiny preset from seed 0 on it with `areno train`,
# packs what training changed into models/phi4mm/demo/demo_weights.safetensors,
# rebuilds, and prints the held-out accuracy of the embedded model.
#
#   scripts/make-demo.sh [--build DIR] [--work DIR] [--no-install]
#
# --build: the meson build folder (default build); --work: where the data,
# base checkpoint and run go (default BUILD/demo); --no-install: train and
# evaluate, but leave the committed weights as they are.
# Takes about 10 minutes on 2 cores. Training is deterministic for a given
# machine and thread count; another CPU may round differently, so the new
# weights can differ in the last bits from the committed ones.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build work="" install=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "make-demo.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
work="${work:-$build/demo}"
areno="$build/app/areno"
ninja -C "$build" app/areno examples/areno-demo-data examples/areno-demo-pack

steps=1500

rm -rf "$work"
"$build/examples/areno-demo-data" --out "$work/data" --seed 1 --train 3000 --heldout 320
"$areno" init --preset tiny --seed 0 --dtype f32 --out "$work/base"
"$areno" train --algo sft --ckpt "$work/base" --dataset-path "$work/data/train.jsonl" \
  --max-steps "$steps" --batch-size 8 --mini-bs 8 --lr 3e-3 --min-lr 3e-4 --warmup-steps 20 \
  --embed-rows data --unfreeze-mm-projector --seed 42 \
  --save-path "$work/run" --metrics-log-dir "$work/run/metrics"
step_dir="$work/run/$(cat "$work/run/latest")"
"$areno" eval --model-path "$step_dir" --dataset-path "$work/data/heldout.jsonl" --group-by family

if [[ $install == 1 ]]; then
  "$build/examples/areno-demo-pack" --model-path "$step_dir" --out models/phi4mm/demo/demo_weights.safetensors
  ninja -C "$build"
  echo "the embedded demo model (no --model-path):"
  "$areno" eval --dataset-path "$work/data/heldout.jsonl" --group-by family
fi
