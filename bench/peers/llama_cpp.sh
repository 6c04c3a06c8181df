#!/usr/bin/env bash
# areno against llama.cpp on the same weights, same threads, one run (issue 16,
# must-show 1). Dev tooling: needs network the first time (PyPI), then works
# from its cache.
#
#   1. llama.cpp from the source PyPI's llama-cpp-python sdist vendors (pinned
#      version and sha256, cached under $ARENO_PEER_CACHE, default
#      ~/.cache/areno-peers), built CPU-only with GGML_NATIVE (-march=native):
#      llama-bench, llama-batched-bench, llama-server;
#   2. an areno checkpoint per dtype (`areno init --preset P --seed 1`, cached),
#      its text decoder written as GGUF `phi3` by bench/peers/to_gguf.py with
#      the gguf package of that same llama.cpp source;
#   3. ROUNDS rounds, each running both engines back to back per dtype
#      (areno's bench/peers/bench_llm, then llama-bench and
#      llama-batched-bench), one engine at a time, THREADS threads each; the
#      best round of each measure is kept;
#   4. a table (tok/s, ratio areno/llama.cpp, and the weight-read bound of
#      decode from the streaming-sum read bandwidth measured in the same run)
#      printed, and with --write-docs put into docs/perf.md between the
#      markers `<!-- llama_cpp.sh:PRESET begin/end -->` (temp + rename;
#      PRESET-avx2 on a CPU without AVX-512, PRESET-noamx on one with AVX-512
#      and no AMX).
#
# usage: bench/peers/llama_cpp.sh [--build DIR] [--preset small|full]
#                                 [--dtypes f32,bf16] [--rounds N] [--reps N]
#                                 [--pp 512,4096] [--batched 8,32|''] [--write-docs]
#                                 [--quantize int8]
#                                 [--prepare]  (steps 1-2 only: llama.cpp and the GGUF files)
#   THREADS (default 2), ARENO_PEER_CACHE, PYTHON (default python3; a venv with
#   numpy and pyyaml is made in the cache when it lacks them).
# Measures (names as llama-bench prints them): ppN prefill of an N-token prompt,
# tg128 128 single-sequence decode steps from an empty cache, tg128_bB decode
# of B sequences after a 128-token prompt each (llama-batched-bench S_TG).
# llama.cpp runs with its defaults (f16 KV cache, flash attention auto);
# areno keeps its KV cache in the model's dtype.
# --quantize int8: areno loads each dtype's checkpoint with --quantize int8
# (bench_llm --quantize int8) and llama.cpp runs that checkpoint's GGUF
# quantized to Q8_0 by its llama-quantize; rows are labelled DT-int8 and the
# table goes between the markers `llama_cpp.sh:PRESET-int8`. llama.cpp runs Q8_0
# without weight repacking (--repack 0 / -nr): with it, this source's
# llama-bench and llama-batched-bench crash (SIGSEGV) on these GGUFs here.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_PYTHON_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

build=build preset=small dtypes=f32,bf16 rounds=2 reps=3 pps=512,4096 batched=8,32 write_docs=0 prepare=0 quantize=none
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --pp) pps=$2; shift 2 ;;
    --batched) batched=$2; shift 2 ;;
    --write-docs) write_docs=1; shift ;;
    --prepare) prepare=1; shift ;;
    --quantize) quantize=$2; shift 2 ;;
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    *) echo "llama_cpp.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $quantize == none || $quantize == int8 ]] || {
  echo "llama_cpp.sh: --quantize must be none or int8, not '$quantize'" >&2; exit 2; }
threads=${THREADS:-2}
cache=${ARENO_PEER_CACHE:-$HOME/.cache/areno-peers}
mkdir -p "$cache"
areno=$root/$build/app/areno
bench_llm=$root/$build/bench/peers/bench_llm
for f in "$areno" "$bench_llm"; do
  [[ -x $f ]] || { echo "llama_cpp.sh: $f not built (ninja -C $build)" >&2; exit 1; }
done

# --- Python for the converter -------------------------------------------------
py=${PYTHON:-python3}
if ! "$py" -c 'import numpy, yaml' 2>/dev/null; then
  if [[ ! -x $cache/venv/bin/python ]]; then
    echo "making $cache/venv (numpy, pyyaml) for the gguf converter" >&2
    python3 -m venv "$cache/venv"
    "$cache/venv/bin/python" -m pip install -q numpy pyyaml
  fi
  py=$cache/venv/bin/python
fi

# --- llama.cpp ------------------------------------------------------------------
sdist=$cache/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
src=$cache/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
if [[ ! -f $sdist ]]; then
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$cache"
fi
echo "$LLAMA_CPP_PYTHON_SHA256  $sdist" | sha256sum -c --quiet - || {
  echo "llama_cpp.sh: $sdist does not have the pinned sha256" >&2; exit 1; }
