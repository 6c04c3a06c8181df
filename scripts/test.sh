#!/usr/bin/env bash
# Installs what is missing, builds (with the CUDA backend when nvcc is found)
# and runs the whole test suite. Extra arguments go to `meson test`.
# Without a GPU the CUDA code is compiled for sm_90 only: nothing runs it
# here, the build only shows that it compiles (nvcc's second architecture was
# a fifth of each .cu file's compile time).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
builddir=${BUILDDIR:-build-test}
sm=()
nvidia-smi -L > /dev/null 2>&1 || sm=(-Dsm=90)
[ -d "$builddir" ] || meson setup "$builddir" -Dcuda=auto "${sm[@]}"
ninja -C "$builddir" -j"$(nproc)"
meson test -C "$builddir" --print-errorlogs --num-processes "$(nproc)" "$@"
