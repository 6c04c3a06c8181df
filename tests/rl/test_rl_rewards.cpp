// RL rewards (issue 15, "Rewards"; must show 5): the built-ins on real cases
// and the --reward-cmd program through the small scripts in tests/rl/scripts/
// (a good program, one that crashes, one that times out, garbage and NaN
// answers, two lines for one record, a closed stdout).
#include <doctest/doctest.h>

#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tests/test_util.h"
#include "train/rl/rewards.h"

using namespace areno::train::rl;
using areno::testing::error_of;
using areno::testing::TempDir;
using nlohmann::json;

namespace {

RewardInput input(const std::string& completion, json row, int64_t prompt = 0, int64_t sample = 0) {
  RewardInput in;
  in.row = std::move(row);
  in.prompt = json::array({{{"role", "user"}, {"content", "question?"}}});
  in.completion = completion;
  in.completion_tokens = int64_t(completion.size());
  in.prompt_index = prompt;
  in.sample_index = sample;
  return in;
}

double score1(RewardFn& fn, const std::string& completion, const json& row) {
  const auto s = fn.score({input(completion, row)});
  REQUIRE(s.size() == 1);
  return s[0];
}

double math(const std::string& completion, const json& answer) {
  static auto fn = make_reward("math");
  return score1(*fn, completion, {{"answer", answer}});
}

// The command that runs a script of tests/rl/scripts (the tests run in the
// source root).
std::string script(const std::string& name_and_args) { return "sh tests/rl/scripts/" + name_and_args; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Whether `pid` is gone or a zombie (killed, waiting for its reaper).
bool gone_or_zombie(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string stat((std::istreambuf_iterator<char>(f)), {});
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

std::vector<RewardInput> inputs(int n) {
  std::vector<RewardInput> v;
  for (int i = 0; i < n; ++i) v.push_back(input(fmt::format("c{}", i), {{"answer", "a"}}, i / 2, i % 2));
  return v;
}

}  // namespace

// --- exact ---------------------------------------------------------------------

TEST_CASE("rl/rewards exact compares the trimmed completion with answer, solution or response") {
  auto fn = make_reward("exact");
  CHECK(score1(*fn, "  72\n", {{"answer", "72"}}) == 1.0);
  CHECK(score1(*fn, "72", {{"answer", " 72 "}}) == 1.0);
  CHECK(score1(*fn, "72.", {{"answer", "72"}}) == 0.0);
  CHECK(score1(*fn, "paris", {{"answer", "Paris"}}) == 0.0);  // case-sensitive
  CHECK(score1(*fn, "72", {{"answer", 72}}) == 1.0);         // a number compares as its JSON text
  CHECK(score1(*fn, "yes", {{"solution", "yes"}}) == 1.0);
  CHECK(score1(*fn, "yes", {{"response", "yes"}}) == 1.0);
  CHECK(score1(*fn, "a", {{"answer", "a"}, {"solution", "b"}}) == 1.0);  // answer comes first
  CHECK(score1(*fn, "", {{"answer", ""}}) == 1.0);
  const auto err = error_of([&] { fn->score({input("x", {{"question", "q"}}, 4)}); });
  CHECK(err == "--reward exact: the row of prompt 4 has no string or number field \"answer\", \"solution\", \"response\"");
}

// --- regex ---------------------------------------------------------------------

TEST_CASE("rl/rewards DAPO's overlong penalty: 0 until the buffer, then linear to -factor at --max-new-tokens") {
  // max_new_tokens 20, buffer 8: free up to 12 tokens, -0.5 * (n - 12) / 8 after.
  auto fn = with_overlong_penalty(make_reward("exact"), 20, 8, 0.5);
  std::vector<RewardInput> in;
  for (int64_t n : {1, 12, 13, 16, 20}) {
    in.push_back(input("4", json{{"answer", "4"}}));
    in.back().completion_tokens = n;
  }
  in.push_back(input("5", json{{"answer", "4"}}));  // wrong and at the limit: 0 - 0.5
  in.back().completion_tokens = 20;
  const std::vector<double> got = fn->score(in);
  const std::vector<double> want = {1.0, 1.0, 1.0 - 0.5 / 8, 1.0 - 0.5 * 4 / 8, 0.5, -0.5};
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-15));
  CHECK(error_of([] { with_overlong_penalty(make_reward("exact"), 20, 20, 1.0); }).find("--overlong-buffer-len") !=
        std::string::npos);
  CHECK(error_of([] { with_overlong_penalty(make_reward("exact"), 20, 0, 1.0); }).find("--overlong-buffer-len") !=
        std::string::npos);
  CHECK(error_of([] { with_overlong_penalty(make_reward("exact"), 20, 4, -1.0); }).find("--overlong-penalty-factor") !=
        std::string::npos);
}

