#!/bin/sh
# Test agent: prints a last line that is not the output object.
cat >/dev/null
echo "{\"trajectory_id\": \"$ARENO_TRAJECTORY_ID\""
echo "done: reward 1"
