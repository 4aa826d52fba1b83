// FlatGrammar and StackArena: the pushdown automaton over bytes.
#include "automaton.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"

namespace tandem::grammar::internal {

FlatGrammar FlatGrammar::Build(const Grammar& grammar) {
  FlatGrammar flat;
  flat.root = grammar.root;
  absl::flat_hash_map<std::bitset<256>, int32_t> set_index;
  flat.rule_starts.resize(grammar.rules.size());
  // Rules reachable from the root; positions of other rules get no masks.
  std::vector<bool> live(grammar.rules.size(), false);
  std::vector<int> queue = {grammar.root};
  live[grammar.root] = true;
  while (!queue.empty()) {
    int r = queue.back();
    queue.pop_back();
    for (const Sequence& seq : grammar.rules[r].alternatives) {
      for (const Element& e : seq) {
        if (e.kind == Element::Kind::kRule && !live[e.rule]) {
          live[e.rule] = true;
          queue.push_back(e.rule);
        }
      }
    }
  }
  for (size_t r = 0; r < grammar.rules.size(); ++r) {
    for (const Sequence& seq : grammar.rules[r].alternatives) {
      flat.rule_starts[r].push_back(flat.positions.size());
      for (const Element& e : seq) {
        if (e.kind == Element::Kind::kRule) {
          flat.positions.push_back({Kind::kRule, e.rule});
        } else {
          auto [it, added] = set_index.try_emplace(e.bytes, flat.byte_sets.size());
          if (added) flat.byte_sets.push_back(e.bytes);
          flat.positions.push_back({Kind::kBytes, it->second});
        }
        flat.reachable.push_back(live[r]);
        flat.rule_of.push_back(r);
      }
      flat.positions.push_back({Kind::kEnd, 0});
      flat.reachable.push_back(live[r]);
      flat.rule_of.push_back(r);
    }
  }
  return flat;
}

int32_t StackArena::Intern(int32_t pos, int32_t parent) {
  uint64_t key =
      (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent);
  auto [it, added] = index_.try_emplace(key, static_cast<int32_t>(nodes_.size()));
  if (added) {
    nodes_.push_back({pos, parent});
    expansion_of_.push_back(-1);
  }
  return it->second;
}

// Iterative (a worklist, not recursion), so a long chain of rules cannot exhaust the stack.
void StackArena::ExpandInto(int32_t start, Expansion& out) {
  std::vector<int32_t> work = {start};
  absl::flat_hash_set<int32_t> visited;
  while (!work.empty()) {
    const int32_t node = work.back();
    work.pop_back();
    if (!visited.insert(node).second) continue;
    const Node n = nodes_[node];
    const FlatGrammar::Position p = grammar_.positions[n.pos];
    switch (p.kind) {
      case FlatGrammar::Kind::kBytes:
        out.tops.push_back(node);
        break;
      case FlatGrammar::Kind::kEnd:
        if (n.parent < 0) {
          out.ended = true;
        } else {
          const Node caller = nodes_[n.parent];
          work.push_back(Intern(caller.pos + 1, caller.parent));
        }
        break;
      case FlatGrammar::Kind::kRule: {
        // A reference in tail position returns straight to this frame's caller, so
        // repetitions (right recursion) keep the stack flat.
        const bool tail = grammar_.positions[n.pos + 1].kind == FlatGrammar::Kind::kEnd;
        const int32_t parent = tail ? n.parent : node;
        for (int32_t first : grammar_.rule_starts[p.arg]) work.push_back(Intern(first, parent));
        break;
      }
    }
  }
}

const StackArena::Expansion& StackArena::Expand(int32_t node) {
  if (expansion_of_[node] < 0) {
    Expansion e;
    ExpandInto(node, e);
    std::sort(e.tops.begin(), e.tops.end());
    e.tops.erase(std::unique(e.tops.begin(), e.tops.end()), e.tops.end());
    expansion_of_[node] = expansions_.size();
    expansions_.push_back(std::move(e));
  }
  return expansions_[expansion_of_[node]];
}

void StackArena::Advance(const std::vector<int32_t>& tops, uint8_t byte, Step& out) {
  out.tops.clear();
  out.matched = out.ended = false;
  for (int32_t top : tops) {
    const Node n = nodes_[top];
    if (!grammar_.byte_sets[grammar_.positions[n.pos].arg].test(byte)) continue;
    out.matched = true;
    const Expansion& e = Expand(Intern(n.pos + 1, n.parent));
    out.ended |= e.ended;
    out.tops.insert(out.tops.end(), e.tops.begin(), e.tops.end());
  }
  if (out.tops.size() > 1) {
    std::sort(out.tops.begin(), out.tops.end());
    out.tops.erase(std::unique(out.tops.begin(), out.tops.end()), out.tops.end());
  }
}

int32_t StackArena::InternSet(const std::vector<int32_t>& tops) {
  auto [it, added] = set_index_.try_emplace(tops, static_cast<int32_t>(sets_.size()));
  if (added) {
    sets_.push_back(tops);
    if (sets_.size() <= static_cast<size_t>(dense_sets_)) {
      set_steps_.resize(sets_.size() * 256, kUnknownStep);
    }
  }
  return it->second;
}

int32_t StackArena::ComputeSetStep(int32_t set, uint8_t byte) {
  Advance(sets_[set], byte, scratch_);  // done with sets_[set] before InternSet grows sets_
  const int32_t step =
      scratch_.matched ? (InternSet(scratch_.tops) << 1) | (scratch_.ended ? 1 : 0) : kNoMatch;
  if (set < dense_sets_) {
    set_steps_[static_cast<size_t>(set) * 256 + byte] = step;
  } else {
    sparse_set_steps_.emplace(SparseKey(set, byte), step);
  }
  return step;
}

StackArena::Expansion StackArena::Start() {
  Expansion all;
  for (int32_t start : grammar_.rule_starts[grammar_.root]) {
    const Expansion& e = Expand(Intern(start, -1));
    all.ended |= e.ended;
    all.tops.insert(all.tops.end(), e.tops.begin(), e.tops.end());
  }
  std::sort(all.tops.begin(), all.tops.end());
  all.tops.erase(std::unique(all.tops.begin(), all.tops.end()), all.tops.end());
  return all;
}

}  // namespace tandem::grammar::internal
