// UTF-8 decoding and the Python str operations built on it (see utf8.h).

#include "text/src/jinja/utf8.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::text::jinja {

std::vector<size_t> CodePointStarts(std::string_view s) {
  std::vector<size_t> starts;
  starts.reserve(s.size());
  for (size_t i = 0; i < s.size(); i += Utf8SeqLen(static_cast<unsigned char>(s[i]))) {
    starts.push_back(i);
  }
  return starts;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += Utf8SeqLen(static_cast<unsigned char>(s[i]))) ++n;
  return n;
}

uint32_t DecodeAt(std::string_view s, size_t i, size_t* len) {
  unsigned char c = s[i];
  size_t n = std::min(Utf8SeqLen(c), s.size() - i);
  *len = n;
  if (n == 1) return c;
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsPySpace(uint32_t cp) {
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  if (cp < 0x80) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

size_t SpaceRunFrom(std::string_view s, size_t i) {
  size_t j = i;
  while (j < s.size()) {
    size_t len;
    if (!IsPySpace(DecodeAt(s, j, &len))) break;
    j += len;
  }
  return j - i;
}

std::string_view RStripSpace(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!IsPySpace(DecodeAt(s, start, &len))) break;
    end = start;
  }
  return s.substr(0, end);
}

std::string_view LStripSpace(std::string_view s) { return s.substr(SpaceRunFrom(s, 0)); }

std::string StripChars(std::string_view s, std::string_view chars, bool left, bool right) {
  std::vector<size_t> starts = CodePointStarts(s);
  auto in_set = [&](size_t k) {
    size_t end = k + 1 < starts.size() ? starts[k + 1] : s.size();
    std::string_view cp = s.substr(starts[k], end - starts[k]);
    return chars.find(cp) != std::string_view::npos;
  };
  size_t lo = 0, hi = starts.size();
  if (left) {
    while (lo < hi && in_set(lo)) ++lo;
  }
  if (right) {
    while (hi > lo && in_set(hi - 1)) --hi;
  }
  size_t b = lo < starts.size() ? starts[lo] : s.size();
  size_t e = hi < starts.size() ? starts[hi] : s.size();
  return std::string(s.substr(b, e - b));
}

std::string AsciiUpper(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return r;
}

std::string AsciiLower(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return r;
}

std::vector<std::string> PySplitLines(const std::string& s, bool keepends) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = DecodeAt(s, i, &len);
    bool brk = cp == '\n' || cp == '\r' || cp == '\v' || cp == '\f' || (cp >= 0x1C && cp <= 0x1E) ||
               cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!brk) {
      i += len;
      continue;
    }
    size_t end = i + len;
    if (cp == '\r' && end < s.size() && s[end] == '\n') ++end;
    lines.push_back(s.substr(start, (keepends ? end : i) - start));
    start = i = end;
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

std::string PyReplace(const std::string& s, const std::string& old, const std::string& repl,
                      int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::vector<size_t> starts = CodePointStarts(s);
    for (size_t k = 0; k <= starts.size(); ++k) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (k < starts.size()) {
        size_t end = k + 1 < starts.size() ? starts[k + 1] : s.size();
        out.append(s, starts[k], end - starts[k]);
      }
    }
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += repl;
    pos = hit + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string PyCapitalize(const std::string& s) {
  std::string out = AsciiLower(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 32);
  return out;
}

std::string PyTitle(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    if (IsAsciiAlpha(c)) {
      c = prev_cased ? static_cast<char>(c | 0x20) : static_cast<char>(c & ~0x20);
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}

std::optional<int64_t> ParsePyInt(std::string_view s, int base) {
  s = RStripSpace(LStripSpace(s));
  bool neg = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    neg = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.size() > 2 && s[0] == '0') {
    char p = s[1] | 0x20;
    if ((p == 'x' && (base == 16 || base == 0)) || (p == 'o' && (base == 8 || base == 0)) ||
        (p == 'b' && (base == 2 || base == 0))) {
      base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
      s.remove_prefix(2);
      if (!s.empty() && s[0] == '_') s.remove_prefix(1);
    }
  }
  if (base == 0) base = 10;
  if (s.empty() || base < 2 || base > 36) return std::nullopt;
  uint64_t v = 0;
  bool prev_digit = false;
  for (char c : s) {
    if (c == '_') {
      if (!prev_digit) return std::nullopt;
      prev_digit = false;
      continue;
    }
    int d = IsAsciiDigit(c) ? c - '0' : IsAsciiAlpha(c) ? (c | 0x20) - 'a' + 10 : 99;
    if (d >= base) return std::nullopt;
    if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - d) / base) {
      return std::nullopt;
    }
    v = v * base + d;
    prev_digit = true;
  }
  if (!prev_digit) return std::nullopt;
  return neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
}

std::optional<double> ParsePyFloat(std::string_view s) {
  s = RStripSpace(LStripSpace(s));
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_') {
      if (i == 0 || i + 1 == s.size() || !IsAsciiDigit(s[i - 1]) || !IsAsciiDigit(s[i + 1])) {
        return std::nullopt;
      }
      continue;
    }
    if (c == 'x' || c == 'X' || c == 'p' || c == 'P') return std::nullopt;
    clean.push_back(c);
  }
  if (clean.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return d;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

}  // namespace tandem::text::jinja
