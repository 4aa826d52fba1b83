#include "text/src/tokenizer/pre_tokenizer.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "text/src/tokenizer/unicode.h"

namespace tandem::text::bpe {
namespace {

struct Pcre2MatchDataFree {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

constexpr std::string_view kWhiteSpaceClassBody =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}";

// Rewrites `\s` (and `\S` outside classes) to the Unicode White_Space set. PCRE2's own `\s`
// also takes U+180E, which the reference tokenizers do not treat as a space.
std::string WithWhiteSpaceProperty(std::string_view pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char e = pattern[i + 1];
      if (e == 's') {
        absl::StrAppend(&out, in_class ? "" : "[", ToAbsl(kWhiteSpaceClassBody),
                        in_class ? "" : "]");
      } else if (e == 'S' && !in_class) {
        absl::StrAppend(&out, "[^", ToAbsl(kWhiteSpaceClassBody), "]");
      } else if (e == 'Q') {  // \Q...\E is literal text: copy it untouched
        size_t end = pattern.find("\\E", i + 2);
        end = end == std::string_view::npos ? pattern.size() : end + 2;
        out.append(pattern.substr(i, end - i));
        i = end - 1;
        continue;
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      size_t end = pattern.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(pattern.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal,
                                                      const std::string& where) {
  std::string source = literal ? std::string(pattern) : WithWhiteSpaceProperty(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                                   options, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat(where, ": invalid regex '", ToAbsl(pattern),
                                                   "' at offset ", offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  auto regex = std::unique_ptr<Regex>(new Regex);
  regex->code_.reset(code);
  // Without JIT (unsupported CPU) pcre2_match interprets the pattern: slower, same results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return regex;
}

void Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree> data(
      pcre2_match_data_create_from_pattern(code_.get(), nullptr));
  static const char kEmpty[] = "";
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.empty() ? kEmpty : text.data());
  size_t offset = 0;
  while (offset <= text.size()) {
    int rc = pcre2_match(code_.get(), subject, text.size(), offset, PCRE2_NO_UTF_CHECK, data.get(),
                         nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The interpreter keeps its backtracking state on the heap instead.
      rc = pcre2_match(code_.get(), subject, text.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       data.get(), nullptr);
    }
    // No match ends the scan; so does a resource limit, leaving the rest as one gap.
    if (rc < 0) return;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      out->emplace_back(begin, end);
      offset = end;
    } else {
      if (begin >= text.size()) return;
      int n = 0;
      DecodeAt(text, begin, &n);
      offset = begin + n;
    }
  }
}

void SplitAround(const Regex& regex, std::string_view piece, bool keep_matches,
                 std::vector<std::string>* out) {
  std::vector<std::pair<size_t, size_t>> matches;
  regex.FindAll(piece, &matches);
  size_t prev = 0;
  for (auto [begin, end] : matches) {
    if (begin > prev) out->emplace_back(piece.substr(prev, begin - prev));
    if (keep_matches) out->emplace_back(piece.substr(begin, end - begin));
    prev = end;
  }
  if (prev < piece.size()) out->emplace_back(piece.substr(prev));
}

}  // namespace tandem::text::bpe
