#!/usr/bin/env bash
# Builds the library, the tests and the fuzz-corpus replays with
# AddressSanitizer + UndefinedBehaviorSanitizer (g++, no CUDA) in
# build-sanitize/ and runs the unit suites there (issue 13, must show 3).
#
#   scripts/sanitize.sh [meson test arguments, e.g. --suite serve]
#
# Default suites: every suite but 'asan' (already instrumented on its own) and
# 'layers' (a script). Any sanitizer report fails the test it occurs in
# (halt_on_error), so a clean run prints only "Ok". Leaks are checked with the
# suppressions of tests/asan/lsan.supp (libraries' one-time allocations).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
b=build-sanitize
[ -f "$b/build.ninja" ] || meson setup "$b" -Dcuda=disabled -Dbuildtype=debugoptimized \
  -Db_sanitize=address,undefined -Db_lundef=false >/dev/null
ninja -C "$b" -j"$(nproc)"
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS=suppressions=$PWD/tests/asan/lsan.supp
if (($#)); then
  exec meson test -C "$b" --print-errorlogs --num-processes "$(nproc)" -t 4 "$@"
fi
exec meson test -C "$b" --print-errorlogs --num-processes "$(nproc)" -t 4 \
  --suite core --suite tokenizer --suite model --suite audio --suite vision --suite serve --suite engine --suite fuzz
