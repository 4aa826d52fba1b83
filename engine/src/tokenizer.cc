// Byte-level BPE read from a Hugging Face tokenizer.json.
//
// Encoding runs the stages in the order the reference implementations do:
//   1. added tokens with normalized=false are cut out of the raw text (leftmost-longest match,
//      honouring lstrip / rstrip / single_word);
//   2. every other section is normalized (NFC and friends, via utf8proc);
//   3. added tokens with normalized=true are cut out of the normalized sections;
//   4. the pre-tokenizer splits the rest into pieces (PCRE2 regex steps, then ByteLevel);
//   5. each piece's bytes are merged by rank (BPE), short pieces through a cache;
//   6. with add_special_tokens, the post-processor templates add BOS and the like.
// Everything the model sees is raw bytes; the ByteLevel byte<->character table is only used
// to read the vocabulary and merges, whose strings are written in that alphabet.
#include "tandem/engine/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

namespace tandem::engine {
namespace {

using Json = nlohmann::json;

// The packaged Abseil has its own string_view type, distinct from std::string_view.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Ids beyond this are rejected as corrupt rather than allocated for.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;
// Pieces up to this many bytes are remembered; longer ones rarely repeat.
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kPieceCacheCapacity = 1 << 16;

// ---------------------------------------------------------------------------------------------
// UTF-8

// Outcome of reading one character at a position: `length` bytes form a valid character, or
// (valid == false) the maximal ill-formed subpart to replace with one U+FFFD.
struct Utf8Step {
  int length;
  bool valid;
};

// Follows the well-formed byte sequences of Unicode Table 3-7, which is also what the WHATWG
// decoder and Python's errors="replace" use to size each replacement.
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

// Decodes the character at s[i] of valid UTF-8.
int32_t DecodeAt(std::string_view s, size_t i, int* length) {
  utf8proc_int32_t cp = 0;
  utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                        static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  *length = n > 0 ? static_cast<int>(n) : 1;
  return n > 0 ? cp : 0xFFFD;
}

// Decodes the character that ends at s[end) of valid UTF-8.
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

// The Unicode White_Space property: what `\s` means to the tokenizers the models were trained
// with, and what lstrip / rstrip of added tokens strip.
bool IsWhiteSpace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Letters, digits and underscore: what a single_word added token must not touch.
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

// ---------------------------------------------------------------------------------------------
// ByteLevel alphabet: every byte stands for one printable character so that BPE vocabularies
// can be stored as text. Bytes that are printable Latin-1 map to themselves; the others
// (controls, space, soft hyphen...) map to U+0100 upwards in byte order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the character standing for each byte
  std::array<int16_t, 324> char_to_byte;      // code point -> byte, -1 where none
};

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

// The bytes a ByteLevel-alphabet string stands for; nullopt when it holds other characters
// (such tokens stand for their own UTF-8, as the reference decoder treats them).
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

// ---------------------------------------------------------------------------------------------
// Unicode normalization

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

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

// ---------------------------------------------------------------------------------------------
// Regex (PCRE2, UTF + UCP, JIT when available)

struct Pcre2CodeFree {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
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

class Regex {
 public:
  // `literal` compiles the pattern as plain text (Split's {"String": ...}).
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal,
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

