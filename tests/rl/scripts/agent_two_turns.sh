#!/bin/sh
# Test agent (docs/rl.md, "Agentic rollouts"): asks the "prompt" of its task
# row, answers the model's reply with a tool result ("42"), asks again, then
# prints its trajectory id and a reward. POSIX sh + curl; the model's reply is
# carried over as the JSON string the server sent ("content":"..."), so no
# JSON parser is needed. 6 tokens a turn at temperature $AGENT_TEMPERATURE
# (default 0: greedy). The reward printed is $AGENT_REWARD ("sample": the
# run's index within its group, $ARENO_SAMPLE_INDEX; unset: none). A row with
# "crash": true makes it exit with status 5 instead, and so does the run whose
# sample index is $AGENT_FAIL_SAMPLE (after its first turn); with
# $AGENT_STREAM set the second turn is streamed (SSE). $AGENT_TURN_REWARDS, when
# set, is printed as "turn_rewards" (a JSON array, one number per turn).
set -eu
row=$(cat)
case $row in *'"crash":true'*) echo "asked to crash" >&2; exit 5 ;; esac
q=$(printf '%s' "$row" | sed -n 's/.*"prompt":"\([^"\\]*\)".*/\1/p')
id=$ARENO_TRAJECTORY_ID
chat() {
  curl -sS --fail-with-body -H "X-Areno-Trajectory: $id" -H 'Content-Type: application/json' \
    -d "{\"messages\":$1,\"max_tokens\":6,\"temperature\":${AGENT_TEMPERATURE:-0}${2:-}}" "$ARENO_BASE_URL/chat/completions"
}
m1="[{\"role\":\"user\",\"content\":\"$q\"}]"
a1=$(chat "$m1" | grep -o '"content":"\([^"\\]\|\\.\)*"' | head -n 1)
if [ "${AGENT_FAIL_SAMPLE:-}" = "$ARENO_SAMPLE_INDEX" ]; then echo "asked to fail sample $ARENO_SAMPLE_INDEX" >&2; exit 5; fi
m2="[{\"role\":\"user\",\"content\":\"$q\"},{\"role\":\"assistant\",$a1},{\"role\":\"tool\",\"content\":\"42\"}]"
if [ -n "${AGENT_STREAM:-}" ]; then
  chat "$m2" ',"stream":true' | grep -q '^data: \[DONE\]'
else
  chat "$m2" >/dev/null
fi
echo "some log line"
turns=${AGENT_TURN_REWARDS:+, \"turn_rewards\": $AGENT_TURN_REWARDS}
case ${AGENT_REWARD:-} in
  "") echo "{\"trajectory_id\": \"$id\"$turns}" ;;
  sample) echo "{\"trajectory_id\": \"$id\", \"reward\": $ARENO_SAMPLE_INDEX$turns}" ;;
  *) echo "{\"trajectory_id\": \"$id\", \"reward\": $AGENT_REWARD$turns}" ;;
esac
