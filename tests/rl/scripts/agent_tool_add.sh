#!/bin/sh
# Test agent (tool calls end to end, docs/rl.md "Agentic rollouts"): asks its
# task's "prompt" with one tool, add(a, b); when the model calls it (the
# server parses Phi's <|tool_call|> reply into tool_calls), runs the tool,
# sends the assistant's tool_calls back with the tool's result, and prints
# reward 1 when the final answer is that sum, else 0 (also when the model
# made no call). Greedy, 48 tokens a turn. POSIX sh + curl + sed: the
# server's JSON is compact, and the call's arguments hold no ']'. With
# $AGENT_LOG set, appends "a b sum answer" to that file.
set -eu
row=$(cat)
q=$(printf '%s' "$row" | sed -n 's/.*"prompt":"\([^"\\]*\)".*/\1/p')
id=$ARENO_TRAJECTORY_ID
tools='[{"type":"function","function":{"name":"add","description":"Adds two integers.","parameters":{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}}}}}]'
chat() {
  curl -sS --fail-with-body -H "X-Areno-Trajectory: $id" -H 'Content-Type: application/json' \
    -d "{\"messages\":$1,\"tools\":$tools,\"max_tokens\":48,\"temperature\":0}" "$ARENO_BASE_URL/chat/completions"
}
m1="[{\"role\":\"user\",\"content\":\"$q\"}]"
r1=$(chat "$m1")
calls=$(printf '%s' "$r1" | grep -o '"tool_calls":\[[^]]*\]' || true)
if [ -z "$calls" ]; then
  [ -z "${AGENT_LOG:-}" ] || echo "no call" >>"$AGENT_LOG"
  echo "{\"trajectory_id\": \"$id\", \"reward\": 0}"
  exit 0
fi
a=$(printf '%s' "$calls" | sed -n 's/.*\\"a\\": *\(-\{0,1\}[0-9][0-9]*\).*/\1/p')
b=$(printf '%s' "$calls" | sed -n 's/.*\\"b\\": *\(-\{0,1\}[0-9][0-9]*\).*/\1/p')
call_id=$(printf '%s' "$calls" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
sum=$((${a:-0} + ${b:-0}))
m2="[{\"role\":\"user\",\"content\":\"$q\"},{\"role\":\"assistant\",\"content\":null,$calls},{\"role\":\"tool\",\"tool_call_id\":\"$call_id\",\"content\":\"$sum\"}]"
r2=$(chat "$m2")
answer=$(printf '%s' "$r2" | grep -o '"content":"[^"]*"' | head -n 1 | sed 's/^"content":"\(.*\)"$/\1/')
reward=0
[ "$answer" != "$sum" ] || reward=1
[ -z "${AGENT_LOG:-}" ] || echo "$a $b $sum $answer" >>"$AGENT_LOG"
echo "{\"trajectory_id\": \"$id\", \"reward\": $reward}"