TEST_CASE("rl/rewards regex finds the pattern anywhere in the completion") {
  auto fn = make_reward("regex:\\d+ apples");
  CHECK(score1(*fn, "so she has 12 apples left", {}) == 1.0);
  CHECK(score1(*fn, "so she has twelve apples", {}) == 0.0);
  auto anchored = make_reward("regex:(?i)^answer: \\w+$");
  CHECK(score1(*anchored, "ANSWER: yes", {}) == 1.0);
  CHECK(score1(*anchored, "the answer: yes", {}) == 0.0);
  // Invalid UTF-8 in a completion is no error; the valid part still matches.
  auto abc = make_reward("regex:abc");
  CHECK(score1(*abc, "\xff\xfe abc", {}) == 1.0);
  CHECK(score1(*abc, "\xff\xfe ab", {}) == 0.0);
  auto unicode = make_reward("regex:caf\xc3\xa9.");  // "café" then one character
  CHECK(score1(*unicode, "un caf\xc3\xa9\xc3\xa9", {}) == 1.0);
}

TEST_CASE("rl/rewards regex: a bad pattern names the flag and the offset") {
  const auto err = error_of([] { make_reward("regex:ab(c"); });
  CHECK(err.find("--reward regex:ab(c: the pattern does not compile at offset 4") == 0);
  CHECK(err.find("missing closing parenthesis") != std::string::npos);
  CHECK(error_of([] { make_reward("regexp:x"); }) ==
        "--reward regexp:x: unknown reward (exact, math, regex:PATTERN; or --reward-cmd CMD)");
}

TEST_CASE("rl/rewards regex: catastrophic backtracking stops at the match limit, quickly") {
  auto fn = make_reward("regex:(a|aa)+$");
  const std::string hostile = std::string(60, 'a') + "!";
  const auto t0 = std::chrono::steady_clock::now();
  const auto err = error_of([&] { fn->score({input(hostile, {}, 2, 3)}); });
  CHECK(seconds_since(t0) < 5.0);
  CHECK(err.find("--reward regex:(a|aa)+$: matching the completion of prompt 2 sample 3 failed: match limit exceeded") ==
        0);
  CHECK(err.find("backtracks catastrophically") != std::string::npos);
  // The same pattern on an ordinary completion still works after the error.
  CHECK(score1(*fn, "aaaa", {}) == 1.0);
}

// --- math ----------------------------------------------------------------------

