// GrammarMatcher: the pushdown matcher over bytes and its token masks.
#include "tandem/grammar/matcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "automaton.h"

namespace tandem::grammar {

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar,
                               int max_rollback_tokens)
    : grammar_(std::move(grammar)),
      arena_(std::make_unique<internal::StackArena>(grammar_->flat())),
      max_rollback_(max_rollback_tokens) {
  internal::StackArena::Expansion start = arena_->Start();
  state_.tops = std::move(start.tops);
  state_.complete = start.ended;
}

GrammarMatcher::~GrammarMatcher() = default;
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;

bool GrammarMatcher::Walk(const std::vector<int32_t>& start, std::string_view bytes, State& out) {
  internal::StackArena::Step step;
  out.tops = start;
  out.complete = state_.complete;
  for (char c : bytes) {
    arena_->Advance(out.tops, static_cast<uint8_t>(c), step);
    if (!step.matched) return false;
    out.tops.swap(step.tops);
    out.complete = step.ended;
  }
  return true;
}

bool GrammarMatcher::AcceptBytes(std::string_view bytes) {
  if (state_.terminated) return false;
  State next;
  if (!Walk(state_.tops, bytes, next)) return false;
  history_.push_back(std::move(state_));
  if (static_cast<int>(history_.size()) > max_rollback_) history_.pop_front();
  state_ = std::move(next);
  return true;
}

bool GrammarMatcher::AcceptToken(int32_t id) {
  const TokenVocabulary& vocab = grammar_->vocabulary();
  if (id < 0 || id >= vocab.size() || state_.terminated) return false;
  const auto stops = vocab.stop_ids();
  if (std::find(stops.begin(), stops.end(), id) != stops.end()) {
    if (!state_.complete) return false;
    history_.push_back(state_);
    if (static_cast<int>(history_.size()) > max_rollback_) history_.pop_front();
    state_.terminated = true;
    return true;
  }
  if (vocab.rank(id) < 0) return false;  // special or empty
  return AcceptBytes(vocab.bytes(id));
}

absl::Status GrammarMatcher::Rollback(int n) {
  if (n < 0 || n > static_cast<int>(history_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("grammar: cannot roll back ", n, " tokens, ", history_.size(), " kept"));
  }
  for (int i = 0; i < n; ++i) {
    state_ = std::move(history_.back());
    history_.pop_back();
  }
  return absl::OkStatus();
}

// Walks the uncertain tokens of one stack in trie order, reusing the states of the prefix a
// token shares with the previous one.
void GrammarMatcher::CheckUncertain(int32_t top, std::span<const int32_t> ranks,
                                    const TokenMask& accepted, std::vector<int32_t>& allowed) {
  const TokenVocabulary& vocab = grammar_->vocabulary();
  const auto sorted = vocab.sorted_tokens();
  std::vector<std::vector<int32_t>> levels = {{top}};
  size_t valid = 1;               // levels[0, valid) hold the states of prev's prefixes
  size_t dead_prefix = SIZE_MAX;  // prev's prefix of this length matches nothing
  internal::StackArena::Step step;
  const std::string* prev = nullptr;
  for (int32_t rank : ranks) {
    const int32_t id = sorted[rank];
    if (MaskAllows(accepted, id)) continue;
    const std::string& bytes = vocab.bytes(id);
    size_t common = 0;
    if (prev != nullptr) {
      const size_t limit = std::min(prev->size(), bytes.size());
      while (common < limit && (*prev)[common] == bytes[common]) ++common;
    }
    prev = &bytes;
    if (common >= dead_prefix) continue;
    dead_prefix = SIZE_MAX;
    valid = std::min(valid, common + 1);
    bool ok = true;
    for (size_t d = valid - 1; d < bytes.size(); ++d) {
      arena_->Advance(levels[d], static_cast<uint8_t>(bytes[d]), step);
      if (!step.matched) {
        dead_prefix = d + 1;
        valid = d + 1;
        ok = false;
        break;
      }
      if (levels.size() <= d + 1) levels.resize(d + 2);
      levels[d + 1] = step.tops;
      valid = d + 2;
    }
    if (ok) allowed.push_back(id);
  }
}

void GrammarMatcher::FillNextTokenMask(TokenMask& mask) {
  const TokenVocabulary& vocab = grammar_->vocabulary();
  mask.assign((vocab.size() + 63) / 64, 0);
  if (state_.terminated) return;
  for (int32_t top : state_.tops) {
    const TokenMask& accepted = grammar_->accepted(arena_->position(top));
    for (size_t w = 0; w < mask.size(); ++w) mask[w] |= accepted[w];
  }
  // The uncertain tokens of a stack are checked once per matcher: stacks are hash-consed, so
  // the same node is the same stack (inside a string, every character leaves the same one).
  for (int32_t top : state_.tops) {
    auto [it, added] = uncertain_allowed_.try_emplace(top);
    if (added) {
      const int32_t pos = arena_->position(top);
      CheckUncertain(top, grammar_->uncertain(pos), grammar_->accepted(pos), it->second);
    }
    for (int32_t id : it->second) mask[id >> 6] |= uint64_t{1} << (id & 63);
  }
  if (state_.complete) {
    for (int32_t id : vocab.stop_ids()) mask[id >> 6] |= uint64_t{1} << (id & 63);
  }
}

}  // namespace tandem::grammar
