#pragma once
// Context-free grammars for constrained decoding (vLLM's `guided_grammar`
// and `structured_outputs.grammar`): a grammar in GBNF, the EBNF dialect of
// llama.cpp's grammars and xgrammar, which vLLM passes on, compiled into
// rules that a set of parse stacks walks byte by byte (as llama.cpp's
// grammar sampler walks them), so the output is one sentence of the `root`
// rule followed by <|end|>.
//
// Syntax:
//   name ::= alternatives        a rule (names: letters, digits, '-', '_',
//                                '.'); `root` is the start. A rule ends
//                                where the next `name ::=` begins, so it may
//                                span lines.
//   a b | c                      sequence and alternation
//   "text"                       literal text (UTF-8; escapes \n \r \t \0 \\ \"
//                                \' \[ \] \- \/ \^ \xHH \uHHHH \UHHHHHHHH)
//   [a-z_] [^"\\]                a class of code points, ranges, negated
//   .                            any code point
//   ( ... )                      a group
//   X* X+ X? X{m} X{m,} X{m,n}   repetitions (m, n up to kMaxRepeat)
//   # comment                    to the end of the line
// Refused with a message naming the byte offset (std::invalid_argument):
// anything else (Lark's `:` rules, regex terminals `/.../`, `%import`), an
// undefined or twice-defined rule, no `root`, left recursion (a rule that
// can reach itself before reading a byte, `x*` of an `x` that can be
// empty among them), a rule reachable from root that can never finish.
//
// Bounds (each a clear error): the grammar's bytes, its rules and elements
// after repetitions are expanded, the shortest sentence of every rule
// together, root's shortest sentence (its bytes; and it must be readable
// within the stacks' bounds), more than kMaxStacks readings of the first
// character.
// While decoding, a state keeps at most kMaxStacks parse stacks of at most
// kMaxDepth frames (a deeper nesting is not written; of more stacks, the
// ones with the shortest completions are kept), and closing a step visits
// at most a fixed number of frames: the output stays in the language, and
// an ambiguous grammar cannot make a step cost more than a bounded amount of
// work. The parser and every walk over the rules use explicit work lists:
// nothing recurses on client data.
//
// As for the other constraints, the state is replayed from the generated
// tokens at each step, and an id is allowed only when the output after it
// can still be completed in the tokens left: a state's completion is the
// shortest sentence's rest of one of its stacks, spelled in the fewest
// tokens (the least over the stacks).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "serve/constraint.h"

namespace areno::serve {

class TokenBytes;

class Cfg final : public OutputConstraint {
 public:
  static constexpr size_t kMaxGrammarBytes = 65536;
  static constexpr size_t kMaxRules = 4096;          // named and from groups and repetitions
  static constexpr size_t kMaxElements = 65536;      // symbols of all alternatives, expanded
  static constexpr uint32_t kMaxRepeat = 1000;       // m and n of {m,n}
  static constexpr size_t kMaxShortestBytes = 1 << 20;  // every rule's shortest sentence, together
  static constexpr size_t kMaxRootBytes = 65536;         // root's shortest sentence
  static constexpr size_t kMaxStacks = 1024;
  static constexpr size_t kMaxDepth = 128;
  // Frames the closing of new states may visit in one mask: past it the
  // request fails ("the grammar needs more work for one token than ...")
  // rather than hold the engine (a crafted ambiguous grammar).
  static constexpr size_t kMaxMaskWork = size_t(1) << 22;

  // Throws std::invalid_argument (what is wrong, and at which byte).
  static std::shared_ptr<const Cfg> compile(std::shared_ptr<const TokenBytes> bytes, std::string_view grammar);
  ~Cfg() override;

  void mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const override;
  int64_t min_tokens() const override { return min_tokens_; }

  // Tests: whether the output is a prefix of the language (the end token
  // included); the tokens of the completion the mask counts after it; the
  // rules after compiling (named, groups, repetitions).
  bool accepts(std::span<const int64_t> generated) const;
  std::vector<int64_t> completion(std::span<const int64_t> generated) const;
  // Its length as the mask counts it (tests: equal to the above's size).
  int64_t completion_length(std::span<const int64_t> generated) const override;
  // Whether `text` is a whole sentence of root (tests).
  bool matches(std::string_view text) const;
  size_t rules() const { return rules_.size(); }

  struct State;  // the parse stacks after an output (serve/cfg.cpp)

 private:
  enum Kind : uint8_t { kEnd, kTerm, kRule };
  struct Elem {
    Kind kind;
    uint32_t id;  // kTerm: the class; kRule: the rule
  };
  struct Rule {
    std::string name;
    size_t origin = 0;           // byte offset where it is defined (or its group)
    std::vector<uint32_t> alts;  // first element of each alternative
    bool defined = false;
  };
  struct Class {
    std::vector<std::pair<uint32_t, uint32_t>> ranges;  // sorted, disjoint, inclusive
    uint32_t pick = 0;                                  // the code point a completion writes
    bool contains(uint32_t cp) const;
    // The least code point in [lo, hi], or kNoCp.
    uint32_t first_in(uint32_t lo, uint32_t hi) const;
  };
  class Parser;

  Cfg();
  void analyse();
  // The stacks that `s` (top not yet a terminal) stands for, added to `out`.
  void close(std::vector<uint32_t>& s, State& out, size_t& work_left) const;
  void start(State& st) const;
  // `spent` (when given) grows by the frames the step's closing visited.
  bool step_byte(const State& in, unsigned char c, State& out, size_t* spent = nullptr) const;
  void step_cp(const State& in, uint32_t cp, State& out, size_t* spent) const;
  void normalize(State& st) const;
  bool replay(std::span<const int64_t> generated, State& st) const;
  // Bytes of the shortest completion of stack k of `st` (end token not counted).
  int64_t stack_bytes(const State& st, size_t k) const;
  std::string stack_text(const State& st, size_t k) const;
  // The completion's tokens (end token included), the least over the
  // stacks; `best` gets the stack it comes from. kInf for a dead state.
  struct SpellCache;
  int64_t completion_tokens(const State& st, SpellCache* cache, size_t* best = nullptr) const;

  std::shared_ptr<const TokenBytes> bytes_;
  std::vector<Elem> elems_;
  std::vector<Rule> rules_;
  std::vector<Class> classes_;
  uint32_t root_ = 0;
  std::vector<int64_t> rest_;         // per element: bytes of the shortest rest of its alternative from it
  std::vector<int64_t> rule_bytes_;   // per rule: bytes of its shortest sentence
  std::vector<std::string> shortest_; // per rule: that sentence
  int64_t min_tokens_ = 0;
  // The states after the last few outputs replayed (one per sample of a
  // request): a step replays only the tokens after the longest of them that
  // its output starts with, not the whole output again.
  std::unique_ptr<ReplayCache<State>> replayed_;
  // The ids allowed after the last few states masked, with the budget from
  // which they all fit: a state met again (inside a free string, every step)
  // costs one pass over the ids.
  std::unique_ptr<MaskCache> masks_;
};

}  // namespace areno::serve
