#!/bin/sh
# Test agent: reads its row, complains on stderr and exits with status 3.
cat >/dev/null
echo "agent: cannot reach the tool server" >&2
exit 3
