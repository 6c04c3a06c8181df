#!/bin/sh
# Test reward program: answers two lines to every record, in one write.
while IFS= read -r line; do
  printf '1\n2\n'
done
