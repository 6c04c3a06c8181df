#!/bin/sh
# Test agent for --skip-failed-agents without a server: task 1 exits with
# status 4, task 2 sleeps past any test's --agent-timeout-s, task 3 prints a
# malformed last line, the others print their suggested trajectory id.
cat >/dev/null
case $ARENO_TASK_INDEX in
  1) echo "task 1 fails" >&2; exit 4 ;;
  2) exec sleep 60 ;;
  3) echo "done" ;;
  *) echo "{\"trajectory_id\": \"$ARENO_TRAJECTORY_ID\"}" ;;
esac
