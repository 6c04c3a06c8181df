#!/bin/sh
# Test reward program: appends each record it reads to the file "$1" and
# answers the record's "completion_tokens" plus 0.25, so the test checks both
# the record's JSON and the number's way back.
while IFS= read -r line; do
  printf '%s\n' "$line" >> "$1"
  tokens=$(printf '%s\n' "$line" | sed -n 's/.*"completion_tokens":\([0-9]*\).*/\1/p')
  echo "$tokens.25"
done
