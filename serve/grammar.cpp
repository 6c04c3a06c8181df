#include "serve/grammar.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

namespace areno::serve {

int utf8_lead(unsigned char c, unsigned char& lo, unsigned char& hi) {
  lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 0;
  if (c >= 0xC2 && c <= 0xDF) return 1;
  if (c >= 0xE0 && c <= 0xEF) {
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
    return 2;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
    return 3;
  }
  return -1;
}

namespace {

// Whole code points of well-formed UTF-8.
bool whole_utf8(std::string_view b) {
  for (size_t i = 0; i < b.size();) {
    unsigned char lo, hi;
    const int n = utf8_lead(uint8_t(b[i]), lo, hi);
    if (n < 0 || i + size_t(n) >= b.size() + (n == 0)) return false;
    for (int k = 1; k <= n; ++k) {
      const unsigned char c = uint8_t(b[i + size_t(k)]);
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return false;
    }
    i += size_t(n) + 1;
  }
  return true;
}

}  // namespace

TokenBytes::TokenBytes(const tok::Tokenizer& tokenizer, int64_t vocab_size) {
  offsets_.reserve(size_t(vocab_size) + 1);
  special_.assign(size_t(vocab_size), 0);
  string_safe_.assign(size_t(vocab_size), 0);
  code_points_.assign(size_t(vocab_size), 0);
  std::fill(std::begin(byte_token_), std::end(byte_token_), int64_t(-1));
  const int64_t known = std::min<int64_t>(vocab_size, int64_t(tokenizer.padded_vocab_size()));
  offsets_.push_back(0);
  for (int64_t id = 0; id < vocab_size; ++id) {
    if (id < known) {
      const tok::TokenId t = tok::TokenId(id);
      const std::string b = tokenizer.decode_bytes(std::span<const tok::TokenId>(&t, 1));
      special_[size_t(id)] = tokenizer.added_token(t) != nullptr;
      if (!special_[size_t(id)] && b.size() == 1 && byte_token_[uint8_t(b[0])] < 0) byte_token_[uint8_t(b[0])] = id;
      code_points_[size_t(id)] = uint16_t(std::min<size_t>(
          std::count_if(b.begin(), b.end(), [](char c) { return (uint8_t(c) & 0xC0) != 0x80; }), 65535));
      string_safe_[size_t(id)] = !special_[size_t(id)] && !b.empty() &&
                                 std::all_of(b.begin(), b.end(), [](char c) {
                                   return uint8_t(c) >= 0x20 && c != '"' && c != '\\';
                                 }) &&
                                 whole_utf8(b);
      data_ += b;
    }
    offsets_.push_back(int64_t(data_.size()));
  }
  for (int64_t id = 0; id < vocab_size; ++id)
    if (!special_[size_t(id)] && !bytes(id).empty()) ordered_.push_back(int32_t(id));
  std::stable_sort(ordered_.begin(), ordered_.end(), [&](int32_t a, int32_t b) { return bytes(a) < bytes(b); });
  ordered_offsets_.push_back(0);
  std::string_view prev;
  for (int32_t id : ordered_) {
    const std::string_view b = bytes(id);
    size_t l = 0;
    while (l < std::min(prev.size(), b.size()) && prev[l] == b[l]) ++l;
    ordered_shared_.push_back(uint32_t(l));
    ordered_data_ += b;
    ordered_offsets_.push_back(uint32_t(ordered_data_.size()));
    prev = b;
  }
  sorted_ = ordered_;
  sorted_.erase(std::unique(sorted_.begin(), sorted_.end(), [&](int32_t a, int32_t b) { return bytes(a) == bytes(b); }),
                sorted_.end());
}

int64_t TokenBytes::spell(std::string_view text, std::vector<int64_t>* out) const {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max() / 4;
  const size_t L = text.size();
  // best[i]: the fewest tokens spelling text[i, L); pick[i] / len[i]: the first of them.
  std::vector<int64_t> best(L + 1, 0);
  std::vector<int32_t> pick(L, -1);
  std::vector<uint32_t> len(L, 0);
  for (size_t i = L; i-- > 0;) {
    best[i] = kNone;
    auto lo = sorted_.begin(), hi = sorted_.end();
    for (size_t l = 1; i + l <= L; ++l) {
      // [lo, hi): the ids whose bytes begin with text[i, i + l - 1), sorted,
      // so the one that is exactly that (one at most) comes first.
      if (lo != hi && bytes(*lo).size() == l - 1) ++lo;
      const unsigned char c = uint8_t(text[i + l - 1]);
      lo = std::partition_point(lo, hi, [&](int32_t id) { return uint8_t(bytes(id)[l - 1]) < c; });
      hi = std::partition_point(lo, hi, [&](int32_t id) { return uint8_t(bytes(id)[l - 1]) == c; });
      if (lo == hi) break;
      if (bytes(*lo).size() == l && best[i + l] < kNone && 1 + best[i + l] <= best[i])
        best[i] = 1 + best[i + l], pick[i] = *lo, len[i] = uint32_t(l);
    }
  }
  if (out && best[0] < kNone)
    for (size_t i = 0; i < L; i += len[i]) out->push_back(pick[i]);
  return best[0];
}

// The replayed position in the chain. In the JSON segment `mode` says what
// may come next and `stack` holds the open containers (their schema node,
// the items or properties so far); `vnode` is the value being read, `pos`
// the position in a literal, name, key or enum text, `names` the candidate
// names or keys, [lo, hi) the candidate enum texts, `chars` a bounded
// string's code points, `sub` a number's state or the hex digits left.
struct OutputGrammar::State {
  struct Frame {
    uint32_t node;
    uint16_t count;   // array: items begun; object: the next property index
    uint8_t emitted;  // object: a property written (the next needs a comma)
    uint8_t pad;
  };
  uint16_t seg = 0;
  uint16_t pos = 0;
  uint8_t chosen = 0;
  uint8_t mode = 0;
  uint8_t sub = 0;
  uint8_t depth = 0;
  bool key = false;
  uint8_t u8lo = 0x80, u8hi = 0xBF;  // a string's next continuation byte (sub of them left)
  bool esc_d = false;                // \uD...: the next digit must not make a surrogate
  // The whitespace run between tokens so far: a lone space, or newlines then indentation.
  bool ws_space = false;
  uint8_t ws_nl = 0, ws_ind = 0;
  uint64_t names = 0;
  uint32_t vnode = 0, lo = 0, hi = 0, chars = 0;
  Frame stack[kMaxDepth] = {};
};

namespace {

using Node = JsonSchema::Node;

enum Mode : uint8_t { kTop, kObjOpen, kObjKey, kKey, kColon, kValue, kArrOpen, kAfter, kStr, kEsc, kUni, kNum, kEnum };
enum Num : uint8_t { kSign, kZero, kInt, kFracStart, kFrac, kExpStart, kExpSign, kExp };
constexpr int64_t kInf = int64_t(1) << 50;
// The longest completion (bytes and special tokens) counted in its fewest
// tokens; a longer one counts one token per byte.
constexpr int64_t kSpellMaxBytes = 4096;
constexpr uint8_t kMaxIndent = 20;
constexpr uint32_t kMaxDigits = 16, kMaxExpDigits = 2;

bool is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool num_endable(uint8_t sub) { return sub == kZero || sub == kInt || sub == kFrac || sub == kExp; }

uint64_t all_names(size_t n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; }

void enter(const std::vector<OutputGrammar::Segment>& segs, OutputGrammar::State& st, size_t seg) {
  const uint8_t chosen = st.chosen;
  st = OutputGrammar::State{};
  st.seg = uint16_t(seg);
  st.chosen = chosen;
  if (seg < segs.size() && segs[seg].kind == OutputGrammar::Segment::choice) st.names = all_names(segs[seg].names.size());
}

// An object's window of candidate keys at property index i: i up to the
// first required one (at most 64, the compiler's bound).
uint32_t window_end(const Node& n, uint32_t i) {
  return std::min<uint32_t>(n.next_required[i], uint32_t(n.keys.size()) - 1);
}

int64_t text_len(const JsonSchema& S, uint32_t v) { return int64_t(S.node(v).minimal.size()); }

// The bytes that close an open container after its value in progress (or
// from its current point): the required properties or items still missing,
// then the closer. `need` gets the deepest nesting they require.
int64_t frame_rest(const JsonSchema& S, const OutputGrammar::State::Frame& f, int32_t& need) {
  const Node& n = S.node(f.node);
  switch (n.kind) {
    case Node::object: {
      const int32_t r = n.req_count[f.count];
      need = n.req_depth[f.count];
      return n.req_bytes[f.count] + (f.emitted ? r : std::max(r - 1, 0)) + 1;
    }
    case Node::array: {
      const int64_t rem = std::max<int64_t>(int64_t(n.min_count) - f.count, 0);
      need = n.items_depth(f.count);
      return n.items_bytes(f.count) + (f.count ? rem : std::max<int64_t>(rem - 1, 0)) + 1;
    }
    default: need = 0; return 1;
  }
}

// An object property k chosen at its key: the rest of its key from `pos`
// (then the quote and the colon), its shortest value, the required
// properties after it, the closer; kInf when it cannot fit in the depth left
// (`level` is the object's own nesting level).
int64_t key_cost(const JsonSchema& S, const Node& n, uint32_t k, size_t pos, int level) {
  const uint32_t v = n.values[k];
  if (level + std::max(S.node(v).min_depth, n.req_depth[k + 1]) > JsonSchema::kMaxDepth) return kInf;
  return int64_t(n.keys[k].size() - pos) + 2 + text_len(S, v) + n.req_bytes[k + 1] + n.req_count[k + 1] + 1;
}

}  // namespace

OutputGrammar::OutputGrammar(std::shared_ptr<const TokenBytes> bytes, std::vector<Segment> segments)
    : bytes_(std::move(bytes)),
      segments_(std::move(segments)),
      masks_(std::make_unique<MaskCache>()),
      replayed_(std::make_unique<ReplayCache<State>>()) {
  // Every character a completion may emit must be one token.
  auto check = [&](std::string_view s, const char* what) {
    for (unsigned char c : s)
      if (bytes_->byte_token(c) < 0)
        throw std::invalid_argument(fmt::format("{} holds the byte 0x{:02x}, which is no single token", what, c));
  };
  check("{}[]\",:0123456789-.eE+truefalsn \\u\x80\x90\xa0", "the JSON grammar");
  size_t names = 1;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const Segment& s = segments_[k];
    check(s.text, "the grammar");
    for (const std::string& n : s.names) check(n, "a tool name");
    if (s.kind == Segment::choice) choice_seg_ = k, names = s.names.size();
    if (s.kind == Segment::special && (s.id < 0 || s.id >= bytes_->size() || !bytes_->special(s.id)))
      throw std::logic_error(fmt::format("grammar: id {} is not a special token", s.id));
    if (s.kind == Segment::json) {
      if (s.schemas.empty()) throw std::logic_error("grammar: a JSON segment without a schema");
      for (const auto& sc : s.schemas) {
        for (size_t i = 0; i < sc->size(); ++i) {
          const Node& n = sc->node(uint32_t(i));
          for (const std::string& key : n.keys) check(key, "a property name");
          for (const std::string& t : n.texts) check(t, "an enum value");
        }
      }
    }
  }
  // The completion of each segment from its start, summed from the back,
  // for each chosen name. (Checking every candidate's completion against the
  // tokens left costs O(depth) per candidate: no bound to skip it by.)
  tails_.assign(names, std::vector<int64_t>(segments_.size() + 1, 0));
  for (size_t c = 0; c < names; ++c) {
    for (size_t k = segments_.size(); k-- > 0;) {
      const Segment& s = segments_[k];
      int64_t own = 0;
      switch (s.kind) {
        case Segment::special: own = 1; break;
        case Segment::literal: own = int64_t(s.text.size()); break;
        case Segment::choice: own = int64_t(s.names[c].size()); break;
        case Segment::json: {
          const JsonSchema& sc = *s.schemas[s.schemas.size() == 1 ? 0 : c];
          own = text_len(sc, sc.root());
          break;
        }
        case Segment::regex: own = s.automaton->distance(s.automaton->start()); break;
      }
      tails_[c][k] = tails_[c][k + 1] + own;
    }
  }
  tail_min_.assign(segments_.size() + 1, kInf);
  for (size_t k = 0; k <= segments_.size(); ++k)
    for (size_t c = 0; c < names; ++c) tail_min_[k] = std::min(tail_min_[k], tails_[c][k]);
  State st;
  enter(segments_, st, 0);
  min_tokens_ = completion_tokens(st, nullptr);
}

