#!/usr/bin/env bash
# Prints the include graph between the top-level folders and fails on an arrow
# that points up the layer order, or on a cycle. The order, lowest first:
#
#   tensor < kernels < autograd < nn < dist < models < serve < train < app
#
# A folder may include its own files and those of any lower folder. tests/,
# bench/ and examples/ sit above everything: they may include anything, and
# nothing may include them. Only quoted and angle includes that name one of
# these folders count ("nn/module.h", <nn/module.h>); system headers do not.
# docs/architecture.md explains the layers.
set -euo pipefail
cd "$(dirname "$0")/.."

layers=(tensor kernels autograd nn dist models serve train app tests bench examples)
declare -A rank
for i in "${!layers[@]}"; do rank[${layers[$i]}]=$i; done
# tests, bench and examples: one rank, at the top.
rank[bench]=${rank[tests]}
rank[examples]=${rank[tests]}

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  list_files() { git ls-files --cached --others --exclude-standard -- "$@"; }
else
  list_files() { find "$@" -type f 2>/dev/null; }
fi

# "from to" per include line, from and to being top-level folders.
edges=$(
  for top in "${layers[@]}"; do
    [ -d "$top" ] || continue
    list_files "$top" | grep -E '\.(h|hpp|hh|c|cc|cpp|cxx|cu|cuh|inc)$' || true
  done | while read -r f; do
    [ -f "$f" ] || continue
    from=${f%%/*}
    sed -nE 's@^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]([A-Za-z0-9_]+)/.*[">].*@\1@p' "$f" |
      while read -r to; do
        [ -n "${rank[$to]+x}" ] && [ "$to" != "$from" ] && echo "$from $to $f"
      done
  done
)

echo "include graph between top-level folders (from -> to: include lines):"
fail=0
if [ -n "$edges" ]; then
  while read -r from to n; do
    mark=""
    if (( rank[$to] > rank[$from] )); then
      mark="   <-- points up: $from sits below $to"
      fail=1
    fi
    printf '  %-9s -> %-9s %4d%s\n' "$from" "$to" "$n" "$mark"
  done < <(echo "$edges" | awk '{print $1, $2}' | sort | uniq -c |
             awk '{print $2, $3, $1}' | sort -k1,1 -k2,2)
fi

if (( fail )); then
  echo
  echo "upward includes (a lower folder must not know a higher one):"
  echo "$edges" | while read -r from to f; do
    if (( rank[$to] > rank[$from] )); then
      grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[\"<]$to/" "$f" | sed "s@^@  $f:@"
    fi
  done
fi

# A cycle among the folders (once the order holds, only possible between
# tests, bench and examples; tsort checks the graph itself).
if [ -n "$edges" ]; then
  if ! loop=$(echo "$edges" | awk '{print $1, $2}' | sort -u | tsort 2>&1 >/dev/null); then
    echo
    echo "cycle between folders:"
    echo "$loop" | sed 's/^/  /'
    fail=1
  fi
fi

if (( fail )); then
  echo
  echo "layers: FAIL (order: ${layers[*]:0:9}; tests, bench, examples on top)"
  exit 1
fi
echo "layers: ok (order: ${layers[*]:0:9}; tests, bench, examples on top)"
