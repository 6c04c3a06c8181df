#!/usr/bin/env bash
# Fuzzes the untrusted-input parsers with libFuzzer (issue 13, must show 2).
#
#   scripts/fuzz.sh [--seconds N] [--jobs N] [--merge] [HARNESS...]
#
# Builds build-fuzz/ with clang 14 (-Dfuzz=true, ASan + UBSan, no CUDA), then
# runs each harness (default: all of request safetensors image audio
# tokenizer_json json_schema regex cfg speech) for N seconds (default 60) on a copy of its corpus
# tests/fuzz/corpus/<name>/. A crash, a sanitizer report, a leak or a timeout
# stops that harness and leaves the input under build-fuzz/findings/<name>/;
# the script then exits non-zero. With --merge the inputs that add coverage
# are merged back into tests/fuzz/corpus/<name>/ (commit them: CI replays the
# corpora as the suite 'fuzz'). Logs and a summary line per harness with the
# corpus size go to build-fuzz/fuzz-<name>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=60 jobs=1 merge=0 names=()
while (($#)); do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --merge) merge=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) names+=("$1"); shift ;;
  esac
done
((${#names[@]})) || names=(request safetensors image audio tokenizer_json json_schema regex cfg speech)
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang-14 CXX=clang++-14 meson setup build-fuzz -Dfuzz=true -Dcuda=disabled -Dbuildtype=debugoptimized \
    -Db_sanitize=address,undefined -Db_lundef=false >/dev/null
fi
ninja -C build-fuzz $(printf 'tests/fuzz/fuzz_%s ' "${names[@]}") >/dev/null
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS=suppressions=$PWD/tests/asan/lsan.supp
status=0
for n in "${names[@]}"; do
  work=build-fuzz/corpus/$n findings=build-fuzz/findings/$n
  mkdir -p "$work" "$findings"
  cp -n tests/fuzz/corpus/"$n"/* "$work"/ 2>/dev/null || true
  log=build-fuzz/fuzz-$n.log
  par=()
  ((jobs > 1)) && par=(-fork="$jobs")  # several processes; -jobs would write ./fuzz-N.log instead
  if ! build-fuzz/tests/fuzz/fuzz_"$n" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
       -max_len=262144 "${par[@]}" -artifact_prefix="$findings/" -print_final_stats=1 >"$log" 2>&1; then
    status=1
    echo "fuzz $n: FAILED (see $log and $findings)"
  fi
  if ((merge)); then
    build-fuzz/tests/fuzz/fuzz_"$n" -merge=1 tests/fuzz/corpus/"$n" "$work" >>"$log" 2>&1
  fi
  runs=$(grep -ho 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{s += $2} END {print s + 0}')
  echo "fuzz $n: ${seconds}s, $runs runs, corpus $(ls "$work" | wc -l) inputs (saved: $(ls tests/fuzz/corpus/"$n" | wc -l)), findings $(ls "$findings" | wc -l)"
done
exit $status