std::shared_ptr<const OutputGrammar> OutputGrammar::tool_call(std::shared_ptr<const TokenBytes> bytes,
                                                              const std::vector<std::string>& names,
                                                              const std::vector<std::shared_ptr<const JsonSchema>>& schemas) {
  if (names.empty() || names.size() > kMaxNames)
    throw std::invalid_argument(fmt::format("a forced tool call chooses among 1 to {} tools (got {})", kMaxNames,
                                            names.size()));
  if (!schemas.empty() && schemas.size() != names.size())
    throw std::logic_error("grammar: one schema per tool name");
  Segment choice{Segment::choice, -1, "", {}, {}, {}};
  Segment args{Segment::json, -1, "", {}, {}, {}};
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& n = names[i];
    if (n.empty() || n.size() > kMaxNameBytes)
      throw std::invalid_argument(fmt::format("a forced tool's name must have 1 to {} bytes (got {})", kMaxNameBytes,
                                              n.size()));
    const std::string quoted = nlohmann::json(n).dump();  // escaped, with its quotes
    choice.names.push_back(quoted.substr(1, quoted.size() - 2));
    args.schemas.push_back(schemas.empty() || !schemas[i] ? JsonSchema::any_object() : schemas[i]);
  }
  std::vector<Segment> segs;
  segs.push_back({Segment::special, phi4mm::kToolCall, "", {}, {}, {}});
  segs.push_back({Segment::literal, -1, "[{\"name\": \"", {}, {}, {}});
  segs.push_back(std::move(choice));
  segs.push_back({Segment::literal, -1, "\", \"arguments\": ", {}, {}, {}});
  segs.push_back(std::move(args));
  segs.push_back({Segment::literal, -1, "}]", {}, {}, {}});
  segs.push_back({Segment::special, phi4mm::kToolCallEnd, "", {}, {}, {}});
  segs.push_back({Segment::special, phi4mm::kEnd, "", {}, {}, {}});
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

