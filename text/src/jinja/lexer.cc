// The lexer: template source to tokens (see lexer.h).

#include "text/src/jinja/lexer.h"

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/utf8.h"

namespace tandem::text::jinja {

absl::Status SyntaxError(int line, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("template line ", line, ": ", msg));
}

namespace {

bool IsHex(char c) { return IsAsciiDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Decodes a string literal's backslash escapes as Python's "unicode-escape" codec does;
// unknown escapes keep their backslash.
absl::StatusOr<std::string> UnescapeLiteral(std::string_view raw, int line) {
  std::string out;
  out.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    char c = raw[i];
    if (c != '\\' || i + 1 == raw.size()) {
      out.push_back(c);
      continue;
    }
    char e = raw[++i];
    switch (e) {
      case '\n':
        break;  // Line continuation.
      case '\\':
      case '\'':
      case '"':
        out.push_back(e);
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'x':
      case 'u':
      case 'U': {
        size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        if (i + digits >= raw.size()) {
          return SyntaxError(line, absl::StrCat("truncated \\", std::string(1, e), " escape"));
        }
        uint32_t cp = 0;
        for (size_t k = 1; k <= digits; ++k) {
          char h = raw[i + k];
          if (!IsHex(h)) {
            return SyntaxError(line, absl::StrCat("truncated \\", std::string(1, e), " escape"));
          }
          cp = cp * 16 + (IsAsciiDigit(h) ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        if (cp > 0x10FFFF) return SyntaxError(line, "illegal Unicode character");
        AppendUtf8(cp, &out);
        i += digits;
        break;
      }
      case 'N':
        return SyntaxError(line, "\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = e - '0';
          for (int k = 0; k < 2 && i + 1 < raw.size() && raw[i + 1] >= '0' && raw[i + 1] <= '7';
               ++k) {
            cp = cp * 8 + (raw[++i] - '0');
          }
          AppendUtf8(cp, &out);
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Jinja2 splits on \r\n, \r and \n, drops one trailing empty line and joins with \n.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < src_.size()) {
      size_t d = FindDelimiter(pos_);
      if (d == std::string::npos) {
        Emit(Tok::kText, src_.substr(pos_), pos_);
        break;
      }
      std::string_view text = std::string_view(src_).substr(pos_, d - pos_);
      char kind = src_[d + 1];
      size_t p = d + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      size_t raw_body = kind == '%' ? MatchRawBegin(p) : std::string::npos;
      EmitText(text, sign, kind != '{');
      line_starting_ = false;
      if (raw_body != std::string::npos) {
        TANDEM_RETURN_IF_ERROR(LexRaw(d, raw_body));
      } else if (kind == '#') {
        TANDEM_RETURN_IF_ERROR(LexComment(d, p));
      } else {
        TANDEM_RETURN_IF_ERROR(LexTag(d, p, kind == '%'));
      }
    }
    Token eof{Tok::kEof, "", LineAt(src_.size())};
    out_.push_back(std::move(eof));
    return std::move(out_);
  }

 private:
  int LineAt(size_t pos) {
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_) {
      if (src_[line_pos_] == '\n') ++line_;
    }
    return line_;
  }

  void Emit(Tok type, std::string text, size_t at) {
    Token t{type, std::move(text), LineAt(at)};
    out_.push_back(std::move(t));
  }

  bool StartsWith(size_t at, std::string_view s) const {
    return src_.compare(at, s.size(), s) == 0;
  }

  size_t FindDelimiter(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // Text before a tag, with the stripping its opening delimiter asks for. `block` is true for
  // statement and comment tags, the ones lstrip_blocks applies to.
  void EmitText(std::string_view text, char sign, bool block) {
    size_t at = pos_;
    if (sign == '-') {
      text = RStripSpace(text);
    } else if (sign != '+' && block) {
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string_view::npos ? 0 : l_pos + 1;
      if ((l_pos > 0 || line_starting_) && l_pos < text.size() &&
          SpaceRunFrom(text, l_pos) == text.size() - l_pos) {
        text = text.substr(0, l_pos);
      }
    }
    if (!text.empty()) Emit(Tok::kText, std::string(text), at);
  }

  // Position after "{% raw %}" when the tag at `p` (after "{%" and its sign) is one, else npos.
  size_t MatchRawBegin(size_t p) const {
    p += SpaceRunFrom(src_, p);
    if (!StartsWith(p, "raw")) return std::string::npos;
    p += 3;
    p += SpaceRunFrom(src_, p);
    if (StartsWith(p, "-%}")) return p + 3 + SpaceRunFrom(src_, p + 3);
    if (StartsWith(p, "%}")) return p + 2;
    return std::string::npos;
  }

  // The end of a statement tag starting at `p` ("+%}", "-%}" plus whitespace, "%}" plus one
  // newline), or npos.
  size_t MatchBlockEnd(size_t p) const {
    if (StartsWith(p, "+%}")) return p + 3;
    if (StartsWith(p, "-%}")) return p + 3 + SpaceRunFrom(src_, p + 3);
    if (StartsWith(p, "%}")) return p + 2 + (StartsWith(p + 2, "\n") ? 1 : 0);
    return std::string::npos;
  }

  absl::Status LexRaw(size_t begin, size_t body) {
    for (size_t i = src_.find("{%", body); i != std::string::npos; i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      p += SpaceRunFrom(src_, p);
      if (!StartsWith(p, "endraw")) continue;
      p += 6;
      p += SpaceRunFrom(src_, p);
      size_t end = MatchBlockEnd(p);
      if (end == std::string::npos) continue;
      line_starting_ = src_[body - 1] == '\n';
      pos_ = body;
      EmitText(std::string_view(src_).substr(body, i - body), sign, true);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return absl::OkStatus();
    }
    return SyntaxError(LineAt(begin), "missing end of raw directive");
  }

  absl::Status LexComment(size_t begin, size_t p) {
    for (size_t i = p; i < src_.size(); ++i) {
      size_t end = std::string::npos;
      if (StartsWith(i, "+#}")) {
        end = i + 3;
      } else if (StartsWith(i, "-#}")) {
        end = i + 3 + SpaceRunFrom(src_, i + 3);
      } else if (StartsWith(i, "#}")) {
        end = i + 2 + (StartsWith(i + 2, "\n") ? 1 : 0);
      }
      if (end != std::string::npos) {
        line_starting_ = src_[end - 1] == '\n';
        pos_ = end;
        return absl::OkStatus();
      }
    }
    return SyntaxError(LineAt(begin), "missing end of comment tag");
  }

  // `(\d+_)*\d+` at `i`: the end of the digits, or npos.
  size_t MatchDigits(size_t i) const {
    if (i >= src_.size() || !IsAsciiDigit(src_[i])) return std::string::npos;
    while (true) {
      while (i < src_.size() && IsAsciiDigit(src_[i])) ++i;
      if (i + 1 < src_.size() && src_[i] == '_' && IsAsciiDigit(src_[i + 1])) {
        ++i;
      } else {
        return i;
      }
    }
  }

  size_t MatchExponent(size_t i) const {
    if (i >= src_.size() || (src_[i] != 'e' && src_[i] != 'E')) return std::string::npos;
    ++i;
    if (i < src_.size() && (src_[i] == '+' || src_[i] == '-')) ++i;
    return MatchDigits(i);
  }

  size_t MatchFloat(size_t i) const {
    if (i > 0 && src_[i - 1] == '.') return std::string::npos;
    size_t a = MatchDigits(i);
    if (a == std::string::npos) return a;
    size_t frac = a < src_.size() && src_[a] == '.' ? MatchDigits(a + 1) : std::string::npos;
    size_t after = frac != std::string::npos ? frac : a;
    size_t exp = MatchExponent(after);
    if (exp != std::string::npos) return exp;
    return frac;
  }

  // Integer literal forms: 0b.., 0o.., 0x.., decimal, with single underscores between digits.
  size_t MatchInt(size_t i, int* base) const {
    auto run = [&](size_t j, auto is_digit) {
      size_t k = j;
      while (true) {
        size_t m = k;
        if (m < src_.size() && src_[m] == '_') ++m;
        if (m < src_.size() && is_digit(src_[m])) {
          k = m + 1;
        } else {
          return k;
        }
      }
    };
    if (i >= src_.size() || !IsAsciiDigit(src_[i])) return std::string::npos;
    if (src_[i] == '0' && i + 1 < src_.size()) {
      char b = src_[i + 1] | 0x20;
      auto try_base = [&](int radix, auto is_digit) -> size_t {
        size_t e = run(i + 2, is_digit);
        if (e == i + 2) return std::string::npos;
        *base = radix;
        return e;
      };
      if (b == 'b') {
        size_t e = try_base(2, [](char c) { return c == '0' || c == '1'; });
        if (e != std::string::npos) return e;
      } else if (b == 'o') {
        size_t e = try_base(8, [](char c) { return c >= '0' && c <= '7'; });
        if (e != std::string::npos) return e;
      } else if (b == 'x') {
        size_t e = try_base(16, IsHex);
        if (e != std::string::npos) return e;
      }
    }
    *base = 10;
    if (src_[i] == '0') return run(i + 1, [](char c) { return c == '0'; });
    return run(i + 1, IsAsciiDigit);
  }

  absl::Status LexTag(size_t begin, size_t p, bool block) {
    Emit(block ? Tok::kBlockBegin : Tok::kVarBegin, "", begin);
    std::string balance;  // Closing brackets still expected.
    size_t i = p;
    while (true) {
      if (i >= src_.size()) {
        return SyntaxError(LineAt(begin), block ? "unexpected end of template, expected '%}'"
                                                : "unexpected end of template, expected '}}'");
      }
      if (balance.empty()) {
        size_t end = std::string::npos;
        if (block) {
          end = MatchBlockEnd(i);
        } else if (StartsWith(i, "-}}")) {
          end = i + 3 + SpaceRunFrom(src_, i + 3);
        } else if (StartsWith(i, "}}")) {
          end = i + 2;
        }
        if (end != std::string::npos) {
          Emit(block ? Tok::kBlockEnd : Tok::kVarEnd, "", i);
          line_starting_ = src_[end - 1] == '\n';
          pos_ = end;
          return absl::OkStatus();
        }
      }
      size_t space = SpaceRunFrom(src_, i);
      if (space > 0) {
        i += space;
        continue;
      }
      char c = src_[i];
      if (size_t e = MatchFloat(i); e != std::string::npos) {
        std::string digits;
        for (size_t k = i; k < e; ++k) {
          if (src_[k] != '_') digits.push_back(src_[k]);
        }
        Token t{Tok::kFloat, digits, LineAt(i)};
        t.float_value = std::strtod(digits.c_str(), nullptr);
        out_.push_back(std::move(t));
        i = e;
        continue;
      }
      int base = 10;
      if (size_t e = MatchInt(i, &base); e != std::string::npos) {
        Token t{Tok::kInt, src_.substr(i, e - i), LineAt(i)};
        uint64_t v = 0;
        for (size_t k = base == 10 ? i : i + 2; k < e; ++k) {
          char d = src_[k];
          if (d == '_') continue;
          int digit = IsAsciiDigit(d) ? d - '0' : (d | 0x20) - 'a' + 10;
          if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - digit) / base) {
            return SyntaxError(t.line, "integer literal too large");
          }
          v = v * base + digit;
        }
        t.int_value = static_cast<int64_t>(v);
        out_.push_back(std::move(t));
        i = e;
        continue;
      }
      if (IsAsciiAlpha(c) || c == '_') {
        size_t e = i + 1;
        while (e < src_.size() &&
               (IsAsciiAlpha(src_[e]) || IsAsciiDigit(src_[e]) || src_[e] == '_')) {
          ++e;
        }
        Emit(Tok::kName, src_.substr(i, e - i), i);
        i = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = i + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e < src_.size()) {
          int line = LineAt(i);
          TANDEM_ASSIGN_OR_RETURN(
              std::string value,
              UnescapeLiteral(std::string_view(src_).substr(i + 1, e - i - 1), line));
          Token t{Tok::kString, std::move(value), line};
          out_.push_back(std::move(t));
          i = e + 1;
          continue;
        }
      }
      static constexpr std::string_view kTwoCharOps[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (std::string_view two : kTwoCharOps) {
        if (StartsWith(i, two)) op = two;
      }
      if (op.empty() &&
          std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) {
        op = std::string(1, c);
      }
      if (op.empty()) {
        return SyntaxError(LineAt(i), absl::StrCat("unexpected char '", std::string(1, c), "'"));
      }
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) return SyntaxError(LineAt(i), absl::StrCat("unexpected '", op, "'"));
        if (balance.back() != op[0]) {
          return SyntaxError(LineAt(i), absl::StrCat("unexpected '", op, "', expected '",
                                                     std::string(1, balance.back()), "'"));
        }
        balance.pop_back();
      }
      Emit(Tok::kOp, op, i);
      i += op.size();
    }
  }

  std::string src_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source) { return Lexer(source).Run(); }

}  // namespace tandem::text::jinja
