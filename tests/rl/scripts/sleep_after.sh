#!/bin/sh
# Test reward program: answers 1 to the first "$1" records, then starts a
# `sleep 30` child (its pid written to the file "$2") and waits for it, so
# the record times out; the timeout must kill the child too.
n=0
while IFS= read -r line; do
  if [ "$n" -ge "$1" ]; then
    sleep 30 &
    echo $! > "$2"
    wait
  fi
  n=$((n + 1))
  echo 1
done
