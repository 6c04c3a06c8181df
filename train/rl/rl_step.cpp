#include "train/rl/rl_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>

#include "train/rl/agent.h"

namespace areno::train::rl {

using Clock = std::chrono::steady_clock;

void validate_rl_loop(const SftOptions& loop, int64_t n_samples, const std::string& algo) {
  SftOptions l = loop;
  l.mini_bs = 1;  // counted in samples here, checked below
  train::validate(l);
  const int64_t samples = loop.batch_size * n_samples;
  if (loop.mini_bs < 1 || loop.mini_bs > samples)
    throw std::invalid_argument(fmt::format("--mini-bs: must be between 1 and --batch-size x --n-samples ({}), got {}",
                                            samples, loop.mini_bs));
  if (loop.groups.embed_rows == EmbedRows::data)
    throw std::invalid_argument(fmt::format("--embed-rows data: not supported with --algo {} (use all or none)", algo));
}

std::unique_ptr<AgentRollout> make_agent_rollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                                                 std::shared_ptr<const tok::Tokenizer> tokenizer,
                                                 const RolloutOptions& rollout, uint64_t seed,
                                                 const AgentOptions& agent) {
  if (agent.cmd.empty()) return nullptr;
  return std::make_unique<AgentRollout>(std::move(model), std::move(tokenizer), seeded_rollout(rollout, seed), agent);
}

nlohmann::json agent_run_keys(const AgentOptions& agent) {
  return {{"--agent-cmd", agent.cmd}, {"--train-tool-results", agent.train_context}};
}

int64_t rollout_runs(const Rollout& rollout, const AgentRollout* agent) {
  return agent ? agent->runs() : int64_t(rollout.runs());
}

void set_rollout_runs(Rollout& rollout, AgentRollout* agent, int64_t runs) {
  if (agent) agent->set_runs(runs);
  else rollout.set_runs(uint64_t(runs));
}

RolloutOptions seeded_rollout(RolloutOptions r, uint64_t seed) {
  r.seed = seed;
  return r;
}

PolicyLogpOptions step_logp_options(const SftOptions& loop, int64_t step, int64_t micro) {
  PolicyLogpOptions po;
  po.chunk_rows = loop.loss_chunk_rows;
  po.recompute_layers = loop.activation_checkpointing;
  po.dropout_seed = splitmix64(loop.seed ^ splitmix64(uint64_t(step) * 0x10000ull + uint64_t(micro)));
  return po;
}

nlohmann::json rollout_run_keys(const std::vector<PromptRow>& rows, const SftOptions& loop, const RolloutOptions& r,
                                const std::string& algo) {
  Fingerprint f;
  for (const PromptRow& p : rows) {
    f.add(int64_t(p.ids.size()));
    for (int64_t v : p.ids) f.add(v);
    f.add(int64_t(p.adapter));
    f.add(p.row.dump());
  }
  nlohmann::json k = loop_run_keys(loop, algo, fmt::format("rows={} data={:016x}", rows.size(), f.value()));
  k["--n-samples"] = r.n_samples;
  k["--temperature"] = r.temperature;
  k["--top-k"] = r.top_k;
  k["--top-p"] = r.top_p;
  k["--greedy"] = r.greedy;
  k["--max-new-tokens"] = r.max_new_tokens;
  k["--max-context-len"] = r.max_context_len;
  return k;
}

SavedState load_rollout_state(const std::filesystem::path& step_dir, const nlohmann::json& keys, int64_t rows,
                              AdamW& optimizer, int64_t& rollout_runs) {
  return load_step_state(step_dir, keys.at("--algo").get<std::string>(), rows, optimizer,
                         [&](const nlohmann::json& st, const std::string& file) {
                           check_run_keys(st, keys, file);
                           auto it = st.find("rollout_runs");
                           if (it == st.end() || !it->is_number_integer() || it->get<int64_t>() < 0)
                             throw std::runtime_error(
                                 fmt::format("{}: rollout_runs must be a non-negative integer", file));
                           rollout_runs = it->get<int64_t>();
                         });
}

int64_t trainable_tokens(const RolloutSample& s) {
  int64_t n = 0;
  for (size_t t = 0; t < s.tokens.size(); ++t) n += is_trainable(s, t) ? 1 : 0;
  return n;
}

