#!/usr/bin/env bash
# Encode throughput, areno vs tiktoken vs HF tokenizers, same corpus, one
# thread each. Run from the repository root after building:
#   bash bench/tokenizer/run.sh [BUILD_DIR]
# Needs: pip install tiktoken tokenizers
set -euo pipefail
BUILD=${1:-build}
CORPUS=tests/data/tokenizer/corpus.jsonl
RANKS=models/phi4mm/tokenizer/o200k_base.tiktoken
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$BUILD/tests/tokenizer/write_phi4_tokenizer" "$TMP/model"
{
  taskset -c 0 "$BUILD/bench/tokenizer/bench_tokenizer" "$CORPUS" "$RANKS" "$TMP/model/tokenizer.json" 2>/dev/null ||
    "$BUILD/bench/tokenizer/bench_tokenizer" "$CORPUS" "$RANKS" "$TMP/model/tokenizer.json"
  python3 bench/tokenizer/peer_tokenizer.py "$CORPUS" "$RANKS" "$TMP/model/tokenizer.json"
} | tee "$TMP/out.txt" | grep '^#' || true
printf '\n| implementation | mode | MB/s (1 thread) |\n|---|---|---|\n'
grep -v '^#' "$TMP/out.txt" | awk '{printf "| %s | %s | %s |\n", $1, $2, $3}'
