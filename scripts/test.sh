#!/usr/bin/env bash
# Installs what is missing, builds (with the CUDA backend when nvcc is found)
# and runs the whole test suite. Extra arguments go to `meson test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
builddir=${BUILDDIR:-build-test}
[ -d "$builddir" ] || meson setup "$builddir" -Dcuda=auto
ninja -C "$builddir" -j"$(nproc)"
meson test -C "$builddir" --print-errorlogs --num-processes "$(nproc)" "$@"
