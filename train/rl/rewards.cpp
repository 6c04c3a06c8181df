#include "train/rl/rewards.h"

#include <poll.h>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "train/rl/process.h"

namespace areno::train::rl {

using nlohmann::json;

namespace {

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alnum(char c) { return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

// The first of `fields` in `row` that is a string or a number, as text.
std::optional<std::string> reference_field(const json& row, std::initializer_list<const char*> fields) {
  if (!row.is_object()) return std::nullopt;
  for (const char* f : fields) {
    auto it = row.find(f);
    if (it == row.end()) continue;
    if (it->is_string()) return it->get<std::string>();
    if (it->is_number()) return it->dump();
  }
  return std::nullopt;
}

std::string require_reference(const RewardInput& in, const char* reward, std::initializer_list<const char*> fields) {
  if (auto r = reference_field(in.row, fields)) return *r;
  std::string names;
  for (const char* f : fields) names += fmt::format("{}\"{}\"", names.empty() ? "" : ", ", f);
  throw RewardError(fmt::format("--reward {}: the row of prompt {} has no string or number field {}", reward,
                                in.prompt_index, names));
}

// A built-in: each completion scored on its own.
class PerCompletionReward : public RewardFn {
 public:
  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    std::vector<double> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) out.push_back(score_one(in));
    return out;
  }

 protected:
  virtual double score_one(const RewardInput& in) = 0;
};

// --- exact -------------------------------------------------------------------

class ExactReward : public PerCompletionReward {
  double score_one(const RewardInput& in) override {
    const std::string ref = require_reference(in, "exact", {"answer", "solution", "response"});
    return trim(in.completion) == trim(ref) ? 1.0 : 0.0;
  }
};

// --- regex -------------------------------------------------------------------

std::string pcre2_message(int code) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(code, msg, sizeof msg);
  return reinterpret_cast<const char*>(msg);
}

class RegexReward : public PerCompletionReward {
 public:
  // Limits that stop catastrophic backtracking within a fraction of a second
  // while leaving ordinary patterns on long completions far below them.
  static constexpr uint32_t kMatchLimit = 10'000'000;
  static constexpr uint32_t kDepthLimit = 1'000'000;
  static constexpr uint32_t kHeapLimitKiB = 64 * 1024;

  explicit RegexReward(std::string pattern) : pattern_(std::move(pattern)) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                          PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
    if (!code_)
      throw RewardError(fmt::format("--reward regex:{}: the pattern does not compile at offset {}: {}", pattern_,
                                    offset, pcre2_message(err)));
    mctx_ = pcre2_match_context_create(nullptr);
    md_ = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (!mctx_ || !md_) {
      free_all();
      throw RewardError("--reward regex: out of memory");
    }
    pcre2_set_match_limit(mctx_, kMatchLimit);
    pcre2_set_depth_limit(mctx_, kDepthLimit);
    pcre2_set_heap_limit(mctx_, kHeapLimitKiB);
  }
  ~RegexReward() override { free_all(); }
  RegexReward(const RegexReward&) = delete;
  RegexReward& operator=(const RegexReward&) = delete;


 private:
  double score_one(const RewardInput& in) override {
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(in.completion.data()), in.completion.size(), 0, 0,
                               md_, mctx_);
    if (rc >= 0) return 1.0;
    if (rc == PCRE2_ERROR_NOMATCH) return 0.0;
    const bool limit = rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT;
    throw RewardError(fmt::format("--reward regex:{}: matching the completion of prompt {} sample {} failed: {}{}",
                                  pattern_, in.prompt_index, in.sample_index, pcre2_message(rc),
                                  limit ? " (the pattern backtracks catastrophically; simplify it)" : ""));
  }

  void free_all() {
    if (md_) pcre2_match_data_free(md_);
    if (mctx_) pcre2_match_context_free(mctx_);
    if (code_) pcre2_code_free(code_);
    md_ = nullptr, mctx_ = nullptr, code_ = nullptr;
  }
  std::string pattern_;
  pcre2_code* code_ = nullptr;
  pcre2_match_context* mctx_ = nullptr;
  pcre2_match_data* md_ = nullptr;
};

// --- math --------------------------------------------------------------------

// The content of the last "\boxed{" up to its balanced "}", or nullopt.
std::optional<std::string_view> last_boxed(std::string_view s) {
  constexpr std::string_view kBoxed = "\\boxed{";
  const size_t at = s.rfind(kBoxed);
  if (at == std::string_view::npos) return std::nullopt;
  const size_t begin = at + kBoxed.size();
  int64_t depth = 1;
  for (size_t i = begin; i < s.size(); ++i) {
    if (s[i] == '{') ++depth;
    else if (s[i] == '}' && --depth == 0) return s.substr(begin, i - begin);
  }
  return std::nullopt;
}

