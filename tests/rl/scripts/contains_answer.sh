#!/bin/sh
# Test reward program (tests/rl/test_rl_rewards.cpp): per JSON record on stdin,
# 1 when the completion contains the row's "answer", else 0. Both are read
# with sed, so they must be plain strings without escapes.
while IFS= read -r line; do
  answer=$(printf '%s\n' "$line" | sed -n 's/.*"row":{.*"answer":"\([^"\\]*\)".*/\1/p')
  completion=$(printf '%s\n' "$line" | sed -n 's/.*"completion":"\([^"\\]*\)".*/\1/p')
  case "$completion" in
    *"$answer"*) if [ -n "$answer" ]; then echo 1; else echo 0; fi ;;
    *) echo 0 ;;
  esac
done