[[ -d $src ]] || tar -xzf "$sdist" -C "$cache"
lbin=$src/build-cpu/bin
if [[ ! -x $lbin/llama-bench || ! -x $lbin/llama-batched-bench || ! -x $lbin/llama-server ||
      ! -x $lbin/llama-quantize ]]; then
  echo "building llama.cpp (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's source, CPU, native)" >&2
  cmake -S "$src" -B "$src/build-cpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$cache/llama-cmake.log"
  ninja -C "$src/build-cpu" -j"$(nproc)" llama-bench llama-batched-bench llama-server llama-quantize \
    >"$cache/llama-build.log"
fi
llama_commit=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "vendored")

# --- checkpoints and GGUF -------------------------------------------------------
IFS=, read -r -a dtype_list <<<"$dtypes"
for dt in "${dtype_list[@]}"; do
  ck=$cache/ckpt-$preset-$dt
  if [[ ! -f $ck/config.json ]]; then
    "$areno" init --preset "$preset" --out "$ck" --seed 1 --dtype "$dt" >&2
  fi
  if [[ ! -f $ck.gguf || $ck.gguf -ot $ck/config.json ]]; then
    PYTHONPATH=$src/gguf-py "$py" bench/peers/to_gguf.py "$ck" "$ck.gguf" --outtype "$dt" >&2
  fi
  if [[ $quantize == int8 && ( ! -f $ck-q8_0.gguf || $ck-q8_0.gguf -ot $ck.gguf ) ]]; then
    "$lbin/llama-quantize" "$ck.gguf" "$ck-q8_0.gguf" Q8_0 >"$cache/llama-quantize.log" 2>&1 ||
      { tail -5 "$cache/llama-quantize.log" >&2; exit 1; }
  fi
done
# What each engine runs per dtype: the label of its rows, areno's extra flags, the GGUF.
label() { [[ $quantize == int8 ]] && echo "$1-int8" || echo "$1"; }
gguf() { [[ $quantize == int8 ]] && echo "$cache/ckpt-$preset-$1-q8_0.gguf" || echo "$cache/ckpt-$preset-$1.gguf"; }
areno_q=() bench_q=() batched_q=()
if [[ $quantize == int8 ]]; then areno_q=(--quantize int8) bench_q=(--repack 0) batched_q=(-nr); fi
labels=$(for dt in "${dtype_list[@]}"; do label "$dt"; done | paste -sd,)
section=$preset
[[ $quantize == int8 ]] && section=$preset-int8
# Tables of a machine without AVX-512 (AVX2 only: oneDNN and the AMX/BF16
# kernels do not run), or with AVX-512 and no AMX (the bf16 GEMMs past a few
# rows on vdpbf16ps and oneDNN), go to their own markers, so every machine's
# tables stay.
if ! grep -qw avx512f /proc/cpuinfo; then section=$section-avx2
elif ! grep -qw amx_tile /proc/cpuinfo; then section=$section-noamx; fi

[[ $prepare == 0 ]] || exit 0

# --- the runs -------------------------------------------------------------------
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
max_b=${batched##*,}
ctx=$(( ${max_b:-0} * 256 + 256 ))
echo "load before: $(uptime)" >&2
for r in $(seq 1 "$rounds"); do
  for dt in "${dtype_list[@]}"; do
    ck=$cache/ckpt-$preset-$dt
    lb=$(label "$dt") g=$(gguf "$dt")
    echo "round $r $lb: areno" >&2
    OMP_NUM_THREADS=$threads "$bench_llm" "$ck" --reps "$reps" --pp "$pps" --tg 128 --batched "$batched" --npp 128 \
      ${areno_q[@]+"${areno_q[@]}"} >"$out/areno-$lb-$r.jsonl"
    echo "round $r $lb: llama.cpp" >&2
    "$lbin/llama-bench" -m "$g" -t "$threads" -p "$pps" -n 128 -r "$reps" -o jsonl ${bench_q[@]+"${bench_q[@]}"} \
      >"$out/llama-$lb-$r.jsonl" 2>"$out/llama-bench.log" || { tail -5 "$out/llama-bench.log" >&2; exit 1; }
    [[ -z $batched ]] || "$lbin/llama-batched-bench" -m "$g" -t "$threads" -tb "$threads" -c "$ctx" -kvu -npp 128 -ntg 128 \
      -npl "$batched" ${batched_q[@]+"${batched_q[@]}"} --output-format jsonl >"$out/batched-$lb-$r.txt" 2>"$out/batched-bench.log" ||
      { tail -5 "$out/batched-bench.log" >&2; exit 1; }
  done
done
echo "load after:  $(uptime)" >&2

commit=$(git -C "$root" rev-parse --short HEAD)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
flags=$(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_int8|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')
"$py" bench/peers/table.py --out-dir "$out" --dtypes "$labels" --rounds "$rounds" --preset "$preset" --section "$section" \
  --threads "$threads" --commit "$commit" --cpu "$cpu" --flags "$flags" \
  --llama "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION ($llama_commit)" \
  $([[ $write_docs == 1 ]] && echo --write-docs docs/perf.md)
