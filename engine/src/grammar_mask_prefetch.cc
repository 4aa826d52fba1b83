// GrammarMaskPrefetch: one job per step on a thread of its own.
#include "grammar_mask_prefetch.h"

namespace tandem::engine::internal {

void GrammarMaskPrefetch::Start(std::vector<grammar::GrammarMatcher*> matchers) {
  Wait();
  matchers_ = std::move(matchers);
  if (masks_.size() < matchers_.size()) masks_.resize(matchers_.size());
  done_ = std::promise<void>();
  pending_ = done_.get_future();
  thread_.Post(
      [this] {
        for (size_t i = 0; i < matchers_.size(); ++i) matchers_[i]->FillNextTokenMask(masks_[i]);
        done_.set_value();
      },
      // Only when the pool stops first, which its destructor does after ours has waited.
      [this] { done_.set_value(); });
}

void GrammarMaskPrefetch::Wait() {
  if (pending_.valid()) pending_.get();
}

}  // namespace tandem::engine::internal
