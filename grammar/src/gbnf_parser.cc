// GBNF text -> Grammar. A recursive-descent parser over the source bytes; repetitions and groups
// become auxiliary rules, Unicode character classes become alternatives of byte sequences.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "char_ranges.h"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/grammar.h"

namespace tandem::grammar {
namespace {

using internal::CodepointRange;
using internal::kMaxCodepoint;

// Deepest nesting of parentheses (the parser recurses once per level).
constexpr int kMaxNesting = 256;
// The largest bound accepted in {m,n}: each bound unrolls into rules.
constexpr int kMaxRepetition = 10000;

int Utf8Length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void EncodeUtf8(uint32_t cp, uint8_t* out) {
  switch (Utf8Length(cp)) {
    case 1:
      out[0] = cp;
      break;
    case 2:
      out[0] = 0xC0 | (cp >> 6);
      out[1] = 0x80 | (cp & 0x3F);
      break;
    case 3:
      out[0] = 0xE0 | (cp >> 12);
      out[1] = 0x80 | ((cp >> 6) & 0x3F);
      out[2] = 0x80 | (cp & 0x3F);
      break;
    default:
      out[0] = 0xF0 | (cp >> 18);
      out[1] = 0x80 | ((cp >> 12) & 0x3F);
      out[2] = 0x80 | ((cp >> 6) & 0x3F);
      out[3] = 0x80 | (cp & 0x3F);
  }
}

std::string EncodeUtf8(uint32_t cp) {
  uint8_t buf[4];
  EncodeUtf8(cp, buf);
  return std::string(reinterpret_cast<char*>(buf), Utf8Length(cp));
}

// Splits [lo, hi] (one UTF-8 length, no surrogates) into sequences of byte ranges, as RE2 and
// Go's regexp do: each emitted sequence is a product of per-byte ranges.
void SplitUtf8(uint32_t lo, uint32_t hi, std::vector<Sequence>& out) {
  static constexpr uint32_t kBoundaries[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t b : kBoundaries) {
    if (lo <= b && hi > b) {
      SplitUtf8(lo, b, out);
      SplitUtf8(b + 1, hi, out);
      return;
    }
  }
  int n = Utf8Length(lo);
  for (int i = 1; i < n; ++i) {
    uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        SplitUtf8(lo, lo | m, out);
        SplitUtf8((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        SplitUtf8(lo, (hi & ~m) - 1, out);
        SplitUtf8(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  EncodeUtf8(lo, a);
  EncodeUtf8(hi, b);
  Sequence seq;
  for (int i = 0; i < n; ++i) {
    std::bitset<256> set;
    for (int c = a[i]; c <= b[i]; ++c) set.set(c);
    seq.push_back(Element::Bytes(set));
  }
  out.push_back(std::move(seq));
}

// Sorted, merged ranges; surrogates removed (they are not characters in UTF-8).
std::vector<CodepointRange> Normalize(std::vector<CodepointRange> ranges, bool negate) {
  std::vector<CodepointRange> merged = internal::MergeRanges(std::move(ranges));
  if (negate) merged = internal::ComplementRanges(merged);
  std::vector<CodepointRange> out;
  for (auto r : merged) {
    if (r.lo < 0xD800 && r.hi > 0xDFFF) {
      out.push_back({r.lo, 0xD7FF});
      out.push_back({0xE000, r.hi});
    } else if (r.hi < 0xD800 || r.lo > 0xDFFF) {
      out.push_back(r);
    } else {
      if (r.lo < 0xD800) out.push_back({r.lo, 0xD7FF});
      if (r.hi > 0xDFFF) out.push_back({0xE000, r.hi});
    }
  }
  return out;
}

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  absl::StatusOr<Grammar> Parse(std::string_view root_rule) {
    SkipSpace(true);
    while (pos_ < text_.size()) {
      TANDEM_RETURN_IF_ERROR(ParseRule());
      SkipSpace(true);
    }
    for (const auto& [index, at] : first_use_) {
      if (!defined_[index]) {
        return ErrorAt(at, absl::StrCat("undefined rule '", grammar_.rules[index].name, "'"));
      }
    }
    auto root = names_.find(std::string(root_rule));
    if (root == names_.end() || !defined_[root->second]) {
      return absl::InvalidArgumentError(
          absl::StrCat("grammar has no root rule '", std::string(root_rule), "'"));
    }
    grammar_.root = root->second;
    TANDEM_RETURN_IF_ERROR(grammar_.CheckNoLeftRecursion());
    return std::move(grammar_);
  }

 private:
  absl::Status ErrorAt(size_t at, std::string_view what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("grammar: line ", line, ", column ", column, ": ", std::string(what)));
  }
  absl::Status Error(std::string_view what) const { return ErrorAt(pos_, what); }

  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek(size_t ahead = 0) const {
    return pos_ + ahead < text_.size() ? text_[pos_ + ahead] : '\0';
  }

  void SkipSpace(bool newlines) {
    while (!AtEnd()) {
      char c = Peek();
      if (c == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  // At a newline outside parentheses: true when the next non-blank line starts with `|`.
  bool ContinuesWithBar() {
    size_t save = pos_;
    SkipSpace(true);
    if (Peek() == '|') return true;
    pos_ = save;
    return false;
  }

  static bool IsNameChar(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  }

  std::string_view ParseName() {
    size_t start = pos_;
    while (!AtEnd() && IsNameChar(Peek())) ++pos_;
    return text_.substr(start, pos_ - start);
  }

  int RuleIndex(std::string_view name) {
    auto it = names_.find(std::string(name));
    if (it != names_.end()) return it->second;
    int index = grammar_.rules.size();
    grammar_.rules.push_back({std::string(name), {}});
    defined_.push_back(false);
    names_.emplace(std::string(name), index);
    return index;
  }

  // A new rule "<parent>_<n>", n chosen so the name is not taken by a rule of the source.
  int NewAuxRuleIndex(int parent) {
    std::string name;
    do {
      name = absl::StrCat(grammar_.rules[parent].name, "_", ++aux_count_[parent]);
    } while (names_.contains(name));
    // Not entered in names_: a rule of the source with the same name stays a different rule.
    int index = grammar_.rules.size();
    grammar_.rules.push_back({std::move(name), {}});
    defined_.push_back(true);
    return index;
  }

  int NewAuxRule(int parent, std::vector<Sequence> alternatives) {
    int index = NewAuxRuleIndex(parent);
    grammar_.rules[index].alternatives = std::move(alternatives);
    return index;
  }

  absl::Status ParseRule() {
    size_t name_at = pos_;
    std::string_view name = ParseName();
    if (name.empty()) return Error("expected a rule name");
    SkipSpace(false);
    if (text_.substr(pos_, 3) != "::=") return Error("expected '::=' after the rule name");
    pos_ += 3;
    SkipSpace(true);
    int index = RuleIndex(name);
    if (defined_[index])
      return ErrorAt(name_at, absl::StrCat("rule '", std::string(name), "' is defined twice"));
    defined_[index] = true;
    TANDEM_ASSIGN_OR_RETURN(auto alternatives, ParseAlternatives(index, /*nested=*/false));
    grammar_.rules[index].alternatives = std::move(alternatives);
    if (!AtEnd() && Peek() != '\n') return Error("expected the end of the line after the rule");
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<Sequence>> ParseAlternatives(int rule, bool nested) {
    std::vector<Sequence> alternatives;
    while (true) {
      TANDEM_ASSIGN_OR_RETURN(Sequence seq, ParseSequence(rule, nested));
      alternatives.push_back(std::move(seq));
      if (!nested && Peek() == '\n' && !ContinuesWithBar()) break;
      if (Peek() != '|') break;
      ++pos_;
      SkipSpace(true);
    }
    return alternatives;
  }

  absl::StatusOr<Sequence> ParseSequence(int rule, bool nested) {
    Sequence seq;
    while (!AtEnd()) {
      char c = Peek();
      if (c == '"') {
        ++pos_;
        while (Peek() != '"') {
          if (AtEnd() || Peek() == '\n') return Error("unterminated string literal");
          TANDEM_ASSIGN_OR_RETURN(uint32_t cp, ParseChar());
          for (char b : EncodeUtf8(cp)) seq.push_back(Element::Byte(static_cast<uint8_t>(b)));
        }
        ++pos_;
      } else if (c == '[') {
        TANDEM_ASSIGN_OR_RETURN(Element e, ParseClass(rule));
        seq.push_back(e);
      } else if (c == '.') {
        ++pos_;
        seq.push_back(ClassElement(rule, Normalize({{0, kMaxCodepoint}}, false)));
      } else if (c == '(') {
        if (++depth_ > kMaxNesting) return Error("parentheses nested too deeply");
        ++pos_;
        SkipSpace(true);
        TANDEM_ASSIGN_OR_RETURN(auto alternatives, ParseAlternatives(rule, /*nested=*/true));
        --depth_;
        if (Peek() != ')') return Error("expected ')'");
        ++pos_;
        seq.push_back(Element::Rule(NewAuxRule(rule, std::move(alternatives))));
      } else if (IsNameChar(c)) {
        size_t at = pos_;
        std::string_view name = ParseName();
        int ref = RuleIndex(name);
        first_use_.emplace(ref, at);
        seq.push_back(Element::Rule(ref));
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        return Error(absl::StrCat("'", std::string(1, c), "' has nothing to repeat"));
      } else {
        break;
      }
      SkipSpace(nested);
      if (AtEnd()) break;
      c = Peek();
      if (c == '*' || c == '+' || c == '?' || c == '{') {
        // A repetition applies to the last element only (the last byte of a literal).
        Element last = seq.back();
        seq.pop_back();
        TANDEM_ASSIGN_OR_RETURN(Element rep, ParseRepetition(rule, last));
        seq.push_back(rep);
        SkipSpace(nested);
      }
    }
    return seq;
  }

  absl::StatusOr<Element> ParseRepetition(int rule, const Element& item) {
    char c = Peek();
    int min = 0, max = -1;  // max -1: unbounded
    if (c == '*') {
      ++pos_;
    } else if (c == '+') {
      ++pos_;
      min = 1;
    } else if (c == '?') {
      ++pos_;
      max = 1;
    } else {
      ++pos_;
      SkipSpace(false);
      TANDEM_ASSIGN_OR_RETURN(min, ParseInt());
      SkipSpace(false);
      max = min;
      if (Peek() == ',') {
        ++pos_;
        SkipSpace(false);
        if (Peek() == '}') {
          max = -1;
        } else {
          TANDEM_ASSIGN_OR_RETURN(max, ParseInt());
          SkipSpace(false);
        }
      }
      if (Peek() != '}') return Error("expected '}' to close the repetition");
      ++pos_;
      if (max != -1 && max < min) return Error("repetition {m,n} has n < m");
    }
    // item{min} then either item* or (max - min) nested optionals.
    Sequence seq(min, item);
    if (max == -1) {
      int star = NewAuxRuleIndex(rule);
      grammar_.rules[star].alternatives = {{item, Element::Rule(star)}, {}};
      seq.push_back(Element::Rule(star));
    } else if (max > min) {
      int tail = -1;
      for (int i = 0; i < max - min; ++i) {
        Sequence more = {item};
        if (tail >= 0) more.push_back(Element::Rule(tail));
        tail = NewAuxRule(rule, {std::move(more), {}});
      }
      seq.push_back(Element::Rule(tail));
    }
    if (seq.size() == 1) return seq[0];
    return Element::Rule(NewAuxRule(rule, {std::move(seq)}));
  }

  absl::StatusOr<int> ParseInt() {
    size_t start = pos_;
    int64_t value = 0;
    while (Peek() >= '0' && Peek() <= '9') {
      value = value * 10 + (Peek() - '0');
      if (value > kMaxRepetition) {
        return ErrorAt(start, absl::StrCat("repetition bound over ", kMaxRepetition));
      }
      ++pos_;
    }
    if (pos_ == start) return Error("expected a number in the repetition");
    return static_cast<int>(value);
  }

  absl::StatusOr<uint32_t> ParseHex(int digits) {
    uint32_t value = 0;
    for (int i = 0; i < digits; ++i) {
      int d = internal::HexDigit(Peek());
      if (d < 0) return Error(absl::StrCat("expected ", digits, " hex digits"));
      value = value * 16 + d;
      ++pos_;
    }
    if (value > kMaxCodepoint) return Error("code point above U+10FFFF");
    return value;
  }

  // One character of a literal or class: an escape or a UTF-8 encoded code point.
  absl::StatusOr<uint32_t> ParseChar() {
    uint8_t c = Peek();
    if (c == '\\') {
      ++pos_;
      char e = Peek();
      ++pos_;
      switch (e) {
        case 'n':
          return '\n';
        case 'r':
          return '\r';
        case 't':
          return '\t';
        case '0':
          return 0;
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '\'':
        case '/':
          return static_cast<uint8_t>(e);
        case 'x':
          return ParseHex(2);
        case 'u':
          return ParseHex(4);
        case 'U':
          return ParseHex(8);
        default:
          pos_ -= 2;
          return Error(absl::StrCat("unknown escape '\\", std::string(1, e), "'"));
      }
    }
    uint32_t cp = 0;
    const int n = internal::DecodeUtf8(text_, pos_, &cp);
    if (n == 0) return Error("invalid UTF-8 in the grammar");
    pos_ += n;
    return cp;
  }

  absl::StatusOr<Element> ParseClass(int rule) {
    size_t start = pos_;
    ++pos_;
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    std::vector<CodepointRange> ranges;
    while (Peek() != ']') {
      if (AtEnd() || Peek() == '\n') return ErrorAt(start, "unterminated character class");
      TANDEM_ASSIGN_OR_RETURN(uint32_t lo, ParseChar());
      uint32_t hi = lo;
      if (Peek() == '-' && Peek(1) != ']') {
        ++pos_;
        if (AtEnd() || Peek() == '\n') return ErrorAt(start, "unterminated character class");
        TANDEM_ASSIGN_OR_RETURN(hi, ParseChar());
        if (hi < lo) return Error("character range is reversed");
      }
      ranges.push_back({lo, hi});
    }
    ++pos_;
    std::vector<CodepointRange> normalized = Normalize(std::move(ranges), negate);
    if (normalized.empty()) return ErrorAt(start, "character class matches nothing");
    return ClassElement(rule, normalized);
  }

  // An ASCII-only class is one byte set; otherwise an auxiliary rule of byte sequences.
  Element ClassElement(int rule, const std::vector<CodepointRange>& ranges) {
    std::bitset<256> ascii;
    std::vector<Sequence> multibyte;
    for (auto r : ranges) {
      for (uint32_t cp = r.lo; cp <= std::min<uint32_t>(r.hi, 0x7F); ++cp) ascii.set(cp);
      if (r.hi >= 0x80) SplitUtf8(std::max<uint32_t>(r.lo, 0x80), r.hi, multibyte);
    }
    if (multibyte.empty()) return Element::Bytes(ascii);
    if (ascii.any()) multibyte.insert(multibyte.begin(), Sequence{Element::Bytes(ascii)});
    return Element::Rule(NewAuxRule(rule, std::move(multibyte)));
  }

  std::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
  Grammar grammar_;
  std::vector<bool> defined_;
  absl::flat_hash_map<std::string, int> names_;
  absl::flat_hash_map<int, size_t> first_use_;
  absl::flat_hash_map<int, int> aux_count_;
};

}  // namespace

absl::StatusOr<Grammar> ParseGbnf(std::string_view text, std::string_view root_rule) {
  return Parser(text).Parse(root_rule);
}

}  // namespace tandem::grammar
