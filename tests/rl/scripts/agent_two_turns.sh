#!/bin/sh
# Test agent (docs/rl.md, "Agentic rollouts"): asks the "prompt" of its task
# row, answers the model's reply with a tool result ("42"), asks again, then
# prints its trajectory id and a reward. POSIX sh + curl; the model's reply is
# carried over as the JSON string the server sent ("content":"..."), so no
# JSON parser is needed. Greedy, 6 tokens a turn.
set -eu
row=$(cat)
q=$(printf '%s' "$row" | sed -n 's/.*"prompt":"\([^"\\]*\)".*/\1/p')
id=$ARENO_TRAJECTORY_ID
chat() {
  curl -sS --fail-with-body -H "X-Areno-Trajectory: $id" -H 'Content-Type: application/json' \
    -d "{\"messages\":$1,\"max_tokens\":6,\"temperature\":0}" "$ARENO_BASE_URL/chat/completions"
}
m1="[{\"role\":\"user\",\"content\":\"$q\"}]"
a1=$(chat "$m1" | grep -o '"content":"\([^"\\]\|\\.\)*"' | head -n 1)
m2="[{\"role\":\"user\",\"content\":\"$q\"},{\"role\":\"assistant\",$a1},{\"role\":\"tool\",\"content\":\"42\"}]"
chat "$m2" >/dev/null
echo "some log line"
echo "{\"trajectory_id\": \"$id\", \"reward\": ${AGENT_REWARD:-0.5}}"
