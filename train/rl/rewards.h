#pragma once
// Rewards for RL post-training (issue 15, "Rewards"): a score per completion,
// from a built-in rule (`--reward exact | regex:PATTERN | math`) or from a
// long-running program (`--reward-cmd CMD`). docs/rl.md, "Rewards", is the
// user's side of this file.
//
// Built-ins (make_reward):
//   exact          1 when the completion, with ASCII whitespace trimmed at both
//                  ends, equals the row's reference trimmed the same way
//                  (byte for byte, case-sensitive), else 0. The reference is
//                  the first of the fields "answer", "solution", "response"
//                  that is a string or a number (a number compares as its
//                  JSON text: 72 -> "72", 0.5 -> "0.5").
//   regex:PATTERN  1 when PCRE2 finds PATTERN anywhere in the completion, else
//                  0. Compiled once (UTF-8; invalid UTF-8 in a completion
//                  never matches a character but is not an error). A match
//                  that exceeds the match, depth or heap limit (catastrophic
//                  backtracking) is an error, never a hang.
//   math           1 when the completion's answer equals the reference answer
//                  (extract_math_answer, math_answers_equal), else 0; a
//                  completion with no answer scores 0. The reference is the
//                  "answer" or else the "solution" field.
// A row without the reference field is an error naming the prompt index.
//
// --reward-cmd (RewardProcess): `/bin/sh -c CMD` started once, in its own
// process group, with stdin and stdout on pipes (stderr is ours). Per
// completion it gets one line, the compact JSON of reward_record, and answers
// one line holding one finite number (surrounding blanks allowed). The
// records of one score() call go one at a time: a record is written, then its
// answer read, within `timeout_s` for the two. Errors (RewardError) name the
// record: the program exited or closed its stdout, no answer in time, an
// answer that is not a finite number, a line over `max_line_bytes`, or output
// beyond the one line of a record. After any error the program is stopped
// (SIGKILL to its group, reaped) and the next score() starts it again. The
// child has default signal dispositions, an empty signal mask and none of our
// other file descriptors; writing to a dead program is EPIPE here, never
// SIGPIPE. The destructor closes the program's stdin, waits up to
// `exit_grace_s` for it to exit, then kills its group.
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace areno::train::rl {

// One completion to score.
struct RewardInput {
  nlohmann::json row;             // the dataset row, every field (object)
  nlohmann::json prompt;          // the prompt messages as given to the model
  std::string completion;         // the completion text (may hold invalid UTF-8)
  int64_t completion_tokens = 0;  // generated tokens
  int64_t sample_index = 0;       // 0 .. n_samples-1 within the prompt's group
  int64_t prompt_index = 0;       // the prompt within the step's batch
};

class RewardError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RewardFn {
 public:
  virtual ~RewardFn() = default;
  // One score per input, in order. Throws RewardError.
  virtual std::vector<double> score(const std::vector<RewardInput>& inputs) = 0;
};

// "exact", "math" or "regex:PATTERN" (the value of --reward). Throws
// RewardError for an unknown name or a pattern that does not compile (naming
// the flag and the offset).
std::unique_ptr<RewardFn> make_reward(const std::string& spec);

// DAPO's soft overlong punishment (Yu et al. 2025; verl's
// reward_model.overlong_buffer): `inner`'s score plus
//   min(0, -(completion_tokens - (max_new_tokens - buffer_len)) / buffer_len * factor),
// 0 up to max_new_tokens - buffer_len tokens, falling linearly to -factor at
// max_new_tokens, so truncated answers are not rewarded for what they got
// right before the cut. Throws std::invalid_argument (naming the flag) unless
// 0 < buffer_len < max_new_tokens and factor >= 0.
std::unique_ptr<RewardFn> with_overlong_penalty(std::unique_ptr<RewardFn> inner, int64_t max_new_tokens,
                                                int64_t buffer_len, double factor);
// The checks of with_overlong_penalty, for a command to run before it loads anything.
void validate_overlong_penalty(int64_t max_new_tokens, int64_t buffer_len, double factor);

// The line --reward-cmd reads for `in` (no newline): one JSON object with the
// keys "row", "prompt", "completion", "completion_tokens", "sample_index",
// "prompt_index". Invalid UTF-8 in strings becomes U+FFFD.
std::string reward_record(const RewardInput& in);

// --- math answers -------------------------------------------------------------
//
// extract_math_answer (a completion), in order:
//   1. the content of the last "\boxed{", up to its balanced "}" (an
//      unbalanced last one counts as none);
//   2. the rest of the line after the last "####";
//   3. the last number: an optional "-" (not after a letter or digit), digits
//      with optional ","-separated groups of three, an optional ".digits" and
//      an optional "/digits" (a simple fraction). "3." at a sentence end is 3.
// Returns nullopt when none applies. extract_reference_answer (the row's
// field) applies 1 and 2 and otherwise takes the whole field, so a plain
// answer "x^2" is not reduced to its last digit.
//
// normalize_math_answer: removes blanks, "\$" and "$", "\%" and "%", "\left",
// "\right", "\!", "\,", a trailing "."; "\dfrac" and "\tfrac" become "\frac";
// U+2212 (minus sign) becomes "-".
//
// math_answers_equal: after normalizing both, when both parse as numbers they
// are equal within 1e-6 relative (|a-b| <= 1e-6 * max(1, |a|, |b|)); otherwise
// the normalized strings must be equal. Numbers: an optional "-" or "+", then
// an integer, a decimal ("0.5", ".5"), an integer with ","-separated groups of
// three ("1,000"), a fraction of integers "a/b" or "\frac{a}{b}" (b != 0).
// So \frac{1}{2}, 1/2, 0.5 and .5 are all equal; "1,2" is not a number.
std::optional<std::string> extract_math_answer(std::string_view completion);
std::string extract_reference_answer(std::string_view reference);
std::string normalize_math_answer(std::string_view answer);
std::optional<double> parse_math_number(std::string_view normalized);
bool math_answers_equal(std::string_view a, std::string_view b);

// --- --reward-cmd ---------------------------------------------------------------

struct RewardProcessOptions {
  double timeout_s = 30;        // per record: writing it and reading its answer
  size_t max_line_bytes = 4096; // longest answer line accepted
  double exit_grace_s = 1;      // destructor: wait this long after closing stdin
};

class RewardProcess : public RewardFn {
 public:
  // Starts the program (throws RewardError when /bin/sh cannot start).
  explicit RewardProcess(std::string cmd, RewardProcessOptions options = {});
  ~RewardProcess() override;
  RewardProcess(const RewardProcess&) = delete;
  RewardProcess& operator=(const RewardProcess&) = delete;

  std::vector<double> score(const std::vector<RewardInput>& inputs) override;

  bool running() const { return pid_ > 0; }
  int64_t starts() const { return starts_; }  // times the program was started

 private:
  void start();
  double score_one(const RewardInput& in, int64_t index);
  // `rec` names the record in messages: "record 3 (prompt 1, sample 1)".
  void write_all(const std::string& line, const std::string& rec, double deadline);
  std::string read_line(const std::string& rec, double deadline);
  // Stops the program and throws RewardError("reward program (--reward-cmd
  // ...) " + what + "; ..."), with its exit status when it has already ended.
  [[noreturn]] void fail(const std::string& what, bool exited);
  void kill_and_reap();

  std::string cmd_;
  RewardProcessOptions opt_;
  pid_t pid_ = -1;
  int to_child_ = -1, from_child_ = -1;
  std::string pending_;      // bytes read past the last answer line
  int64_t answered_ = 0;     // records answered since the last start
  int64_t starts_ = 0;
};

}  // namespace areno::train::rl