// The rest of the line after the last "####", or nullopt.
std::optional<std::string_view> after_hashes(std::string_view s) {
  const size_t at = s.rfind("####");
  if (at == std::string_view::npos) return std::nullopt;
  std::string_view rest = s.substr(at + 4);
  return trim(rest.substr(0, rest.find('\n')));
}

// The last number in `s` (see the header), or nullopt.
std::optional<std::string_view> last_number(std::string_view s) {
  std::optional<std::string_view> last;
  size_t i = 0;
  while (i < s.size()) {
    if (!is_digit(s[i])) {
      ++i;
      continue;
    }
    size_t b = i;
    if (b > 0 && s[b - 1] == '-' && (b == 1 || !is_alnum(s[b - 2]))) --b;
    while (i < s.size() && is_digit(s[i])) ++i;
    // ",ddd" groups: exactly three digits, not followed by a fourth.
    while (i + 3 < s.size() && s[i] == ',' && is_digit(s[i + 1]) && is_digit(s[i + 2]) && is_digit(s[i + 3]) &&
           (i + 4 >= s.size() || !is_digit(s[i + 4])))
      i += 4;
    if (i + 1 < s.size() && s[i] == '.' && is_digit(s[i + 1])) {
      ++i;
      while (i < s.size() && is_digit(s[i])) ++i;
    } else if (i + 1 < s.size() && s[i] == '/' && is_digit(s[i + 1])) {
      ++i;
      while (i < s.size() && is_digit(s[i])) ++i;
    }
    last = s.substr(b, i - b);
  }
  return last;
}

void erase_all(std::string& s, std::string_view what) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s.compare(i, what.size(), what) == 0) {
      i += what.size();
    } else {
      out += s[i++];
    }
  }
  s = std::move(out);
}

void replace_all(std::string& s, std::string_view what, std::string_view with) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s.compare(i, what.size(), what) == 0) {
      out += with;
      i += what.size();
    } else {
      out += s[i++];
    }
  }
  s = std::move(out);
}

// A run of digits with optional ","-groups of three; returns its value's text
// without commas, or nullopt.
std::optional<std::string> integer_text(std::string_view s) {
  if (s.empty() || !is_digit(s[0])) return std::nullopt;
  std::string out;
  size_t i = 0;
  while (i < s.size() && is_digit(s[i])) out += s[i++];
  const bool grouped = i < s.size() && s[i] == ',';
  if (grouped && out.size() > 3) return std::nullopt;
  while (i < s.size()) {
    if (s[i] != ',' || i + 4 > s.size()) return std::nullopt;
    for (size_t k = 1; k <= 3; ++k)
      if (!is_digit(s[i + k])) return std::nullopt;
    out.append(s.substr(i + 1, 3));
    i += 4;
  }
  return out;
}

std::optional<double> to_double(const std::string& text) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// An unsigned decimal: integer (with optional groups), "a.b" or ".b".
std::optional<double> unsigned_decimal(std::string_view s) {
  const size_t dot = s.find('.');
  std::string text;
  if (dot == std::string_view::npos) {
    auto i = integer_text(s);
    if (!i) return std::nullopt;
    text = *i;
  } else {
    const std::string_view frac = s.substr(dot + 1);
    if (frac.empty() || !std::all_of(frac.begin(), frac.end(), is_digit)) return std::nullopt;
    if (dot > 0) {
      auto i = integer_text(s.substr(0, dot));
      if (!i) return std::nullopt;
      text = *i;
    }
    text = (text.empty() ? "0" : text) + "." + std::string(frac);
  }
  return to_double(text);
}

std::optional<double> unsigned_integer(std::string_view s) {
  auto i = integer_text(s);
  return i ? to_double(*i) : std::nullopt;
}

}  // namespace

std::optional<std::string> extract_math_answer(std::string_view completion) {
  if (auto b = last_boxed(completion)) return std::string(*b);
  if (auto h = after_hashes(completion)) return std::string(*h);
  if (auto n = last_number(completion)) return std::string(*n);
  return std::nullopt;
}

std::string extract_reference_answer(std::string_view reference) {
  if (auto b = last_boxed(reference)) return std::string(*b);
  if (auto h = after_hashes(reference)) return std::string(*h);
  return std::string(reference);
}