AutoToolCall::AutoToolCall(std::shared_ptr<const OutputGrammar> call) : call_(std::move(call)) {
  if (!call_) throw std::invalid_argument("AutoToolCall: no call grammar");
}

void AutoToolCall::mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const {
  const auto at = std::find(generated.begin(), generated.end(), int64_t(phi4mm::kToolCall));
  if (at != generated.end()) {
    call_->mask(generated.subspan(size_t(at - generated.begin())), remaining, work, V);
    return;
  }
  if (remaining >= call_->min_tokens() || phi4mm::kToolCall >= V) return;
  float& marker = work[phi4mm::kToolCall];
  if (!std::isfinite(marker)) return;
  for (int64_t id = 0; id < V; ++id)
    if (id != phi4mm::kToolCall && std::isfinite(work[id])) {
      marker = -std::numeric_limits<float>::infinity();
      return;
    }
}

int64_t AutoToolCall::completion_length(std::span<const int64_t> generated) const {
  const auto at = std::find(generated.begin(), generated.end(), int64_t(phi4mm::kToolCall));
  return at == generated.end() ? 0 : call_->completion_length(generated.subspan(size_t(at - generated.begin())));
}

std::shared_ptr<const OutputGrammar> OutputGrammar::choice(std::shared_ptr<const TokenBytes> bytes,
                                                           const std::vector<std::string>& options) {
  if (options.empty() || options.size() > kMaxNames)
    throw std::invalid_argument(fmt::format("a choice is among 1 to {} strings (got {})", kMaxNames, options.size()));
  for (const std::string& o : options)
    if (o.empty() || o.size() > kMaxNameBytes)
      throw std::invalid_argument(fmt::format("a choice's strings must have 1 to {} bytes (got {})", kMaxNameBytes, o.size()));
  std::vector<Segment> segs;
  segs.push_back({Segment::choice, -1, "", options, {}, {}});
  segs.push_back({Segment::special, phi4mm::kEnd, "", {}, {}, {}});
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

std::shared_ptr<const OutputGrammar> OutputGrammar::json_object(std::shared_ptr<const TokenBytes> bytes) {
  return json_schema(std::move(bytes), JsonSchema::any_object());
}

std::shared_ptr<const OutputGrammar> OutputGrammar::json_schema(std::shared_ptr<const TokenBytes> bytes,
                                                                std::shared_ptr<const JsonSchema> schema) {
  std::vector<Segment> segs;
  segs.push_back({Segment::json, -1, "", {}, {std::move(schema)}, {}});
  segs.push_back({Segment::special, phi4mm::kEnd, "", {}, {}, {}});
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

std::shared_ptr<const OutputGrammar> OutputGrammar::regex(std::shared_ptr<const TokenBytes> bytes,
                                                          std::shared_ptr<const Regex> regex) {
  // A completion may write any byte a match can hold: each must be a token.
  for (int c = 0; c < 256; ++c)
    if (bytes->byte_token(uint8_t(c)) < 0)
      throw std::invalid_argument(fmt::format("the vocabulary has no token of the byte 0x{:02x}", c));
  std::vector<Segment> segs;
  segs.push_back({Segment::regex, -1, "", {}, {}, std::move(regex)});
  segs.push_back({Segment::special, phi4mm::kEnd, "", {}, {}, {}});
  return std::shared_ptr<const OutputGrammar>(new OutputGrammar(std::move(bytes), std::move(segs)));
}

const JsonSchema& OutputGrammar::schema(const State& st) const {
  const Segment& s = segments_[st.seg];
  return *s.schemas[s.schemas.size() == 1 ? 0 : st.chosen];
}

int64_t OutputGrammar::tail(size_t k, uint8_t chosen) const {
  return choice_seg_ != size_t(-1) && k > choice_seg_ ? tails_[chosen][k] : tail_min_[k];
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
      int complete = -1;
      for (size_t i = 0; i < seg.names.size(); ++i) {
        if (!(st.names >> i & 1)) continue;
        const std::string& n = seg.names[i];
        if (n.size() > st.pos && uint8_t(n[st.pos]) == c) ext |= uint64_t(1) << i;
        if (n.size() == st.pos) complete = int(i);
      }
      if (ext) {
        st.names = ext;
        ++st.pos;
        return true;
      }
      if (complete < 0) return false;
      st.chosen = uint8_t(complete);
      enter(segments_, st, st.seg + 1u);
      return step_byte(st, c);  // at most once: the next segment is a literal
    }
    case Segment::json: return step_json(st, c);
    case Segment::regex: {
      const int32_t next = seg.automaton->next(int32_t(st.vnode), c);
      if (next != Regex::kDead) {
        st.vnode = uint32_t(next);
        return true;
      }
      if (!seg.automaton->accepting(int32_t(st.vnode))) return false;
      enter(segments_, st, st.seg + 1u);
      return step_byte(st, c);  // at most once: a regex is followed by a special token
    }
  }
  return false;
}

