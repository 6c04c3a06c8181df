#include "train/rl/agent.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "tensor/backend.h"
#include "train/rl/process.h"

namespace areno::train::rl {

using nlohmann::json;

// ---- the recorder -------------------------------------------------------------

void TrajectoryStore::record(serve::TrajectoryTurn turn) {
  std::lock_guard<std::mutex> lk(mu_);
  turns_[turn.trajectory].push_back(std::move(turn));
}

std::vector<serve::TrajectoryTurn> TrajectoryStore::take(const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = turns_.find(id);
  if (it == turns_.end()) return {};
  std::vector<serve::TrajectoryTurn> out = std::move(it->second);
  turns_.erase(it);
  return out;
}

void TrajectoryStore::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  turns_.clear();
}

// ---- turns -> rows --------------------------------------------------------------

namespace {

// The same decoded item under the same crop limit (the decode hold is bookkeeping, not content).
bool same_media(const phi4mm::Media& a, const phi4mm::Media& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == phi4mm::MediaKind::kImage)
    return a.image.width == b.image.width && a.image.height == b.image.height && a.max_crops == b.max_crops &&
           a.image.rgb == b.image.rgb;
  return a.sample_rate == b.sample_rate && a.samples == b.samples;
}

}  // namespace

AssembledTrajectory assemble_trajectory(const std::vector<serve::TrajectoryTurn>& turns, bool train_context) {
  if (turns.empty()) throw std::invalid_argument("assemble_trajectory: no turns");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  AssembledTrajectory out;
  AgentRow* row = nullptr;
  // The current row's whole sequence: prompt ids then tokens.
  std::vector<int64_t> seq;
  for (const serve::TrajectoryTurn& t : turns) {
    // The row's media must come first in the turn's, item for item: the
    // history's placeholders are the same tokens for any image of the same
    // size, so the items themselves are compared. Items after them belong to
    // placeholders in the new part (the server prefilled exactly one row per
    // placeholder, in order).
    const std::vector<phi4mm::Media>* media = row != nullptr ? &row->prompt.media : nullptr;
    bool continues = row != nullptr && t.prompt.size() >= seq.size() && t.adapter == row->prompt.adapter &&
                     std::equal(seq.begin(), seq.end(), t.prompt.begin()) && t.media.size() >= media->size() &&
                     std::equal(media->begin(), media->end(), t.media.begin(), same_media);
    // New items exactly when the new part has placeholders (the server's turns
    // always agree; a turn that does not starts its own row).
    if (continues)
      continues = std::any_of(t.prompt.begin() + int64_t(seq.size()), t.prompt.end(), phi4mm::is_media_token) ==
                  (t.media.size() > media->size());
    if (!continues) {
      out.rows.push_back({});
      row = &out.rows.back();
      row->prompt = {t.prompt, t.media, t.adapter};
      seq = t.prompt;
    } else {
      row->prompt.media.insert(row->prompt.media.end(), t.media.begin() + int64_t(row->prompt.media.size()),
                               t.media.end());
      for (size_t i = seq.size(); i < t.prompt.size(); ++i) {
        row->tokens.push_back(t.prompt[i]);
        // Media placeholders are input, never targets (the sampler bans them).
        row->trainable.push_back(train_context && !phi4mm::is_media_token(t.prompt[i]) ? 1 : 0);
        row->logp.push_back(nan);
      }
      seq = t.prompt;
    }
    for (size_t i = 0; i < t.completion.size(); ++i) {
      row->tokens.push_back(t.completion[i]);
      row->trainable.push_back(1);
      row->logp.push_back(i < t.logprobs.size() ? t.logprobs[i] : nan);
    }
    seq.insert(seq.end(), t.completion.begin(), t.completion.end());
    row->turn_ends.push_back(int64_t(row->tokens.size()) - 1);
    ++row->turns;
  }
  out.final_text = turns.back().text;
  out.final_tokens = int64_t(turns.back().completion.size());
  return out;
}