TEST_CASE("rl/rewards math extracts \\boxed{}, then ####, then the last number") {
  CHECK(extract_math_answer("so x = \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}");
  CHECK(extract_math_answer("\\boxed{1} no, \\boxed{2}") == "2");
  CHECK(extract_math_answer("\\boxed{7} and then\n#### 8") == "7");  // \boxed wins over ####
  CHECK(extract_math_answer("48/2 = 24 clips\n#### 72\nthanks 5") == "72");
  CHECK(extract_math_answer("she pays $1,000.50 in 3 days") == "3");
  CHECK(extract_math_answer("in total 1,000 apples.") == "1,000");
  CHECK(extract_math_answer("x=-3") == "-3");
  CHECK(extract_math_answer("5-3") == "3");        // a minus after a digit is no sign
  CHECK(extract_math_answer("a ratio of 3/4") == "3/4");
  CHECK(extract_math_answer("1,23") == "23");      // "1,23" is no grouped number
  CHECK(extract_math_answer("\\boxed{12") == "12");  // unbalanced: not a box, the last number
  CHECK(extract_math_answer("I do not know.") == std::nullopt);
  CHECK(extract_math_answer("") == std::nullopt);
  // No recursion on client data: deep braces are a loop.
  const std::string deep = "\\boxed{" + std::string(200000, '{') + "9";
  CHECK(extract_math_answer(deep) == "9");
  // The reference: \boxed or #### when present, else the whole field.
  CHECK(extract_reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72") == "72");
  CHECK(extract_reference_answer("so the answer is $\\boxed{\\frac{\\pi}{2}}$.") == "\\frac{\\pi}{2}");
  CHECK(extract_reference_answer("x^2+1") == "x^2+1");
}

TEST_CASE("rl/rewards math numbers: commas, $, %, trailing dot, fractions, signs") {
  CHECK(parse_math_number("1000") == 1000.0);
  CHECK(parse_math_number("1,000") == 1000.0);
  CHECK(parse_math_number("1,000,000.5") == 1000000.5);
  CHECK(parse_math_number("-0.25") == -0.25);
  CHECK(parse_math_number(".5") == 0.5);
  CHECK(parse_math_number("+3") == 3.0);
  CHECK(parse_math_number("3/4") == 0.75);
  CHECK(parse_math_number("-\\frac{1}{2}") == -0.5);
  CHECK(parse_math_number("1,2") == std::nullopt);
  CHECK(parse_math_number("1000,000") == std::nullopt);
  CHECK(parse_math_number("1/0") == std::nullopt);
  CHECK(parse_math_number("1e3") == std::nullopt);
  CHECK(parse_math_number("\\frac{x}{2}") == std::nullopt);
  CHECK(parse_math_number("") == std::nullopt);
  CHECK(parse_math_number("-") == std::nullopt);
  CHECK(normalize_math_answer(" \\$1,000.00. ") == "1,000.00");
  CHECK(normalize_math_answer("50\\%") == "50");
  CHECK(normalize_math_answer("\\left( 1, 2 \\right)") == "(1,2)");
  CHECK(normalize_math_answer("\\dfrac{1}{2}") == "\\frac{1}{2}");
  CHECK(normalize_math_answer("\xe2\x88\x92" "4") == "-4");
}

TEST_CASE("rl/rewards math scores GSM8K and MATH style answers") {
  const std::string gsm = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72";
  CHECK(math("She sold 48 + 24 = 72 clips.\n#### 72", gsm) == 1.0);
  CHECK(math("She sold 48 + 24 = 72 clips in total.", gsm) == 1.0);  // the last number
  CHECK(math("She sold 72 clips, or 70 in round figures.", gsm) == 0.0);
  CHECK(math("#### 71", gsm) == 0.0);
  CHECK(math("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0);  // decided: numerically equal
  CHECK(math("so the answer is \\boxed{\\dfrac{1}{2}}", "1/2") == 1.0);
  CHECK(math("so the answer is \\boxed{\\frac{1}{3}}", "0.333") == 0.0);  // 1e-6 relative
  CHECK(math("It costs $1,000.", "1000") == 1.0);
  CHECK(math("#### 1,000", "#### 1000") == 1.0);
  CHECK(math("the growth is 50\\%", "50") == 1.0);
  CHECK(math("x = -3", "-3") == 1.0);
  CHECK(math("x = 3", "-3") == 0.0);
  CHECK(math("x = -3", "3") == 0.0);
  CHECK(math("3.50", "3.5") == 1.0);
  CHECK(math("I do not know.", "72") == 0.0);  // no answer
  CHECK(math("", "0") == 0.0);
  CHECK(math("\\boxed{x^2 + 1}", "x^2+1") == 1.0);  // strings: blanks removed
  CHECK(math("\\boxed{x^2 + 2}", "x^2+1") == 0.0);
  CHECK(math("\\boxed{\\frac{\\pi}{2}}", "The answer is $\\boxed{\\frac{\\pi}{2}}$") == 1.0);
  CHECK(math("\\boxed{}", "") == 0.0);  // empty answers never match
  CHECK(math("the answer is 72", 72) == 1.0);  // a number field
  auto fn = make_reward("math");
  CHECK(score1(*fn, "#### 4", {{"solution", "2+2 = 4\n#### 4"}}) == 1.0);
  CHECK(error_of([&] { fn->score({input("4", {{"response", "4"}}, 1)}); }) ==
        "--reward math: the row of prompt 1 has no string or number field \"answer\", \"solution\"");
}

// --- --reward-cmd ----------------------------------------------------------------

TEST_CASE("rl/rewards the record is one JSON line with the row, prompt, completion, counts and indices") {
  RewardInput in = input("caf\xc3\xa9 \xff!", {{"answer", "72"}, {"id", 9}, {"tags", {"a", "b"}}}, 3, 1);
  in.completion_tokens = 11;
  const std::string line = reward_record(in);
  CHECK(line.find('\n') == std::string::npos);
  const json j = json::parse(line);
  CHECK(j == json({{"row", {{"answer", "72"}, {"id", 9}, {"tags", {"a", "b"}}}},
                   {"prompt", json::array({{{"role", "user"}, {"content", "question?"}}})},
                   {"completion", "caf\xc3\xa9 \xef\xbf\xbd!"},  // invalid UTF-8 -> U+FFFD
                   {"completion_tokens", 11},
                   {"sample_index", 1},
                   {"prompt_index", 3}}));
}

TEST_CASE("rl/rewards --reward-cmd: a good program scores every record end to end") {
  RewardProcess p(script("contains_answer.sh"), {.timeout_s = 10});
  const std::vector<RewardInput> batch = {input("so 72 clips", {{"answer", "72"}}, 0, 0),
                                          input("so 71 clips", {{"answer", "72"}}, 0, 1),
                                          input("it is Paris.", {{"answer", "Paris"}}, 1, 0),
                                          input("it is paris.", {{"answer", "Paris"}}, 1, 1)};
  CHECK(p.score(batch) == std::vector<double>{1, 0, 1, 0});
  CHECK(p.score({batch[2], batch[1]}) == std::vector<double>{1, 0});  // the same program, started once
  CHECK(p.starts() == 1);
  CHECK(p.score({}).empty());
}

TEST_CASE("rl/rewards --reward-cmd: the program receives exactly the records, in order") {
  TempDir dir;
  const std::string log = dir.str("records.jsonl");
  std::vector<RewardInput> batch = {input("first", {{"answer", "1"}, {"n", 1}}, 0, 0),
                                    input("second \"quoted\"\nline", {{"answer", "2"}}, 0, 1),
                                    input("third", {{"solution", "#### 3"}}, 1, 0)};
  batch[0].completion_tokens = 5, batch[1].completion_tokens = 17, batch[2].completion_tokens = 0;
  {
    RewardProcess p(script("record_to_file.sh " + log), {.timeout_s = 10});
    CHECK(p.score(batch) == std::vector<double>{5.25, 17.25, 0.25});
  }
  std::ifstream f(log);
  std::vector<json> got;
  for (std::string line; std::getline(f, line);) got.push_back(json::parse(line));
  REQUIRE(got.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(got[i] == json::parse(reward_record(batch[i])));
  CHECK(got[1]["completion"] == "second \"quoted\"\nline");
  CHECK(got[1]["sample_index"] == 1);
  CHECK(got[2]["prompt_index"] == 1);
  CHECK(got[2]["row"]["solution"] == "#### 3");
}

TEST_CASE("rl/rewards --reward-cmd: a crashing program is a clear error and restarts on the next call") {
  RewardProcess p(script("crash_after.sh 2"), {.timeout_s = 10});
  const auto err = error_of([&] { p.score(inputs(3)); });
  CHECK(err ==
        "reward program (--reward-cmd \"sh tests/rl/scripts/crash_after.sh 2\") exited with status 3 after 2 records "
        "(no answer to record 2 (prompt 1, sample 0)); it was stopped and the next call restarts it");
  CHECK(!p.running());
  CHECK(p.score(inputs(2)) == std::vector<double>{0.5, 0.5});
  CHECK(p.starts() == 2);
  // It dies between calls too: the first record of the next call sees it.
  CHECK(error_of([&] { p.score(inputs(1)); }).find("exited with status 3 after 2 records") != std::string::npos);
  CHECK(p.score(inputs(1)) == std::vector<double>{0.5});
  CHECK(p.starts() == 3);
}

TEST_CASE("rl/rewards --reward-cmd: a missing command names status 127") {
  RewardProcess p("areno-no-such-reward-program-xyz", {.timeout_s = 10});
  const auto err = error_of([&] { p.score(inputs(1)); });
  CHECK(err.find("exited with status 127 (127: the shell did not find the command) after 0 records") !=
        std::string::npos);
}

TEST_CASE("rl/rewards --reward-cmd: a program that exits without reading does not kill us with SIGPIPE") {
  RewardProcess p("exit 5", {.timeout_s = 10});
  // Larger than a pipe's buffer, so the write itself meets the closed pipe.
  RewardInput big = input(std::string(1 << 20, 'x'), {{"answer", "x"}});
  const auto err = error_of([&] { p.score({big}); });
  CHECK(err.find("reward program (--reward-cmd \"exit 5\") exited with status 5 after 0 records") == 0);
  // No SIGPIPE left pending for this thread either.
  sigset_t pending;
  sigpending(&pending);
  CHECK(sigismember(&pending, SIGPIPE) == 0);
}

TEST_CASE("rl/rewards --reward-cmd: a timeout kills the program and its children") {
  TempDir dir;
  const std::string pidfile = dir.str("sleep.pid");
  RewardProcess p(script("sleep_after.sh 1 " + pidfile), {.timeout_s = 0.5});
  const auto t0 = std::chrono::steady_clock::now();
  const auto err = error_of([&] { p.score(inputs(2)); });
  const double took = seconds_since(t0);
  CHECK(err == "reward program (--reward-cmd \"sh tests/rl/scripts/sleep_after.sh 1 " + pidfile +
                   "\") gave no answer to record 1 (prompt 0, sample 1) within 0.5 s (the timeout); it was stopped and "
                   "the next call restarts it");
  CHECK(took >= 0.45);
  CHECK(took < 5.0);
  CHECK(!p.running());
  pid_t sleeper = 0;
  std::ifstream(pidfile) >> sleeper;
  REQUIRE(sleeper > 0);
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {  // the orphan is reaped by init: allow it 2 s
    gone = gone_or_zombie(sleeper);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(gone);
  CHECK(p.score(inputs(1)) == std::vector<double>{1});  // restarted
}

TEST_CASE("rl/rewards --reward-cmd: garbage, NaN, inf, empty and overlong answers are errors naming the line") {
  struct Case {
    std::string line, message;
  };
  const std::vector<Case> cases = {
      {"hello", "answered \"hello\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"nan", "answered \"nan\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"-inf", "answered \"-inf\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"1e999", "answered \"1e999\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"1 2", "answered \"1 2\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"", "answered \"\" to record 0 (prompt 0, sample 0): not a finite number"},
      {"0x10", "answered \"0x10\" to record 0 (prompt 0, sample 0): not a finite number"},
      {std::string(5000, '7'), "wrote a line longer than 4096 bytes for record 0 (prompt 0, sample 0)"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.line.substr(0, 20));
    RewardProcess p(script("print_line.sh '" + c.line + "'"), {.timeout_s = 10});
    const auto err = error_of([&] { p.score(inputs(1)); });
    CHECK(err == "reward program (--reward-cmd \"sh tests/rl/scripts/print_line.sh '" + c.line + "'\") " + c.message +
                     "; it was stopped and the next call restarts it");
  }
  // Blanks around a number and a leading + are fine.
  RewardProcess ok(script("print_line.sh ' +0.75 '"), {.timeout_s = 10});
  CHECK(ok.score(inputs(2)) == std::vector<double>{0.75, 0.75});
  RewardProcess neg(script("print_line.sh -2e-1"), {.timeout_s = 10});
  CHECK(neg.score(inputs(1)) == std::vector<double>{-0.2});
}

TEST_CASE("rl/rewards --reward-cmd: two lines for one record is an error") {
  RewardProcess p(script("two_lines.sh"), {.timeout_s = 10});
  const auto err = error_of([&] { p.score(inputs(2)); });
  CHECK(err ==
        "reward program (--reward-cmd \"sh tests/rl/scripts/two_lines.sh\") wrote more than one line for record 0 "
        "(prompt 0, sample 0) (\"1\", then \"2\\x0a\"); it was stopped and the next call restarts it");
}

TEST_CASE("rl/rewards --reward-cmd: a program that closes its stdout but runs on is stopped") {
  // `exec`: otherwise the outer /bin/sh -c keeps the pipe open while it waits.
  RewardProcess p("exec " + script("close_stdout.sh"), {.timeout_s = 10, .exit_grace_s = 0.2});
  const auto t0 = std::chrono::steady_clock::now();
  const auto err = error_of([&] { p.score(inputs(1)); });
  CHECK(seconds_since(t0) < 5.0);
  CHECK(err ==
        "reward program (--reward-cmd \"exec sh tests/rl/scripts/close_stdout.sh\") closed its stdout but did not exit "
        "after 0 records (no answer to record 0 (prompt 0, sample 0)); it was stopped and the next call restarts it");
  CHECK(!p.running());
}

TEST_CASE("rl/rewards --reward-cmd: the destructor ends a program that ignores the end of its input") {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  {
    RewardProcess p("trap '' TERM; while :; do sleep 1; done", {.timeout_s = 10, .exit_grace_s = 0.2});
    CHECK(p.running());
  }
  CHECK(seconds_since(t0) < 5.0);
  const auto t1 = std::chrono::steady_clock::now();
  {
    RewardProcess p(script("contains_answer.sh"), {.timeout_s = 10, .exit_grace_s = 5});
    CHECK(p.score(inputs(1)) == std::vector<double>{0});
  }
  CHECK(seconds_since(t1) < 4.0);  // it exits at the end of its input, long before the grace
}