namespace {

// The engine's completions of `rows`, one trajectory (and row) each.
RolloutBatch engine_rollouts(Rollout& rollout, const std::vector<const PromptRow*>& rows,
                             const tok::Tokenizer& tokenizer) {
  RolloutBatch b;
  for (const PromptRow* p : rows) b.prompts.push_back({p->ids, p->media, p->adapter});
  b.samples = rollout.run(b.prompts);
  for (size_t k = 0; k < b.samples.size(); ++k) {
    const RolloutSample& s = b.samples[k];
    const std::vector<tok::TokenId> ids(s.tokens.begin(), s.tokens.end());
    b.trajectories.push_back({s.prompt, s.index, {int64_t(k)}, std::nullopt,
                              tokenizer.decode(ids, /*skip_special_tokens=*/true), int64_t(s.tokens.size()), {}});
  }
  return b;
}

// n_samples agent runs of each of `rows`.
RolloutBatch agent_rollouts(AgentRollout& agent, const std::vector<const PromptRow*>& rows) {
  std::vector<AgentTask> tasks;
  for (size_t i = 0; i < rows.size(); ++i) tasks.push_back({rows[i]->row, int64_t(i), 0, rows[i]->line, {}});
  return agent.run(tasks);
}

// The first trajectory of each group of `r` (task-major: a new group where
// the task changes), and one past the last.
std::vector<int64_t> group_starts(const ScoredRollouts& r) {
  std::vector<int64_t> starts;
  for (size_t k = 0; k < r.trajectories.size(); ++k)
    if (k == 0 || r.trajectories[k].task != r.trajectories[k - 1].task) starts.push_back(int64_t(k));
  starts.push_back(int64_t(r.trajectories.size()));
  return starts;
}

}  // namespace

ScoredRollouts roll_and_score(const std::vector<PromptRow>& rows, const TrainerState& state, const SftOptions& loop,
                              Rollout& rollout, AgentRollout* agent, RewardFn* reward,
                              const tok::Tokenizer& tokenizer) {
  const auto t0 = Clock::now();
  ScoredRollouts r;
  for (int64_t i : next_step_rows(state, int64_t(rows.size()), loop)) r.rows.push_back(&rows[size_t(i)]);
  static_cast<RolloutBatch&>(r) = agent ? agent_rollouts(*agent, r.rows) : engine_rollouts(rollout, r.rows, tokenizer);
  r.rollout_s = seconds_since(t0);
  const int64_t P = int64_t(r.rows.size()), G = rollout.options().n_samples;
  const int64_t NT = int64_t(r.trajectories.size());
  if (agent) r.agent_failures = agent->last_failures();
  const int64_t skipped = int64_t(r.agent_failures.size());
  if (NT + skipped != P * G)
    throw std::logic_error(fmt::format("the rollout gave {} trajectories ({} failed runs skipped) for {} prompts x {} "
                                       "samples", NT, skipped, P, G));
  const std::vector<int64_t> starts = group_starts(r);
  for (size_t g = 0; g + 1 < starts.size(); ++g) r.group_sizes.push_back(starts[g + 1] - starts[g]);
  for (const RolloutSample& s : r.samples) r.tokens += trainable_tokens(s);

  // Rewards: the source's, else the RewardFn's on the decoded final answer.
  const auto t_reward = Clock::now();
  r.outcomes.assign(size_t(NT), 0.0);
  std::vector<RewardInput> inputs;
  std::vector<int64_t> scored;
  for (int64_t k = 0; k < NT; ++k) {
    const RolloutBatch::Trajectory& t = r.trajectories[size_t(k)];
    if (t.reward) {
      r.outcomes[size_t(k)] = *t.reward;
      continue;
    }
    if (!reward) {
      if (!t.turn_rewards.empty()) continue;  // the turn rewards alone
      throw std::invalid_argument(fmt::format("--agent-cmd: the agent of task {} (sample {}) printed no reward (nor "
                                              "turn_rewards) and neither --reward nor --reward-cmd is given",
                                              t.task, t.index));
    }
    const PromptRow& p = *r.rows[size_t(t.task)];
    inputs.push_back({p.row, p.messages, t.text, t.tokens, t.index, t.task});
    scored.push_back(k);
  }
  if (!inputs.empty()) {
    const std::vector<double> got = reward->score(inputs);
    if (got.size() != inputs.size())
      throw std::logic_error(fmt::format("the reward gave {} scores for {} completions", got.size(), inputs.size()));
    for (size_t i = 0; i < scored.size(); ++i) r.outcomes[size_t(scored[i])] = got[i];
  }
  r.rewards = r.outcomes;
  for (int64_t k = 0; k < NT; ++k)
    for (double x : r.trajectories[size_t(k)].turn_rewards) r.rewards[size_t(k)] += x;
  r.reward_s = seconds_since(t_reward);
  return r;
}