// ---- the agent's output -------------------------------------------------------------

namespace {

bool blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }

const char* kOutputFormat =
    "{\"trajectory_id\": \"ID\", \"reward\": <number, optional>, \"turn_rewards\": [<number per turn>, optional]}";

}  // namespace

AgentOutput parse_agent_output(const std::string& text, const std::string& who) {
  // The last non-blank line.
  size_t end = text.size();
  while (end > 0 && blank(text[end - 1])) --end;
  if (end == 0)
    throw AgentError(fmt::format("{} printed nothing on stdout: its last line must be {}", who, kOutputFormat));
  const size_t nl = text.rfind('\n', end - 1);
  const std::string line = text.substr(nl == std::string::npos ? 0 : nl + 1, end - (nl == std::string::npos ? 0 : nl + 1));
  auto bad = [&](const std::string& why) {
    return AgentError(fmt::format("{} printed \"{}\" as its last line: {}; expected {}", who, shown(line), why,
                                  kOutputFormat));
  };
  const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw bad("not JSON");
  if (!j.is_object()) throw bad(fmt::format("a JSON {}, not an object", j.type_name()));
  auto id = j.find("trajectory_id");
  if (id == j.end() || !id->is_string() || id->get<std::string>().empty())
    throw bad("\"trajectory_id\" must be a non-empty string");
  AgentOutput o;
  o.trajectory_id = id->get<std::string>();
  if (auto r = j.find("reward"); r != j.end() && !r->is_null()) {
    if (!r->is_number() || !std::isfinite(r->get<double>())) throw bad("\"reward\" must be a finite number");
    o.reward = r->get<double>();
  }
  if (auto r = j.find("turn_rewards"); r != j.end() && !r->is_null()) {
    if (!r->is_array() || r->empty()) throw bad("\"turn_rewards\" must be an array of finite numbers, one per turn");
    std::vector<double> v;
    for (const json& x : *r) {
      if (!x.is_number() || !std::isfinite(x.get<double>()))
        throw bad(fmt::format("\"turn_rewards\"[{}] must be a finite number", v.size()));
      v.push_back(x.get<double>());
    }
    o.turn_rewards = std::move(v);
  }
  return o;
}

// ---- agent processes ----------------------------------------------------------------

namespace {

struct Running {
  size_t index = 0;  // into tasks
  ChildProcess c;
  std::string input;
  size_t written = 0;
  std::string out, err;
  bool out_eof = false, err_eof = false;
  double deadline = 0;
};

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd), fd = -1;
}

// Reads what is there; false at EOF (or an error).
bool drain(int fd, std::string& into) {
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      into.append(buf, size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    return false;
  }
}

}  // namespace

