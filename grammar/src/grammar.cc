// Grammar printing and the left-recursion check.
#include "tandem/grammar/grammar.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::grammar {
namespace {

std::string ByteSetToString(const std::bitset<256>& set) {
  if (set.count() == 1) {
    for (int b = 0; b < 256; ++b) {
      if (set.test(b)) {
        if (b >= 0x20 && b < 0x7F && b != '"' && b != '\\')
          return absl::StrCat("\"", std::string(1, char(b)), "\"");
        return absl::StrFormat("[\\x%02X]", b);
      }
    }
  }
  std::string out = "[";
  for (int b = 0; b < 256;) {
    if (!set.test(b)) {
      ++b;
      continue;
    }
    int e = b;
    while (e + 1 < 256 && set.test(e + 1)) ++e;
    absl::StrAppendFormat(&out, "\\x%02X", b);
    if (e > b) absl::StrAppendFormat(&out, "-\\x%02X", e);
    b = e + 1;
  }
  return out + "]";
}

}  // namespace

std::string Grammar::ToString() const {
  std::string out;
  for (const Rule& rule : rules) {
    absl::StrAppend(&out, rule.name, " ::=");
    for (size_t a = 0; a < rule.alternatives.size(); ++a) {
      if (a > 0) out += " |";
      if (rule.alternatives[a].empty()) out += " \"\"";
      for (const Element& e : rule.alternatives[a]) {
        out += " ";
        out += e.kind == Element::Kind::kRule ? rules[e.rule].name : ByteSetToString(e.bytes);
      }
    }
    out += "\n";
  }
  return out;
}

absl::Status Grammar::CheckNoLeftRecursion() const {
  const int n = rules.size();
  // Nullable rules, to a fixed point.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const Sequence& seq : rules[r].alternatives) {
        bool all = true;
        for (const Element& e : seq) {
          if (e.kind == Element::Kind::kBytes || !nullable[e.rule]) {
            all = false;
            break;
          }
        }
        if (all) {
          nullable[r] = changed = true;
          break;
        }
      }
    }
  }
  // Left-corner edges: r -> s when s can be the first symbol r expands to.
  std::vector<std::vector<int>> corner(n);
  for (int r = 0; r < n; ++r) {
    for (const Sequence& seq : rules[r].alternatives) {
      for (const Element& e : seq) {
        if (e.kind == Element::Kind::kBytes) break;
        corner[r].push_back(e.rule);
        if (!nullable[e.rule]) break;
      }
    }
  }
  // A cycle in the left-corner graph is left recursion (iterative DFS, colours).
  std::vector<int> colour(n, 0);
  for (int start = 0; start < n; ++start) {
    if (colour[start] != 0) continue;
    std::vector<std::pair<int, size_t>> stack = {{start, 0}};
    colour[start] = 1;
    while (!stack.empty()) {
      auto& [r, i] = stack.back();
      if (i == corner[r].size()) {
        colour[r] = 2;
        stack.pop_back();
        continue;
      }
      int s = corner[r][i++];
      if (colour[s] == 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("grammar: rule '", rules[s].name,
                         "' is left-recursive (it can expand to itself before matching any byte)"));
      }
      if (colour[s] == 0) {
        colour[s] = 1;
        stack.push_back({s, 0});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::grammar
