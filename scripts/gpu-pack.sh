#!/usr/bin/env bash
# Packs a CUDA build made on this machine for a GPU machine that cannot build
# areno itself: the lent H200's image has nvcc, the CUDA libraries and Python,
# but not the Debian packages areno builds against (Eigen, fmt, doctest,
# oneDNN, cpp-httplib, the audio decoders, ...). The pack holds the
# executables scripts/gpu-check.sh runs and every shared library they need that
# is neither glibc nor CUDA's; gpu-check.sh unpacks it and links only the
# libraries the GPU machine lacks (by soname).
#
#   scripts/gpu-pack.sh                 # build/ -> .gpu/areno-gpu.tar.xz
#   BUILD_DIR=build-sm90 scripts/gpu-pack.sh
#
# The build must have the CUDA backend (meson setup -Dcuda=enabled, sm list
# holding 90) and the same CUDA major version as the GPU machine (13 here).
# .gpu/ is ignored by git; name it in the device tool's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
PACK="${PACK:-.gpu/areno-gpu.tar.xz}"

# Executables with [cuda] cases or GPU benchmarks, and the CLI.
bins=(app/areno
      tests/core/test_ops tests/core/test_autograd tests/optim/test_optim tests/nn/test_nn tests/io/test_io
      tests/model/test_model tests/vision/test_vision
      bench/core/bench_core bench/train/bench_train)

grep -q "ARENO_HAVE_CUDA 1" "$BUILD_DIR/areno_build_config.h" 2> /dev/null \
  || { echo "gpu-pack: $BUILD_DIR was built without CUDA (meson setup -Dcuda=enabled)" >&2; exit 1; }
ninja -C "$BUILD_DIR" "${bins[@]}" > /dev/null

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build" "$stage/lib"
for b in "${bins[@]}"; do
  mkdir -p "$stage/build/$(dirname "$b")"
  cp "$BUILD_DIR/$b" "$stage/build/$b"
done
# Shared libraries outside glibc and the CUDA toolkit (the GPU machine has its own).
for b in "${bins[@]}"; do ldd "$BUILD_DIR/$b"; done \
  | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u \
  | while read -r soname path; do
      case "$soname" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda.so*) continue ;;
      esac
      case "$path" in /usr/local/cuda*) continue ;; esac
      cp -L "$path" "$stage/lib/$soname"
    done
git rev-parse --short HEAD > "$stage/commit" 2> /dev/null || echo unknown > "$stage/commit"
git status --porcelain --untracked-files=no | grep -q . && echo "+dirty" >> "$stage/commit"
mkdir -p "$(dirname "$PACK")"
tar -C "$stage" -cf - build lib commit | xz -T0 -6 > "$PACK.tmp"
mv "$PACK.tmp" "$PACK"
echo "gpu-pack: $PACK ($(du -h "$PACK" | cut -f1)), $(ls "$stage/lib" | wc -l) libraries, commit $(tr '\n' ' ' < "$stage/commit")"
