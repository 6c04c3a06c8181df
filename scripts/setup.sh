#!/usr/bin/env bash
# Installs the Debian packages areno builds with, when any is missing.
# The CUDA toolkit is expected in /usr/local/cuda (the build works without it).
set -euo pipefail
pkgs=(meson ninja-build g++ pkg-config libeigen3-dev libfmt-dev doctest-dev
      nlohmann-json3-dev libpcre2-dev libfftw3-dev libstb-dev libcpp-httplib-dev libsndfile1-dev
      libdnnl-dev  # oneDNN: bf16 GEMMs (kernels/cpu/gemm_dnnl.h)
      libssl-dev   # libcrypto's SHA-256: the prefix cache's digests (serve/engine.cpp)
      curl)        # curl: the test agents of tests/rl/scripts/
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
