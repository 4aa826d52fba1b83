// Internal: the grammar flattened into positions, and the persistent stacks of the pushdown
// matcher. Shared by the compiler (context-independent masks) and the matcher.
#pragma once

#include <bitset>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "tandem/grammar/grammar.h"

namespace tandem::grammar::internal {

// Every alternative of every rule laid out as its elements followed by an end marker; a
// position is an index into `positions`.
struct FlatGrammar {
  enum class Kind : uint8_t { kBytes, kRule, kEnd };
  struct Position {
    Kind kind;
    int32_t arg;  // kBytes: index into byte_sets; kRule: rule index
  };
  std::vector<Position> positions;
  std::vector<std::bitset<256>> byte_sets;
  std::vector<std::vector<int32_t>> rule_starts;  // per rule, its alternatives' first positions
  std::vector<bool> reachable;   // per position: part of a rule reachable from root
  std::vector<int32_t> rule_of;  // per position: its rule
  int root = 0;

  static FlatGrammar Build(const Grammar& grammar);
};

// Stacks as hash-consed linked frames: a node is (position, parent node); parent -1 is the
// bottom (the root rule's caller, or, when computing context-independent masks, the unknown
// context). Equal stacks are the same node, so a set of stacks is a sorted vector of ints.
class StackArena {
 public:
  static constexpr int32_t kDenseSets = 1 << 15;  // 32 MiB of step tables at most
  // `dense_sets`: how many interned sets get a table of 256 steps (see AdvanceSet); tests
  // lower it to exercise the hash map.
  explicit StackArena(const FlatGrammar& grammar, int32_t dense_sets = kDenseSets)
      : grammar_(grammar), dense_sets_(dense_sets) {}

  struct Expansion {
    std::vector<int32_t> tops;  // stacks whose top is a byte set (sorted, unique)
    bool ended = false;         // some path popped the bottom frame
  };
  struct Step {
    std::vector<int32_t> tops;
    bool matched = false;  // some stack's byte set held the byte
    bool ended = false;    // some path popped the bottom frame after the byte
  };

  int32_t Intern(int32_t pos, int32_t parent);
  // Closure of one stack: rule references expanded, ended alternatives returned from.
  const Expansion& Expand(int32_t node);
  // The stacks after `byte` from `tops` (each top must be a byte-set position).
  void Advance(const std::vector<int32_t>& tops, uint8_t byte, Step& out);
  // The initial stacks of the root rule.
  Expansion Start();
  int32_t position(int32_t node) const { return nodes_[node].pos; }
  size_t size() const { return nodes_.size(); }

  // Sets of stacks (sorted, unique tops), interned: equal sets get the same id.
  int32_t InternSet(const std::vector<int32_t>& tops);
  struct SetStep {
    int32_t next = -1;  // the interned set after the byte
    bool matched = false;
    bool ended = false;
  };
  // Advance over an interned set, memoized: a walk of the vocabulary's trie asks for the same
  // (set, byte) again and again (every token continuing a string from the same stacks), so each
  // pair is computed once per arena. The first `dense_sets` sets keep a table of 256 steps each;
  // later ones (a grammar with very many stack sets) go to a hash map, bounding the tables.
  SetStep AdvanceSet(int32_t set, uint8_t byte) {
    int32_t t;
    if (set < dense_sets_) {
      t = set_steps_[static_cast<size_t>(set) * 256 + byte];
      if (t == kUnknownStep) t = ComputeSetStep(set, byte);
    } else {
      auto it = sparse_set_steps_.find(SparseKey(set, byte));
      t = it != sparse_set_steps_.end() ? it->second : ComputeSetStep(set, byte);
    }
    if (t == kNoMatch) return SetStep{};
    return SetStep{t >> 1, true, (t & 1) != 0};
  }
  const std::vector<int32_t>& set(int32_t id) const { return sets_[id]; }

 private:
  struct Node {
    int32_t pos, parent;
  };
  void ExpandInto(int32_t node, Expansion& out);
  // set_steps_ entries: (next set << 1) | ended, or one of these.
  static constexpr int32_t kUnknownStep = -1;
  static constexpr int32_t kNoMatch = -2;
  static uint64_t SparseKey(int32_t set, uint8_t byte) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(set)) << 8) | byte;
  }
  int32_t ComputeSetStep(int32_t set, uint8_t byte);

  const FlatGrammar& grammar_;
  const int32_t dense_sets_;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int32_t> index_;
  std::vector<int32_t> expansion_of_;  // node -> index into expansions_, -1 before computed
  std::vector<Expansion> expansions_;
  absl::flat_hash_map<std::vector<int32_t>, int32_t> set_index_;
  std::vector<std::vector<int32_t>> sets_;
  std::vector<int32_t> set_steps_;  // set * 256 + byte -> step, for sets below dense_sets_
  absl::flat_hash_map<uint64_t, int32_t> sparse_set_steps_;  // SparseKey -> step, the others
  Step scratch_;
};

}  // namespace tandem::grammar::internal