std::vector<AgentOutput> run_agents(const std::vector<AgentTask>& tasks, const std::string& base_url,
                                    const AgentOptions& o) {
  if (o.cmd.empty()) throw std::invalid_argument("--agent-cmd: empty command");
  std::vector<AgentOutput> results(tasks.size());
  const size_t limit = o.concurrency > 0 ? size_t(o.concurrency) : std::max<size_t>(1, tasks.size());
  std::vector<Running> running;
  SigpipeBlock block;
  auto who = [&](const Running& r) {
    const AgentTask& t = tasks[r.index];
    return fmt::format("--agent-cmd: the agent of task {} (sample {}{})", t.task, t.sample,
                       t.line > 0 ? fmt::format(", dataset line {}", t.line) : std::string());
  };
  auto stderr_tail = [&](const Running& r) {
    if (r.err.empty()) return std::string();
    const size_t n = std::min(r.err.size(), o.stderr_tail_bytes);
    return fmt::format("; its stderr ended with \"{}\"", shown(std::string_view(r.err).substr(r.err.size() - n), n));
  };
  auto fail = [&](const std::string& message) {
    for (Running& r : running) kill_and_reap(r.c);
    running.clear();
    throw AgentError(message);
  };
  size_t next = 0, finished = 0;
  // Run `index` failed: the call fails, or with skip_failed the run alone ends
  // (killed and reaped if it is running) with `message` as its output's error.
  auto fail_run = [&](size_t index, const std::string& message) {
    if (!o.skip_failed) fail(message);
    for (size_t k = 0; k < running.size(); ++k)
      if (running[k].index == index) {
        kill_and_reap(running[k].c);
        running.erase(running.begin() + int64_t(k));
        break;
      }
    results[index].error = message;
    ++finished;
  };
  while (finished < tasks.size()) {
    while (next < tasks.size() && running.size() < limit) {
      const AgentTask& t = tasks[next];
      SpawnOptions so;
      so.capture_stderr = true;
      so.env = {"ARENO_BASE_URL=" + base_url, "ARENO_TRAJECTORY_ID=" + t.trajectory,
                fmt::format("ARENO_TASK_INDEX={}", t.task), fmt::format("ARENO_SAMPLE_INDEX={}", t.sample)};
      Running r;
      r.index = next++;
      try {
        r.c = spawn_shell(o.cmd, so, "--agent-cmd");
      } catch (const std::runtime_error& e) {
        fail_run(r.index, e.what());
        continue;
      }
      r.input = t.row.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
      r.deadline = now_s() + o.timeout_s;
      running.push_back(std::move(r));
    }
    // One poll over every pipe, at most 50 ms.
    std::vector<pollfd> fds;
    for (const Running& r : running) {
      if (r.c.in >= 0) fds.push_back({r.c.in, POLLOUT, 0});
      if (r.c.out >= 0) fds.push_back({r.c.out, POLLIN, 0});
      if (r.c.err >= 0) fds.push_back({r.c.err, POLLIN, 0});
    }
    if (!fds.empty()) ::poll(fds.data(), nfds_t(fds.size()), 50);
    else ::usleep(20000);
    for (size_t k = 0; k < running.size();) {
      Running& r = running[k];
      if (r.c.in >= 0) {
        bool gone = false;  // the agent closed its stdin (it need not read the row)
        while (r.written < r.input.size()) {
          const ssize_t n = ::write(r.c.in, r.input.data() + r.written, r.input.size() - r.written);
          if (n > 0) r.written += size_t(n);
          else if (n < 0 && errno == EINTR) continue;
          else {
            gone = n < 0 && errno != EAGAIN && errno != EWOULDBLOCK;
            break;
          }
        }
        if (r.written == r.input.size() || gone) close_fd(r.c.in);
      }
      if (r.c.out >= 0 && !drain(r.c.out, r.out)) close_fd(r.c.out), r.out_eof = true;
      if (r.c.err >= 0 && !drain(r.c.err, r.err)) close_fd(r.c.err), r.err_eof = true;
      if (r.err.size() > 4 * o.stderr_tail_bytes) r.err.erase(0, r.err.size() - o.stderr_tail_bytes);
      if (r.out.size() > o.max_stdout_bytes) {
        fail_run(r.index, fmt::format("{} printed more than {} bytes on stdout (only the last line, {}, is read){}",
                                      who(r), o.max_stdout_bytes, kOutputFormat, stderr_tail(r)));
        continue;  // (skip_failed: the run is gone from `running`, k is the next one)
      }
      if (r.out_eof && r.err_eof) {
        if (auto si = wait_ended(r.c.pid, 0)) {
          const siginfo_t end = *si;
          kill_and_reap(r.c);  // reaps it (and whatever it left in its group)
          std::string error;
          if (!(end.si_code == CLD_EXITED && end.si_status == 0)) {
            error = fmt::format("{} {}{}", who(r), describe_end(end), stderr_tail(r));
          } else {
            try {
              results[r.index] = parse_agent_output(r.out, who(r));
            } catch (const AgentError& e) {
              error = e.what();
            }
          }
          if (!error.empty()) {
            fail_run(r.index, error);  // removes r from `running`
            continue;
          }
          ++finished;
          running.erase(running.begin() + int64_t(k));
          continue;
        }
      }
      if (now_s() > r.deadline) {
        fail_run(r.index, fmt::format("{} did not finish within {} s (--agent-timeout-s); it was killed{}", who(r),
                                      o.timeout_s, stderr_tail(r)));
        continue;
      }
      ++k;
    }
  }
  return results;
}

