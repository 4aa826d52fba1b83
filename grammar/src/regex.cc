// Regular expressions -> GBNF expressions, by a recursive-descent parser over the pattern.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "char_ranges.h"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/json_schema.h"

namespace tandem::grammar {
namespace {

using Range = internal::CodepointRange;
using CharSet = std::vector<Range>;  // sorted, merged

CharSet Normalize(CharSet s) { return internal::MergeRanges(std::move(s)); }
CharSet Complement(const CharSet& s) { return internal::ComplementRanges(s); }

CharSet Subtract(const CharSet& a, const CharSet& b) {
  CharSet nb = Complement(b), out;
  for (auto x : a) {
    for (auto y : nb) {
      uint32_t lo = std::max(x.lo, y.lo), hi = std::min(x.hi, y.hi);
      if (lo <= hi) out.push_back({lo, hi});
    }
  }
  return Normalize(out);
}

CharSet Intersect(const CharSet& a, const CharSet& b) { return Subtract(a, Complement(b)); }

const CharSet kDigit = {{'0', '9'}};
const CharSet kWord = Normalize({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}});
const CharSet kSpace = Normalize({{'\t', '\r'}, {' ', ' '}});
// What a JSON string holds only escaped.
const CharSet kJsonEscaped = Normalize({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});

std::string ClassToGbnf(const CharSet& s) {
  std::string out = "[";
  for (auto r : s) {
    absl::StrAppendFormat(&out, "\\U%08X", r.lo);
    if (r.hi > r.lo) absl::StrAppendFormat(&out, "-\\U%08X", r.hi);
  }
  return out + "]";
}

class RegexParser {
 public:
  RegexParser(std::string_view re, bool json) : re_(re), json_(json) {}

  absl::StatusOr<std::string> Parse() {
    if (Peek() == '^') ++pos_;
    TANDEM_ASSIGN_OR_RETURN(std::string expr, ParseAlternation());
    if (pos_ < re_.size()) {
      return Error(Peek() == ')' ? "unbalanced ')'" : "unexpected character");
    }
    return expr;
  }

