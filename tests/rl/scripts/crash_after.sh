#!/bin/sh
# Test reward program: answers 0.5 to the first "$1" records, then exits with
# status 3 on the next one.
n=0
while IFS= read -r line; do
  if [ "$n" -ge "$1" ]; then exit 3; fi
  n=$((n + 1))
  echo 0.5
done
