#pragma once
// A JSON Schema numeric range (`minimum`, `maximum`, `exclusiveMinimum`,
// `exclusiveMaximum`) as a regular expression (serve/regex.h's syntax) that
// the number's whole text must match, so constrained decoding writes only
// numbers inside it (as xgrammar turns ranges into patterns).
//
// The texts it matches are JSON numbers as the grammar writes them: an
// optional '-', an integer part without leading zeros of at most 16 digits,
// and for a `number` an optional fraction of 1 to 16 digits; no exponent
// (the unranged number's exponent is what a range gives up), no "-0". The
// comparison is exact in decimal: a bound is read as the decimal its JSON
// text (the shortest text that reads back as the same double) writes, and a
// text is in the range when its decimal value is. A bound beyond 16 integer
// digits bounds nothing the grammar can write on that side.
#include <span>
#include <string>

namespace areno::serve {

struct NumberBound {
  std::string text;  // a JSON number's text: "-12", "0.5", "1e-05"
  bool exclusive = false;
};

// The pattern for the numbers (integers when `integer`) at or above every
// one of `lower` and at or below every one of `upper` (strictly, for an
// exclusive bound). Throws std::invalid_argument when a bound's text is not
// a JSON number, or when no number the grammar writes is in the range.
std::string number_range_pattern(std::span<const NumberBound> lower, std::span<const NumberBound> upper, bool integer);

}  // namespace areno::serve
