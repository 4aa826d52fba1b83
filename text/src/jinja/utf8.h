// UTF-8 and Python string helpers for the Jinja interpreter. Python strings are sequences of
// code points, so lengths, indices, slices and character iteration work on code points;
// everything else treats the text as bytes. Case mapping covers ASCII only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::text::jinja {

// ---- UTF-8 ----------------------------------------------------------------------------------

// Length in bytes of the UTF-8 sequence that byte `c` starts.
inline size_t Utf8SeqLen(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 1;  // Stray continuation byte: step over it alone.
}

// Byte offsets where each code point of `s` starts.
std::vector<size_t> CodePointStarts(std::string_view s);
size_t CodePointCount(std::string_view s);
// Decodes the code point at byte `i` (which must start one) and its length in bytes.
uint32_t DecodeAt(std::string_view s, size_t i, size_t* len);
void AppendUtf8(uint32_t cp, std::string* out);

// ---- whitespace and case --------------------------------------------------------------------

// Python's str.isspace() for one code point.
bool IsPySpace(uint32_t cp);
// Length in bytes of the run of Python whitespace that starts at byte `i`.
size_t SpaceRunFrom(std::string_view s, size_t i);
// str.rstrip() / str.lstrip() with no arguments.
std::string_view RStripSpace(std::string_view s);
std::string_view LStripSpace(std::string_view s);
// str.strip(chars) family with an explicit character set (code points).
std::string StripChars(std::string_view s, std::string_view chars, bool left, bool right);

// Case mapping covers ASCII only; other letters are left as they are.
std::string AsciiUpper(std::string_view s);
std::string AsciiLower(std::string_view s);
inline bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
inline bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// ---- Python str operations ------------------------------------------------------------------

// str.splitlines(): splits on every Python line boundary.
std::vector<std::string> PySplitLines(const std::string& s, bool keepends);
// str.replace(old, repl, count); a negative count replaces every occurrence.
std::string PyReplace(const std::string& s, const std::string& old, const std::string& repl,
                      int64_t count);
// str.capitalize().
std::string PyCapitalize(const std::string& s);
// str.title(): a letter after a letter is lowercased, any other letter uppercased.
std::string PyTitle(const std::string& s);
// Python's int(str, base): optional surrounding whitespace and sign, single underscores
// between digits, and a 0x/0o/0b prefix matching the base.
std::optional<int64_t> ParsePyInt(std::string_view s, int base);
// Python's float(str).
std::optional<double> ParsePyFloat(std::string_view s);
// markupsafe's escape(): & < > " ' as HTML entities.
std::string HtmlEscape(const std::string& s);

}  // namespace tandem::text::jinja
