#include "serve/grammar.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

namespace areno::serve {

TokenBytes::TokenBytes(const tok::Tokenizer& tokenizer, int64_t vocab_size) {
  offsets_.reserve(size_t(vocab_size) + 1);
  special_.assign(size_t(vocab_size), 0);
  string_safe_.assign(size_t(vocab_size), 0);
  std::fill(std::begin(byte_token_), std::end(byte_token_), int64_t(-1));
  const int64_t known = std::min<int64_t>(vocab_size, int64_t(tokenizer.padded_vocab_size()));
  offsets_.push_back(0);
  for (int64_t id = 0; id < vocab_size; ++id) {
    if (id < known) {
      const tok::TokenId t = tok::TokenId(id);
      const std::string b = tokenizer.decode_bytes(std::span<const tok::TokenId>(&t, 1));
      special_[size_t(id)] = tokenizer.added_token(t) != nullptr;
      if (!special_[size_t(id)] && b.size() == 1 && byte_token_[uint8_t(b[0])] < 0) byte_token_[uint8_t(b[0])] = id;
      string_safe_[size_t(id)] = !special_[size_t(id)] && !b.empty() &&
                                 std::all_of(b.begin(), b.end(), [](char c) {
                                   return uint8_t(c) >= 0x20 && c != '"' && c != '\\';
                                 });
      data_ += b;
    }
    offsets_.push_back(int64_t(data_.size()));
  }
}

// The replayed position in the chain. JSON: `mode` says what may come next,
// `stack` the open containers; `pos` and `sub` are the current segment's
// position (literal, choice, a JSON literal word) and sub-state (number
// state, the word, hex digits left).
struct OutputGrammar::State {
  uint16_t seg = 0;
  uint16_t pos = 0;
  uint64_t names = 0;
  uint8_t mode = 0;
  uint8_t sub = 0;
  uint8_t depth = 0;
  bool key = false;
  uint8_t stack[kMaxDepth] = {};
};

namespace {

enum Mode : uint8_t { kTop, kObjOpen, kObjKey, kColon, kValue, kArrOpen, kAfter, kStr, kEsc, kUni, kNum, kLit };
enum Num : uint8_t { kSign, kZero, kInt, kFracStart, kFrac, kExpStart, kExpSign, kExp };
enum Container : uint8_t { kObject = 1, kArray = 2 };
constexpr std::string_view kWords[] = {"true", "false", "null"};

bool is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool num_endable(uint8_t sub) { return sub == kZero || sub == kInt || sub == kFrac || sub == kExp; }

uint64_t all_names(size_t n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; }

}  // namespace

namespace {

void enter(const std::vector<OutputGrammar::Segment>& segs, OutputGrammar::State& st, size_t seg) {
  st = OutputGrammar::State{};
  st.seg = uint16_t(seg);
  if (seg < segs.size() && segs[seg].kind == OutputGrammar::Segment::choice) st.names = all_names(segs[seg].names.size());
}

}  // namespace

OutputGrammar::OutputGrammar(std::shared_ptr<const TokenBytes> bytes, std::vector<Segment> segments)
    : bytes_(std::move(bytes)), segments_(std::move(segments)) {
  // Every character a completion may emit must be one token.
  auto check = [&](std::string_view s, const char* what) {
    for (unsigned char c : s)
      if (bytes_->byte_token(c) < 0)
        throw std::invalid_argument(fmt::format("{} holds the byte 0x{:02x}, which is no single token", what, c));
  };
  check("{}[]\":0truefalsn", "the JSON grammar");
  size_t longest = 0;
  for (const Segment& s : segments_) {
    check(s.text, "the grammar");
    longest = std::max(longest, s.text.size());
    for (const std::string& n : s.names) {
      check(n, "a tool name");
      longest = std::max(longest, n.size());
    }
    if (s.kind == Segment::special && (s.id < 0 || s.id >= bytes_->size() || !bytes_->special(s.id)))
      throw std::logic_error(fmt::format("grammar: id {} is not a special token", s.id));
  }
  // The completion of each segment from its start, summed from the back.
  tail_.assign(segments_.size() + 1, 0);
  for (size_t k = segments_.size(); k-- > 0;) {
    State st;
    enter(segments_, st, k);
    tail_[k] = tail_[k + 1] + current_length(st);
  }
  // No state's completion is longer: the whole chain's, plus a string's
  // escape and key (":0 and 5 more), every container's closer, a literal word.
  max_completion_ = tail_[0] + int64_t(longest) + kMaxDepth + 16;
}

std::shared_ptr<const OutputGrammar> OutputGrammar::tool_call(std::shared_ptr<const TokenBytes> bytes,
                                                              const std::vector<std::string>& names) {
  if (names.empty() || names.size() > kMaxNames)
    throw std::invalid_argument(fmt::format("a forced tool call chooses among 1 to {} tools (got {})", kMaxNames,
                                            names.size()));
  Segment choice{Segment::choice, -1, "", {}};
  for (const std::string& n : names) {
    if (n.empty() || n.size() > kMaxNameBytes)
      throw std::invalid_argument(fmt::format("a forced tool's name must have 1 to {} bytes (got {})", kMaxNameBytes,
                                              n.size()));
    const std::string quoted = nlohmann::json(n).dump();  // escaped, with its quotes
    choice.names.push_back(quoted.substr(1, quoted.size() - 2));
  }
  std::vector<Segment> segs = {{Segment::special, phi4mm::kToolCall, "", {}},
                               {Segment::literal, -1, "[{\"name\": \"", {}},
                               std::move(choice),
                               {Segment::literal, -1, "\", \"arguments\": ", {}},
                               {Segment::json, -1, "", {}},
                               {Segment::literal, -1, "}]", {}},
                               {Segment::special, phi4mm::kToolCallEnd, "", {}},
                               {Segment::special, phi4mm::kEnd, "", {}}};
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

std::shared_ptr<const OutputGrammar> OutputGrammar::json_object(std::shared_ptr<const TokenBytes> bytes) {
  std::vector<Segment> segs = {{Segment::json, -1, "", {}}, {Segment::special, phi4mm::kEnd, "", {}}};
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

bool OutputGrammar::step_byte(State& st, unsigned char c) const {
  if (st.seg >= segments_.size()) return false;
  const Segment& seg = segments_[st.seg];
  switch (seg.kind) {
    case Segment::special: return false;
    case Segment::literal:
      if (c != uint8_t(seg.text[st.pos])) return false;
      if (++st.pos == seg.text.size()) enter(segments_, st, st.seg + 1u);
      return true;
    case Segment::choice: {
      uint64_t ext = 0;
      bool complete = false;
      for (size_t i = 0; i < seg.names.size(); ++i) {
        if (!(st.names >> i & 1)) continue;
        const std::string& n = seg.names[i];
        if (n.size() > st.pos && uint8_t(n[st.pos]) == c) ext |= uint64_t(1) << i;
        if (n.size() == st.pos) complete = true;
      }
      if (ext) {
        st.names = ext;
        ++st.pos;
        return true;
      }
      if (!complete) return false;
      enter(segments_, st, st.seg + 1u);
      return step_byte(st, c);  // at most once: the next segment is a literal
    }
    case Segment::json: break;
  }
  auto push = [&](Container k, Mode m) {
    if (st.depth == kMaxDepth) return false;
    st.stack[st.depth++] = k;
    st.mode = m;
    return true;
  };
  auto pop = [&] {
    if (--st.depth == 0) enter(segments_, st, st.seg + 1u);
    else st.mode = kAfter;
    return true;
  };
  auto start_value = [&]() -> bool {
    switch (c) {
      case '"': st.mode = kStr, st.key = false; return true;
      case '{': return push(kObject, kObjOpen);
      case '[': return push(kArray, kArrOpen);
      case '-': st.mode = kNum, st.sub = kSign; return true;
      case '0': st.mode = kNum, st.sub = kZero; return true;
      case 't': st.mode = kLit, st.sub = 0, st.pos = 1; return true;
      case 'f': st.mode = kLit, st.sub = 1, st.pos = 1; return true;
      case 'n': st.mode = kLit, st.sub = 2, st.pos = 1; return true;
      default:
        if (c >= '1' && c <= '9') {
          st.mode = kNum, st.sub = kInt;
          return true;
        }
        return false;
    }
  };
  switch (st.mode) {
    case kTop: return c == '{' && push(kObject, kObjOpen);
    case kObjOpen:
      if (is_ws(c)) return true;
      if (c == '}') return pop();
      [[fallthrough]];
    case kObjKey:
      if (is_ws(c)) return true;
      if (c != '"') return false;
      st.mode = kStr, st.key = true;
      return true;
    case kColon:
      if (is_ws(c)) return true;
      if (c != ':') return false;
      st.mode = kValue;
      return true;
    case kArrOpen:
      if (c == ']') return pop();
      [[fallthrough]];
    case kValue: return is_ws(c) || start_value();
    case kAfter: {
      if (is_ws(c)) return true;
      const uint8_t top = st.stack[st.depth - 1];
      if (c == ',') {
        st.mode = top == kObject ? kObjKey : kValue;
        return true;
      }
      if ((c == '}' && top == kObject) || (c == ']' && top == kArray)) return pop();
      return false;
    }
    case kStr:
      if (c == '"') {
        st.mode = st.key ? kColon : kAfter;
        st.key = false;
        return true;
      }
      if (c == '\\') {
        st.mode = kEsc;
        return true;
      }
      return c >= 0x20;
    case kEsc:
      if (c == 'u') {
        st.mode = kUni, st.sub = 4;
        return true;
      }
      if (std::string_view("\"\\/bfnrt").find(char(c)) == std::string_view::npos) return false;
      st.mode = kStr;
      return true;
    case kUni:
      if (!std::isxdigit(c)) return false;
      if (--st.sub == 0) st.mode = kStr;
      return true;
    case kNum: {
      const bool digit = is_digit(c), e = c == 'e' || c == 'E';
      switch (st.sub) {
        case kSign:
          if (!digit) return false;
          st.sub = c == '0' ? kZero : kInt;
          return true;
        case kZero:
        case kInt:
        case kFrac:
          if (digit && st.sub != kZero) return true;
          if (c == '.' && st.sub != kFrac) return st.sub = kFracStart, true;
          if (e) return st.sub = kExpStart, true;
          break;
        case kFracStart:
          if (!digit) return false;
          st.sub = kFrac;
          return true;
        case kExpStart:
          if (c == '+' || c == '-') return st.sub = kExpSign, true;
          [[fallthrough]];
        case kExpSign:
          if (!digit) return false;
          st.sub = kExp;
          return true;
        case kExp:
          if (digit) return true;
          break;
      }
      if (!num_endable(st.sub)) return false;
      st.mode = kAfter;  // the number ended: c belongs to its container
      return step_byte(st, c);
    }
    case kLit: {
      const std::string_view w = kWords[st.sub];
      if (c != uint8_t(w[st.pos])) return false;
      if (++st.pos == w.size()) st.mode = kAfter, st.pos = 0;
      return true;
    }
  }
  return false;
}

bool OutputGrammar::step_token(State& st, int64_t id) const {
  if (id < 0 || id >= bytes_->size()) return false;
  if (bytes_->special(id)) {
    if (st.seg >= segments_.size() || segments_[st.seg].kind != Segment::special || segments_[st.seg].id != id)
      return false;
    enter(segments_, st, st.seg + 1u);
    return true;
  }
  const std::string_view b = bytes_->bytes(id);
  if (b.empty()) return false;
  for (unsigned char c : b)
    if (!step_byte(st, c)) return false;
  return true;
}

bool OutputGrammar::replay(std::span<const int64_t> generated, State& st) const {
  enter(segments_, st, 0);
  for (int64_t id : generated)
    if (!step_token(st, id)) return false;
  return true;
}

// Calls emit(id) for each token of the shortest completion of `st`.
template <typename F>
void OutputGrammar::for_completion(const State& st, F&& emit) const {
  auto text = [&](std::string_view s) {
    for (unsigned char c : s) emit(bytes_->byte_token(c));
  };
  auto shortest = [&](const Segment& s, uint64_t candidates, size_t pos) {
    const std::string* best = nullptr;
    for (size_t i = 0; i < s.names.size(); ++i)
      if ((candidates >> i & 1) && s.names[i].size() >= pos && (!best || s.names[i].size() < best->size()))
        best = &s.names[i];
    if (best) text(std::string_view(*best).substr(pos));
  };
  for (size_t k = st.seg; k < segments_.size(); ++k) {
    const Segment& s = segments_[k];
    const bool here = k == st.seg;
    switch (s.kind) {
      case Segment::special: emit(s.id); break;
      case Segment::literal: text(std::string_view(s.text).substr(here ? st.pos : 0)); break;
      case Segment::choice: shortest(s, here ? st.names : all_names(s.names.size()), here ? st.pos : 0); break;
      case Segment::json:
        if (!here || st.mode == kTop) {
          text("{}");
          break;
        }
        switch (st.mode) {
          case kObjKey: text("\"\":0"); break;
          case kColon: text(":0"); break;
          case kValue: text("0"); break;
          case kStr: text(st.key ? "\":0" : "\""); break;
          case kEsc: text(st.key ? "n\":0" : "n\""); break;
          case kUni:
            for (int i = 0; i < st.sub; ++i) text("0");
            text(st.key ? "\":0" : "\"");
            break;
          case kNum:
            if (!num_endable(st.sub)) text("0");
            break;
          case kLit: text(kWords[st.sub].substr(st.pos)); break;
          default: break;  // kObjOpen, kArrOpen, kAfter: only the closers
        }
        for (int d = st.depth - 1; d >= 0; --d) text(st.stack[d] == kObject ? "}" : "]");
        break;
    }
  }
}

// The current segment's part of the shortest completion, counted (the
// tokens for_completion would emit for it) in O(names + depth), whatever the
// lengths of the literals and names: the mask asks it for every candidate.
int64_t OutputGrammar::current_length(const State& st) const {
  if (st.seg >= segments_.size()) return 0;
  const Segment& s = segments_[st.seg];
  switch (s.kind) {
    case Segment::special: return 1;
    case Segment::literal: return int64_t(s.text.size()) - st.pos;
    case Segment::choice: {
      int64_t best = std::numeric_limits<int64_t>::max();
      for (size_t i = 0; i < s.names.size(); ++i)
        if (st.names >> i & 1) best = std::min(best, int64_t(s.names[i].size()) - st.pos);
      return best;
    }
    case Segment::json: break;
  }
  int64_t n = 0;
  switch (st.mode) {
    case kTop: return 2;
    case kObjKey: n = 4; break;
    case kColon: n = 2; break;
    case kValue: n = 1; break;
    case kStr: n = st.key ? 3 : 1; break;
    case kEsc: n = st.key ? 4 : 2; break;
    case kUni: n = st.sub + (st.key ? 3 : 1); break;
    case kNum: n = num_endable(st.sub) ? 0 : 1; break;
    case kLit: n = int64_t(kWords[st.sub].size()) - st.pos; break;
    default: break;  // kObjOpen, kArrOpen, kAfter: only the closers
  }
  return n + st.depth;
}

int64_t OutputGrammar::completion_length(const State& st) const {
  if (st.seg >= segments_.size()) return 0;
  return current_length(st) + tail_[st.seg + 1u];
}

bool OutputGrammar::accepts(std::span<const int64_t> generated) const {
  State st;
  return replay(generated, st);
}

std::vector<int64_t> OutputGrammar::completion(std::span<const int64_t> generated) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  std::vector<int64_t> out;
  for_completion(st, [&](int64_t id) { out.push_back(id); });
  return out;
}

void OutputGrammar::mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  if (st.seg >= segments_.size()) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t budget = remaining - 1;  // tokens after this one
  const int64_t n = std::min(V, bytes_->size());
  // Far from max_tokens no state's completion can fail to fit.
  const bool check_length = budget < max_completion_;
  // Inside a JSON string a token of plain text keeps the state (and its
  // completion): allowed when the state's own completion fits.
  const bool in_string = segments_[st.seg].kind == Segment::json && st.mode == kStr;
  const bool string_fits = in_string && completion_length(st) <= budget;
  // The bytes the state accepts first: a token starting with another is out.
  bool first_ok[256];
  for (int c = 0; c < 256; ++c) {
    State s = st;
    first_ok[c] = step_byte(s, uint8_t(c));
  }
  bool any = false;
  for (int64_t id = 0; id < n; ++id) {
    if (work[id] == kNegInf) continue;
    if (!bytes_->special(id)) {
      const std::string_view b = bytes_->bytes(id);
      if (b.empty() || !first_ok[uint8_t(b[0])]) {
        work[id] = kNegInf;
        continue;
      }
    }
    if (in_string && bytes_->string_safe(id)) {
      if (string_fits) any = true;
      else work[id] = kNegInf;
      continue;
    }
    State s = st;
    if (std::isnan(work[id]) || !step_token(s, id) || (check_length && completion_length(s) > budget)) work[id] = kNegInf;
    else any = true;
  }
  std::fill(work + n, work + V, kNegInf);
  if (any) return;
  int64_t first = -1;
  for_completion(st, [&](int64_t id) {
    if (first < 0) first = id;
  });
  std::fill(work, work + V, kNegInf);
  work[first] = 0.0f;
}

}  // namespace areno::serve
