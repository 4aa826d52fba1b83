// The syntax tree the parser builds and the renderer walks: expressions (Expr), statements
// (Node) and assignment targets (Target).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/src/jinja/value.h"

namespace tandem::text::jinja {

struct Expr {
  enum class Op {
    kLiteral,  // literal
    kName,     // name
    kList,     // args: items
    kTuple,    // args: items
    kDict,     // args: key0, value0, key1, value1, ...
    kGetAttr,  // args: object; name: attribute
    kGetItem,  // args: object, key
    kSlice,    // args: object, start, stop, step (each may be null)
    kCall,     // args: callee, positional...; kwargs
    kFilter,   // args: input (null inside a filter chain), positional...; kwargs; name
    kTest,     // args: input, positional...; kwargs; name
    kNeg,      // args: operand
    kPos,      // args: operand
    kNot,      // args: operand
    kAnd,      // args: left, right
    kOr,       // args: left, right
    kBinary,   // args: left, right; name: + - * / // % **
    kCompare,  // args: operands; compare_ops between them
    kConcat,   // args: parts joined by ~
    kCond,     // args: value, condition, else-value (may be null)
  };
  Op op;
  int line;
  Value literal;
  std::string name;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<std::string> compare_ops;

  Expr() = default;
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;
  ~Expr();
};
using ExprPtr = std::unique_ptr<Expr>;

// A new expression of kind `op` from template line `line`, its operands still to be added.
ExprPtr MakeExpr(Expr::Op op, int line);

// Where `{% set %}` and `{% for %}` store values.
struct Target {
  enum class Kind { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::vector<std::string> names;  // One name, the tuple's names, or the namespace variable.
  std::string attr;                // kNamespaceAttr: the attribute.
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Type {
    kText,      // text
    kOutput,    // expr
    kIf,        // conds[i] selects branches[i]; a trailing extra branch is the else
    kFor,       // target in expr [if cond]: body, else_body
    kSet,       // target = expr
    kSetBlock,  // target = rendered body, through filters
    kMacro,     // text: name; params, defaults; body
    kBreak,
    kContinue,
    kWith,         // with_targets = with_values: body
    kFilterBlock,  // rendered body through filters
    kPassThrough,  // body rendered as is ({% generation %})
  };
  Type type;
  int line;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<ExprPtr> conds;
  std::vector<Body> branches;
  Target target;
  Body body;
  Body else_body;
  std::vector<ExprPtr> filters;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // Parallel to params; null where a parameter has none.
  std::vector<Target> with_targets;
  std::vector<ExprPtr> with_values;
};

}  // namespace tandem::text::jinja
