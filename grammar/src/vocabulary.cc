// TokenVocabulary: the byte trie over the grammar-visible tokens.
#include "tandem/grammar/vocabulary.h"

#include <algorithm>
#include <numeric>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace tandem::grammar {

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::Create(
    std::vector<std::string> token_bytes, std::vector<int32_t> stop_ids,
    std::vector<int32_t> special_ids) {
  const int n = token_bytes.size();
  if (n == 0) return absl::InvalidArgumentError("vocabulary: no tokens");
  std::shared_ptr<TokenVocabulary> vocab(new TokenVocabulary());
  std::vector<char> hidden(n, 0);  // 1: special, 2: stop
  for (int32_t id : special_ids) {
    if (id < 0 || id >= n)
      return absl::InvalidArgumentError(
          absl::StrCat("vocabulary: special id ", id, " out of range"));
    hidden[id] = 1;
  }
  for (int32_t id : stop_ids) {
    if (id < 0 || id >= n)
      return absl::InvalidArgumentError(absl::StrCat("vocabulary: stop id ", id, " out of range"));
    hidden[id] = 2;
  }
  std::vector<int32_t> sorted;
  for (int32_t id = 0; id < n; ++id) {
    if (hidden[id] == 0 && !token_bytes[id].empty()) sorted.push_back(id);
  }
  std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) {
    return token_bytes[a] != token_bytes[b] ? token_bytes[a] < token_bytes[b] : a < b;
  });
  vocab->rank_.assign(n, -1);
  for (size_t i = 0; i < sorted.size(); ++i) vocab->rank_[sorted[i]] = i;

  // Build the trie in pre-order: `path` holds the node index at each depth of the last token.
  auto& trie = vocab->trie_;
  trie.push_back({});
  std::vector<int32_t> path = {0};
  const std::string* previous = nullptr;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const std::string& bytes = token_bytes[sorted[i]];
    size_t common = 0;
    if (previous != nullptr) {
      while (common < previous->size() && common < bytes.size() &&
             (*previous)[common] == bytes[common]) {
        ++common;
      }
    }
    while (path.size() > common + 1) {
      trie[path.back()].subtree_end = trie.size();
      path.pop_back();
    }
    for (size_t d = common; d < bytes.size(); ++d) {
      TrieNode node;
      node.byte = static_cast<uint8_t>(bytes[d]);
      node.depth = d + 1;
      node.tokens_begin = node.tokens_end = i;
      path.push_back(trie.size());
      trie.push_back(node);
    }
    TrieNode& last = trie[path.back()];
    if (last.tokens_end == last.tokens_begin) last.tokens_begin = i;
    last.tokens_end = i + 1;
    previous = &bytes;
  }
  while (!path.empty()) {
    trie[path.back()].subtree_end = trie.size();
    path.pop_back();
  }
  vocab->fingerprint_ = absl::Hash<std::vector<std::string>>{}(token_bytes)*0x9E3779B97F4A7C15ull ^
                        absl::Hash<std::vector<char>>{}(hidden);
  vocab->sorted_tokens_ = std::move(sorted);
  vocab->token_bytes_ = std::move(token_bytes);
  for (int32_t id = 0; id < n; ++id) {
    if (hidden[id] == 2) vocab->stop_ids_.push_back(id);
  }
  return std::shared_ptr<const TokenVocabulary>(std::move(vocab));
}

}  // namespace tandem::grammar
