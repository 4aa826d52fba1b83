// CompiledGrammar: inlining small rules, flattening, and the context-independent token masks.
#include <algorithm>
#include <thread>

#include "automaton.h"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/matcher.h"

namespace tandem::grammar {
namespace {

// Limits on inlining: a rule is copied into its callers when it is not recursive and small,
// and the caller stays below kMaxAlternatives.
constexpr size_t kMaxInlinedAlternatives = 16;
constexpr size_t kMaxInlinedLength = 8;
constexpr size_t kMaxAlternatives = 64;

// Rules that can reach themselves through references: members of a strongly connected
// component of the reference graph with more than one rule, or with a self-reference.
// Tarjan's algorithm, iterative.
std::vector<bool> RecursiveRules(const Grammar& g) {
  const int n = g.rules.size();
  std::vector<std::vector<int>> edges(n);
  std::vector<bool> recursive(n, false);
  for (int r = 0; r < n; ++r) {
    for (const Sequence& seq : g.rules[r].alternatives) {
      for (const Element& e : seq) {
        if (e.kind != Element::Kind::kRule) continue;
        edges[r].push_back(e.rule);
        if (e.rule == r) recursive[r] = true;
      }
    }
  }
  std::vector<int> index(n, -1), low(n, 0), component;
  std::vector<bool> on_stack(n, false);
  int next_index = 0;
  for (int start = 0; start < n; ++start) {
    if (index[start] >= 0) continue;
    std::vector<std::pair<int, size_t>> frames = {{start, 0}};
    index[start] = low[start] = next_index++;
    component.push_back(start);
    on_stack[start] = true;
    while (!frames.empty()) {
      auto& [v, i] = frames.back();
      if (i < edges[v].size()) {
        const int w = edges[v][i++];
        if (index[w] < 0) {
          index[w] = low[w] = next_index++;
          component.push_back(w);
          on_stack[w] = true;
          frames.push_back({w, 0});
        } else if (on_stack[w]) {
          low[v] = std::min(low[v], index[w]);
        }
        continue;
      }
      const int done = v;
      frames.pop_back();
      if (!frames.empty()) low[frames.back().first] = std::min(low[frames.back().first], low[done]);
      if (low[done] == index[done]) {
        std::vector<int> members;
        int w;
        do {
          w = component.back();
          component.pop_back();
          on_stack[w] = false;
          members.push_back(w);
        } while (w != done);
        if (members.size() > 1) {
          for (int m : members) recursive[m] = true;
        }
      }
    }
  }
  return recursive;
}

// Replaces leading references to small non-recursive rules by their alternatives, so that e.g. the
// characters of a string live in the string's repetition rule: the context-independent masks
// then accept a whole token of string content instead of leaving it to the run-time check.
Grammar InlineSmallRules(Grammar g) {
  const std::vector<bool> recursive = RecursiveRules(g);
  auto inlinable = [&](int r) {
    const Rule& rule = g.rules[r];
    if (recursive[r] || r == g.root || rule.alternatives.size() > kMaxInlinedAlternatives) {
      return false;
    }
    for (const Sequence& seq : rule.alternatives) {
      if (seq.size() > kMaxInlinedLength) return false;
    }
    return true;
  };
  for (int pass = 0; pass < 4; ++pass) {
    bool changed = false;
    for (size_t r = 0; r < g.rules.size(); ++r) {
      std::vector<Sequence> out;
      const std::vector<Sequence>& alternatives = g.rules[r].alternatives;
      for (size_t a = 0; a < alternatives.size(); ++a) {
        const Sequence& seq = alternatives[a];
        // Only a leading reference: its alternatives then differ from the first byte on, so
        // at most one of them is alive after a byte. Inlining a later reference would copy
        // the alternative's prefix, keeping every copy alive in parallel until they differ.
        const size_t at = 0;
        if (seq.empty() || seq[0].kind != Element::Kind::kRule || !inlinable(seq[0].rule) ||
            out.size() + (alternatives.size() - a) - 1 + g.rules[seq[0].rule].alternatives.size() >
                kMaxAlternatives) {
          out.push_back(seq);
          continue;
        }
        changed = true;
        for (const Sequence& inner : g.rules[seq[at].rule].alternatives) {
          Sequence s(seq.begin(), seq.begin() + at);
          s.insert(s.end(), inner.begin(), inner.end());
          s.insert(s.end(), seq.begin() + at + 1, seq.end());
          out.push_back(std::move(s));
        }
      }
      g.rules[r].alternatives = std::move(out);
    }
    if (!changed) break;
  }
  return g;
}

// Per rule, the bytes that can come right after it ends, anywhere in the grammar (nothing
// after the root). A token that leaves a rule must continue with one of them.
std::vector<std::bitset<256>> FollowBytes(const internal::FlatGrammar& flat) {
  using Kind = internal::FlatGrammar::Kind;
  const size_t n = flat.rule_starts.size();
  std::vector<bool> nullable(n, false);
  std::vector<std::bitset<256>> first(n), follow(n);
  // First bytes of the suffix starting at `pos`; `*rest_nullable` when it can match nothing.
  auto suffix_first = [&](size_t pos, bool* rest_nullable) {
    std::bitset<256> out;
    for (;; ++pos) {
      const auto& p = flat.positions[pos];
      if (p.kind == Kind::kEnd) {
        *rest_nullable = true;
        return out;
      }
      if (p.kind == Kind::kBytes) {
        *rest_nullable = false;
        return out | flat.byte_sets[p.arg];
      }
      out |= first[p.arg];
      if (!nullable[p.arg]) {
        *rest_nullable = false;
        return out;
      }
    }
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      for (int32_t start : flat.rule_starts[r]) {
        bool nul = false;
        std::bitset<256> f = suffix_first(start, &nul);
        if ((first[r] | f) != first[r]) {
          first[r] |= f;
          changed = true;
        }
        if (nul && !nullable[r]) nullable[r] = changed = true;
      }
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t q = 0; q < flat.positions.size(); ++q) {
      if (flat.positions[q].kind != Kind::kRule || !flat.reachable[q]) continue;
      const int32_t r = flat.positions[q].arg;
      bool nul = false;
      std::bitset<256> f = suffix_first(q + 1, &nul);
      if (nul) f |= follow[flat.rule_of[q]];
      if ((follow[r] | f) != follow[r]) {
        follow[r] |= f;
        changed = true;
      }
    }
  }
  return follow;
}

}  // namespace