bool OutputGrammar::step_json(State& st, unsigned char c) const {
  const JsonSchema& S = schema(st);
  // Whitespace between tokens, bounded as llama.cpp's JSON grammars bound it
  // (a model cannot pad forever): nothing, one space, or one or two newlines
  // then at most kMaxIndent spaces or tabs.
  const bool between = st.mode == kObjOpen || st.mode == kObjKey || st.mode == kColon || st.mode == kValue ||
                       st.mode == kArrOpen || st.mode == kAfter;
  if (between && is_ws(c)) {
    if (c == '\n') {
      if (st.ws_space || st.ws_ind || st.ws_nl == 2) return false;
      ++st.ws_nl;
      return true;
    }
    if (c == '\r') return false;
    if (st.ws_nl) return st.ws_ind < kMaxIndent && (++st.ws_ind, true);
    if (c != ' ' || st.ws_space) return false;
    st.ws_space = true;
    return true;
  }
  st.ws_space = false, st.ws_nl = 0, st.ws_ind = 0;
  auto push = [&](uint32_t node, Mode m) {
    if (st.depth == kMaxDepth) return false;
    st.stack[st.depth++] = State::Frame{node, 0, 0, 0};
    st.mode = m;
    return true;
  };
  auto pop = [&] {
    if (--st.depth == 0) enter(segments_, st, st.seg + 1u);
    else st.mode = kAfter;
    return true;
  };
  // The enum texts in [lo, hi) that go on with c at pos; the value ends
  // (and c goes to its container) when none does and one is complete.
  auto enum_step = [&]() -> bool {
    const Node& n = S.node(st.vnode);
    uint32_t lo = st.lo;
    const bool complete = n.texts[lo].size() == st.pos;
    if (complete) ++lo;
    const auto first = n.texts.begin() + lo, last = n.texts.begin() + st.hi;
    const size_t p = st.pos;
    const auto b = std::lower_bound(first, last, c, [&](const std::string& t, unsigned char x) { return uint8_t(t[p]) < x; });
    const auto e = std::upper_bound(b, last, c, [&](unsigned char x, const std::string& t) { return x < uint8_t(t[p]); });
    if (b != e) {
      st.lo = uint32_t(b - n.texts.begin());
      st.hi = uint32_t(e - n.texts.begin());
      ++st.pos;
      return true;
    }
    if (!complete) return false;
    st.mode = kAfter, st.pos = 0;
    return step_json(st, c);
  };
  auto start_value = [&](uint32_t v) -> bool {
    const Node* n = &S.node(v);
    if (n->kind == Node::union_) {
      v = S.first(*n, c);
      if (v == JsonSchema::kNone) return false;
      n = &S.node(v);
    }
    switch (n->kind) {
      case Node::object:
      case Node::map: return c == '{' && push(v, kObjOpen);
      case Node::array: return c == '[' && push(v, kArrOpen);
      case Node::string:
        if (c != '"') return false;
        st.mode = kStr, st.key = false, st.vnode = v, st.chars = 0, st.sub = 0, st.lo = 0;  // lo: a pattern's state
        return true;
      case Node::number:
      case Node::integer:
        if (n->pattern) {  // a range: its automaton until the number ends
          const int32_t t = n->pattern->next(n->pattern->start(), c);
          if (t == Regex::kDead) return false;
          st.vnode = v, st.mode = kNum, st.lo = uint32_t(t);
          return true;
        }
        st.vnode = v, st.mode = kNum, st.chars = 1;
        if (c == '-') st.sub = kSign, st.chars = 0;
        else if (c == '0') st.sub = kZero;
        else if (c >= '1' && c <= '9') st.sub = kInt;
        else return false;
        return true;
      case Node::enumeration:
        st.vnode = v, st.mode = kEnum, st.lo = 0, st.hi = uint32_t(n->texts.size()), st.pos = 0;
        return enum_step();
      case Node::union_: break;
    }
    return false;
  };
  auto begin_key = [&]() -> bool {
    State::Frame& f = st.stack[st.depth - 1];
    const Node& n = S.node(f.node);
    if (n.kind == Node::map) {
      st.mode = kStr, st.key = true, st.chars = 0, st.sub = 0;
      return true;
    }
    if (f.count >= n.keys.size()) return false;
    st.names = all_names(window_end(n, f.count) - f.count + 1u);
    st.pos = 0;
    st.mode = kKey;
    return true;
  };
  switch (st.mode) {
    case kTop: return start_value(S.root());
    case kObjOpen: {
      const Node& n = S.node(st.stack[st.depth - 1].node);
      if (c == '}') return (n.kind == Node::map || n.req_count[0] == 0) && pop();
      return c == '"' && begin_key();
    }
    case kObjKey: return c == '"' && begin_key();
    case kKey: {
      State::Frame& f = st.stack[st.depth - 1];
      const Node& n = S.node(f.node);
      if (c == '"') {
        for (size_t j = 0; j < 64; ++j)
          if ((st.names >> j & 1) && n.keys[f.count + j].size() == st.pos) {
            st.vnode = n.values[f.count + j];
            f.count = uint16_t(f.count + j + 1);
            f.emitted = 1;
            st.mode = kColon, st.pos = 0;
            return true;
          }
        return false;
      }
      uint64_t ext = 0;
      for (size_t j = 0; j < 64; ++j) {
        if (!(st.names >> j & 1)) continue;
        const std::string& k = n.keys[f.count + j];
        if (k.size() > st.pos && uint8_t(k[st.pos]) == c) ext |= uint64_t(1) << j;
      }
      if (!ext) return false;
      st.names = ext;
      ++st.pos;
      return true;
    }
    case kColon:
      if (c != ':') return false;
      st.mode = kValue;
      return true;
    case kValue: return start_value(st.vnode);
    case kArrOpen: {
      State::Frame& f = st.stack[st.depth - 1];
      const Node& n = S.node(f.node);
      if (c == ']') return n.min_count == 0 && pop();
      if (n.max_count == 0) return false;
      f.count = 1;
      return start_value(n.item(0));
    }
    case kAfter: {
      State::Frame& f = st.stack[st.depth - 1];
      const Node& n = S.node(f.node);
      switch (n.kind) {
        case Node::object:
          if (c == ',') return f.count < n.keys.size() && (st.mode = kObjKey, true);
          return c == '}' && n.req_count[f.count] == 0 && pop();
        case Node::map:
          if (c == ',') return st.mode = kObjKey, true;
          return c == '}' && pop();
        case Node::array:
          if (c == ',') {
            if (f.count >= n.max_count) return false;
            st.mode = kValue, st.vnode = n.item(f.count);
            ++f.count;
            return true;
          }
          return c == ']' && f.count >= n.min_count && pop();
        default: return false;
      }
    }
    case kStr: {
      if (st.sub) {  // inside a code point: its continuation bytes
        if (c < st.u8lo || c > st.u8hi) return false;
        --st.sub, st.u8lo = 0x80, st.u8hi = 0xBF;
        return true;
      }
      const Node* n = st.key ? nullptr : &S.node(st.vnode);
      if (n && n->pattern) {  // its automaton (which never takes '"', '\\' or a control) until it matches
        if (c == '"') {
          if (!n->pattern->accepting(int32_t(st.lo))) return false;
          st.mode = kAfter;
          return true;
        }
        const int32_t t = n->pattern->next(int32_t(st.lo), c);
        if (t == Regex::kDead) return false;
        st.lo = uint32_t(t);
        return true;
      }
      const bool limited = n && n->limited;
      if (c == '"') {
        if (st.key) {  // a map's key: its value follows
          st.key = false;
          st.mode = kColon;
          st.vnode = S.node(st.stack[st.depth - 1].node).values[0];
          return true;
        }
        if (limited && st.chars < n->min_count) return false;
        st.mode = kAfter;
        return true;
      }
      if (c < 0x20) return false;
      const int follow = utf8_lead(c, st.u8lo, st.u8hi);
      if (follow < 0) return false;
      if (limited) {  // a code point (or an escape) begins
        if (st.chars >= n->max_count) return false;
        ++st.chars;
      }
      st.sub = uint8_t(follow);
      if (c == '\\') st.mode = kEsc;
      return true;
    }
    case kEsc:
      if (c == 'u') {
        st.mode = kUni, st.sub = 4, st.esc_d = false;
        return true;
      }
      if (std::string_view("\"\\/bfnrt").find(char(c)) == std::string_view::npos) return false;
      st.mode = kStr;
      return true;
    case kUni:
      if (!std::isxdigit(c)) return false;
      // No surrogate code units (D800-DFFF): a JSON parser may refuse them alone.
      if (st.sub == 3 && st.esc_d && !(c >= '0' && c <= '7')) return false;
      st.esc_d = st.sub == 4 && (c == 'd' || c == 'D');
      if (--st.sub == 0) st.mode = kStr;
      return true;
    case kNum: {
      if (const Node& nn = S.node(st.vnode); nn.pattern) {
        // A range's automaton (digits, '-' and '.' only): a byte it cannot
        // take ends the number, if the number is complete.
        const int32_t t = nn.pattern->next(int32_t(st.lo), c);
        if (t != Regex::kDead) return st.lo = uint32_t(t), true;
        if (!nn.pattern->accepting(int32_t(st.lo))) return false;
        st.mode = kAfter;
        return step_json(st, c);
      }
      // Digits counted per part (`chars`): at most kMaxDigits before and after
      // the point and kMaxExpDigits in the exponent, so a number stays a
      // finite double (and an integer fits an int64 only up to 18 digits:
      // clients' parsers differ past that) and a model cannot run on.
      const bool digit = is_digit(c), e = c == 'e' || c == 'E';
      const bool integer = S.node(st.vnode).kind == Node::integer;
      switch (st.sub) {
        case kSign:
          if (!digit) return false;
          st.sub = c == '0' ? kZero : kInt, st.chars = 1;
          return true;
        case kZero:
        case kInt:
        case kFrac:
          if (digit && st.sub != kZero) return st.chars < kMaxDigits && (++st.chars, true);
          if (c == '.' && st.sub != kFrac && !integer) return st.sub = kFracStart, true;
          if (e && !integer) return st.sub = kExpStart, true;
          break;
        case kFracStart:
          if (!digit) return false;
          st.sub = kFrac, st.chars = 1;
          return true;
        case kExpStart:
          if (c == '+' || c == '-') return st.sub = kExpSign, true;
          [[fallthrough]];
        case kExpSign:
          if (!digit) return false;
          st.sub = kExp, st.chars = 1;
          return true;
        case kExp:
          if (digit) return st.chars < kMaxExpDigits && (++st.chars, true);
          break;
      }
      if (!num_endable(st.sub)) return false;
      st.mode = kAfter;  // the number ended: c belongs to its container
      return step_json(st, c);
    }
    case kEnum: return enum_step();
  }
  return false;
}