  // Appends the [begin, end) offsets of every non-empty match, scanning left to right.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
    std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr));
    static const char kEmpty[] = "";
    auto subject = reinterpret_cast<PCRE2_SPTR>(text.empty() ? kEmpty : text.data());
    size_t offset = 0;
    while (offset <= text.size()) {
      int rc = pcre2_match(code_.get(), subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                           data.get(), nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        // The interpreter keeps its backtracking state on the heap instead.
        rc = pcre2_match(code_.get(), subject, text.size(), offset,
                         PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data.get(), nullptr);
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

 private:
  Regex() = default;
  std::unique_ptr<pcre2_code, Pcre2CodeFree> code_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer steps. Pieces are raw bytes; the ByteLevel mapping happens in the model.

// Appends the text between matches of `regex` in `piece` and, with keep_matches, the matches.
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

class PreTokenizerStep {
 public:
  virtual ~PreTokenizerStep() = default;
  virtual void Apply(std::string_view piece, std::vector<std::string>* out) const = 0;
};

// Split with behavior Isolated (matches and the text between them are pieces) or Removed
// (only the text between matches is kept).
class SplitStep : public PreTokenizerStep {
 public:
  SplitStep(std::unique_ptr<Regex> regex, bool keep_matches)
      : regex_(std::move(regex)), keep_matches_(keep_matches) {}

  void Apply(std::string_view piece, std::vector<std::string>* out) const override {
    SplitAround(*regex_, piece, keep_matches_, out);
  }

 private:
  std::unique_ptr<Regex> regex_;
  bool keep_matches_;
};

// ByteLevel: an optional leading space, then (use_regex) the GPT-2 word split.
class ByteLevelStep : public PreTokenizerStep {
 public:
  ByteLevelStep(bool add_prefix_space, std::unique_ptr<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}

  void Apply(std::string_view piece, std::vector<std::string>* out) const override {
    std::string prefixed;
    if (add_prefix_space_ && (piece.empty() || piece[0] != ' ')) {
      prefixed = absl::StrCat(" ", ToAbsl(piece));
      piece = prefixed;
    }
    if (regex_ == nullptr) {
      out->emplace_back(piece);
    } else {
      SplitAround(*regex_, piece, /*keep_matches=*/true, out);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;  // null without use_regex
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// Added tokens

struct AddedToken {
  int32_t id = 0;
  std::string content;  // as matched: normalized first when `normalized`
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// A piece of text between added tokens, or one added token (token >= 0, an index into the
// tokenizer's added-token list).
struct Segment {
  std::string_view text;
  int token = -1;
};

// Finds added tokens leftmost-longest with a byte trie.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() : terminal_(1, -1) { first_byte_.fill(false); }

  bool empty() const { return terminal_.size() == 1; }

  void Add(std::string_view content, int token) {
    if (content.empty()) return;
    int32_t node = 0;
    for (unsigned char b : content) {
      auto [it, inserted] =
          edges_.try_emplace(Edge(node, b), static_cast<int32_t>(terminal_.size()));
      if (inserted) terminal_.push_back(-1);
      node = it->second;
    }
    if (terminal_[node] < 0) terminal_[node] = token;
    first_byte_[static_cast<unsigned char>(content[0])] = true;
  }

  void Split(std::string_view text, const std::vector<AddedToken>& tokens,
             std::vector<Segment>* out) const {
    const auto* p = reinterpret_cast<const uint8_t*>(text.data());
    size_t segment_start = 0;
    std::vector<std::pair<size_t, int>> candidates;  // (end, token), shortest first
    for (size_t i = 0; i < text.size();) {
      if (!first_byte_[p[i]]) {
        ++i;
        continue;
      }
      candidates.clear();
      int32_t node = 0;
      for (size_t j = i; j < text.size(); ++j) {
        auto it = edges_.find(Edge(node, p[j]));
        if (it == edges_.end()) break;
        node = it->second;
        if (terminal_[node] >= 0) candidates.emplace_back(j + 1, terminal_[node]);
      }
      int chosen = -1;
      size_t end = 0;
      for (auto c = candidates.rbegin(); c != candidates.rend(); ++c) {
        if (!tokens[c->second].single_word || IsSingleWord(text, i, c->first)) {
          chosen = c->second;
          end = c->first;
          break;
        }
      }
      if (chosen < 0) {
        ++i;
        continue;
      }
      size_t start = i;
      const AddedToken& token = tokens[chosen];
      int n = 0;
      while (token.lstrip && start > segment_start && IsWhiteSpace(DecodeBefore(text, start, &n))) {
        start -= n;
      }
      while (token.rstrip && end < text.size() && IsWhiteSpace(DecodeAt(text, end, &n))) {
        end += n;
      }
      if (start > segment_start) {
        out->push_back({text.substr(segment_start, start - segment_start), -1});
      }
      out->push_back({text.substr(start, end - start), chosen});
      segment_start = i = end;
    }
    if (segment_start < text.size()) out->push_back({text.substr(segment_start), -1});
  }

 private:
  static uint64_t Edge(int32_t node, uint8_t byte) {
    return (static_cast<uint64_t>(node) << 8) | byte;
  }
  static bool IsSingleWord(std::string_view text, size_t begin, size_t end) {
    int n = 0;
    if (begin > 0 && IsWordChar(DecodeBefore(text, begin, &n))) return false;
    if (end < text.size() && IsWordChar(DecodeAt(text, end, &n))) return false;
    return true;
  }

  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node, byte) -> child node
  std::vector<int32_t> terminal_;                 // node -> token index ending there, or -1
  std::array<bool, 256> first_byte_;
};

// ---------------------------------------------------------------------------------------------
// Reading tokenizer.json

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

std::string TypeOf(const Json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

absl::StatusOr<bool> BoolField(const Json& obj, const char* key, bool fallback,
                               const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Invalid(where, absl::StrCat("'", key, "' must be a boolean"));
  return it->get<bool>();
}

absl::StatusOr<std::string> StringField(const Json& obj, const char* key,
                                        const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return Invalid(where, absl::StrCat("'", key, "' must be a string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<int32_t> IdValue(const Json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
      value.get<int64_t>() >= kMaxTokenId) {
    return Invalid(
        where, absl::StrCat("id ", value.dump(), " is not an integer in [0, ", kMaxTokenId, ")"));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

// The two large parts of a tokenizer.json, read straight off the parser instead of through a
// JSON tree: building that tree for a 128k vocabulary and 280k merges costs most of the load.
struct BulkModel {
  bool has_vocab = false;
  bool has_merges = false;
  std::vector<std::pair<std::string, int32_t>> vocab;
  // Each merge as the merged token's text and where the left part ends in it.
  std::vector<std::pair<std::string, uint32_t>> merges;
};

// SAX handler that builds the JSON tree of everything except model.vocab and model.merges, which
// it collects into a BulkModel (leaving an empty object / array in their place).
class TokenizerJsonReader : public nlohmann::json_sax<Json> {
 public:
  explicit TokenizerJsonReader(BulkModel* bulk) : bulk_(bulk) {}

  Json& root() { return root_; }
  // Set when the handler stopped the parse because of a wrongly typed vocab or merge entry.
  const absl::Status& error() const { return error_; }

  bool null() override { return Value(Json(nullptr)); }
  bool boolean(bool v) override { return Value(Json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == Mode::kVocab) return VocabId(v);
    return Value(Json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == Mode::kVocab) {
      return VocabId(v > static_cast<uint64_t>(kMaxTokenId) ? kMaxTokenId
                                                            : static_cast<int64_t>(v));
    }
    return Value(Json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return Value(Json(v)); }
  bool binary(binary_t& v) override { return Value(Json(v)); }
  bool string(string_t& v) override {
    if (mode_ == Mode::kMerges) {
      size_t space = v.find(' ');
      if (space == std::string::npos || v.find(' ', space + 1) != std::string::npos) {
        return Fail(MergeWhere(), absl::StrCat("'", v, "' is not two tokens separated by a space"));
      }
      v.erase(space, 1);
      bulk_->merges.emplace_back(std::move(v), static_cast<uint32_t>(space));
      return true;
    }
    if (mode_ == Mode::kMergePair) {
      if (pair_size_ == 0) {
        bulk_->merges.emplace_back(std::move(v), 0);
        bulk_->merges.back().second = static_cast<uint32_t>(bulk_->merges.back().first.size());
      } else if (pair_size_ == 1) {
        bulk_->merges.back().first += v;
      }
      ++pair_size_;
      return true;
    }
    return Value(Json(std::move(v)));
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::kNone && InModel() && key_ == "vocab") {
      mode_ = Mode::kVocab;
      bulk_->has_vocab = true;
      return Value(Json::object());
    }
    if (mode_ != Mode::kNone) return BadEntry();
    return Open(Json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNone;
      return true;
    }
    return Close();
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::kNone && InModel() && key_ == "merges") {
      mode_ = Mode::kMerges;
      bulk_->has_merges = true;
      return Value(Json::array());
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kMergePair;
      pair_size_ = 0;
      return true;
    }
    if (mode_ != Mode::kNone) return BadEntry();
    return Open(Json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::kMergePair) {
      if (pair_size_ != 2) return BadEntry();
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kNone;
      return true;
    }
    return Close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error_ = absl::InvalidArgumentError(e.what());
    return false;
  }

 private:
  enum class Mode { kNone, kVocab, kMerges, kMergePair };

  // True when the container being filled is the object under the top-level "model" key.
  bool InModel() const {
    return stack_.size() == 2 && stack_keys_[1] == "model" && stack_[1]->is_object();
  }
  std::string MergeWhere() const {
    return absl::StrCat("model.merges[", bulk_->merges.size() - (mode_ == Mode::kMergePair), "]");
  }
  bool Fail(const std::string& where, const std::string& what) {
    error_ = Invalid(where, what);
    return false;
  }
  bool BadEntry() {
    if (mode_ == Mode::kVocab)
      return Fail("model.vocab", absl::StrCat("id of '", key_, "' must be an integer"));
    return Fail(MergeWhere(), "must be \"a b\" or [\"a\", \"b\"]");
  }
  bool VocabId(int64_t id) {
    if (id < 0 || id >= kMaxTokenId) {
      return Fail("model.vocab",
                  absl::StrCat("id ", id, " of '", key_, "' is not in [0, ", kMaxTokenId, ")"));
    }
    bulk_->vocab.emplace_back(std::move(key_), static_cast<int32_t>(id));
    return true;
  }
  // Adds a scalar (or an empty placeholder) to the container being filled.
  bool Value(Json v) {
    if (mode_ != Mode::kNone && mode_ != Mode::kVocab && mode_ != Mode::kMerges) return BadEntry();
    if (mode_ != Mode::kNone && !(v.is_object() || v.is_array())) return BadEntry();
    Insert(std::move(v));
    return true;
  }
  Json* Insert(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json* top = stack_.back();
    if (top->is_array()) {
      top->push_back(std::move(v));
      return &top->back();
    }
    Json& slot = (*top)[key_];
    slot = std::move(v);
    return &slot;
  }
  // Containers are filled in place: a parent is not touched again until its child closes, so
  // the pointers on the stack stay valid.
  bool Open(Json container) {
    std::string key = stack_.empty() || stack_.back()->is_array() ? std::string() : key_;
    stack_.push_back(Insert(std::move(container)));
    stack_keys_.push_back(std::move(key));
    return true;
  }
  bool Close() {
    stack_.pop_back();
    stack_keys_.pop_back();
    return true;
  }

  BulkModel* bulk_;  // not owned
  Json root_;
  std::vector<Json*> stack_;             // containers being filled, innermost last
  std::vector<std::string> stack_keys_;  // key each of them sits under ("" in arrays)
  std::string key_;
  Mode mode_ = Mode::kNone;
  int pair_size_ = 0;
  absl::Status error_;
};

// One post-processor template: the ids of the encoded text ($A) with special tokens around it.
struct Template {
  struct Item {
    bool is_sequence = false;
    std::vector<int32_t> ids;  // special token ids when !is_sequence
  };
  std::vector<Item> items;
};

// ---------------------------------------------------------------------------------------------

class ByteLevelBpeTokenizer : public Tokenizer {
 public:
  // `root` is the document without model.vocab and model.merges, which come in `bulk`.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const Json& root, BulkModel& bulk) {
    if (!root.is_object()) return Invalid("tokenizer.json", "top level must be an object");
    auto tok = std::unique_ptr<ByteLevelBpeTokenizer>(new ByteLevelBpeTokenizer);
    for (const char* key : {"truncation", "padding"}) {
      auto it = root.find(key);
      if (it != root.end() && !it->is_null()) {
        return Invalid(key, "is not supported (must be null); Tandem limits lengths itself");
      }
    }
    TANDEM_RETURN_IF_ERROR(tok->LoadModel(root, bulk));
    TANDEM_RETURN_IF_ERROR(tok->LoadNormalizer(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadAddedTokens(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadPreTokenizer(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadDecoder(root));
    auto post = root.find("post_processor");
    if (post != root.end()) {
      TANDEM_RETURN_IF_ERROR(tok->LoadPostProcessor(*post, "post_processor"));
    }
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override {
    std::string sanitized;
    if (!IsValidUtf8(text)) {
      sanitized = ReplaceInvalidUtf8(text);
      text = sanitized;
    }
    std::vector<int32_t> ids;
    Walk(
        text, [&](int32_t id) { ids.push_back(id); },
        [&](std::string_view piece) { EncodePiece(piece, &ids); });
    if (add_special_tokens) {
      for (const Template& t : templates_) {
        std::vector<int32_t> out;
        out.reserve(ids.size() + 4);
        for (const Template::Item& item : t.items) {
          const std::vector<int32_t>& src = item.is_sequence ? ids : item.ids;
          out.insert(out.end(), src.begin(), src.end());
        }
        ids = std::move(out);
      }
    }
    return ids;
  }

  std::vector<std::string> PreTokenize(std::string_view text) const override {
    std::string sanitized;
    if (!IsValidUtf8(text)) {
      sanitized = ReplaceInvalidUtf8(text);
      text = sanitized;
    }
    std::vector<std::string> pieces;
    Walk(
        text, [](int32_t) {}, [&](std::string_view piece) { pieces.emplace_back(piece); });
    return pieces;
  }

  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::string bytes;
    for (int32_t id : ids) {
      // Ids outside the vocabulary stand for nothing; callers validate ids they take as input.
      if (id < 0 || id >= vocab_size()) continue;
      if (skip_special_tokens && special_[id]) continue;
      bytes += id_to_bytes_[id];
    }
    return ReplaceInvalidUtf8(bytes);
  }

  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? id_to_bytes_[id] : std::string();
  }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (auto it = added_ids_.find(ToAbsl(token)); it != added_ids_.end()) return it->second;
    if (auto it = vocab_.find(ToAbsl(token)); it != vocab_.end()) return it->second;
    return std::nullopt;
  }

  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size() && special_[id]; }

  int vocab_size() const override { return static_cast<int>(id_to_bytes_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;
  };

  ByteLevelBpeTokenizer() = default;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  void GrowTo(int32_t id) {
    if (id >= static_cast<int32_t>(id_to_bytes_.size())) {
      id_to_bytes_.resize(id + 1);
      special_.resize(id + 1, false);
    }
  }

  absl::Status LoadModel(const Json& root, BulkModel& bulk) {
    auto it = root.find("model");
    if (it == root.end() || !it->is_object()) {
      return Invalid("model", "missing (a BPE model with vocab and merges is required)");
    }
    const Json& model = *it;
    std::string type = TypeOf(model);
    if (!type.empty() && type != "BPE") {
      return Invalid("model", absl::StrCat("unsupported type '", type, "' (only BPE)"));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto f = model.find(key);
      if (f != model.end() && !f->is_null() && !(f->is_string() && f->get<std::string>().empty())) {
        return Invalid("model", absl::StrCat("'", key, "' is not supported"));
      }
    }
    if (auto f = model.find("dropout");
        f != model.end() && !f->is_null() && !(f->is_number() && f->get<double>() == 0.0)) {
      return Invalid("model", "'dropout' is not supported");
    }
    TANDEM_ASSIGN_OR_RETURN(bool byte_fallback, BoolField(model, "byte_fallback", false, "model"));
    if (byte_fallback) return Invalid("model", "'byte_fallback' is not supported");
    TANDEM_ASSIGN_OR_RETURN(ignore_merges_, BoolField(model, "ignore_merges", false, "model"));
    if (!bulk.has_vocab) return Invalid("model", "'vocab' must be an object of token -> id");
    if (!bulk.has_merges) return Invalid("model", "'merges' must be an array");

    int32_t max_id = -1;
    for (const auto& entry : bulk.vocab) max_id = std::max(max_id, entry.second);
    GrowTo(max_id);
    std::vector<bool> seen(max_id + 1, false);
    vocab_.reserve(bulk.vocab.size());
    for (auto& [token, id] : bulk.vocab) {
      if (seen[id]) {
        return Invalid("model.vocab",
                       absl::StrCat("id ", id, " is used twice (again by '", token, "')"));
      }
      seen[id] = true;
      std::optional<std::string> bytes = FromByteLevel(token);
      id_to_bytes_[id] = bytes ? std::move(*bytes) : token;
      vocab_.emplace(std::move(token), id);
    }
    const ByteLevelAlphabet& alphabet = Alphabet();
    for (int b = 0; b < 256; ++b) {
      auto f = vocab_.find(alphabet.byte_to_char[b]);
      byte_ids_[b] = f == vocab_.end() ? -1 : f->second;
    }
    if (auto unk = model.find("unk_token"); unk != model.end() && unk->is_string()) {
      if (auto f = vocab_.find(unk->get<std::string>()); f != vocab_.end()) unk_id_ = f->second;
    }

    merges_.reserve(bulk.merges.size());
    for (size_t rank = 0; rank < bulk.merges.size(); ++rank) {
      absl::string_view merged = bulk.merges[rank].first;
      const size_t split = bulk.merges[rank].second;
      absl::string_view names[3] = {merged.substr(0, split), merged.substr(split), merged};
      int32_t ids[3];
      for (int k = 0; k < 3; ++k) {
        auto f = vocab_.find(names[k]);
        if (f == vocab_.end()) {
          return Invalid(absl::StrCat("model.merges[", rank, "]"),
                         absl::StrCat("'", names[k], "' is not in the vocabulary"));
        }
        ids[k] = f->second;
      }
      // A pair listed twice keeps its first (best) rank.
      merges_.try_emplace(PairKey(ids[0], ids[1]), Merge{static_cast<int32_t>(rank), ids[2]});
    }
    return absl::OkStatus();
  }

  absl::Status ParseNormalizer(const Json& n, const std::string& where) {
    if (n.is_null()) return absl::OkStatus();
    std::string type = TypeOf(n);
    if (type == "NFC") {
      normal_forms_.push_back(NormalForm::kNfc);
    } else if (type == "NFD") {
      normal_forms_.push_back(NormalForm::kNfd);
    } else if (type == "NFKC") {
      normal_forms_.push_back(NormalForm::kNfkc);
    } else if (type == "NFKD") {
      normal_forms_.push_back(NormalForm::kNfkd);
    } else if (type == "Sequence") {
      auto list = n.find("normalizers");
      if (list == n.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'normalizers' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            ParseNormalizer((*list)[i], absl::StrCat(where, ".normalizers[", i, "]")));
      }
    } else {
      return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? n.dump() : type,
                                         "' (supported: NFC, NFD, NFKC, NFKD, Sequence)"));
    }
    return absl::OkStatus();
  }

  absl::Status LoadNormalizer(const Json& root) {
    auto it = root.find("normalizer");
    return it == root.end() ? absl::OkStatus() : ParseNormalizer(*it, "normalizer");
  }

  std::string ApplyNormalizer(std::string_view text) const {
    std::string out(text);
    for (NormalForm form : normal_forms_) out = Normalize(out, form);
    return out;
  }

  absl::Status LoadAddedTokens(const Json& root) {
    auto it = root.find("added_tokens");
    if (it == root.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_array()) return Invalid("added_tokens", "must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& a = (*it)[i];
      std::string where = absl::StrCat("added_tokens[", i, "]");
      if (!a.is_object()) return Invalid(where, "must be an object");
      AddedToken token;
      auto id = a.find("id");
      if (id == a.end()) return Invalid(where, "'id' is missing");
      TANDEM_ASSIGN_OR_RETURN(token.id, IdValue(*id, where));
      TANDEM_ASSIGN_OR_RETURN(token.content, StringField(a, "content", where));
      if (token.content.empty() || !IsValidUtf8(token.content)) {
        return Invalid(where, "'content' must be non-empty UTF-8");
      }
      TANDEM_ASSIGN_OR_RETURN(token.special, BoolField(a, "special", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.lstrip, BoolField(a, "lstrip", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.rstrip, BoolField(a, "rstrip", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.single_word, BoolField(a, "single_word", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.normalized, BoolField(a, "normalized", !token.special, where));
      if (!added_ids_.emplace(token.content, token.id).second) {
        return Invalid(where, absl::StrCat("'", token.content, "' is listed twice"));
      }
      GrowTo(token.id);
      id_to_bytes_[token.id] = token.content;
      special_[token.id] = token.special;
      int index = static_cast<int>(added_.size());
      if (token.normalized) {
        // Matched against normalized text, so compare with the normalized spelling.
        normalized_matcher_.Add(ApplyNormalizer(token.content), index);
      } else {
        raw_matcher_.Add(token.content, index);
      }
      added_.push_back(std::move(token));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Regex>> ParsePattern(const Json& step, const std::string& where) {
    auto pattern = step.find("pattern");
    if (pattern != step.end() && pattern->is_object()) {
      if (auto r = pattern->find("Regex"); r != pattern->end() && r->is_string()) {
        return Regex::Compile(r->get<std::string>(), /*literal=*/false, where);
      }
      if (auto s = pattern->find("String"); s != pattern->end() && s->is_string()) {
        return Regex::Compile(s->get<std::string>(), /*literal=*/true, where);
      }
    }
    return Invalid(where, "'pattern' must be {\"Regex\": ...} or {\"String\": ...}");
  }

  absl::Status ParsePreTokenizer(const Json& p, const std::string& where) {
    std::string type = TypeOf(p);
    if (type == "Sequence") {
      auto list = p.find("pretokenizers");
      if (list == p.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'pretokenizers' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            ParsePreTokenizer((*list)[i], absl::StrCat(where, ".pretokenizers[", i, "]")));
      }
      return absl::OkStatus();
    }
    if (has_byte_level_) {
      return Invalid(where, "ByteLevel must be the last pre-tokenizer step");
    }
    if (type == "Split") {
      TANDEM_ASSIGN_OR_RETURN(bool invert, BoolField(p, "invert", false, where));
      if (invert) return Invalid(where, "Split with invert=true is not supported");
      auto behavior = p.find("behavior");
      std::string b =
          behavior != p.end() && behavior->is_string() ? behavior->get<std::string>() : "";
      if (b != "Isolated" && b != "Removed") {
        return Invalid(where, absl::StrCat("Split behavior '", b,
                                           "' is not supported (supported: Isolated, Removed)"));
      }
      TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Regex> regex, ParsePattern(p, where));
      steps_.push_back(std::make_unique<SplitStep>(std::move(regex), b == "Isolated"));
      return absl::OkStatus();
    }
    if (type == "ByteLevel") {
      TANDEM_ASSIGN_OR_RETURN(bool prefix, BoolField(p, "add_prefix_space", true, where));
      TANDEM_ASSIGN_OR_RETURN(bool use_regex, BoolField(p, "use_regex", true, where));
      std::unique_ptr<Regex> regex;
      if (use_regex) {
        TANDEM_ASSIGN_OR_RETURN(regex, Regex::Compile(kGpt2Pattern, false, where));
      }
      steps_.push_back(std::make_unique<ByteLevelStep>(prefix, std::move(regex)));
      has_byte_level_ = true;
      return absl::OkStatus();
    }
    return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? p.dump() : type,
                                       "' (supported: Split, ByteLevel, Sequence)"));
  }

  absl::Status LoadPreTokenizer(const Json& root) {
    auto it = root.find("pre_tokenizer");
    if (it != root.end() && !it->is_null()) {
      TANDEM_RETURN_IF_ERROR(ParsePreTokenizer(*it, "pre_tokenizer"));
    }
    if (!has_byte_level_) {
      return Invalid("pre_tokenizer",
                     "a ByteLevel step is required (only byte-level BPE is supported)");
    }
    return absl::OkStatus();
  }

  absl::Status LoadDecoder(const Json& root) {
    auto it = root.find("decoder");
    std::string type = it == root.end() ? "" : TypeOf(*it);
    if (type != "ByteLevel") {
      return Invalid("decoder",
                     absl::StrCat("unsupported type '",
                                  type.empty() ? (it == root.end() ? "none" : it->dump()) : type,
                                  "' (only ByteLevel)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int32_t>> SpecialTokenIds(const Json& processor,
                                                       const std::string& name,
                                                       const std::string& where) {
    std::vector<int32_t> ids;
    auto specials = processor.find("special_tokens");
    if (specials != processor.end() && specials->is_object()) {
      auto entry = specials->find(name);
      if (entry != specials->end() && entry->is_object()) {
        auto list = entry->find("ids");
        if (list == entry->end() || !list->is_array()) {
          return Invalid(where, absl::StrCat("special_tokens['", name, "'] has no 'ids' array"));
        }
        for (const Json& id : *list) {
          TANDEM_ASSIGN_OR_RETURN(int32_t value, IdValue(id, where));
          if (value >= vocab_size()) {
            return Invalid(where, absl::StrCat("special token id ", value, " is out of range"));
          }
          ids.push_back(value);
        }
        return ids;
      }
    }
    if (std::optional<int32_t> id = TokenToId(name)) return std::vector<int32_t>{*id};
    return Invalid(where, absl::StrCat("special token '", name, "' is not in the vocabulary"));
  }

  absl::Status LoadPostProcessor(const Json& p, const std::string& where) {
    if (p.is_null()) return absl::OkStatus();
    std::string type = TypeOf(p);
    if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets, never ids
    if (type == "Sequence") {
      auto list = p.find("processors");
      if (list == p.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'processors' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            LoadPostProcessor((*list)[i], absl::StrCat(where, ".processors[", i, "]")));
      }
      return absl::OkStatus();
    }
    if (type == "TemplateProcessing") {
      auto single = p.find("single");
      if (single == p.end() || !single->is_array()) {
        return Invalid(where, "TemplateProcessing needs a 'single' array");
      }
      Template t;
      for (const Json& item : *single) {
        if (auto s = item.find("SpecialToken"); item.is_object() && s != item.end()) {
          TANDEM_ASSIGN_OR_RETURN(std::string name, StringField(*s, "id", where));
          TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> ids, SpecialTokenIds(p, name, where));
          t.items.push_back({false, std::move(ids)});
        } else if (auto q = item.find("Sequence"); item.is_object() && q != item.end()) {
          TANDEM_ASSIGN_OR_RETURN(std::string seq, StringField(*q, "id", where));
          if (seq != "A") {
            return Invalid(where, absl::StrCat("single template refers to sequence '", seq, "'"));
          }
          t.items.push_back({true, {}});
        } else {
          return Invalid(where, absl::StrCat("unsupported template item ", item.dump()));
        }
      }
      templates_.push_back(std::move(t));
      return absl::OkStatus();
    }
    return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? p.dump() : type,
                                       "' (supported: TemplateProcessing, ByteLevel, Sequence)"));
  }

  // Runs stages 1-4 on valid UTF-8, calling on_token(id) for added tokens and on_piece(bytes)
  // for each pre-tokenized piece, in text order.
  template <typename OnToken, typename OnPiece>
  void Walk(std::string_view text, OnToken on_token, OnPiece on_piece) const {
    std::vector<Segment> raw;
    raw_matcher_.Split(text, added_, &raw);
    std::vector<Segment> normalized;
    std::vector<std::string> pieces, next;
    for (const Segment& segment : raw) {
      if (segment.token >= 0) {
        on_token(added_[segment.token].id);
        continue;
      }
      std::string norm = ApplyNormalizer(segment.text);
      normalized.clear();
      normalized_matcher_.Split(norm, added_, &normalized);
      for (const Segment& sub : normalized) {
        if (sub.token >= 0) {
          on_token(added_[sub.token].id);
          continue;
        }
        pieces.assign(1, std::string(sub.text));
        for (const auto& step : steps_) {
          next.clear();
          for (const std::string& piece : pieces) step->Apply(piece, &next);
          pieces.swap(next);
        }
        for (const std::string& piece : pieces) on_piece(piece);
      }
    }
  }

  void EncodePiece(std::string_view bytes, std::vector<int32_t>* out) const {
    if (bytes.empty()) return;
    if (ignore_merges_) {
      if (auto it = vocab_.find(ToByteLevel(bytes)); it != vocab_.end()) {
        out->push_back(it->second);
        return;
      }
    }
    const bool cacheable = bytes.size() <= kMaxCachedPieceBytes;
    if (cacheable) {
      std::shared_lock lock(cache_mu_);
      if (auto it = cache_.find(ToAbsl(bytes)); it != cache_.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t first = out->size();
    MergeBytes(bytes, out);
    if (cacheable) {
      std::unique_lock lock(cache_mu_);
      if (cache_.size() >= kPieceCacheCapacity) cache_.clear();
      cache_.try_emplace(std::string(bytes), out->begin() + first, out->end());
    }
  }

  // BPE: repeatedly merges the adjacent pair with the lowest rank, leftmost first on ties.
  // Symbols form a linked list over the byte positions and candidate pairs sit in a min-heap,
  // so a piece of n bytes costs O(n log n).
  void MergeBytes(std::string_view bytes, std::vector<int32_t>* out) const {
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev;
      int32_t next;
    };
    struct Candidate {
      int32_t rank;
      int32_t pos;  // index of the left symbol
      int32_t left;
      int32_t right;
      int32_t merged;
    };
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(bytes.size());
    for (unsigned char b : bytes) {
      int32_t id = byte_ids_[b] >= 0 ? byte_ids_[b] : unk_id_.value_or(-1);
      if (id < 0) continue;  // a byte the vocabulary cannot express is dropped, as upstream
      int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, index - 1, index + 1});
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    std::vector<Candidate> heap;
    auto consider = [&](int32_t pos) {
      const Symbol& left = symbols[pos];
      if (left.next < 0) return;
      int32_t right = symbols[left.next].id;
      auto it = merges_.find(PairKey(left.id, right));
      if (it == merges_.end()) return;
      heap.push_back({it->second.rank, pos, left.id, right, it->second.merged});
      std::push_heap(heap.begin(), heap.end(), later);
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      Candidate c = heap.back();
      heap.pop_back();
      Symbol& left = symbols[c.pos];
      // Skip candidates that an earlier merge made stale.
      if (left.id != c.left || left.next < 0 || symbols[left.next].id != c.right) continue;
      Symbol& right = symbols[left.next];
      left.id = c.merged;
      right.id = -1;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = c.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(c.pos);
    }
    for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
  }

  // Model.
  absl::flat_hash_map<std::string, int32_t> vocab_;  // ByteLevel-alphabet token -> id
  absl::flat_hash_map<uint64_t, Merge> merges_;      // (left id, right id) -> merge
  std::array<int32_t, 256> byte_ids_{};              // id of each single byte, -1 if none
  std::optional<int32_t> unk_id_;
  bool ignore_merges_ = false;
  // Per id: the bytes it decodes to, and whether it is a special added token.
  std::vector<std::string> id_to_bytes_;
  std::vector<bool> special_;
  // Added tokens.
  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, int32_t> added_ids_;  // content -> id
  AddedTokenMatcher raw_matcher_;
  AddedTokenMatcher normalized_matcher_;
  // Normalizer, pre-tokenizer, post-processor.
  std::vector<NormalForm> normal_forms_;
  std::vector<std::unique_ptr<PreTokenizerStep>> steps_;
  bool has_byte_level_ = false;
  std::vector<Template> templates_;
  // Piece -> ids for short pieces; Encode is const and may run on several threads.
  mutable std::shared_mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace

std::string ReplaceInvalidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    Utf8Step step = ReadUtf8(bytes, i);
    if (step.valid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += step.length;
  }
  return out;
}

namespace {

// Errors say which file they concern first: `source` is a path or "tokenizer.json".
absl::StatusOr<std::unique_ptr<Tokenizer>> Parse(std::string_view json, const std::string& source) {
  // nlohmann reports malformed JSON and type mismatches by throwing; nothing escapes this call.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer;
  try {
    BulkModel bulk;
    TokenizerJsonReader reader(&bulk);
    if (Json::sax_parse(json.begin(), json.end(), &reader)) {
      tokenizer = ByteLevelBpeTokenizer::Load(reader.root(), bulk);
    } else {
      tokenizer = reader.error().ok() ? absl::InvalidArgumentError("invalid JSON") : reader.error();
    }
  } catch (const Json::exception& e) {
    tokenizer = absl::InvalidArgumentError(e.what());
  }
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat(source, ": ", tokenizer.status().message()));
  }
  return tokenizer;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json) {
  return Parse(json, "tokenizer.json");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open tokenizer file '", path, "': ", std::strerror(errno)));
  }
  std::string contents;
  in.seekg(0, std::ios::end);
  contents.resize(static_cast<size_t>(std::max<std::streamoff>(0, in.tellg())));
  in.seekg(0, std::ios::beg);
  if (!in.read(contents.data(), static_cast<std::streamsize>(contents.size()))) {
    return absl::DataLossError(absl::StrCat("cannot read tokenizer file '", path, "'"));
  }
  return Parse(contents, path);
}

}  // namespace tandem::engine
