// Unicode and byte helpers of the byte-level BPE tokenizer: UTF-8 reading, the code point
// classes the reference tokenizers use, the ByteLevel byte <-> character alphabet and
// normalization (utf8proc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"

namespace tandem::text::bpe {

// The packaged Abseil has its own string_view type, distinct from std::string_view.
inline absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Outcome of reading one character at a position: `length` bytes form a valid character, or
// (valid == false) the maximal ill-formed subpart to replace with one U+FFFD.
struct Utf8Step {
  int length;
  bool valid;
};

// Follows the well-formed byte sequences of Unicode Table 3-7, which is also what the WHATWG
// decoder and Python's errors="replace" use to size each replacement.
Utf8Step ReadUtf8(std::string_view s, size_t i);

// True when `s` is well-formed UTF-8.
bool IsValidUtf8(std::string_view s);

// Decodes the character at s[i] of valid UTF-8.
int32_t DecodeAt(std::string_view s, size_t i, int* length);

// Decodes the character that ends at s[end) of valid UTF-8.
int32_t DecodeBefore(std::string_view s, size_t end, int* length);

// The Unicode White_Space property: what `\s` means to the tokenizers the models were trained
// with, and what lstrip / rstrip of added tokens strip.
bool IsWhiteSpace(int32_t cp);

// Letters, digits and underscore: what a single_word added token must not touch.
bool IsWordChar(int32_t cp);

// ByteLevel alphabet: every byte stands for one printable character so that BPE vocabularies
// can be stored as text. Bytes that are printable Latin-1 map to themselves; the others
// (controls, space, soft hyphen...) map to U+0100 upwards in byte order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the character standing for each byte
  std::array<int16_t, 324> char_to_byte;      // code point -> byte, -1 where none
};

// The one table, built on first use.
const ByteLevelAlphabet& Alphabet();

// `bytes` written in the ByteLevel alphabet (how vocabularies and merges store them).
std::string ToByteLevel(std::string_view bytes);

// The bytes a ByteLevel-alphabet string stands for; nullopt when it holds other characters
// (such tokens stand for their own UTF-8, as the reference decoder treats them).
std::optional<std::string> FromByteLevel(std::string_view token);

// The Unicode normalization forms a tokenizer.json normalizer may ask for.
enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

// `text` in normal form `form` (utf8proc); ASCII and invalid UTF-8 come back unchanged.
std::string Normalize(std::string_view text, NormalForm form);

}  // namespace tandem::text::bpe