std::vector<int64_t> varied_groups(const ScoredRollouts& r) {
  const std::vector<int64_t> starts = group_starts(r);
  std::vector<int64_t> out;
  for (size_t g = 0; g + 1 < starts.size(); ++g) {
    const auto b = r.rewards.begin() + starts[g], e = r.rewards.begin() + starts[g + 1];
    const auto [lo, hi] = std::minmax_element(b, e);
    if (e - b == 1 || *lo != *hi) out.push_back(int64_t(g));
  }
  return out;
}

void append_groups(ScoredRollouts& into, const ScoredRollouts& from, const std::vector<int64_t>& groups,
                   int64_t limit) {
  const std::vector<int64_t> starts = group_starts(from);
  std::map<int64_t, int64_t> prompt_at;  // from's prompt index -> into's
  for (int64_t g : groups) {
    if (int64_t(into.group_sizes.size()) >= limit) break;
    if (g < 0 || g + 1 >= int64_t(starts.size()))
      throw std::logic_error(fmt::format("append_groups: no group {} of {}", g, starts.size() - 1));
    const int64_t task = int64_t(into.rows.size());
    into.rows.push_back(from.rows[size_t(from.trajectories[size_t(starts[size_t(g)])].task)]);
    into.group_sizes.push_back(starts[size_t(g) + 1] - starts[size_t(g)]);
    for (int64_t k = starts[size_t(g)]; k < starts[size_t(g) + 1]; ++k) {
      RolloutBatch::Trajectory t = from.trajectories[size_t(k)];
      t.task = task;
      for (int64_t& row : t.rows) {
        RolloutSample s = from.samples[size_t(row)];
        auto [it, fresh] = prompt_at.emplace(s.prompt, int64_t(into.prompts.size()));
        if (fresh) into.prompts.push_back(from.prompts[size_t(s.prompt)]);
        s.prompt = it->second;
        into.tokens += trainable_tokens(s);
        row = int64_t(into.samples.size());
        into.samples.push_back(std::move(s));
      }
      into.trajectories.push_back(std::move(t));
      into.rewards.push_back(from.rewards[size_t(k)]);
      into.outcomes.push_back(from.outcomes[size_t(k)]);
    }
  }
  into.agent_failures.insert(into.agent_failures.end(), from.agent_failures.begin(), from.agent_failures.end());
  into.rollout_s += from.rollout_s;
  into.reward_s += from.reward_s;
}

std::vector<double> per_row(const ScoredRollouts& r, const std::vector<double>& per_trajectory) {
  std::vector<double> out(r.samples.size(), 0.0);
  for (size_t k = 0; k < r.trajectories.size(); ++k)
    for (int64_t row : r.trajectories[k].rows) out[size_t(row)] = per_trajectory[k];
  return out;
}

MicroBatch micro_batch(const ScoredRollouts& r, int64_t b, int64_t e) {
  MicroBatch mb;
  std::map<int64_t, int64_t> local;
  for (int64_t i = b; i < e; ++i) {
    const RolloutSample& s = r.samples[size_t(i)];
    auto [it, fresh] = local.emplace(s.prompt, int64_t(mb.prompts.size()));
    if (fresh) mb.prompts.push_back(r.prompts[size_t(s.prompt)]);
    mb.seqs.push_back({it->second, s.tokens, s.trainable});
    mb.tokens += trainable_tokens(s);
  }
  return mb;
}

Tensor rollout_logp(const ScoredRollouts& r, int64_t b, const Tensor& train_logp) {
  const int64_t n = train_logp.size(0), T = train_logp.size(1);
  std::vector<float> old(static_cast<size_t>(n * T), 0.0f);
  std::vector<float> lp;  // the training forward's, read only when a token has no rollout log-probability
  for (int64_t i = 0; i < n; ++i) {
    const RolloutSample& s = r.samples[size_t(b + i)];
    for (size_t t = 0; t < s.logp.size(); ++t) {
      const size_t cell = size_t(i * T) + t;
      if (!std::isnan(s.logp[t])) {
        old[cell] = s.logp[t];
        continue;
      }
      if (lp.empty()) lp = train_logp.to_vector<float>();
      old[cell] = lp[cell];
    }
  }
  return from_vector(old, {n, T}).to(train_logp.device());
}

