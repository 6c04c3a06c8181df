#!/usr/bin/env bash
# Serving under load: `areno serve` against llama.cpp's `llama-server` on the
# same weights, same threads (issue 16, must-show 6). Dev tooling.
#
#   1. bench/peers/llama_cpp.sh --prepare: llama.cpp (llama-server among its
#      tools) from llama-cpp-python's vendored source, the cached `small`
#      checkpoints (`areno init --seed 1`) and their GGUF files;
#   2. for each dtype and each client count, one server at a time on loopback:
#      `areno serve --model-path CKPT` (OMP_NUM_THREADS=THREADS, 32 running
#      sequences, a KV cache sized for 32 x (prompt + max_tokens), twice over),
#      then `llama-server -m CKPT.gguf -t THREADS --parallel 32 -c 32*512`
#      (its defaults otherwise); each warmed up by one 16-token request per
#      client, then driven by bench/serve/load.py for DURATION seconds:
#      streaming /v1/completions, a distinct deterministic prompt of
#      PROMPT_WORDS words per request (about one token each), max_tokens
#      MAX_TOKENS, ignore_eos, temperature 1; the server's peak RSS (VmHWM)
#      read before it is stopped;
#      with --loras K (served LoRAs), both servers hold K random rank-R
#      adapters on every decoder linear (bench/peers/random_lora.py: the same
#      numbers as a PEFT folder for `areno serve --lora-modules a0=DIR ...` and
#      as a GGUF adapter for `llama-server --lora FILE ...
#      --lora-init-without-apply`), and client i's requests go through adapter
#      i mod K (areno: `"model": "a<j>"`; llama-server: `"lora": [{"id": j,
#      "scale": 1}]`);
#   3. a table (bench/peers/serve_table.py: output tokens/s and the ratio
#      areno/llama-server, TTFT and inter-token p50/p99, failed requests, peak
#      RSS, the must-show checks) printed, and with --write-docs put into
#      docs/perf.md between `<!-- llama_server.sh begin/end -->` (with --loras,
#      `<!-- llama_server.sh:lora begin/end -->`).
#
# usage: bench/peers/llama_server.sh [--build DIR] [--dtypes f32,bf16]
#                                    [--clients 1,4,16,32] [--loras K] [--write-docs]
#   LORA_RANK (16, with --loras), THREADS (2), DURATION (30 s per point), PROMPT_WORDS (200), MAX_TOKENS (128),
#   ARENO_SERVE_ARGS / LLAMA_SERVER_ARGS (appended to each server's flags),
#   ARENO_PEER_CACHE, PYTHON (as llama_cpp.sh).
# Takes about dtypes x points x 2 x (DURATION + the last requests' drain +
# ~10 s start and warm-up).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

build=build dtypes=f32,bf16 clients=1,4,16,32 write_docs=0 loras=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --loras) loras=$2; shift 2 ;;
    --write-docs) write_docs=1; shift ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "llama_server.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
