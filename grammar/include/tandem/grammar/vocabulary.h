// A tokenizer's vocabulary as byte strings, with the byte trie token masks are computed over.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::grammar {

// Token id -> bytes (e.g. text::Tokenizer::TokenBytes for every id), which ids end generation
// (allowed only once the grammar is complete), and which are special (never produced by a
// grammar: their content is not text). Immutable; shared by every grammar compiled for it.
//   std::vector<std::string> bytes;
//   for (int id = 0; id < tok.vocab_size(); ++id) bytes.push_back(tok.TokenBytes(id));
//   TANDEM_ASSIGN_OR_RETURN(auto vocab, TokenVocabulary::Create(std::move(bytes), {eos},
//   specials));
class TokenVocabulary {
 public:
  // A node of the trie over every grammar-visible token's bytes, in depth-first pre-order:
  // node 0 is the root (the empty prefix); the subtree of node i is [i, subtree_end).
  struct TrieNode {
    uint8_t byte = 0;          // the edge from the parent
    int32_t depth = 0;         // bytes from the root
    int32_t subtree_end = 0;   // one past the last node under this one
    int32_t tokens_begin = 0;  // ids whose bytes end here: sorted_tokens()[begin, end)
    int32_t tokens_end = 0;
  };

  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> Create(
      std::vector<std::string> token_bytes, std::vector<int32_t> stop_ids,
      std::vector<int32_t> special_ids);

  int size() const { return static_cast<int>(token_bytes_.size()); }
  const std::string& bytes(int32_t id) const { return token_bytes_[id]; }
  std::span<const int32_t> stop_ids() const { return stop_ids_; }
  std::span<const TrieNode> trie() const { return trie_; }
  // Grammar-visible ids sorted by their bytes (the trie's leaf order).
  std::span<const int32_t> sorted_tokens() const { return sorted_tokens_; }
  // Position of `id` in sorted_tokens(), or -1 for stop, special and empty tokens.
  int32_t rank(int32_t id) const { return rank_[id]; }
  // A hash of every token's bytes and kind: grammars compiled for equal vocabularies are equal.
  uint64_t fingerprint() const { return fingerprint_; }

 private:
  TokenVocabulary() = default;
  std::vector<std::string> token_bytes_;
  std::vector<int32_t> stop_ids_;
  std::vector<TrieNode> trie_;
  std::vector<int32_t> sorted_tokens_;
  std::vector<int32_t> rank_;
  uint64_t fingerprint_ = 0;
};

}  // namespace tandem::grammar
