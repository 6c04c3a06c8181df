#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the [cuda] test cases of every
# test executable that has them, then the GPU benchmarks (bench_core's cuBLAS
# GEMM and copy, bench_train's SFT steps on the GPU against the PyTorch peer),
# keeping all logs under $OUT.
#
# Two ways to get the executables:
#   build (default when no pack is there): meson setup -Dcuda=enabled
#     -Dsm=$CUDA_ARCH and ninja, on a machine with areno's build dependencies;
#   pack: scripts/gpu-pack.sh, run on a machine that can build, writes
#     .gpu/areno-gpu.tar.xz (the executables and the non-CUDA shared libraries
#     they need); here it is unpacked and only the libraries this machine lacks
#     are linked in. The lent H200 has nvcc and the CUDA libraries but not the
#     Debian packages areno builds against, so there the pack is the way:
#       scripts/gpu-pack.sh          # here
#       device run, carry [".gpu"]:  TAR_LOGS=1 scripts/gpu-check.sh
#
#   scripts/gpu-check.sh            # logs in ./gpu-out
#   OUT=/tmp/x scripts/gpu-check.sh
#
# Environment: OUT (log folder, default ./gpu-out), PACK (default
# .gpu/areno-gpu.tar.xz), CUDA_ARCH (default 90), BUILD_DIR (default build-gpu),
# JOBS (default nproc), DEADLINE (seconds for the whole script, default 3000: a
# step that would run past it is cut short or skipped), STEPS (which parts to
# run: any of "tests bench train composed profile peer serve full decode
# peerfull";
# default "tests bench train profile peer serve", about 2 minutes on an H200;
# full, decode and peerfull build the released sizes and take minutes more;
# composed reruns the bf16 training rows with ARENO_CUDA_FUSED_ATTENTION=0),
# TAR_LOGS=1 (pack the per-step logs into $OUT/logs.tar.gz, for tools that
# bring back few files). Exits non-zero when there is no GPU or any step fails.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="${OUT:-./gpu-out}"
PACK="${PACK:-.gpu/areno-gpu.tar.xz}"
CUDA_ARCH="${CUDA_ARCH:-90}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
JOBS="${JOBS:-$(nproc)}"
DEADLINE="${DEADLINE:-3000}"
STEPS="${STEPS:-tests bench train profile peer serve}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"
SUMMARY="$OUT/summary.txt"
RESULTS="$OUT/results.jsonl"
: > "$SUMMARY"
: > "$RESULTS"
status=0

