#!/bin/sh
# Test agent (docs/rl.md, "Agentic rollouts", media in a later turn): sends
# the image $AGENT_IMAGE_1 (a data URL) with a question, then the whole
# history again with a second image, $AGENT_IMAGE_2, in a new user turn, and
# prints its trajectory id with reward 1. With $AGENT_IMAGE_1_AGAIN set, the
# history of the second turn carries that image in place of the first (same
# size, other pixels). POSIX sh + curl; 4 greedy tokens a turn.
set -eu
cat >/dev/null
id=$ARENO_TRAJECTORY_ID
chat() {
  curl -sS --fail-with-body -H "X-Areno-Trajectory: $id" -H 'Content-Type: application/json' \
    -d "{\"messages\":$1,\"max_tokens\":4,\"temperature\":0}" "$ARENO_BASE_URL/chat/completions"
}
user() {
  printf '{"role":"user","content":[{"type":"image_url","image_url":{"url":"%s"}},{"type":"text","text":"%s"}]}' "$1" "$2"
}
a1=$(chat "[$(user "$AGENT_IMAGE_1" "What colour is the shape?")]" | grep -o '"content":"\([^"\\]\|\\.\)*"' | head -n 1)
first=${AGENT_IMAGE_1_AGAIN:-$AGENT_IMAGE_1}
chat "[$(user "$first" "What colour is the shape?"),{\"role\":\"assistant\",$a1},$(user "$AGENT_IMAGE_2" "And this one?")]" >/dev/null
echo "{\"trajectory_id\": \"$id\", \"reward\": 1}"
