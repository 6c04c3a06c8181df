#!/usr/bin/env bash
# Serving benchmark (issue 7): `areno serve` under bench/serve/load.py at 1, 8
# and 32 concurrent streaming clients, and Hugging Face `generate` on the same
# weights (bench/serve/peer_hf_generate.py), in one session, on the `small`
# preset (written to a temp dir unless a checkpoint dir is given).
# usage: bench/serve/run.sh [builddir] [checkpoint_dir]
#   DURATION (default 30 s per concurrency), MAX_TOKENS (64), THREADS (2), CLIENTS (1,8,32)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
ckpt=${2:-}
export THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
duration=${DURATION:-30}
max_tokens=${MAX_TOKENS:-64}
clients=${CLIENTS:-1,8,32}
if [[ -z "$ckpt" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  ckpt=$tmp/small
  "$build/app/areno" init --preset small --out "$ckpt" --seed 1 --dtype f32 >&2
fi
echo "load before: $(uptime)" >&2
for c in ${clients//,/ }; do
  python3 bench/serve/load.py --areno "$build/app/areno" --clients "$c" --duration "$duration" \
    --max-tokens "$max_tokens" --serve-args "--model-path $ckpt --max-batch-tokens 2048" \
    --json "${tmp:-/tmp}/areno_c$c.json" > /dev/null
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['peer']='areno'; print(json.dumps(r))" \
    "${tmp:-/tmp}/areno_c$c.json"
done
python3 -W ignore bench/serve/peer_hf_generate.py "$ckpt" --clients "$clients" --duration "$duration" \
  --max-tokens "$max_tokens" 2>/dev/null
echo "load after:  $(uptime)" >&2