bool OutputGrammar::step_token(State& st, int64_t id) const {
  if (id < 0 || id >= bytes_->size()) return false;
  if (bytes_->special(id)) {
    // A choice whose name is complete ends at a special token too.
    if (st.seg < segments_.size() && segments_[st.seg].kind == Segment::choice) {
      const Segment& c = segments_[st.seg];
      int complete = -1;
      for (size_t i = 0; i < c.names.size(); ++i)
        if ((st.names >> i & 1) && c.names[i].size() == st.pos) complete = int(i);
      if (complete < 0) return false;
      st.chosen = uint8_t(complete);
      enter(segments_, st, st.seg + 1u);
    }
    // So does a regex's text once it matches.
    if (st.seg < segments_.size() && segments_[st.seg].kind == Segment::regex) {
      if (!segments_[st.seg].automaton->accepting(int32_t(st.vnode))) return false;
      enter(segments_, st, st.seg + 1u);
    }
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

OutputGrammar::~OutputGrammar() = default;

bool OutputGrammar::replay(std::span<const int64_t> generated, State& st, bool remember) const {
  const size_t from = replayed_->find(generated, st);
  if (from == 0) {
    st = State{};
    enter(segments_, st, 0);
  }
  for (int64_t id : generated.subspan(from))
    if (!step_token(st, id)) return false;
  if (remember && from < generated.size()) replayed_->put(generated, st);
  return true;
}

// The JSON segment's part of the shortest completion, counted from the
// schema's tables in O(depth) (O(64) at a key): the mask asks it for every
// candidate. kInf when the state cannot be completed within kMaxDepth.
int64_t OutputGrammar::json_length(const State& st) const {
  const JsonSchema& S = schema(st);
  if (st.mode == kTop) return text_len(S, S.root());
  int64_t n = 0;
  const int top = st.depth - 1;
  const State::Frame& f = st.stack[top];
  const Node& fn = S.node(f.node);
  int32_t need = 0;  // the deepest nesting the top frame's completion adds below it
  bool top_done = false;
  switch (st.mode) {
    case kObjKey:
    case kKey: {
      if (fn.kind == Node::map) {  // kObjKey of a map: "":value}
        const uint32_t v = fn.values[0];
        n = 3 + text_len(S, v) + 1;
        need = S.node(v).min_depth;
        top_done = true;
        break;
      }
      int64_t best = kInf;
      if (st.mode == kObjKey) {
        for (uint32_t k = f.count; k <= window_end(fn, f.count); ++k)
          best = std::min(best, key_cost(S, fn, k, 0, top + 1) + 1);  // and the opening quote
      } else {
        for (size_t j = 0; j < 64; ++j)
          if (st.names >> j & 1) best = std::min(best, key_cost(S, fn, uint32_t(f.count + j), st.pos, top + 1));
      }
      if (best >= kInf) return kInf;
      n = best;
      top_done = true;  // the cost includes the rest of the object
      break;
    }
    case kColon: n = 1 + text_len(S, st.vnode), need = S.node(st.vnode).min_depth; break;
    case kValue: n = text_len(S, st.vnode), need = S.node(st.vnode).min_depth; break;
    case kStr:
    case kEsc:
    case kUni: {
      if (st.mode == kEsc) n = 1;
      if (st.mode == kUni) n = st.sub;
      if (st.mode == kStr) n = st.sub;  // a code point's continuation bytes
      if (st.key) {  // a map's key: ":value
        const uint32_t v = fn.values[0];
        n += 2 + text_len(S, v);
        need = S.node(v).min_depth;
      } else {
        const Node& sn = S.node(st.vnode);
        n += 1 + (sn.pattern   ? sn.pattern->distance(int32_t(st.lo))
                  : sn.limited ? std::max<int64_t>(int64_t(sn.min_count) - st.chars, 0)
                               : 0);
      }
      break;
    }
    case kNum: {
      const Node& nn = S.node(st.vnode);
      n = nn.pattern ? nn.pattern->distance(int32_t(st.lo)) : num_endable(st.sub) ? 0 : 1;
      break;
    }
    case kEnum: {
      const Node& en = S.node(st.vnode);
      n = int64_t(en.texts[en.shortest_in(st.lo, st.hi)].size()) - st.pos;
      break;
    }
    default: break;  // kObjOpen, kArrOpen, kAfter: the frame's rest
  }
  if (top + 1 + need > kMaxDepth) return kInf;
  for (int d = top_done ? top - 1 : top; d >= 0; --d) {
    int32_t req = 0;
    n += frame_rest(S, st.stack[d], req);
    if (d + 1 + req > kMaxDepth) return kInf;
  }
  return n;
}

int64_t OutputGrammar::completion_bytes(const State& st) const {
  if (st.seg >= segments_.size()) return 0;
  const Segment& s = segments_[st.seg];
  switch (s.kind) {
    case Segment::special: return 1 + tail(st.seg + 1u, st.chosen);
    case Segment::literal: return int64_t(s.text.size()) - st.pos + tail(st.seg + 1u, st.chosen);
    case Segment::choice: {
      int64_t best = kInf;
      for (size_t i = 0; i < s.names.size(); ++i)
        if (st.names >> i & 1)
          best = std::min(best, int64_t(s.names[i].size()) - st.pos + tails_[i][st.seg + 1u]);
      return best;
    }
    case Segment::json: {
      const int64_t j = json_length(st);
      return j >= kInf ? kInf : j + tail(st.seg + 1u, st.chosen);
    }
    case Segment::regex: return s.automaton->distance(int32_t(st.vnode)) + tail(st.seg + 1u, st.chosen);
  }
  return kInf;
}

// Calls emit(id) for each byte (as its one-byte token) and special token of
// the shortest completion of `st`: the same choices json_length counts; with
// `force`, that name of the choice segment (one of the candidates left).
template <typename F>
void OutputGrammar::for_completion(const State& st0, F&& emit, int force) const {
  State st = st0;
  auto text = [&](std::string_view s) {
    for (unsigned char c : s) emit(bytes_->byte_token(c));
  };
  // The required properties from k on (a comma before each when one was
  // written), then the closer.
  auto object_rest = [&](const JsonSchema& S, const Node& n, uint32_t k, bool emitted) {
    for (size_t i = k; i < n.keys.size(); ++i) {
      if (!n.required[i]) continue;
      if (emitted) text(",");
      emitted = true;
      text("\"");
      text(n.keys[i]);
      text("\":");
      text(S.node(n.values[i]).minimal);
    }
    text("}");
  };
  auto frame_text = [&](const JsonSchema& S, const State::Frame& f) {
    const Node& n = S.node(f.node);
    switch (n.kind) {
      case Node::object: object_rest(S, n, f.count, f.emitted); break;
      case Node::array:
        for (uint32_t j = f.count; j < n.min_count; ++j) {
          if (j) text(",");
          text(S.node(n.item(j)).minimal);
        }
        text("]");
        break;
      default: text("}"); break;
    }
  };
  for (size_t k = st.seg; k < segments_.size(); ++k) {
    const Segment& s = segments_[k];
    const bool here = k == st.seg;
    switch (s.kind) {
      case Segment::special: emit(s.id); break;
      case Segment::literal: text(std::string_view(s.text).substr(here ? st.pos : 0)); break;
      case Segment::choice: {
        const uint64_t cand = here ? st.names : all_names(s.names.size());
        const size_t pos = here ? st.pos : 0;
        size_t best = 0;
        int64_t best_len = kInf;
        for (size_t i = 0; i < s.names.size(); ++i) {
          if (!(cand >> i & 1)) continue;
          const int64_t l = int64_t(s.names[i].size() - pos) + tails_[i][k + 1];
          if (l < best_len) best = i, best_len = l;
        }
        if (force >= 0) best = size_t(force);
        text(std::string_view(s.names[best]).substr(pos));
        st.chosen = uint8_t(best);
        break;
      }
      case Segment::regex: text(s.automaton->shortest(here ? int32_t(st.vnode) : s.automaton->start())); break;
      case Segment::json: {
        const JsonSchema& S = *s.schemas[s.schemas.size() == 1 ? 0 : st.chosen];
        if (!here || st.mode == kTop) {
          text(S.node(S.root()).minimal);
          break;
        }
        const int top = st.depth - 1;
        const State::Frame& f = st.stack[top];
        const Node& fn = S.node(f.node);
        bool top_done = false;
        switch (st.mode) {
          case kObjKey:
          case kKey: {
            top_done = true;
            if (fn.kind == Node::map) {
              text("\"\":");
              text(S.node(fn.values[0]).minimal);
              text("}");
              break;
            }
            uint32_t best = f.count;
            int64_t best_len = kInf;
            const size_t pos = st.mode == kKey ? st.pos : 0;
            for (uint32_t j = 0; j < 64 && f.count + j <= window_end(fn, f.count); ++j) {
              if (st.mode == kKey && !(st.names >> j & 1)) continue;
              const int64_t l = key_cost(S, fn, f.count + j, pos, top + 1);
              if (l < best_len) best = f.count + j, best_len = l;
            }
            if (st.mode == kObjKey) text("\"");
            text(std::string_view(fn.keys[best]).substr(pos));
            text("\":");
            text(S.node(fn.values[best]).minimal);
            object_rest(S, fn, best + 1, true);
            break;
          }
          case kColon:
            text(":");
            text(S.node(st.vnode).minimal);
            break;
          case kValue: text(S.node(st.vnode).minimal); break;
          case kStr:
          case kEsc:
          case kUni: {
            if (st.mode == kEsc) text("n");
            if (st.mode == kUni)
              for (int i = 0; i < st.sub; ++i) text("0");
            if (st.mode == kStr)
              for (int i = 0; i < st.sub; ++i) text(std::string(1, char(i == 0 ? st.u8lo : 0x80)));
            if (st.key) {
              text("\":");
              text(S.node(fn.values[0]).minimal);
            } else {
              const Node& sn = S.node(st.vnode);
              if (sn.pattern) text(sn.pattern->shortest(int32_t(st.lo)));
              if (sn.limited)
                for (uint32_t i = st.chars; i < sn.min_count; ++i) text("a");
              text("\"");
            }
            break;
          }
          case kNum:
            if (const Node& nn = S.node(st.vnode); nn.pattern) text(nn.pattern->shortest(int32_t(st.lo)));
            else if (!num_endable(st.sub)) text("0");
            break;
          case kEnum: {
            const Node& en = S.node(st.vnode);
            text(std::string_view(en.texts[en.shortest_in(st.lo, st.hi)]).substr(st.pos));
            break;
          }
          default: break;  // kObjOpen, kArrOpen, kAfter: only the frames' rests
        }
        for (int d = top_done ? top - 1 : top; d >= 0; --d) frame_text(S, st.stack[d]);
        break;
      }
    }
  }
}

// Memo of the mask's token counts by completion text: many candidates (the
// digits of a number, the words of a free string) leave the same completion.
struct OutputGrammar::SpellCache {
  std::unordered_map<std::string, int64_t> tokens;
  std::unordered_map<int64_t, int64_t> in_string;  // by the code points a bounded string still lacked
  std::unordered_map<uint32_t, int64_t> regex;      // by the automaton's state: its completion
  std::unordered_map<uint32_t, int64_t> pattern;    // in the state's JSON string with a pattern: by its state
};

// The completion's token count: for each name the choice segment may still
// take (one candidate without a choice, or past it), the shortest completion
// with that name in the fewest tokens; the least of those (ties: fewer bytes,
// then the earlier name). Its bytes are a special token's id between 0xFF
// marks (never a byte of UTF-8 text) and the text around them spelled. A
// completion over kSpellMaxBytes counts a token per byte instead (spelling
// it would cost the request's thread O(its bytes) per candidate); that keeps
// the rule that the first token takes one off the count, as the rest, once
// short enough, is spelled.
int64_t OutputGrammar::completion_tokens(const State& st, std::vector<int64_t>* out, SpellCache* cache) const {
  if (st.seg >= segments_.size()) return 0;
  uint64_t cand = 0;
  if (choice_seg_ != size_t(-1) && st.seg <= choice_seg_)
    cand = st.seg == choice_seg_ ? st.names : all_names(segments_[choice_seg_].names.size());
  const auto push = [&](int64_t id) { out->push_back(id); };
  if (!cand) {
    const int64_t b = completion_bytes(st);
    if (b >= kInf) return kInf;
    if (b > kSpellMaxBytes) {
      if (out) for_completion(st, push);
      return b;
    }
  }
  auto count = [&](std::string_view k, std::vector<int64_t>* o) {
    int64_t n = 0;
    for (size_t i = 0; i < k.size();) {
      size_t j = std::min(k.find('\xff', i), k.size());
      if (j > i) n += bytes_->spell(k.substr(i, j - i), o);
      if (j < k.size()) {
        const size_t e = k.find('\xff', j + 1);
        const int64_t id = std::stoll(std::string(k.substr(j + 1, e - j - 1)));
        if (o) o->push_back(id);
        ++n, j = e + 1;
      }
      i = j;
    }
    return n;
  };
  std::string key;
  int64_t units = 0;  // bytes and special tokens
  auto materialize = [&](int name) {
    key.clear();
    units = 0;
    for_completion(
        st,
        [&](int64_t id) {
          if (++units > kSpellMaxBytes) return;  // counted by its bytes: no key
          if (bytes_->special(id)) key += fmt::format("\xff{}\xff", id);
          else key += bytes_->bytes(id);
        },
        name);
  };
  int64_t best = kInf, best_units = 0;
  int best_name = -1;
  for (int i = cand ? 0 : -1; i < (cand ? 64 : 0); ++i) {
    if (i >= 0 && !(cand >> i & 1)) continue;
    materialize(i);
    int64_t n = units;
    if (units <= kSpellMaxBytes) {
      if (!cache) {
        n = count(key, nullptr);
      } else if (auto it = cache->tokens.find(key); it != cache->tokens.end()) {
        n = it->second;
      } else {
        n = count(key, nullptr);
        cache->tokens.emplace(key, n);
      }
    }
    if (n < best || (n == best && units < best_units)) best = n, best_units = units, best_name = i;
  }
  if (out) {
    materialize(best_name);
    if (units <= kSpellMaxBytes) count(key, out);
    else for_completion(st, push, best_name);
  }
  return best;
}

bool OutputGrammar::accepts(std::span<const int64_t> generated) const {
  State st;
  return replay(generated, st);
}

std::vector<int64_t> OutputGrammar::completion(std::span<const int64_t> generated) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  std::vector<int64_t> out;
  if (completion_bytes(st) < kInf) completion_tokens(st, &out);
  return out;
}

int64_t OutputGrammar::completion_length(std::span<const int64_t> generated) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  return completion_bytes(st) < kInf ? completion_tokens(st, nullptr) : kInf;
}

