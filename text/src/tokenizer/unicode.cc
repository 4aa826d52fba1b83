#include "text/src/tokenizer/unicode.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

namespace tandem::text::bpe {

Utf8Step ReadUtf8(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const uint8_t b = p[i];
  if (b < 0x80) return {1, true};
  int len = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    len = 2;
  } else if (b == 0xE0) {
    len = 3;
    lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    len = 3;
  } else if (b == 0xED) {
    len = 3;
    hi = 0x9F;
  } else if (b == 0xF0) {
    len = 4;
    lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    len = 4;
  } else if (b == 0xF4) {
    len = 4;
    hi = 0x8F;
  } else {
    return {1, false};
  }
  for (int j = 1; j < len; ++j) {
    if (i + j >= s.size()) return {j, false};
    const uint8_t c = p[i + j];
    if (c < (j == 1 ? lo : 0x80) || c > (j == 1 ? hi : 0xBF)) return {j, false};
  }
  return {len, true};
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step step = ReadUtf8(s, i);
    if (!step.valid) return false;
    i += step.length;
  }
  return true;
}

int32_t DecodeAt(std::string_view s, size_t i, int* length) {
  utf8proc_int32_t cp = 0;
  utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                        static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  *length = n > 0 ? static_cast<int>(n) : 1;
  return n > 0 ? cp : 0xFFFD;
}

int32_t DecodeBefore(std::string_view s, size_t end, int* length) {
  size_t start = end - 1;
  while (start > 0 && end - start < 4 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) {
    --start;
  }
  int n = 0;
  int32_t cp = DecodeAt(s, start, &n);
  *length = static_cast<int>(end - start);
  return cp;
}

bool IsWhiteSpace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool IsWordChar(int32_t cp) {
  if (cp == '_') return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet* const alphabet = [] {
    auto* a = new ByteLevelAlphabet;
    a->char_to_byte.fill(-1);
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      int32_t cp = printable(b) ? b : next_extra++;
      utf8proc_uint8_t buf[4];
      utf8proc_ssize_t n = utf8proc_encode_char(cp, buf);
      a->byte_to_char[b].assign(reinterpret_cast<const char*>(buf), n);
      a->char_to_byte[cp] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return *alphabet;
}

std::string ToByteLevel(std::string_view bytes) {
  const ByteLevelAlphabet& a = Alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += a.byte_to_char[b];
  return out;
}

std::optional<std::string> FromByteLevel(std::string_view token) {
  const ByteLevelAlphabet& a = Alphabet();
  std::string out;
  out.reserve(token.size());
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  for (size_t i = 0; i < token.size();) {
    // The alphabet lies below U+0800, so only one- and two-byte characters can belong to it.
    int32_t cp = -1;
    if (p[i] < 0x80) {
      cp = p[i];
      i += 1;
    } else if (p[i] >= 0xC2 && p[i] <= 0xDF && i + 1 < token.size() && (p[i + 1] & 0xC0) == 0x80) {
      cp = ((p[i] & 0x1F) << 6) | (p[i + 1] & 0x3F);
      i += 2;
    }
    if (cp < 0 || cp >= static_cast<int32_t>(a.char_to_byte.size()) || a.char_to_byte[cp] < 0) {
      return std::nullopt;
    }
    out += static_cast<char>(a.char_to_byte[cp]);
  }
  return out;
}

std::string Normalize(std::string_view text, NormalForm form) {
  bool ascii = std::all_of(text.begin(), text.end(),
                           [](char c) { return static_cast<unsigned char>(c) < 0x80; });
  if (ascii || text.empty()) return std::string(text);  // ASCII is invariant under all forms
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                    static_cast<utf8proc_ssize_t>(text.size()), &out,
                                    static_cast<utf8proc_option_t>(options));
  if (n < 0) return std::string(text);  // only on invalid UTF-8, which Encode never passes
  std::string result(reinterpret_cast<const char*>(out), n);
  std::free(out);
  return result;
}

}  // namespace tandem::text::bpe
