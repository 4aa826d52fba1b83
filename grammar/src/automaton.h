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
  explicit StackArena(const FlatGrammar& grammar) : grammar_(grammar) {}

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

 private:
  struct Node {
    int32_t pos, parent;
  };
  void ExpandInto(int32_t node, Expansion& out);

  const FlatGrammar& grammar_;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int32_t> index_;
  std::vector<int32_t> expansion_of_;  // node -> index into expansions_, -1 before computed
  std::vector<Expansion> expansions_;
};

}  // namespace tandem::grammar::internal
