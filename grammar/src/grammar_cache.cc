// GrammarCache: compiled grammars by (kind, source, vocabulary), compiled once.
#include <future>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/matcher.h"

namespace tandem::grammar {

struct GrammarCache::Entry {
  std::shared_future<absl::StatusOr<std::shared_ptr<const CompiledGrammar>>> result;
  std::list<std::string>::iterator lru;
};

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCache::GetOrCompile(
    std::string_view kind, std::string_view source,
    const std::shared_ptr<const TokenVocabulary>& vocabulary, const Builder& build) {
  std::string key =
      absl::StrCat(std::string(kind), "\n", vocabulary->fingerprint(), "\n", std::string(source));
  std::promise<absl::StatusOr<std::shared_ptr<const CompiledGrammar>>> promise;
  std::shared_future<absl::StatusOr<std::shared_ptr<const CompiledGrammar>>> result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second->lru);
      result = it->second->result;
    } else {
      auto entry = std::make_shared<Entry>();
      entry->result = promise.get_future().share();
      lru_.push_front(key);
      entry->lru = lru_.begin();
      entries_.emplace(key, entry);
      ++compilations_;
      while (entries_.size() > capacity_) {
        entries_.erase(lru_.back());
        lru_.pop_back();
      }
    }
  }
  if (result.valid()) return result.get();
  // This call compiles; others asking for the same key wait on the future.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> compiled =
      [&]() -> absl::StatusOr<std::shared_ptr<const CompiledGrammar>> {
    TANDEM_ASSIGN_OR_RETURN(Grammar grammar, build());
    return CompiledGrammar::Create(grammar, vocabulary);
  }();
  promise.set_value(compiled);
  return compiled;
}

size_t GrammarCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t GrammarCache::compilations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return compilations_;
}

}  // namespace tandem::grammar