 private:
  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("regex: column ", pos_ + 1, ": ", std::string(what)));
  }
  char Peek(size_t ahead = 0) const { return pos_ + ahead < re_.size() ? re_[pos_ + ahead] : '\0'; }
  bool AtEnd() const { return pos_ >= re_.size(); }

  // The GBNF of one character set, escaped for JSON strings in JSON mode.
  std::string SetToGbnf(const CharSet& s) {
    if (!json_) return s.empty() ? "[^\\U00000000-\\U0010FFFF]" : ClassToGbnf(s);
    std::vector<std::string> alternatives;
    CharSet plain = Subtract(s, kJsonEscaped);
    if (!plain.empty()) alternatives.push_back(ClassToGbnf(plain));
    for (auto r : Intersect(s, kJsonEscaped)) {
      for (uint32_t c = r.lo; c <= r.hi; ++c) {
        alternatives.push_back(c == '"'    ? "\"\\\\\\\"\""
                               : c == '\\' ? "\"\\\\\\\\\""
                                           : absl::StrFormat("\"\\\\u%04x\"", c));
      }
    }
    if (alternatives.empty()) return "[^\\U00000000-\\U0010FFFF]";
    if (alternatives.size() == 1) return alternatives[0];
    return absl::StrCat("(", absl::StrJoin(alternatives, " | "), ")");
  }

  absl::StatusOr<std::string> ParseAlternation() {
    std::vector<std::string> alternatives;
    while (true) {
      TANDEM_ASSIGN_OR_RETURN(std::string seq, ParseSequence());
      alternatives.push_back(seq.empty() ? "\"\"" : seq);
      if (Peek() != '|') break;
      ++pos_;
    }
    if (alternatives.size() == 1) return alternatives[0];
    return absl::StrCat("(", absl::StrJoin(alternatives, " | "), ")");
  }

  absl::StatusOr<std::string> ParseSequence() {
    std::string out;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (Peek() == '$' && pos_ + 1 == re_.size()) {
        ++pos_;
        break;
      }
      TANDEM_ASSIGN_OR_RETURN(std::string atom, ParseAtom());
      TANDEM_ASSIGN_OR_RETURN(std::string repeated, ParseQuantifier(atom));
      if (!out.empty()) out += " ";
      out += repeated;
    }
    return out;
  }

  absl::StatusOr<std::string> ParseQuantifier(const std::string& atom) {
    char c = Peek();
    std::string suffix;
    if (c == '*' || c == '+' || c == '?') {
      ++pos_;
      suffix = std::string(1, c);
    } else if (c == '{' && (Peek(1) >= '0' && Peek(1) <= '9')) {
      size_t start = pos_;
      while (!AtEnd() && Peek() != '}') ++pos_;
      if (AtEnd()) return Error("unterminated '{'");
      ++pos_;
      suffix = std::string(re_.substr(start, pos_ - start));
    } else {
      return atom;
    }
    if (Peek() == '?' || Peek() == '+') ++pos_;  // lazy / possessive: same language
    if (Peek() == '*' || Peek() == '+' || Peek() == '?' ||
        (Peek() == '{' && Peek(1) >= '0' && Peek(1) <= '9')) {
      return Error("nested quantifier");
    }
    return absl::StrCat("(", atom, ")", suffix);
  }

  absl::StatusOr<std::string> ParseAtom() {
    char c = Peek();
    if (c == '(') {
      if (++depth_ > 256) return Error("groups nested too deeply");
      ++pos_;
      if (Peek() == '?') {
        if (Peek(1) == ':') {
          pos_ += 2;
        } else if (Peek(1) == 'P' && Peek(2) == '<') {
          pos_ = re_.find('>', pos_);
          if (pos_ == std::string_view::npos) return Error("unterminated group name");
          ++pos_;
        } else if (Peek(1) == '<' && Peek(2) != '=' && Peek(2) != '!') {
          pos_ = re_.find('>', pos_);
          if (pos_ == std::string_view::npos) return Error("unterminated group name");
          ++pos_;
        } else {
          --pos_;
          return Error("lookaround and inline flags are not supported");
        }
      }
      TANDEM_ASSIGN_OR_RETURN(std::string inner, ParseAlternation());
      if (Peek() != ')') return Error("missing ')'");
      ++pos_;
      --depth_;
      return absl::StrCat("(", inner, ")");
    }
    if (c == '[') return ParseClass();
    if (c == '.') {
      ++pos_;
      return SetToGbnf(Complement({{'\n', '\n'}}));
    }
    if (c == '^' || c == '$') return Error("anchors are supported only at the ends");
    if (c == '*' || c == '+' || c == '?') return Error("quantifier with nothing to repeat");
    if (c == '\\') {
      TANDEM_ASSIGN_OR_RETURN(CharSet s, ParseEscape(/*in_class=*/false));
      return SetToGbnf(s);
    }
    TANDEM_ASSIGN_OR_RETURN(uint32_t cp, ParseUtf8());
    return SetToGbnf({{cp, cp}});
  }

  absl::StatusOr<uint32_t> ParseUtf8() {
    uint32_t cp = 0;
    const int n = internal::DecodeUtf8(re_, pos_, &cp);
    if (n == 0) return Error("invalid UTF-8");
    pos_ += n;
    return cp;
  }

  absl::StatusOr<uint32_t> ParseHex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      int d = internal::HexDigit(Peek());
      if (d < 0) return Error("bad hex escape");
      v = v * 16 + d;
      ++pos_;
    }
    return v;
  }

  absl::StatusOr<CharSet> ParseEscape(bool in_class) {
    ++pos_;  // backslash
    if (AtEnd()) return Error("trailing backslash");
    char e = Peek();
    ++pos_;
    switch (e) {
      case 'd':
        return kDigit;
      case 'D':
        return Complement(kDigit);
      case 'w':
        return kWord;
      case 'W':
        return Complement(kWord);
      case 's':
        return kSpace;
      case 'S':
        return Complement(kSpace);
      case 'n':
        return CharSet{{'\n', '\n'}};
      case 't':
        return CharSet{{'\t', '\t'}};
      case 'r':
        return CharSet{{'\r', '\r'}};
      case 'f':
        return CharSet{{'\f', '\f'}};
      case 'v':
        return CharSet{{'\v', '\v'}};
      case '0':
        return CharSet{{0, 0}};
      case 'x': {
        TANDEM_ASSIGN_OR_RETURN(uint32_t v, ParseHex(2));
        return CharSet{{v, v}};
      }
      case 'u': {
        TANDEM_ASSIGN_OR_RETURN(uint32_t v, ParseHex(4));
        return CharSet{{v, v}};
      }
      case 'b':
        if (in_class) return CharSet{{'\b', '\b'}};
        [[fallthrough]];
      case 'B':
      case 'A':
      case 'z':
      case 'Z':
        --pos_;
        return Error("word boundaries and anchors are not supported");
      default:
        if ((e >= '1' && e <= '9') || e == 'k') {
          --pos_;
          return Error("backreferences are not supported");
        }
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
          --pos_;
          return Error(absl::StrCat("unknown escape '\\", std::string(1, e), "'"));
        }
        return CharSet{{static_cast<uint8_t>(e), static_cast<uint8_t>(e)}};
    }
  }

  absl::StatusOr<std::string> ParseClass() {
    size_t start = pos_++;
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    CharSet set;
    bool first = true;
    while (first || Peek() != ']') {
      first = false;
      if (AtEnd()) {
        pos_ = start;
        return Error("unterminated character class");
      }
      CharSet item;
      if (Peek() == '\\') {
        TANDEM_ASSIGN_OR_RETURN(item, ParseEscape(/*in_class=*/true));
      } else {
        TANDEM_ASSIGN_OR_RETURN(uint32_t cp, ParseUtf8());
        item = {{cp, cp}};
      }
      if (Peek() == '-' && Peek(1) != ']' && Peek(1) != '\0' && item.size() == 1 &&
          item[0].lo == item[0].hi) {
        ++pos_;
        CharSet hi;
        if (Peek() == '\\') {
          TANDEM_ASSIGN_OR_RETURN(hi, ParseEscape(/*in_class=*/true));
        } else {
          TANDEM_ASSIGN_OR_RETURN(uint32_t cp, ParseUtf8());
          hi = {{cp, cp}};
        }
        if (hi.size() != 1 || hi[0].lo != hi[0].hi) return Error("bad range in class");
        if (hi[0].lo < item[0].lo) return Error("reversed range in class");
        item = {{item[0].lo, hi[0].lo}};
      }
      set.insert(set.end(), item.begin(), item.end());
    }
    ++pos_;
    set = Normalize(set);
    if (negate) set = Complement(set);
    return SetToGbnf(set);
  }

  std::string_view re_;
  bool json_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<std::string> RegexToGbnf(std::string_view regex) {
  TANDEM_ASSIGN_OR_RETURN(std::string expr, RegexParser(regex, false).Parse());
  return absl::StrCat("root ::= ", expr.empty() ? "\"\"" : expr, "\n");
}

absl::StatusOr<std::string> RegexToJsonStringGbnf(std::string_view regex) {
  TANDEM_ASSIGN_OR_RETURN(std::string expr, RegexParser(regex, true).Parse());
  return expr.empty() ? "\"\"" : expr;
}

}  // namespace tandem::grammar