// ---- the rollout source -------------------------------------------------------------

AgentRollout::AgentRollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                           std::shared_ptr<const tok::Tokenizer> tokenizer, RolloutOptions rollout, AgentOptions agent)
    : model_(std::move(model)), tok_(std::move(tokenizer)), rollout_(std::move(rollout)), agent_(std::move(agent)) {
  if (!model_ || !tok_) throw std::invalid_argument("agent rollout: model and tokenizer are required");
  if (agent_.cmd.empty()) throw std::invalid_argument("--agent-cmd: empty command");
  if (!(agent_.timeout_s > 0)) throw std::invalid_argument("--agent-timeout-s: must be positive");
  if (agent_.concurrency < 0) throw std::invalid_argument("--agent-concurrency: must be 0 (all) or more");
  if (rollout_.n_samples < 1) throw std::invalid_argument("--n-samples: must be at least 1");
  if (rollout_.max_new_tokens < 1) throw std::invalid_argument("--max-new-tokens: must be at least 1");
}

AgentRollout::~AgentRollout() { stop_server(); }

int AgentRollout::port() const { return server_ ? server_->port() : -1; }

void AgentRollout::start_server() {
  if (server_) return;
  serve::EngineOptions eo = rollout_.engine;
  eo.seed = rollout_.seed;
  engine_ = std::make_unique<serve::Engine>(model_, tok_, eo);
  serve::ServerOptions so;
  so.host = "127.0.0.1";  // loopback only
  so.port = 0;            // an ephemeral port
  so.served_model_name = "areno-policy";
  so.max_context_len = rollout_.max_context_len;
  so.api.default_max_tokens = rollout_.max_new_tokens;
  so.recorder = store_;
  so.threads = size_t(std::max<int64_t>(8, 2 * eo.max_running));
  server_ = std::make_unique<serve::HttpServer>(*engine_, so);
  server_->bind();
  listen_thread_ = std::thread([s = server_.get()] { s->listen(); });
}

void AgentRollout::stop_server() {
  if (engine_) engine_->stop(/*drain=*/false);
  if (server_) server_->stop();
  if (listen_thread_.joinable()) listen_thread_.join();
  server_.reset();
  engine_.reset();
}