CompiledGrammar::~CompiledGrammar() = default;

size_t CompiledGrammar::num_uncertain() const {
  size_t n = 0;
  for (const auto& u : uncertain_) n += u.size();
  return n;
}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> CompiledGrammar::Create(
    const Grammar& grammar, std::shared_ptr<const TokenVocabulary> vocabulary, int num_threads) {
  if (grammar.root < 0 || grammar.root >= static_cast<int>(grammar.rules.size())) {
    return absl::InvalidArgumentError("grammar: no root rule");
  }
  TANDEM_RETURN_IF_ERROR(grammar.CheckNoLeftRecursion());
  std::shared_ptr<CompiledGrammar> compiled(new CompiledGrammar());
  compiled->vocabulary_ = std::move(vocabulary);
  compiled->flat_ = std::make_unique<internal::FlatGrammar>(
      internal::FlatGrammar::Build(InlineSmallRules(grammar)));
  const internal::FlatGrammar& flat = *compiled->flat_;
  const TokenVocabulary& vocab = *compiled->vocabulary_;
  const auto trie = vocab.trie();
  const auto sorted = vocab.sorted_tokens();
  const size_t words = (vocab.size() + 63) / 64;

  // The byte-set positions, each with its slot; their walks are independent.
  compiled->slot_.assign(flat.positions.size(), -1);
  std::vector<int32_t> byte_positions;
  for (size_t pos = 0; pos < flat.positions.size(); ++pos) {
    if (flat.positions[pos].kind != internal::FlatGrammar::Kind::kBytes || !flat.reachable[pos]) {
      continue;
    }
    compiled->slot_[pos] = static_cast<int32_t>(byte_positions.size());
    byte_positions.push_back(static_cast<int32_t>(pos));
  }
  compiled->accepted_.resize(byte_positions.size());
  compiled->uncertain_.resize(byte_positions.size());
  const std::vector<std::bitset<256>> follow = FollowBytes(flat);

  // Walks positions first, first + stride, ...: each worker with its own arena (stack ids are
  // only used inside a walk), writing only its positions' slots.
  auto walk = [&](size_t first, size_t stride) {
    // The bottom frame (-1) stands for the unknown context.
    internal::StackArena arena(flat);
    struct Level {
      int32_t set;           // the interned set of stacks after this node's bytes
      bool ended = false;    // the position's rule can end after exactly this many bytes
      bool escaped = false;  // it can end after fewer, followed by a byte that may follow it
    };
    std::vector<Level> levels;
    for (size_t slot = first; slot < byte_positions.size(); slot += stride) {
      const int32_t pos = byte_positions[slot];
      TokenMask accepted(words, 0);
      std::vector<int32_t> uncertain;
      const std::bitset<256>& after = follow[flat.rule_of[pos]];
      levels.assign(1, Level{arena.InternSet({arena.Intern(pos, -1)}), false, false});
      for (size_t i = 1; i < trie.size();) {
        const auto& node = trie[i];
        const Level parent = levels[node.depth - 1];
        const bool escaped = parent.escaped || (parent.ended && after.test(node.byte));
        const internal::StackArena::SetStep step = arena.AdvanceSet(parent.set, node.byte);
        if (!step.matched) {
          // No token below this node is matched inside the rule; those that continue after
          // the rule ended depend on the stack below.
          if (escaped) {
            for (int32_t k = trie[i].tokens_begin; k < trie[node.subtree_end - 1].tokens_end; ++k) {
              uncertain.push_back(k);
            }
          }
          i = node.subtree_end;
          continue;
        }
        for (int32_t k = node.tokens_begin; k < node.tokens_end; ++k) {
          const int32_t id = sorted[k];
          accepted[id >> 6] |= uint64_t{1} << (id & 63);
        }
        if (static_cast<int>(levels.size()) <= node.depth) levels.resize(node.depth + 1);
        levels[node.depth] = Level{step.next, step.ended, escaped};
        ++i;
      }
      compiled->accepted_[slot] = std::move(accepted);
      compiled->uncertain_[slot] = std::move(uncertain);
    }
  };
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
    // A small grammar or vocabulary is not worth a thread.
    if (byte_positions.size() * trie.size() < (size_t{1} << 20)) num_threads = 1;
  }
  num_threads = std::clamp(num_threads, 1, kMaxCompileThreads);
  num_threads = std::min<int>(num_threads, std::max<size_t>(byte_positions.size(), 1));
  if (num_threads == 1) {
    walk(0, 1);
  } else {
    std::vector<std::jthread> workers;
    for (int t = 1; t < num_threads; ++t) workers.emplace_back(walk, t, num_threads);
    walk(0, num_threads);
  }  // the workers join here
  return std::shared_ptr<const CompiledGrammar>(std::move(compiled));
}

}  // namespace tandem::grammar