std::string OutputGrammar::state_key(const State& st) const {
  std::string k;
  auto put = [&k](const auto& v) { k.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  // Between a string's code points the last lead byte's range is spent.
  const bool between = st.mode == kStr && st.sub == 0;
  put(st.seg), put(st.pos), put(st.chosen), put(st.mode), put(st.sub), put(st.depth), put(st.key);
  put(between ? uint8_t(0x80) : st.u8lo), put(between ? uint8_t(0xBF) : st.u8hi), put(st.esc_d);
  put(st.ws_space), put(st.ws_nl), put(st.ws_ind), put(st.names), put(st.vnode), put(st.lo), put(st.hi), put(st.chars);
  for (int i = 0; i < st.depth; ++i) put(st.stack[i].node), put(st.stack[i].count), put(st.stack[i].emitted);
  return k;
}

void OutputGrammar::mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const {
  State st;
  if (!replay(generated, st, /*remember=*/true)) throw std::logic_error("grammar: the output is not a prefix of the language");
  if (st.seg >= segments_.size()) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t budget = remaining - 1;  // tokens after this one
  const int64_t n = std::min(V, bytes_->size());
  // No finite id left (penalties, logit_bias or min_tokens masked every
  // allowed one): the shortest completion's first token.
  auto force = [&] {
    std::vector<int64_t> c;
    completion_tokens(st, &c);
    std::fill(work, work + V, kNegInf);
    work[c.at(0)] = 0.0f;
  };
  // A state met before with room for every id it allows: those ids.
  const std::string key = state_key(st);
  if (std::vector<uint64_t> allowed; masks_->find(key, remaining, allowed)) {
    bool any = false;
    for (int64_t id = 0; id < n; ++id) {
      if (!(allowed[size_t(id) >> 6] >> (id & 63) & 1) || std::isnan(work[id])) work[id] = kNegInf;
      else any |= work[id] != kNegInf;
    }
    std::fill(work + n, work + V, kNegInf);
    if (!any) force();
    return;
  }
  SpellCache cache;
  // A state fits when its completion's bytes `b` do (each byte is a token),
  // else when their fewest tokens do: spelled only where the bytes are too many.
  // Inside a JSON string with a pattern, a token that keeps to the string
  // leaves a completion that depends only on the pattern's state (the
  // containers around are the same): counted once per state.
  const bool in_pattern = segments_[st.seg].kind == Segment::json && st.mode == kStr && !st.key &&
                          schema(st).node(st.vnode).pattern;
  // The token count of state s's completion, kept in `memo` under `key`.
  auto counted = [&](auto& memo, auto key, const State& s) {
    auto it = memo.find(key);
    if (it == memo.end()) it = memo.emplace(key, completion_tokens(s, nullptr, &cache)).first;
    return it->second;
  };
  auto fits = [&](const State& s, int64_t b) {
    if (b <= budget) return true;
    if (in_pattern && s.mode == kStr && s.seg == st.seg && s.depth == st.depth && s.vnode == st.vnode &&
        std::memcmp(s.stack, st.stack, sizeof(State::Frame) * st.depth) == 0)  // still the same string
      return counted(cache.pattern, s.lo, s) <= budget;
    return completion_tokens(s, nullptr, &cache) <= budget;
  };
  // Inside a JSON string a token of whole code points with no quote,
  // backslash or control byte only adds text: in O(1), allowed when a
  // bounded string keeps its maximum and the completion (shorter by the code
  // points the string still lacked) fits.
  const bool in_string = segments_[st.seg].kind == Segment::json && st.mode == kStr && st.sub == 0 &&
                         (st.key || !schema(st).node(st.vnode).pattern);  // a pattern's text walks its automaton
  const Node* sn = in_string && !st.key ? &schema(st).node(st.vnode) : nullptr;
  const bool limited = sn && sn->limited;
  const int64_t base = in_string ? completion_bytes(st) : 0;
  const int64_t lacking = limited ? std::max<int64_t>(int64_t(sn->min_count) - st.chars, 0) : 0;
  const int64_t room = limited ? int64_t(sn->max_count) - st.chars : kInf;
  // Past its bytes, such a token's completion depends only on the code
  // points it fills of those lacking: its token count is kept by them.
  auto string_fits = [&](int64_t id, int64_t cp) {
    const int64_t filled = std::min(cp, lacking);
    if (base - filled <= budget) return true;
    if (auto it = cache.in_string.find(filled); it != cache.in_string.end()) return it->second <= budget;
    State s = st;
    step_token(s, id);
    return counted(cache.in_string, filled, s) <= budget;
  };
  // In a regex a token's bytes walk the automaton from its state (no State
  // copied per id); the completion is counted once per state reached (`.`
  // lets every id through).
  const Regex* rx = segments_[st.seg].kind == Segment::regex ? segments_[st.seg].automaton.get() : nullptr;
  const int64_t rx_tail = rx ? tail(st.seg + 1u, st.chosen) : 0;
  auto regex_fits = [&](int32_t t) {
    if (rx->distance(t) + rx_tail <= budget) return true;
    if (auto it = cache.regex.find(uint32_t(t)); it != cache.regex.end()) return it->second <= budget;
    State s = st;
    s.vnode = uint32_t(t);
    return counted(cache.regex, uint32_t(t), s) <= budget;
  };
  // The bytes the state accepts first: a token starting with another is out;
  // then, per first byte as it is met, the second bytes that may follow it.
  bool first_ok[256];
  for (int c = 0; c < 256; ++c) {
    State s = st;
    first_ok[c] = step_byte(s, uint8_t(c));
  }
  std::vector<uint8_t> second(256 * 256, 0);
  bool second_known[256] = {};
  auto pair_ok = [&](unsigned char c1, unsigned char c2) {
    if (!second_known[c1]) {
      State s1 = st;
      step_byte(s1, c1);
      for (int c = 0; c < 256; ++c) {
        State s2 = s1;
        second[size_t(c1) * 256 + size_t(c)] = step_byte(s2, uint8_t(c));
      }
      second_known[c1] = true;
    }
    return second[size_t(c1) * 256 + c2] != 0;
  };
  // live: the ids the language allows with a completion (kept for the
  // state, masked ids included), worst: the most bytes such a completion has.
  std::vector<uint64_t> live(size_t(n + 63) / 64, 0);
  int64_t worst = 0;
  bool any = false;
  for (int64_t id = 0; id < n; ++id) {
    // An id masked already (or NaN) stays out, but the language's verdict is kept.
    const bool open = work[id] != kNegInf && !std::isnan(work[id]);
    auto allow = [&](int64_t b) {
      live[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
      worst = std::max(worst, b);
      return open;
    };
    bool ok = false;
    if (!bytes_->special(id)) {
      const std::string_view b = bytes_->bytes(id);
      if (b.empty() || !first_ok[uint8_t(b[0])]) {
        work[id] = kNegInf;
        continue;
      }
      if (rx) {
        int32_t t = int32_t(st.vnode);
        for (unsigned char c : b)
          if ((t = rx->next(t, c)) == Regex::kDead) break;
        if (t != Regex::kDead && rx->distance(t) + rx_tail < kInf)
          ok = allow(rx->distance(t) + rx_tail) && regex_fits(t);
        if (ok) any = true;
        else work[id] = kNegInf;
        continue;
      }
      if (in_string && bytes_->string_safe(id)) {
        const int64_t cp = bytes_->code_points(id);
        if (cp <= room && base < kInf) ok = allow(base - std::min(cp, lacking)) && string_fits(id, cp);
        if (ok) any = true;
        else work[id] = kNegInf;
        continue;
      }
      if (b.size() > 1 && !pair_ok(uint8_t(b[0]), uint8_t(b[1]))) {
        work[id] = kNegInf;
        continue;
      }
    }
    State s = st;
    if (step_token(s, id))
      if (const int64_t b = completion_bytes(s); b < kInf) ok = allow(b) && fits(s, b);
    if (ok) any = true;
    else work[id] = kNegInf;
  }
  std::fill(work + n, work + V, kNegInf);
  masks_->put(key, std::move(live), worst + 1);
  if (!any) force();
}

}  // namespace areno::serve