void LogpParity::add(const Tensor& logp, const ScoredRollouts& r, int64_t b, int64_t n) {
  const int64_t T = logp.size(1);
  const std::vector<float> lp = logp.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    const RolloutSample& s = r.samples[size_t(b + i)];
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      if (!is_trainable(s, t) || std::isnan(s.logp[t])) continue;
      const double tr = lp[size_t(i * T) + t], ro = s.logp[t];
      rollout_sum += ro;
      train_sum += tr;
      diff_sum += tr - ro;
      abs_sum += std::abs(tr - ro);
      abs_max = std::max(abs_max, std::abs(tr - ro));
      tokens += 1;
    }
  }
}

void LogpParity::finish(RlStepStats& st) const {
  const double d = std::max(1.0, tokens);
  st.rollout_logprobs_mean = rollout_sum / d;
  st.train_logprobs_mean = train_sum / d;
  st.logp_diff_mean = diff_sum / d;
  st.logp_abs_diff_mean = abs_sum / d;
  st.logp_abs_diff_max = abs_max;
}

void record_rollouts(const ScoredRollouts& r, RlStepStats& st) {
  const int64_t N = int64_t(r.samples.size()), NT = int64_t(r.trajectories.size());
  st.prompts = int64_t(r.rows.size());
  st.samples = N;
  st.trajectories = NT;
  st.split_rows = N - NT;
  st.agent_failures = r.agent_failures;
  st.response_tokens = r.tokens;
  st.rewards = r.rewards;
  double sum = 0;
  for (double x : r.rewards) sum += x;
  st.reward_mean = NT > 0 ? sum / double(NT) : 0.0;
  st.response_len = N > 0 ? double(r.tokens) / double(N) : 0.0;
  st.rollout_s = r.rollout_s;
  st.reward_s = r.reward_s;
}

Scalars rl_scalars(const RlStepStats& st) {
  Scalars s = {{"reward_mean", st.reward_mean},
               {"advantage_mean", st.advantage_mean},
               {"response_len", st.response_len},
               {"rollout_logprobs_mean", st.rollout_logprobs_mean},
               {"train_logprobs_mean", st.train_logprobs_mean},
               {"logp_diff_mean", st.logp_diff_mean},
               {"logp_abs_diff_mean", st.logp_abs_diff_mean},
               {"ratio_mean", st.ratio_mean},
               {"clip_frac", st.clip_frac},
               {"kl", st.kl},
               {"loss", st.loss},
               {"pg_loss", st.pg_loss},
               {"grad_norm", st.grad_norm}};
  for (const auto& [g, lr] : st.lrs) s.emplace_back("lr/" + g, lr);
  s.insert(s.end(), {{"samples", double(st.samples)},
                     {"trajectories", double(st.trajectories)},
                     {"split_rows", double(st.split_rows)},
                     {"agent_failed", double(st.agent_failures.size())},
                     {"response_tokens", double(st.response_tokens)},
                     {"time/rollout_s", st.rollout_s},
                     {"time/reward_s", st.reward_s},
                     {"time/train_s", st.train_s},
                     {"time/total_s", st.total_s},
                     {"memory/peak_rss_bytes", double(peak_rss_bytes())}});
  if (st.gen_batches > 0)
    s.insert(s.end(), {{"filter_groups/gen_batches", double(st.gen_batches)},
                       {"filter_groups/filtered", double(st.filtered_groups)},
                       {"filter_groups/prompts_read", double(st.prompts_read)}});
  return s;
}

std::string format_rl_progress(const RlStepStats& st, int64_t total_steps, const std::string& extra) {
  return fmt::format("step {}/{}  reward {:.3f}  loss {:.4f}  len {:.1f}  logp_abs_diff {:.1e}  ratio {:.4f}  "
                     "clip_frac {:.3f}  {}{}  grad_norm {:.3f}  time rollout={:.2f}s train={:.2f}s total={:.2f}s",
                     st.step, total_steps, st.reward_mean, st.loss, st.response_len, st.logp_abs_diff_mean,
                     st.ratio_mean, st.clip_frac,
                     (st.agent_failures.empty() ? std::string()
                                                : fmt::format("agents_failed {}  ", st.agent_failures.size())) +
                         (st.gen_batches == 0 ? std::string()
                                              : fmt::format("groups {} of {} prompts in {} batches  ", st.prompts,
                                                            st.prompts_read, st.gen_batches)) +
                         (extra.empty() ? "" : extra + "  "),
                     format_group_lrs(st.lrs),
                     st.grad_norm, st.rollout_s + st.reward_s, st.train_s, st.total_s);
}

}  // namespace areno::train::rl
