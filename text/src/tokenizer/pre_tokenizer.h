// The pre-tokenizer of the byte-level BPE tokenizer: regular expressions (PCRE2, UTF + UCP,
// JIT when available) and the steps that split text into the pieces BPE merges within.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "text/src/tokenizer/unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace tandem::text::bpe {

struct Pcre2CodeFree {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};

class Regex {
 public:
  // `literal` compiles the pattern as plain text (Split's {"String": ...}).
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal,
                                                        const std::string& where);

  // Appends the [begin, end) offsets of every non-empty match, scanning left to right.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;

 private:
  Regex() = default;
  std::unique_ptr<pcre2_code, Pcre2CodeFree> code_;
};

// Pre-tokenizer steps. Pieces are raw bytes; the ByteLevel mapping happens in the model.

// Appends the text between matches of `regex` in `piece` and, with keep_matches, the matches.
void SplitAround(const Regex& regex, std::string_view piece, bool keep_matches,
                 std::vector<std::string>* out);

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

// The GPT-2 word split of ByteLevel with use_regex.
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace tandem::text::bpe
