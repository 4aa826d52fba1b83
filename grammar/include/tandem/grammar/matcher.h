// Compiled grammars (per vocabulary, with context-independent token masks), the byte-level
// pushdown matcher that constrains one sample, and a cache of compiled grammars by hash.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "tandem/grammar/grammar.h"
#include "tandem/grammar/vocabulary.h"

namespace tandem::grammar {

namespace internal {
struct FlatGrammar;
class StackArena;
}  // namespace internal

// A token mask: bit `id % 64` of word `id / 64` is set when the token is allowed.
using TokenMask = std::vector<uint64_t>;
inline bool MaskAllows(const TokenMask& mask, int32_t id) {
  return (mask[id >> 6] >> (id & 63)) & 1;
}

// A grammar lowered to a pushdown automaton for one vocabulary. For every byte-set position
// the vocabulary is split, walking its byte trie once, into tokens accepted whatever the stack
// below the position's rule holds, tokens rejected whatever it holds, and the rest, which the
// matcher checks against the real stack at run time (xgrammar's adaptive masks). Small
// non-recursive rules are inlined first so the positions of a repetition live in one rule.
// Immutable; shared by every matcher of the grammar.
class CompiledGrammar {
 public:
  // The trie walks of the byte-set positions (the compile's cost: one walk of up to the whole
  // vocabulary per position, thousands of positions for bounded strings) run on `num_threads`
  // threads, each with its own stack arena; 0 (the default): one per hardware thread (at most
  // kMaxCompileThreads), or one for a small grammar and vocabulary. The result does not depend
  // on it. Two threads compiled the bounded order schema 1.9x faster than one on the 2-core VM
  // (bench/results/grammar-compile-2026-11-27.md).
  static absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Create(
      const Grammar& grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
      int num_threads = 0);
  static constexpr int kMaxCompileThreads = 16;
  ~CompiledGrammar();

  const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  const internal::FlatGrammar& flat() const { return *flat_; }
  // Tokens decided ahead of time at `position`: accepted ids as a mask, and the ranks (see
  // TokenVocabulary::rank) of those left to the run-time check, ascending.
  const TokenMask& accepted(int32_t position) const { return accepted_[slot_[position]]; }
  std::span<const int32_t> uncertain(int32_t position) const { return uncertain_[slot_[position]]; }
  // Totals over every reachable byte-set position, for benchmarks and logs.
  size_t num_positions() const { return accepted_.size(); }
  size_t num_uncertain() const;

 private:
  CompiledGrammar() = default;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::unique_ptr<internal::FlatGrammar> flat_;
  std::vector<int32_t> slot_;  // position -> index into accepted_ / uncertain_ (-1: none)
  std::vector<TokenMask> accepted_;
  std::vector<std::vector<int32_t>> uncertain_;
};

// The state of one constrained sample: the set of live stacks after the bytes accepted so far.
// Not thread-safe; one per sample. Tokens can be rolled back (a rejected speculative proposal).
//   GrammarMatcher m(compiled);
//   TokenMask mask;
//   m.FillNextTokenMask(mask);     // sample among allowed ids
//   m.AcceptToken(id);             // false (state unchanged) when the grammar forbids it
class GrammarMatcher {
 public:
  // Keeps the states of the last `max_rollback_tokens` tokens for Rollback.
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar,
                          int max_rollback_tokens = 16);
  ~GrammarMatcher();
  GrammarMatcher(GrammarMatcher&&) noexcept;

  // Consumes a token's bytes (or a stop token once complete). False, state unchanged, when
  // not allowed.
  bool AcceptToken(int32_t id);
  // Consumes raw bytes as one step (e.g. a forced prefix). False, state unchanged, when not
  // allowed.
  bool AcceptBytes(std::string_view bytes);
  // The grammar can end here (a stop token would be accepted).
  bool IsComplete() const { return state_.complete; }
  // A stop token was accepted: nothing more is allowed.
  bool IsTerminated() const { return state_.terminated; }
  // Undoes the last `n` accepted steps; InvalidArgument if fewer are kept.
  absl::Status Rollback(int n);
  // Sets `mask` (resized to the vocabulary) to the tokens AcceptToken would accept.
  void FillNextTokenMask(TokenMask& mask);

 private:
  struct State {
    std::vector<int32_t> tops;
    bool complete = false;
    bool terminated = false;
  };
  bool Walk(const std::vector<int32_t>& start, std::string_view bytes, State& out);
  // Appends to `allowed` the tokens of `ranks` that `top` accepts and `accepted` does not hold.
  void CheckUncertain(int32_t top, std::span<const int32_t> ranks, const TokenMask& accepted,
                      std::vector<int32_t>& allowed);

  std::shared_ptr<const CompiledGrammar> grammar_;
  std::unique_ptr<internal::StackArena> arena_;
  int max_rollback_;
  State state_;
  std::deque<State> history_;
  absl::flat_hash_map<int32_t, std::vector<int32_t>> uncertain_allowed_;  // stack node -> ids
};

// Compiled grammars by (kind, source, vocabulary), least recently used evicted past
// `capacity`. Thread-safe; a grammar compiles once even when asked for concurrently.
//   auto compiled = cache.GetOrCompile("json_schema", schema_text, vocab, [&] { ... });
class GrammarCache {
 public:
  explicit GrammarCache(size_t capacity = 64) : capacity_(capacity) {}
  using Builder = std::function<absl::StatusOr<Grammar>()>;
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GetOrCompile(
      std::string_view kind, std::string_view source,
      const std::shared_ptr<const TokenVocabulary>& vocabulary, const Builder& build);
  size_t size() const;
  // Compilations done (misses), for tests and metrics.
  size_t compilations() const;

 private:
  struct Entry;
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::string> lru_;  // keys, most recent first
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_;
  size_t compilations_ = 0;
};

}  // namespace tandem::grammar