RolloutBatch AgentRollout::run(const std::vector<AgentTask>& tasks_in) {
  start_server();
  const int64_t G = rollout_.n_samples;
  const int64_t run = runs_++;
  // Every task n_samples times, task-major; the suggested ids unique within the run.
  std::vector<AgentTask> tasks;
  for (const AgentTask& t : tasks_in)
    for (int64_t j = 0; j < G; ++j) {
      AgentTask a = t;
      a.sample = j;
      a.trajectory = fmt::format("areno-r{}-t{}-s{}", run, t.task, j);
      tasks.push_back(std::move(a));
    }
  store_->clear();
  std::vector<AgentOutput> outputs;
  release_cpu_threads();  // idle for the rollout; the next training op makes new ones
  engine_->start();
  try {
    outputs = run_agents(tasks, fmt::format("http://127.0.0.1:{}/v1", server_->port()), agent_);
  } catch (...) {
    engine_->stop(/*drain=*/false);
    server_->wait_idle(5);
    store_->clear();
    throw;
  }
  // The phase ends: requests still in flight (a stray child of an agent) are
  // aborted, and later ones are refused until the next phase.
  engine_->stop(/*drain=*/false);
  server_->wait_idle(5);
  last_stats_ = engine_->stats();
  if (last_stats_.kv_blocks_used != 0 || last_stats_.running != 0 || last_stats_.waiting != 0)
    throw std::logic_error(fmt::format("agent rollout: the engine still holds {} of {} KV blocks ({} running, {} "
                                       "waiting) after the agents ended", last_stats_.kv_blocks_used,
                                       last_stats_.kv_blocks_total, last_stats_.running, last_stats_.waiting));

  RolloutBatch b;
  std::set<std::string> seen;
  last_failures_.clear();
  // A failed run: fatal, or with skip_failed counted and left out.
  auto failed = [&](const std::string& message) {
    if (!agent_.skip_failed) throw AgentError(message);
    last_failures_.push_back(message);
  };
  for (size_t k = 0; k < tasks.size(); ++k) {
    const AgentTask& t = tasks[k];
    const AgentOutput& out = outputs[k];
    if (!out.error.empty()) {
      failed(out.error);
      continue;
    }
    const std::string who = fmt::format("--agent-cmd: the agent of task {} (sample {}{})", t.task, t.sample,
                                        t.line > 0 ? fmt::format(", dataset line {}", t.line) : std::string());
    if (!seen.insert(out.trajectory_id).second) {
      failed(fmt::format("{} printed trajectory_id \"{}\", which another agent of this step printed too "
                         "(each run needs its own id; ARENO_TRAJECTORY_ID is one)",
                         who, shown(out.trajectory_id)));
      continue;
    }
    const std::vector<serve::TrajectoryTurn> turns = store_->take(out.trajectory_id);
    if (turns.empty()) {
      failed(fmt::format("{} printed trajectory_id \"{}\", but the server recorded no request under that "
                         "id (send the header {}: {} with each request)",
                         who, shown(out.trajectory_id), serve::kTrajectoryHeader, shown(out.trajectory_id)));
      continue;
    }
    if (out.turn_rewards && out.turn_rewards->size() != turns.size()) {
      failed(fmt::format("{} printed {} turn_rewards, but the server recorded {} turn{} under trajectory_id \"{}\" "
                         "(one reward per recorded request, in the order they finished)",
                         who, out.turn_rewards->size(), turns.size(), turns.size() == 1 ? "" : "s",
                         shown(out.trajectory_id)));
      continue;
    }
    AssembledTrajectory a = assemble_trajectory(turns, agent_.train_context);
    split_rows_ += int64_t(a.rows.size()) - 1;
    RolloutBatch::Trajectory tr;
    tr.task = t.task;
    tr.index = t.sample;
    tr.reward = out.reward;
    if (out.turn_rewards) tr.turn_rewards = *out.turn_rewards;
    size_t turn = 0;  // the trajectory's turn of each row's first
    tr.text = std::move(a.final_text);
    tr.tokens = a.final_tokens;
    for (AgentRow& r : a.rows) {
      tr.rows.push_back(int64_t(b.samples.size()));
      RolloutSample s;
      s.prompt = int64_t(b.prompts.size());
      s.index = t.sample;
      s.tokens = std::move(r.tokens);
      s.logp = std::move(r.logp);
      s.trainable = std::move(r.trainable);
      if (out.turn_rewards)
        for (int64_t end : r.turn_ends) s.turn_rewards.emplace_back(end, (*out.turn_rewards)[turn++]);
      b.prompts.push_back(std::move(r.prompt));
      b.samples.push_back(std::move(s));
    }
    b.trajectories.push_back(std::move(tr));
  }
  failed_runs_ += int64_t(last_failures_.size());
  if (b.trajectories.empty() && !tasks.empty()) {
    store_->clear();
    throw AgentError(fmt::format("--skip-failed-agents: all {} agent runs of the step failed; the first: {}",
                                 tasks.size(), last_failures_.front()));
  }
  store_->clear();
  if (rollout_.drop_rollout_state) stop_server();
  return b;
}

}  // namespace areno::train::rl
