#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: build areno for sm_90, run
# every test suite (the [cuda] cases run instead of being skipped) and the
# benchmarks under build-gpu/bench, keeping all logs under $OUT.
#
#   scripts/gpu-check.sh            # logs in ./gpu-out
#   OUT=/tmp/x scripts/gpu-check.sh
#
# Environment: OUT (log folder, default ./gpu-out), CUDA_ARCH (default 90),
# BUILD_DIR (default build-gpu), JOBS (default nproc), BENCH_TIMEOUT (seconds
# per benchmark, default 600). Exits non-zero when there is no GPU or any step fails.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-out}"
CUDA_ARCH="${CUDA_ARCH:-90}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
JOBS="${JOBS:-$(nproc)}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-600}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

say() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME LOG CMD...: runs CMD with output in LOG, records pass/fail and the time.
step() {
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  "$@" > "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    say "PASS  $name ($((SECONDS - t0)) s, log: $log)"
  else
    say "FAIL  $name (exit $rc after $((SECONDS - t0)) s, log: $log)"
    tail -n 30 "$log" | sed 's/^/      /' | tee -a "$SUMMARY"
    status=1
  fi
  return $rc
}

say "areno gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

# ---- a GPU must be visible: fail loudly otherwise ----
if ! command -v nvidia-smi > /dev/null 2>&1; then
  say "ERROR: nvidia-smi not found: this script needs a machine with an NVIDIA GPU and driver."
  exit 2
fi
if ! nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || ! nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  say "ERROR: nvidia-smi sees no GPU (see $OUT/nvidia-smi.txt)."
  cat "$OUT/nvidia-smi.txt" >&2
  exit 2
fi
nvidia-smi -L | sed 's/^/gpu: /' | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv \
  >> "$OUT/nvidia-smi.txt" 2>&1 || true
/usr/local/cuda/bin/nvcc --version > "$OUT/nvcc.txt" 2>&1 || true

# ---- build ----
if [ -d "$BUILD_DIR" ]; then
  step "configure" "$OUT/configure.log" \
    meson setup --reconfigure "$BUILD_DIR" -Dcuda=enabled -Dsm="$CUDA_ARCH" -Dbuildtype=release
else
  step "configure" "$OUT/configure.log" \
    meson setup "$BUILD_DIR" -Dcuda=enabled -Dsm="$CUDA_ARCH" -Dbuildtype=release
fi || { say "summary: FAILED (configure)"; exit 1; }
step "build (sm_$CUDA_ARCH, -j$JOBS)" "$OUT/build.log" ninja -C "$BUILD_DIR" -j "$JOBS" \
  || { say "summary: FAILED (build)"; exit 1; }

if [ -x "$BUILD_DIR/app/areno" ]; then
  step "areno env" "$OUT/areno-env.txt" "$BUILD_DIR/app/areno" env
fi

# ---- tests: every suite; the [cuda] cases run on this GPU ----
step "meson test (all suites)" "$OUT/test.log" \
  meson test -C "$BUILD_DIR" --print-errorlogs --num-processes 1
cp "$BUILD_DIR/meson-logs/testlog.txt" "$OUT/testlog.txt" 2> /dev/null || true
cp "$BUILD_DIR/meson-logs/testlog.json" "$OUT/testlog.json" 2> /dev/null || true
grep -E '^(Ok|Expected Fail|Fail|Unexpected Pass|Skipped|Timeout):' "$OUT/test.log" \
  | sed 's/^/tests: /' | tee -a "$SUMMARY"
# doctest's own counts, which show how many [cuda] cases ran rather than skipped
grep -hE '^\[doctest\] test cases:' "$OUT/testlog.txt" 2> /dev/null | sed 's/^/doctest: /' \
  >> "$SUMMARY" || true

# ---- benchmarks: every executable under $BUILD_DIR/bench ----
mapfile -t benches < <(find "$BUILD_DIR/bench" -type f -executable ! -name '*.so' ! -name '*.p' \
                         2> /dev/null | grep -v '\.p/' | sort)
if [ ${#benches[@]} -eq 0 ]; then
  say "SKIP  benchmarks (no executables under $BUILD_DIR/bench)"
else
  mkdir -p "$OUT/bench"
  for b in "${benches[@]}"; do
    name=$(basename "$b")
    step "bench $name" "$OUT/bench/$name.log" timeout "$BENCH_TIMEOUT" "$b"
  done
fi

nvidia-smi --query-gpu=name,temperature.gpu,power.draw,clocks.sm --format=csv \
  > "$OUT/nvidia-smi-after.txt" 2>&1 || true
if [ $status -eq 0 ]; then say "summary: ALL PASSED"; else say "summary: FAILED (see above)"; fi
say "logs: $OUT"
exit $status
