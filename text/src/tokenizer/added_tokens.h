// Added tokens (special and not) of a tokenizer.json and the matcher that cuts them out of
// text before the rest is normalized and pre-tokenized.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "text/src/tokenizer/unicode.h"

namespace tandem::text::bpe {

// One entry of tokenizer.json's added_tokens.
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

}  // namespace tandem::text::bpe
