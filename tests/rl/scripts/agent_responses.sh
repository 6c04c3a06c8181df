#!/bin/sh
# Test agent (docs/rl.md, "Agentic rollouts") over the Responses API: asks
# the "prompt" of its task row through /v1/responses, sends the reply back as
# an assistant message with one more user question, then prints its
# trajectory id and reward 1. POSIX sh + curl; the reply's text is carried
# over as the JSON string the server sent ("text":"..."). 6 tokens a turn,
# greedy; with $AGENT_STREAM set the second turn is streamed (typed events).
set -eu
row=$(cat)
q=$(printf '%s' "$row" | sed -n 's/.*"prompt":"\([^"\\]*\)".*/\1/p')
id=$ARENO_TRAJECTORY_ID
respond() {
  curl -sS --fail-with-body -H "X-Areno-Trajectory: $id" -H 'Content-Type: application/json' \
    -d "{\"input\":$1,\"max_output_tokens\":6,\"temperature\":0${2:-}}" "$ARENO_BASE_URL/responses"
}
i1="[{\"role\":\"user\",\"content\":\"$q\"}]"
t1=$(respond "$i1" | grep -o '"text":"\([^"\\]\|\\.\)*"' | head -n 1)
i2="[{\"role\":\"user\",\"content\":\"$q\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",$t1}]},{\"role\":\"user\",\"content\":\"Again?\"}]"
if [ -n "${AGENT_STREAM:-}" ]; then
  respond "$i2" ',"stream":true' | grep -q '^event: response.completed'
else
  respond "$i2" >/dev/null
fi
echo "{\"trajectory_id\": \"$id\", \"reward\": 1}"
