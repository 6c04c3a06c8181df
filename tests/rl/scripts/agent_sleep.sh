#!/bin/sh
# Test agent: never answers (sleeps far past any --agent-timeout-s).
cat >/dev/null
sleep 60
