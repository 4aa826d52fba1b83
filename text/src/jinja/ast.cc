// Syntax tree (see ast.h).

#include "text/src/jinja/ast.h"

#include <memory>
#include <utility>
#include <vector>

namespace tandem::text::jinja {

// Frees the tree without recursion: a long chain such as "a ~ b + c + ..." nests as deep as it
// is long.
Expr::~Expr() {
  std::vector<ExprPtr> pending;
  auto take_children = [&pending](Expr& e) {
    for (ExprPtr& a : e.args) {
      if (a) pending.push_back(std::move(a));
    }
    for (auto& kw : e.kwargs) {
      if (kw.second) pending.push_back(std::move(kw.second));
    }
  };
  take_children(*this);
  while (!pending.empty()) {
    ExprPtr e = std::move(pending.back());
    pending.pop_back();
    take_children(*e);
  }
}

ExprPtr MakeExpr(Expr::Op op, int line) {
  auto e = std::make_unique<Expr>();
  e->op = op;
  e->line = line;
  return e;
}

}  // namespace tandem::text::jinja
