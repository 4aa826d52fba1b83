// Internal: code point sets as sorted ranges, UTF-8 decoding and hex digits, shared by the GBNF
// and regex parsers.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace tandem::grammar::internal {

constexpr uint32_t kMaxCodepoint = 0x10FFFF;

struct CodepointRange {
  uint32_t lo, hi;
};

// Sorted by `lo`, overlapping and adjacent ranges merged.
std::vector<CodepointRange> MergeRanges(std::vector<CodepointRange> ranges);
// The code points 0..U+10FFFF not in `ranges` (which must be merged).
std::vector<CodepointRange> ComplementRanges(const std::vector<CodepointRange>& ranges);

// The value of a hex digit, or -1.
int HexDigit(char c);

// Decodes the UTF-8 character at text[pos] into *cp; returns its length, 0 when ill-formed.
int DecodeUtf8(std::string_view text, size_t pos, uint32_t* cp);

}  // namespace tandem::grammar::internal
