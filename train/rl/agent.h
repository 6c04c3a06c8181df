#pragma once
// Agentic rollouts (issue 15, "Agentic rollouts"; docs/rl.md, "Agentic
// rollouts", is the user's side of this file): `--agent-cmd CMD` runs an
// agent program per task against an OpenAI-compatible server over the
// trainer's own model, records every turn of its trajectory, and turns the
// trajectory into training rows for the GRPO/GSPO step.
//
//   AgentRollout::run(rows)
//     1. the HTTP server (serve::HttpServer, 127.0.0.1, an ephemeral port)
//        over a serve::Engine on the same shared model; its engine thread
//        runs only during this phase (the trainer waits);
//     2. run_agents: `/bin/sh -c CMD` per task and sample, the row on stdin,
//        ARENO_BASE_URL etc. in the environment, up to `concurrency` at once;
//     3. the engine stopped (whatever is left is aborted), its KV blocks
//        checked free (EngineStats, a leak is a std::logic_error);
//     4. each printed trajectory's turns (TrajectoryStore) -> rows
//        (assemble_trajectory).
//
// Row rule (assemble_trajectory): a turn continues the current row when its
// prompt starts with the row so far (the previous turn's prompt and
// completion, token for token), its adapter is the row's and its media start
// with the row's media, item for item; then the new prompt part is appended
// as context, its new media (an image or clip added by a later turn) to the
// row's media, and the completion as sampled tokens. Otherwise (the client
// re-templated an earlier answer into different tokens, edited the history,
// replaced an earlier image, or added the first image or clip of a text row,
// which changes the adapter) the turn starts a new row from its own prompt:
// the trajectory gives several rows, each with the trajectory's reward and
// advantage. Sampled tokens are trainable with
// their rollout log-probabilities; context tokens (tool results, later user
// and system turns, template tokens) are masked, or trainable with
// `train_context` (--train-tool-results; they have no rollout log-probability,
// so their old log-probability is the training forward's own: ratio 1), all
// but media placeholders, which are never targets.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/http_server.h"
#include "train/rl/rollout.h"

namespace areno::train::rl {

class AgentError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct AgentOptions {
  std::string cmd;                        // --agent-cmd; empty: engine rollouts
  double timeout_s = 300;                 // --agent-timeout-s, per agent run
  int64_t concurrency = 0;                // --agent-concurrency; 0: every run of the step at once
  bool train_context = false;             // --train-tool-results
  bool skip_failed = false;               // --skip-failed-agents: a failed run is dropped, not fatal
  size_t max_stdout_bytes = size_t(1) << 20;
  size_t stderr_tail_bytes = 2048;        // kept for error messages
};

// The server's recorder: the turns of every trajectory id, in the order they finished.
class TrajectoryStore : public serve::TrajectoryRecorder {
 public:
  void record(serve::TrajectoryTurn turn) override;
  // The turns of `id`, removed from the store (empty when none).
  std::vector<serve::TrajectoryTurn> take(const std::string& id);
  void clear();