say() { echo "$*" | tee -a "$SUMMARY"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
# step NAME LIMIT CMD...: runs CMD (at most LIMIT seconds, and never past
# DEADLINE) with its output in $LOGS/NAME.log; records pass/fail and the time.
step() {
  local name=$1 limit=$2
  shift 2
  local log="$LOGS/$name.log" left=$((DEADLINE - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    say "SKIP  $name (deadline)"
    status=1
    return 1
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    say "PASS  $name ($((SECONDS - t0)) s)"
  else
    say "FAIL  $name (exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ", timed out at $limit s"))"
    tail -n 25 "$log" | cut -c1-300 | sed 's/^/      /' | tee -a "$SUMMARY"
    status=1
  fi
  return $rc
}
finish() {
  nvidia-smi --query-gpu=name,temperature.gpu,power.draw,clocks.sm --format=csv \
    > "$LOGS/nvidia-smi-after.txt" 2>&1 || true
  if [ $status -eq 0 ]; then say "summary: ALL PASSED"; else say "summary: FAILED (see above)"; fi
  if [ "${TAR_LOGS:-0}" = 1 ]; then
    tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"
    say "logs: $OUT/logs.tar.gz"
  else
    say "logs: $LOGS"
  fi
  exit $status
}

say "areno gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "commit: $(git rev-parse --short HEAD 2> /dev/null || echo unknown)"

# ---- a GPU must be visible: fail loudly otherwise ----
if ! command -v nvidia-smi > /dev/null 2>&1; then
  say "ERROR: nvidia-smi not found: this script needs a machine with an NVIDIA GPU and driver."
  exit 2
fi
if ! nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || ! nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  say "ERROR: nvidia-smi sees no GPU (see $LOGS/nvidia-smi.txt)."
  cat "$LOGS/nvidia-smi.txt" >&2
  exit 2
fi
nvidia-smi -L | sed 's/^/gpu: /' | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv,noheader \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"
say "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(. /etc/os-release 2> /dev/null; echo "${PRETTY_NAME:-?}")"

# ---- the executables: unpack the pack, or build ----
if [ -f "$PACK" ]; then
  stage=/tmp/areno-gpu-pack
  rm -rf "$stage" && mkdir -p "$stage/ld"
  step "unpack" 120 tar -C "$stage" -xJf "$PACK" || finish
  say "pack: $PACK, built at commit $(tr '\n' ' ' < "$stage/commit")"
  BUILD_DIR="$stage/build"
  # Link in only what the loader cannot find: first the CUDA libraries from
  # wherever this machine keeps them, then the pack's own copies.
  export LD_LIBRARY_PATH="$stage/ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for _ in 1 2; do
    for so in $(for b in "$BUILD_DIR"/*/*/* "$BUILD_DIR"/app/areno; do [ -x "$b" ] && ldd "$b"; done 2> /dev/null \
                | awk '/not found/ {print $1}' | sort -u); do
      if [ -f "$stage/lib/$so" ]; then
        ln -sf "$stage/lib/$so" "$stage/ld/$so"
        say "lib: $so from the pack"
      else
        p=$(find /usr/local/cuda*/ /usr/local/lib /usr/lib /opt -name "$so" 2> /dev/null | head -1)
        if [ -n "$p" ]; then ln -sf "$p" "$stage/ld/$so" && say "lib: $so from $p"; fi
      fi
    done
  done
  missing=$(ldd "$BUILD_DIR/app/areno" "$BUILD_DIR/tests/core/test_ops" 2>&1 | grep 'not found' | sort -u)
  if [ -n "$missing" ]; then say "ERROR: libraries not found:"; say "$missing"; status=1; finish; fi
else
  if [ -d "$BUILD_DIR" ]; then
    step "configure" 600 meson setup --reconfigure "$BUILD_DIR" -Dcuda=enabled -Dsm="$CUDA_ARCH" -Dbuildtype=release
  else
    step "configure" 600 meson setup "$BUILD_DIR" -Dcuda=enabled -Dsm="$CUDA_ARCH" -Dbuildtype=release
  fi || finish
  step "build" 3000 ninja -C "$BUILD_DIR" -j "$JOBS" || finish
fi
step "areno-env" 60 "$BUILD_DIR/app/areno" env && sed 's/^/env: /' "$LOGS/areno-env.log" | head -20 >> "$SUMMARY"

# ---- tests: the [cuda] cases (and the case that loops over every device) ----
if want tests; then
  for t in core/test_ops optim/test_optim nn/test_nn io/test_io core/test_autograd vision/test_vision model/test_model; do
    [ -x "$BUILD_DIR/tests/$t" ] || { say "SKIP  $t (not built)"; continue; }
    step "test-$(basename "$t")" 240 "$BUILD_DIR/tests/$t" '-tc=*[cuda]*,*confident 200064*' --duration=true
    rc=$?
    if { [ $rc -eq 139 ] || [ $rc -eq 134 ]; } && command -v cuda-gdb > /dev/null; then
      # A crash: its backtrace (function names; the build has no line tables).
      step "bt-$(basename "$t")" 90 cuda-gdb -q -batch -ex run -ex bt --args "$BUILD_DIR/tests/$t" \
        '-tc=*[cuda]*,*confident 200064*'
      grep -E '^#[0-9]+ ' "$LOGS/bt-$(basename "$t").log" | head -12 | cut -c1-200 | sed 's/^/      /' | tee -a "$SUMMARY"
    fi
    grep -hE '^\[doctest\] (test cases|assertions):' "$LOGS/test-$(basename "$t").log" | sed "s|^|      $(basename "$t"): |" \
      | tee -a "$SUMMARY"
  done
fi

# ---- benchmarks: one JSON object per line in $RESULTS ----
if want bench; then
  step "bench_core" 180 "$BUILD_DIR/bench/core/bench_core" && grep '^{' "$LOGS/bench_core.log" >> "$RESULTS"
  grep '"device": "cuda' "$LOGS/bench_core.log" 2> /dev/null | sed 's/^/      /' | tee -a "$SUMMARY"
fi
# SFT steps on the GPU, areno then the PyTorch peer on the same weights and rows.
# One line of a result for the summary (the JSON object on stdin).
show() {
  python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
gpu = j.get("peak_gpu_bytes", 0) / 2**30
print("      %s %s %s: %.0f tok/s, %.3f s/step, losses %s, mfu %s, peak gpu %.2f GiB"
      % (j.get("impl"), j.get("preset", j.get("torch", "")), j.get("dtype"), j["tokens_per_s"], j["s_per_step"],
         j["losses"], j.get("mfu", "-"), gpu))'
}
train_row() {  # NAME LIMIT ARGS...: bench_train on cuda, its JSON kept
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BUILD_DIR/bench/train/bench_train" --device cuda --gemm-peak off "$@" \
    && grep '^{' "$LOGS/$name.log" | tail -1 | tee -a "$RESULTS" | show | tee -a "$SUMMARY"
}
peer_row() {  # NAME LIMIT CKPT ARGS...
  local name=$1 limit=$2 ckpt=$3
  shift 3
  step "$name" "$limit" env PYTHONUNBUFFERED=1 python3 -W ignore bench/train/torch_train.py --checkpoint "$ckpt" --device cuda "$@" \
    && grep '^{' "$LOGS/$name.log" | tail -1 | tee -a "$RESULTS" | show | tee -a "$SUMMARY"
}
small=(--seq 2048 --batch-size 8 --mini-bs 8 --warmup 1 --steps 3 --activation-checkpointing off --phases on)
if want train; then
  train_row "train-small-f32" 150 --preset small --dtype f32 "${small[@]}" --peak-tflops 67
  train_row "train-small-bf16" 150 --preset small --dtype bf16 "${small[@]}" --peak-tflops 989
fi
if want composed; then
  # The same rows with the fused attention kernels off (the composed op), for
  # the comparison in one run.
  export ARENO_CUDA_FUSED_ATTENTION=0
  train_row "train-small-bf16-composed" 150 --preset small --dtype bf16 "${small[@]}" --peak-tflops 989
  want full && train_row "train-full-lora-bf16-composed" 400 --preset full --dtype bf16 --lm-trainable lora \
    --seq 2048 --batch-size 4 --mini-bs 4 --warmup 1 --steps 2 --activation-checkpointing on --phases off \
    --peak-tflops 989
  unset ARENO_CUDA_FUSED_ATTENTION
fi
if want full; then
  # The released sizes, random weights, LoRA only (the base frozen in bf16).
  train_row "train-full-lora-bf16" 400 --preset full --dtype bf16 --lm-trainable lora --seq 2048 --batch-size 4 \
    --mini-bs 4 --warmup 1 --steps 2 --activation-checkpointing on --phases off --peak-tflops 989
fi
if want profile; then
  # Where a step goes, by kernel family (ARENO_PROFILE_OPS=1: every backend
  # call synchronized and timed; the table is printed at exit).
  for cfg in "small bf16" "full bf16"; do
    read -r preset dtype <<< "$cfg"
    extra=("${small[@]}")
    [ "$preset" = full ] && extra=(--lm-trainable lora --seq 2048 --batch-size 4 --mini-bs 4 --activation-checkpointing on)
    step "profile-$preset-$dtype" 200 env ARENO_PROFILE_OPS=1 "$BUILD_DIR/bench/train/bench_train" --device cuda \
      --gemm-peak off --preset "$preset" --dtype "$dtype" "${extra[@]}" --warmup 1 --steps 1 --phases off \
      && sed -n '/^ARENO_PROFILE_OPS/,$p' "$LOGS/profile-$preset-$dtype.log" | head -26 | sed 's/^/      /' \
        | tee -a "$SUMMARY"
  done
fi
if want serve; then
  # The engine on the GPU: greedy answers of the embedded demo model (f32) on
  # cuda:0 must be the CPU's tokens, for a text prompt and an image + audio one.
  img=tests/fuzz/corpus/image/tiny.png wav=tests/fuzz/corpus/audio/tone_16k.wav
  for dev in cpu cuda; do
    step "generate-text-$dev" 120 "$BUILD_DIR/app/areno" generate --device "$dev" --prompt "What is 2+3?" \
      --max-tokens 32 --print-ids
    step "generate-media-$dev" 120 "$BUILD_DIR/app/areno" generate --device "$dev" \
      --prompt "Describe the image and the sound." --image "$img" --audio "$wav" --max-tokens 32 --print-ids
  done
  for kind in text media; do
    python3 - "$LOGS/generate-$kind-cpu.log" "$LOGS/generate-$kind-cuda.log" << 'PY' | tee -a "$SUMMARY"
import json, sys
def last(p):
    lines = [l for l in open(p) if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None
a, b = last(sys.argv[1]), last(sys.argv[2])
if not a or not b:
    print("      generate: no answer to compare"); sys.exit(0)
same = a["ids"] == b["ids"]
d = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
print(f"      generate {sys.argv[1].split('generate-')[1].split('-')[0]}: cuda ids {'==' if same else '!='} cpu ids "
      f"({len(a['ids'])} tokens), max |logprob difference| {d:.2e}, text {b['text'][:60]!r}")
PY
  done
fi
if want decode; then
  # The released sizes served on the GPU: random bf16 weights, a 1,000-token
  # text prompt, 128 greedy tokens (the stats line: time to first token, tokens/s).
  ckpt=/tmp/areno-gpu-full
  [ -f "$ckpt/config.json" ] || step "init-full" 240 "$BUILD_DIR/app/areno" init --preset full --seed 1 --dtype bf16 --out "$ckpt"
  prompt=$(python3 -c 'print(" ".join(["the quick brown fox jumps over the lazy dog"] * 110))')
  for dt in bf16 f32; do
    step "decode-full-$dt" 200 "$BUILD_DIR/app/areno" generate --model-path "$ckpt" --device cuda --dtype "$dt" \
      --no-chat-template --prompt "$prompt" --max-tokens 128 \
      && grep -oE '\[[0-9]+ tokens[^]]*\]' "$LOGS/decode-full-$dt.log" | sed "s/^/      full $dt: /" | tee -a "$SUMMARY"
  done
fi
if want peerfull; then
  # The released sizes for the PyTorch peer: the checkpoint written in bf16
  # (11 GB), then LoRA-only SFT under autocast (its parameters load as f32).
  ckpt=/tmp/areno-gpu-full
  rm -rf "$ckpt"
  if step "init-full" 240 "$BUILD_DIR/app/areno" init --preset full --seed 1 --dtype bf16 --out "$ckpt"; then
    peer_row "peer-full-lora-bf16" 400 "$ckpt" --dtype bf16 --lm-trainable lora --seq 2048 --batch-size 4 \
      --mini-bs 4 --warmup 1 --steps 2 --activation-checkpointing on
  fi
fi
if want peer; then
  ckpt=/tmp/areno-gpu-small
  rm -rf "$ckpt"
  if step "init-small" 120 "$BUILD_DIR/app/areno" init --preset small --seed 1 --dtype f32 --out "$ckpt"; then
    peer_row "peer-small-f32" 150 "$ckpt" --dtype f32 "${small[@]}"
    peer_row "peer-small-bf16" 150 "$ckpt" --dtype bf16 "${small[@]}"
  fi
fi
finish