threads=${THREADS:-2}
duration=${DURATION:-30}
prompt_words=${PROMPT_WORDS:-200}
max_tokens=${MAX_TOKENS:-128}
lora_rank=${LORA_RANK:-16}
for v in threads duration prompt_words max_tokens lora_rank; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "llama_server.sh: ${v^^} must be a positive integer (got '${!v}')" >&2; exit 2; }
done
[[ $clients =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
  { echo "llama_server.sh: --clients must be positive integers separated by commas (got '$clients')" >&2; exit 2; }
[[ $dtypes =~ ^(f32|bf16)(,(f32|bf16))*$ ]] ||
  { echo "llama_server.sh: --dtypes must be f32 and/or bf16 separated by commas (got '$dtypes')" >&2; exit 2; }
[[ $loras =~ ^[0-9]+$ ]] || { echo "llama_server.sh: --loras must be a count (got '$loras')" >&2; exit 2; }
cache=${ARENO_PEER_CACHE:-$HOME/.cache/areno-peers}
areno=$root/$build/app/areno
[[ -x $areno ]] || { echo "llama_server.sh: $areno not built (ninja -C $build)" >&2; exit 1; }

bench/peers/llama_cpp.sh --build "$build" --preset small --dtypes "$dtypes" --prepare
llama_version=llama-cpp-python-$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=//p' bench/peers/llama_cpp.sh)
llama_server=$cache/${llama_version/-cpp-python-/_cpp_python-}/vendor/llama.cpp/build-cpu/bin/llama-server
[[ -x $llama_server ]] || { echo "llama_server.sh: $llama_server missing after llama_cpp.sh --prepare" >&2; exit 1; }
llama_src=${llama_server%/build-cpu/bin/llama-server}
# Python with numpy for random_lora.py (llama_cpp.sh made $cache/venv when python3 lacks it).
py=${PYTHON:-python3}
"$py" -c 'import numpy, yaml' 2>/dev/null || py=$cache/venv/bin/python

# Slots and KV for 32 clients (or the largest count, when more): llama-server
# splits -c evenly over its slots; areno's KV pool gets twice as many tokens.
max_clients=$(tr , '\n' <<<"$clients" | sort -n | tail -1)
slots=$(( max_clients > 32 ? max_clients : 32 ))
per_slot=$(( (prompt_words * 3 / 2 + max_tokens + 63) / 64 * 64 ))
llama_args="-t $threads --parallel $slots -c $(( slots * per_slot )) --host 127.0.0.1"
llama_args+=${LLAMA_SERVER_ARGS:+ $LLAMA_SERVER_ARGS}
engine_args="--max-running-prompts $slots --max-batch-tokens 2048 --prefill-chunk-tokens 512"
engine_args+=${ARENO_SERVE_ARGS:+ $ARENO_SERVE_ARGS}

out=$(mktemp -d)
server_pid=
stop_server() {
  [[ -n $server_pid ]] || return 0
  kill -INT "$server_pid" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
trap 'stop_server; rm -rf "$out"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_server NAME LOG CMD...: runs CMD in the background and waits for
# GET /health to answer 200 (llama-server answers 503 while it loads).
start_server() {
  local name=$1 log=$2
  shift 2
  "$@" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 1200); do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      echo "llama_server.sh: $name exited while starting; the end of $log:" >&2
      tail -20 "$log" >&2
      server_pid=
      exit 1
    fi
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && return 0
    sleep 0.1
  done
  echo "llama_server.sh: $name did not answer /health within 120 s" >&2
  exit 1
}

# drive NAME DT CLIENTS [load.py flags]: bench/serve/load.py against the
# server on $port, its report in $out/NAME-DT-cCLIENTS.json.
drive() {
  local name=$1 dt=$2 c=$3
  shift 3
  python3 bench/serve/load.py --url "http://127.0.0.1:$port" --pid "$server_pid" --endpoint completions \
    --clients "$c" --duration "$duration" --prompt-tokens "$prompt_words" --max-tokens "$max_tokens" \
    --temperature 1 --ignore-eos --warmup-requests "$c" --json "$out/$name-$dt-c$c.json" "$@" >"$out/load.log" 2>&1 ||
    { echo "llama_server.sh: $name $dt $c clients: load.py reported a failure:" >&2; tail -30 "$out/load.log" >&2; }
  python3 - "$out/$name-$dt-c$c.json" "$name" >&2 <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"  {sys.argv[2]}: {r['throughput_tok_s']} tok/s, TTFT p50 {r['ttft_p50_ms']} ms, ITL p50 / p99 "
      f"{r['itl_p50_ms']} / {r['itl_p99_ms']} ms, {r['requests_ok']} ok, {r['requests_failed']} failed, "
      f"peak RSS {r['rss_mb_peak_hwm']} MB")
EOF
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load before: $(uptime)" >&2
IFS=, read -r -a dtype_list <<<"$dtypes"
IFS=, read -r -a client_list <<<"$clients"
for dt in "${dtype_list[@]}"; do
  ck=$cache/ckpt-small-$dt
  # KV bytes per token: layers x (K, V) x kv heads x head dim x dtype size.
  kv_gb=$(python3 - "$ck/config.json" "$dt" "$slots" "$per_slot" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * (4 if sys.argv[2] == "f32" else 2)
print(f"{max(2 * int(sys.argv[3]) * int(sys.argv[4]) * per_token / 2**30, 0.01):.3f}")
EOF
)
  areno_args="$engine_args --kv-cache-gb $kv_gb"
  llama_dt_args=$llama_args
  areno_load=() llama_load=()
  if (( loras > 0 )); then
    areno_args+=" --max-loras $loras --lora-modules"
    llama_dt_args+=" --lora-init-without-apply"
    for j in $(seq 0 $(( loras - 1 ))); do
      ad=$cache/lora-small-$dt-r$lora_rank-$j
      if [[ ! -f $ad.gguf || $ad.gguf -ot $ck/config.json ]]; then
        PYTHONPATH=$llama_src/gguf-py "$py" bench/peers/random_lora.py "$ck" "$ad" "$ad.gguf" --rank "$lora_rank" \
          --seed "$j" --outtype "$dt" >&2
      fi
      areno_args+=" a$j=$ad"
      llama_dt_args+=" --lora $ad.gguf"
    done
    areno_load=(--adapters "$loras") llama_load=(--adapters "$loras" --adapter-style llama)
  fi
  for c in "${client_list[@]}"; do
    echo "$dt, $c clients ($(cut -d' ' -f1 /proc/loadavg) load):" >&2
    port=$(free_port)
    # shellcheck disable=SC2086  # the flag strings split into words
    start_server "areno serve" "$out/areno-$dt-c$c.log" \
      env OMP_NUM_THREADS="$threads" "$areno" serve --model-path "$ck" --port "$port" --host 127.0.0.1 $areno_args
    drive areno "$dt" "$c" "${areno_load[@]}"
    stop_server
    port=$(free_port)
    # shellcheck disable=SC2086
    start_server llama-server "$out/llama-$dt-c$c.log" "$llama_server" -m "$ck.gguf" --port "$port" $llama_dt_args
    drive llama "$dt" "$c" --no-metrics "${llama_load[@]}"
    stop_server
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load after:  $(uptime)" >&2

commit=$(git -C "$root" rev-parse --short HEAD)
docs_flag=()
[[ $write_docs == 0 ]] || docs_flag=(--write-docs docs/perf.md)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
python3 bench/peers/serve_table.py --out-dir "$out" --dtypes "$dtypes" --clients "$clients" --threads "$threads" \
  --duration "$duration" --prompt-words "$prompt_words" --max-tokens "$max_tokens" --commit "$commit" --cpu "$cpu" \
  --llama "llama-server from $llama_version's vendored llama.cpp" \
  --areno-args "\`$engine_args\` (OMP_NUM_THREADS=$threads; \`--kv-cache-gb\` for twice $slots x $per_slot tokens)" \
  --llama-args "\`$llama_args\`" --load-before "$load_before" --load-after "$load_after" \
  --loras "$loras" --lora-rank "$lora_rank" "${docs_flag[@]}"
