#!/bin/sh
# Test agent: prints an id the server never saw (no request carried it).
cat >/dev/null
echo '{"trajectory_id": "never-sent"}'