std::string normalize_math_answer(std::string_view answer) {
  std::string s;
  s.reserve(answer.size());
  for (char c : answer)
    if (!is_blank(c)) s += c;
  replace_all(s, "\xe2\x88\x92", "-");  // U+2212 MINUS SIGN
  for (std::string_view w : {"\\$", "$", "\\%", "%", "\\left", "\\right", "\\!", "\\,"}) erase_all(s, w);
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  while (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

std::optional<double> parse_math_number(std::string_view s) {
  double sign = 1;
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) {
    sign = s[0] == '-' ? -1 : 1;
    s.remove_prefix(1);
  }
  std::optional<double> num, den;
  constexpr std::string_view kFrac = "\\frac{";
  if (s.substr(0, kFrac.size()) == kFrac) {
    // \frac{a}{b} with integers a and b, nothing else.
    const std::string_view rest = s.substr(kFrac.size());
    const size_t close = rest.find('}');
    if (close == std::string_view::npos || rest.substr(close + 1, 1) != "{" || rest.back() != '}')
      return std::nullopt;
    num = unsigned_integer(rest.substr(0, close));
    den = unsigned_integer(rest.substr(close + 2, rest.size() - close - 3));
  } else if (const size_t slash = s.find('/'); slash != std::string_view::npos) {
    num = unsigned_integer(s.substr(0, slash));
    den = unsigned_integer(s.substr(slash + 1));
  } else {
    auto v = unsigned_decimal(s);
    if (!v) return std::nullopt;
    return sign * *v;
  }
  if (!num || !den || *den == 0) return std::nullopt;
  return sign * *num / *den;
}

bool math_answers_equal(std::string_view a, std::string_view b) {
  const std::string na = normalize_math_answer(a), nb = normalize_math_answer(b);
  const auto va = parse_math_number(na), vb = parse_math_number(nb);
  if (va && vb) return std::abs(*va - *vb) <= 1e-6 * std::max({1.0, std::abs(*va), std::abs(*vb)});
  return !na.empty() && na == nb;
}

namespace {

class MathReward : public PerCompletionReward {
  double score_one(const RewardInput& in) override {
    const std::string ref = extract_reference_answer(require_reference(in, "math", {"answer", "solution"}));
    const auto got = extract_math_answer(in.completion);
    return got && math_answers_equal(*got, ref) ? 1.0 : 0.0;
  }
};

}  // namespace

std::unique_ptr<RewardFn> make_reward(const std::string& spec) {
  if (spec == "exact") return std::make_unique<ExactReward>();
  if (spec == "math") return std::make_unique<MathReward>();
  if (spec.rfind("regex:", 0) == 0) return std::make_unique<RegexReward>(spec.substr(6));
  throw RewardError(
      fmt::format("--reward {}: unknown reward (exact, math, regex:PATTERN; or --reward-cmd CMD)", spec));
}

std::string reward_record(const RewardInput& in) {
  const json j = {{"row", in.row},
                  {"prompt", in.prompt},
                  {"completion", in.completion},
                  {"completion_tokens", in.completion_tokens},
                  {"sample_index", in.sample_index},
                  {"prompt_index", in.prompt_index}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// --- --reward-cmd ------------------------------------------------------------

RewardProcess::RewardProcess(std::string cmd, RewardProcessOptions options)
    : cmd_(std::move(cmd)), opt_(options) {
  start();
}

RewardProcess::~RewardProcess() {
  if (pid_ <= 0) return;
  ::close(to_child_);
  to_child_ = -1;
  wait_ended(pid_, opt_.exit_grace_s);
  kill_and_reap();
}

void RewardProcess::start() {
  ChildProcess c;
  try {
    c = spawn_shell(cmd_, {}, "--reward-cmd");
  } catch (const std::runtime_error& e) {
    throw RewardError(e.what());
  }
  pid_ = c.pid;
  to_child_ = c.in;
  from_child_ = c.out;
  pending_.clear();
  answered_ = 0;
  ++starts_;
}

void RewardProcess::kill_and_reap() {
  if (pid_ <= 0) return;
  ChildProcess c{pid_, to_child_, from_child_, -1};
  rl::kill_and_reap(c);
  pid_ = -1;
  to_child_ = from_child_ = -1;
  pending_.clear();
}

void RewardProcess::fail(const std::string& what, bool exited) {
  std::string head = what;
  if (exited) {
    if (auto si = wait_ended(pid_, opt_.exit_grace_s)) {
      head = describe_end(*si);
    } else {
      head = "closed its stdout but did not exit";
    }
    head += fmt::format(" after {} records ({})", answered_, what);
  }
  kill_and_reap();
  throw RewardError(fmt::format("reward program (--reward-cmd \"{}\") {}; it was stopped and the next call restarts it",
                                cmd_, head));
}

void RewardProcess::write_all(const std::string& line, const std::string& rec, double deadline) {
  SigpipeBlock block;
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(to_child_, line.data() + done, line.size() - done);
    if (n > 0) {
      done += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EPIPE) fail(fmt::format("its stdin closed while {} was being written", rec), true);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      fail(fmt::format("writing {} failed: {}", rec, std::strerror(errno)), false);
    if (poll_until(to_child_, POLLOUT, deadline) == 0)
      fail(fmt::format("did not read {} within {} s (the timeout)", rec, opt_.timeout_s), false);
  }
}

std::string RewardProcess::read_line(const std::string& rec, double deadline) {
  char buf[4096];
  for (;;) {
    const size_t nl = pending_.find('\n');
    if (nl != std::string::npos) {
      if (nl > opt_.max_line_bytes)
        fail(fmt::format("wrote a line longer than {} bytes for {}", opt_.max_line_bytes, rec), false);
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (!pending_.empty())
        fail(fmt::format("wrote more than one line for {} (\"{}\", then \"{}\")", rec, shown(line),
                         shown(pending_)),
             false);
      return line;
    }
    if (pending_.size() > opt_.max_line_bytes)
      fail(fmt::format("wrote a line longer than {} bytes for {}", opt_.max_line_bytes, rec), false);
    const ssize_t n = ::read(from_child_, buf, sizeof buf);
    if (n > 0) {
      pending_.append(buf, size_t(n));
      continue;
    }
    if (n == 0) fail(fmt::format("no answer to {}", rec), true);
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      fail(fmt::format("reading the answer to {} failed: {}", rec, std::strerror(errno)), false);
    if (poll_until(from_child_, POLLIN, deadline) == 0)
      fail(fmt::format("gave no answer to {} within {} s (the timeout)", rec, opt_.timeout_s), false);
  }
}

double RewardProcess::score_one(const RewardInput& in, int64_t index) {
  const std::string rec = fmt::format("record {} (prompt {}, sample {})", index, in.prompt_index, in.sample_index);
  // Output before the record is sent: a line too many for an earlier record
  // (or the program ended).
  if (pending_.empty() && poll_until(from_child_, POLLIN, 0) != 0) {
    char buf[256];
    const ssize_t n = ::read(from_child_, buf, sizeof buf);
    if (n == 0) fail(fmt::format("no answer to {}", rec), true);
    if (n > 0) pending_.assign(buf, size_t(n));
  }
  if (!pending_.empty())
    fail(fmt::format("wrote \"{}\" before it was sent {} (more than one line for an earlier record)",
                     shown(pending_), rec),
         false);
  const double deadline = now_s() + opt_.timeout_s;
  write_all(reward_record(in) + "\n", rec, deadline);
  const std::string line = read_line(rec, deadline);
  std::string_view t = trim(line);
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  double v = 0;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || r.ec != std::errc() || r.ptr != t.data() + t.size() || !std::isfinite(v))
    fail(fmt::format("answered \"{}\" to {}: not a finite number", shown(line), rec), false);
  ++answered_;
  return v;
}

std::vector<double> RewardProcess::score(const std::vector<RewardInput>& inputs) {
  std::vector<double> out;
  out.reserve(inputs.size());
  if (inputs.empty()) return out;
  if (pid_ <= 0) start();
  for (size_t i = 0; i < inputs.size(); ++i) out.push_back(score_one(inputs[i], int64_t(i)));
  return out;
}

namespace {

class OverlongPenalty : public RewardFn {
 public:
  OverlongPenalty(std::unique_ptr<RewardFn> inner, int64_t max_new_tokens, int64_t buffer_len, double factor)
      : inner_(std::move(inner)), expected_(max_new_tokens - buffer_len), buffer_(buffer_len), factor_(factor) {}
  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    std::vector<double> out = inner_->score(inputs);
    for (size_t i = 0; i < out.size() && i < inputs.size(); ++i) {
      const double exceed = double(inputs[i].completion_tokens - expected_);
      out[i] += std::min(0.0, -exceed / double(buffer_) * factor_);
    }
    return out;
  }

 private:
  std::unique_ptr<RewardFn> inner_;
  int64_t expected_, buffer_;
  double factor_;
};

}  // namespace

std::unique_ptr<RewardFn> with_overlong_penalty(std::unique_ptr<RewardFn> inner, int64_t max_new_tokens,
                                                int64_t buffer_len, double factor) {
  if (!inner) throw std::invalid_argument("--overlong-buffer-len: needs --reward or --reward-cmd");
  validate_overlong_penalty(max_new_tokens, buffer_len, factor);
  return std::make_unique<OverlongPenalty>(std::move(inner), max_new_tokens, buffer_len, factor);
}

void validate_overlong_penalty(int64_t max_new_tokens, int64_t buffer_len, double factor) {
  if (!(buffer_len > 0 && buffer_len < max_new_tokens))
    throw std::invalid_argument(fmt::format("--overlong-buffer-len: must be between 1 and --max-new-tokens - 1 ({}), "
                                            "got {}", max_new_tokens - 1, buffer_len));
  if (!(factor >= 0) || !std::isfinite(factor))
    throw std::invalid_argument("--overlong-penalty-factor: must be 0 or more");
}

}  // namespace areno::train::rl