 private:
  std::mutex mu_;
  std::map<std::string, std::vector<serve::TrajectoryTurn>> turns_;
};

// One training row of a trajectory: `prompt` (its first turn's prompt) then
// `tokens`, sampled and context tokens interleaved.
struct AgentRow {
  Prompt prompt;
  std::vector<int64_t> tokens;
  std::vector<uint8_t> trainable;  // per token
  std::vector<float> logp;         // rollout log-probability of sampled tokens, NaN on context
  int64_t turns = 0;
  // Per turn of the row, in order: the index in `tokens` of its completion's
  // last token (of the row's last token before it when the completion is
  // empty; -1 when the row has none yet). Where a PPO step puts the turn's reward.
  std::vector<int64_t> turn_ends;
};

struct AssembledTrajectory {
  std::vector<AgentRow> rows;
  std::string final_text;      // the last turn's completion text
  int64_t final_tokens = 0;    // its token count
};

// The row rule at the top. Throws std::invalid_argument for no turns.
AssembledTrajectory assemble_trajectory(const std::vector<serve::TrajectoryTurn>& turns, bool train_context);

// What one agent run printed: the last non-blank stdout line, one JSON object
// {"trajectory_id": "ID", "reward": <finite number, optional>,
//  "turn_rewards": [<finite number per recorded turn>, optional]}.
struct AgentOutput {
  std::string trajectory_id;
  std::optional<double> reward;
  // One per turn the server recorded under the id, in the order they
  // finished (AgentRollout::run checks the count).
  std::optional<std::vector<double>> turn_rewards;
  std::string error;  // run_agents with skip_failed: why this run failed (empty: it did not)
};
// Throws AgentError("<who> printed ...") for anything else.
AgentOutput parse_agent_output(const std::string& stdout_text, const std::string& who);

struct AgentTask {
  nlohmann::json row;       // written to the agent's stdin as one line
  int64_t task = 0;         // the task within the step
  int64_t sample = 0;       // the run within its group
  int64_t line = 0;         // the dataset line (0: unknown), for messages
  std::string trajectory;   // suggested id (ARENO_TRAJECTORY_ID)
};

// Runs `options.cmd` once per task, at most `concurrency` at a time (0: all),
// each with the task's row on stdin (then closed) and in its environment
// ARENO_BASE_URL=base_url, ARENO_TRAJECTORY_ID, ARENO_TASK_INDEX,
// ARENO_SAMPLE_INDEX. stdout is kept up to max_stdout_bytes, the tail of
// stderr for messages. An agent that does not end within timeout_s, exits
// non-zero or by a signal, prints too much or prints a malformed last line
// fails the call: the others are killed (their process groups) and an
// AgentError names the task, the sample and the dataset line. With
// options.skip_failed only that run is killed and its output carries the
// message in `error`; the others go on.
std::vector<AgentOutput> run_agents(const std::vector<AgentTask>& tasks, const std::string& base_url,
                                    const AgentOptions& options);

class AgentRollout {
 public:
  // `rollout`: the engine options (max_running, KV cache), max_new_tokens (the
  // default max_tokens of a request), max_context_len, seed, drop_rollout_state.
  // Throws std::invalid_argument for a bad option (naming the flag).
  AgentRollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
               RolloutOptions rollout, AgentOptions agent);
  ~AgentRollout();
  AgentRollout(const AgentRollout&) = delete;
  AgentRollout& operator=(const AgentRollout&) = delete;

  // n_samples agent runs per task: the trajectories task-major, their rows,
  // each row's prompt in `prompts`. Throws AgentError. With skip_failed a
  // failed run (run_agents' failures, and an id the server did not record or
  // another run printed too) gives no trajectory (a task may then have fewer
  // than n_samples, or none); it throws only when every run failed.
  RolloutBatch run(const std::vector<AgentTask>& tasks);
  // With skip_failed: the failures of the last run() (messages naming task,
  // sample and line), and their count over every run so far.
  const std::vector<std::string>& last_failures() const { return last_failures_; }
  int64_t failed_runs() const { return failed_runs_; }

  // The engine's counters when the last phase ended (kv_blocks_used is 0).
  const serve::EngineStats& last_stats() const { return last_stats_; }
  // The server's port while it lives (-1 before the first run and after
  // drop_rollout_state).
  int port() const;
  const AgentOptions& options() const { return agent_; }
  // Turns split into a new row by the row rule, over every run so far.
  int64_t split_rows() const { return split_rows_; }
  // Runs so far (the r of the suggested trajectory ids "areno-r<r>-..."); a
  // resumed trainer sets the saved count.
  int64_t runs() const { return runs_; }
  void set_runs(int64_t runs) { runs_ = runs; }

 private:
  void start_server();
  void stop_server();

  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::shared_ptr<const tok::Tokenizer> tok_;
  RolloutOptions rollout_;
  AgentOptions agent_;
  std::vector<std::string> last_failures_;
  int64_t failed_runs_ = 0;
  std::shared_ptr<TrajectoryStore> store_ = std::make_shared<TrajectoryStore>();
  std::unique_ptr<serve::Engine> engine_;
  std::unique_ptr<serve::HttpServer> server_;
  std::thread listen_thread_;
  serve::EngineStats last_stats_;
  int64_t runs_ = 0;
  int64_t split_rows_ = 0;
};

}  // namespace areno::train::rl
