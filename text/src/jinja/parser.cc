// The parser: tokens to a syntax tree (see parser.h).

#include "text/src/jinja/parser.h"

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/builtins.h"

namespace tandem::text::jinja {
namespace {

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  absl::StatusOr<Body> ParseTemplate() {
    std::string end;
    return ParseBody({}, &end);
  }

 private:
  static constexpr int kMaxNesting = 100;

  const Token& Cur() const { return toks_[pos_]; }
  const Token& Look() const { return toks_[std::min(pos_ + 1, toks_.size() - 1)]; }
  bool IsName(std::string_view n) const { return Cur().type == Tok::kName && Cur().text == n; }
  bool IsOp(std::string_view o) const { return Cur().type == Tok::kOp && Cur().text == o; }
  bool SkipName(std::string_view n) {
    if (!IsName(n)) return false;
    ++pos_;
    return true;
  }
  bool SkipOp(std::string_view o) {
    if (!IsOp(o)) return false;
    ++pos_;
    return true;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kText:
        return "template data";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kString:
        return "string";
      case Tok::kEof:
        return "end of template";
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }

  absl::Status Unexpected(absl::string_view expected = "") const {
    std::string msg = absl::StrCat("unexpected ", Describe(Cur()));
    if (!expected.empty()) absl::StrAppend(&msg, ", expected ", expected);
    return SyntaxError(Cur().line, msg);
  }
  absl::Status ExpectOp(std::string_view o) {
    if (!SkipOp(o)) return Unexpected(absl::StrCat("'", std::string(o), "'"));
    return absl::OkStatus();
  }
  absl::Status ExpectName(std::string_view n) {
    if (!SkipName(n)) return Unexpected(absl::StrCat("'", std::string(n), "'"));
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectAnyName() {
    if (Cur().type != Tok::kName) return Unexpected("a name");
    return toks_[pos_++].text;
  }
  absl::Status ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) return Unexpected("end of statement block");
    ++pos_;
    return absl::OkStatus();
  }

  // Counts nesting of statements and parenthesised expressions so that a hostile template
  // cannot overflow the parser's stack.
  class NestingGuard {
   public:
    explicit NestingGuard(Parser* p) : p_(p) { ++p_->nesting_; }
    ~NestingGuard() { --p_->nesting_; }
    absl::Status Check() const {
      if (p_->nesting_ > kMaxNesting)
        return SyntaxError(p_->Cur().line, "template nests too deeply");
      return absl::OkStatus();
    }

   private:
    Parser* p_;
  };

  // Parses template data, output and statements until a tag named in `ends` (consumed along
  // with the "{%" before it; its name goes to *end) or, when `ends` is empty, the end.
  absl::StatusOr<Body> ParseBody(const std::vector<std::string_view>& ends, std::string* end) {
    NestingGuard guard(this);
    TANDEM_RETURN_IF_ERROR(guard.Check());
    Body body;
    while (true) {
      const Token& t = Cur();
      switch (t.type) {
        case Tok::kText: {
          auto node = std::make_unique<Node>();
          node->type = Node::Type::kText;
          node->line = t.line;
          node->text = t.text;
          body.push_back(std::move(node));
          ++pos_;
          break;
        }
        case Tok::kVarBegin: {
          auto node = std::make_unique<Node>();
          node->type = Node::Type::kOutput;
          node->line = t.line;
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(true, {}, false));
          if (Cur().type != Tok::kVarEnd) return Unexpected("end of print statement");
          ++pos_;
          body.push_back(std::move(node));
          break;
        }
        case Tok::kBlockBegin: {
          const Token& name = Look();
          if (name.type == Tok::kName &&
              std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
            *end = name.text;
            pos_ += 2;
            return body;
          }
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Node> node, ParseStatement());
          body.push_back(std::move(node));
          break;
        }
        case Tok::kEof:
          if (!ends.empty()) {
            return SyntaxError(
                t.line,
                absl::StrCat(
                    "unexpected end of template, expected '",
                    absl::StrJoin(std::vector<std::string>(ends.begin(), ends.end()), "' or '"),
                    "'"));
          }
          return body;
        default:
          return Unexpected();
      }
    }
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseStatement() {
    const Token& t = Cur();
    if (t.type != Tok::kName) return SyntaxError(t.line, "tag name expected");
    auto node = std::make_unique<Node>();
    node->line = t.line;
    std::string tag = t.text;
    ++pos_;
    if (tag == "if") {
      TANDEM_RETURN_IF_ERROR(ParseIf(node.get()));
    } else if (tag == "for") {
      TANDEM_RETURN_IF_ERROR(ParseFor(node.get()));
    } else if (tag == "set") {
      TANDEM_RETURN_IF_ERROR(ParseSet(node.get()));
    } else if (tag == "macro") {
      TANDEM_RETURN_IF_ERROR(ParseMacro(node.get()));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) {
        return SyntaxError(node->line, absl::StrCat("'", tag, "' outside of a loop"));
      }
      node->type = tag == "break" ? Node::Type::kBreak : Node::Type::kContinue;
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    } else if (tag == "with") {
      TANDEM_RETURN_IF_ERROR(ParseWith(node.get()));
    } else if (tag == "filter") {
      node->type = Node::Type::kFilterBlock;
      TANDEM_RETURN_IF_ERROR(ParseFilterChain(node.get(), /*first_pipe=*/false));
      TANDEM_RETURN_IF_ERROR(ParseBlockBody(node.get(), "endfilter"));
    } else if (tag == "generation") {
      // Hugging Face marks assistant turns with {% generation %} to build masks; the text
      // renders unchanged.
      node->type = Node::Type::kPassThrough;
      TANDEM_RETURN_IF_ERROR(ParseBlockBody(node.get(), "endgeneration"));
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "call" || tag == "autoescape" || tag == "print") {
      return SyntaxError(node->line, absl::StrCat("the '", tag, "' tag is not supported"));
    } else {
      return SyntaxError(node->line, absl::StrCat("unknown tag '", tag, "'"));
    }
    return node;
  }

  absl::Status ParseBlockBody(Node* node, std::string_view end_tag) {
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    TANDEM_ASSIGN_OR_RETURN(node->body, ParseBody({end_tag}, &end));
    return ExpectBlockEnd();
  }

  absl::Status ParseIf(Node* node) {
    node->type = Node::Type::kIf;
    while (true) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr cond, ParseTuple(false, {}, false));
      node->conds.push_back(std::move(cond));
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      std::string end;
      TANDEM_ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &end));
      node->branches.push_back(std::move(body));
      if (end == "elif") continue;
      if (end == "else") {
        TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
        TANDEM_ASSIGN_OR_RETURN(Body else_body, ParseBody({"endif"}, &end));
        node->branches.push_back(std::move(else_body));
      }
      return ExpectBlockEnd();
    }
  }

  absl::Status ParseFor(Node* node) {
    node->type = Node::Type::kFor;
    TANDEM_ASSIGN_OR_RETURN(node->target, ParseTarget({"in"}));
    TANDEM_RETURN_IF_ERROR(ExpectName("in"));
    TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(false, {"recursive"}, false));
    if (SkipName("if")) {
      TANDEM_ASSIGN_OR_RETURN(node->cond, ParseExpression(true));
    }
    if (IsName("recursive")) return SyntaxError(Cur().line, "recursive loops are not supported");
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ++loop_depth_;
    absl::StatusOr<Body> body = ParseBody({"endfor", "else"}, &end);
    --loop_depth_;
    if (!body.ok()) return body.status();
    node->body = std::move(*body);
    if (end == "else") {
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      TANDEM_ASSIGN_OR_RETURN(node->else_body, ParseBody({"endfor"}, &end));
    }
    return ExpectBlockEnd();
  }

  absl::Status ParseSet(Node* node) {
    if (Cur().type == Tok::kName && Look().type == Tok::kOp && Look().text == ".") {
      node->target.kind = Target::Kind::kNamespaceAttr;
      node->target.names.push_back(Cur().text);
      pos_ += 2;
      TANDEM_ASSIGN_OR_RETURN(node->target.attr, ExpectAnyName());
    } else {
      TANDEM_ASSIGN_OR_RETURN(node->target, ParseTarget({}));
    }
    if (SkipOp("=")) {
      node->type = Node::Type::kSet;
      TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(true, {}, false));
      return ExpectBlockEnd();
    }
    node->type = Node::Type::kSetBlock;
    if (IsOp("|")) TANDEM_RETURN_IF_ERROR(ParseFilterChain(node, /*first_pipe=*/true));
    return ParseBlockBody(node, "endset");
  }

  absl::Status ParseMacro(Node* node) {
    node->type = Node::Type::kMacro;
    TANDEM_ASSIGN_OR_RETURN(node->text, ExpectAnyName());
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (!node->params.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      TANDEM_ASSIGN_OR_RETURN(std::string param, ExpectAnyName());
      ExprPtr def;
      if (SkipOp("=")) {
        TANDEM_ASSIGN_OR_RETURN(def, ParseExpression(true));
      } else if (!node->defaults.empty() && node->defaults.back() != nullptr) {
        return SyntaxError(Cur().line, "non-default argument follows default argument");
      }
      node->params.push_back(std::move(param));
      node->defaults.push_back(std::move(def));
    }
    ++pos_;
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;  // `break` inside a macro cannot leave a loop around its definition.
    absl::Status status = ParseBlockBody(node, "endmacro");
    loop_depth_ = saved_loop_depth;
    return status;
  }

  absl::Status ParseWith(Node* node) {
    node->type = Node::Type::kWith;
    while (Cur().type != Tok::kBlockEnd) {
      if (!node->with_targets.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      TANDEM_ASSIGN_OR_RETURN(Target target, ParseTarget({}));
      TANDEM_RETURN_IF_ERROR(ExpectOp("="));
      TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      node->with_targets.push_back(std::move(target));
      node->with_values.push_back(std::move(value));
    }
    return ParseBlockBody(node, "endwith");
  }

  // `name(args) | name ...` for {% filter %} and {% set x | filter %}.
  absl::Status ParseFilterChain(Node* node, bool first_pipe) {
    bool first = true;
    while (IsOp("|") || (first && !first_pipe)) {
      if (!(first && !first_pipe)) ++pos_;
      first = false;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr filter, ParseFilter(nullptr));
      node->filters.push_back(std::move(filter));
    }
    return absl::OkStatus();
  }

  // A name or comma-separated names, optionally in parentheses, ended by a name in `ends`,
  // "=", or the end of the tag.
  absl::StatusOr<Target> ParseTarget(const std::vector<std::string_view>& ends) {
    Target target;
    bool paren = SkipOp("(");
    bool comma = false;
    while (true) {
      if (Cur().type != Tok::kName) return Unexpected("a name to assign to");
      const std::string& n = Cur().text;
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" ||
          n == "None") {
        return SyntaxError(Cur().line, "can't assign to a constant");
      }
      target.names.push_back(n);
      ++pos_;
      if (!SkipOp(",")) break;
      comma = true;
      if (IsOp(")") || IsOp("=") || Cur().type == Tok::kBlockEnd ||
          (Cur().type == Tok::kName &&
           std::find(ends.begin(), ends.end(), Cur().text) != ends.end())) {
        break;
      }
    }
    if (paren) TANDEM_RETURN_IF_ERROR(ExpectOp(")"));
    target.kind = comma ? Target::Kind::kTuple : Target::Kind::kName;
    return target;
  }

  bool IsTupleEnd(const std::vector<std::string_view>& extra_ends) const {
    if (Cur().type == Tok::kVarEnd || Cur().type == Tok::kBlockEnd || IsOp(")")) return true;
    return Cur().type == Tok::kName &&
           std::find(extra_ends.begin(), extra_ends.end(), Cur().text) != extra_ends.end();
  }

  // Expressions separated by commas form a tuple.
  absl::StatusOr<ExprPtr> ParseTuple(bool with_condexpr,
                                     const std::vector<std::string_view>& extra_ends,
                                     bool explicit_parens) {
    int line = Cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(extra_ends)) break;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(with_condexpr));
      items.push_back(std::move(item));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) return Unexpected("an expression");
    }
    ExprPtr tuple = MakeExpr(Expr::Op::kTuple, line);
    tuple->args = std::move(items);
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    if (!with_condexpr) return ParseOr();
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (SkipName("if")) {
      ExprPtr cond_expr = MakeExpr(Expr::Op::kCond, line);
      TANDEM_ASSIGN_OR_RETURN(ExprPtr cond, ParseOr());
      ExprPtr otherwise;
      if (SkipName("else")) {
        TANDEM_ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      cond_expr->args.push_back(std::move(expr));
      cond_expr->args.push_back(std::move(cond));
      cond_expr->args.push_back(std::move(otherwise));
      expr = std::move(cond_expr);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      ExprPtr node = MakeExpr(Expr::Op::kOr, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      node->args.push_back(std::move(left));
      node->args.push_back(std::move(right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      ExprPtr node = MakeExpr(Expr::Op::kAnd, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      node->args.push_back(std::move(left));
      node->args.push_back(std::move(right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      NestingGuard guard(this);
      TANDEM_RETURN_IF_ERROR(guard.Check());
      ExprPtr node = MakeExpr(Expr::Op::kNot, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      node->args.push_back(std::move(operand));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == "<=" ||
           Cur().text == ">" || Cur().text == ">=")) {
        op = Cur().text;
        ++pos_;
      } else if (IsName("in")) {
        op = "in";
        ++pos_;
      } else if (IsName("not") && Look().type == Tok::kName && Look().text == "in") {
        op = "not in";
        pos_ += 2;
      } else {
        break;
      }
      if (!cmp) {
        cmp = MakeExpr(Expr::Op::kCompare, line);
        cmp->args.push_back(std::move(first));
      }
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      cmp->args.push_back(std::move(operand));
      cmp->compare_ops.push_back(std::move(op));
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  absl::StatusOr<ExprPtr> Binary(ExprPtr left, std::string op,
                                 absl::StatusOr<ExprPtr> (Parser::*next)()) {
    ExprPtr node = MakeExpr(Expr::Op::kBinary, Cur().line);
    TANDEM_ASSIGN_OR_RETURN(ExprPtr right, (this->*next)());
    node->name = std::move(op);
    node->args.push_back(std::move(left));
    node->args.push_back(std::move(right));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      std::string op = toks_[pos_++].text;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParseConcat));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseMath2());
    if (!IsOp("~")) return first;
    ExprPtr node = MakeExpr(Expr::Op::kConcat, line);
    node->args.push_back(std::move(first));
    while (SkipOp("~")) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr part, ParseMath2());
      node->args.push_back(std::move(part));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      std::string op = toks_[pos_++].text;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParsePow));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseUnaryWithFilters());
    while (IsOp("**")) {
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), "**", &Parser::ParseUnaryWithFilters));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnaryWithFilters() { return ParseUnary(true); }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    NestingGuard guard(this);
    TANDEM_RETURN_IF_ERROR(guard.Check());
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      node = MakeExpr(IsOp("-") ? Expr::Op::kNeg : Expr::Op::kPos, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      node->args.push_back(std::move(operand));
    } else {
      TANDEM_ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    TANDEM_ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      TANDEM_ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& t = Cur();
    int line = t.line;
    switch (t.type) {
      case Tok::kName: {
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        if (t.text == "true" || t.text == "True") {
          node->literal = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          node->literal = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          node->literal = Value::None();
        } else {
          node->op = Expr::Op::kName;
          node->name = t.text;
        }
        ++pos_;
        return node;
      }
      case Tok::kString: {
        // Adjacent string literals concatenate, as in Python.
        std::string s;
        while (Cur().type == Tok::kString) s += toks_[pos_++].text;
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        node->literal = Value::Str(std::move(s));
        return node;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        node->literal = t.type == Tok::kInt ? Value::Int(t.int_value) : Value::Float(t.float_value);
        ++pos_;
        return node;
      }
      case Tok::kOp:
        if (t.text == "(") {
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(ExprPtr inner, ParseTuple(true, {}, true));
          TANDEM_RETURN_IF_ERROR(ExpectOp(")"));
          return inner;
        }
        if (t.text == "[") {
          ++pos_;
          ExprPtr node = MakeExpr(Expr::Op::kList, line);
          while (!IsOp("]")) {
            if (!node->args.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("]")) break;
            TANDEM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
            node->args.push_back(std::move(item));
          }
          ++pos_;
          return node;
        }
        if (t.text == "{") {
          ++pos_;
          ExprPtr node = MakeExpr(Expr::Op::kDict, line);
          while (!IsOp("}")) {
            if (!node->args.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("}")) break;
            TANDEM_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
            TANDEM_RETURN_IF_ERROR(ExpectOp(":"));
            TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
            node->args.push_back(std::move(key));
            node->args.push_back(std::move(value));
          }
          ++pos_;
          return node;
        }
        break;
      default:
        break;
    }
    return Unexpected();
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        int line = Cur().line;
        ++pos_;
        if (Cur().type == Tok::kName) {
          ExprPtr attr = MakeExpr(Expr::Op::kGetAttr, line);
          attr->name = toks_[pos_++].text;
          attr->args.push_back(std::move(node));
          node = std::move(attr);
        } else if (Cur().type == Tok::kInt) {
          ExprPtr item = MakeExpr(Expr::Op::kGetItem, line);
          item->args.push_back(std::move(node));
          ExprPtr index = MakeExpr(Expr::Op::kLiteral, line);
          index->literal = Value::Int(toks_[pos_++].int_value);
          item->args.push_back(std::move(index));
          node = std::move(item);
        } else {
          return Unexpected("a name or number");
        }
      } else if (IsOp("[")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp("(")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr object) {
    int line = Cur().line;
    ++pos_;                      // [
    std::vector<ExprPtr> parts;  // start, stop, step
    bool is_slice = false;
    if (!IsOp(":")) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
      parts.push_back(std::move(first));
    } else {
      parts.push_back(nullptr);
    }
    if (SkipOp(":")) {
      is_slice = true;
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && !SkipOp(":")) {
          parts.push_back(nullptr);
          break;
        }
        if (IsOp(":") || IsOp("]")) {
          parts.push_back(nullptr);
        } else {
          TANDEM_ASSIGN_OR_RETURN(ExprPtr part, ParseExpression(true));
          parts.push_back(std::move(part));
        }
      }
    }
    if (IsOp(",")) return SyntaxError(Cur().line, "tuple subscripts are not supported");
    TANDEM_RETURN_IF_ERROR(ExpectOp("]"));
    ExprPtr node = MakeExpr(is_slice ? Expr::Op::kSlice : Expr::Op::kGetItem, line);
    node->args.push_back(std::move(object));
    for (ExprPtr& p : parts) node->args.push_back(std::move(p));
    return node;
  }

  absl::Status ParseCallArgs(Expr* node) {
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    bool need_comma = false;
    while (!IsOp(")")) {
      if (need_comma) {
        TANDEM_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(")")) break;
      }
      if (IsOp("*") || IsOp("**")) {
        return SyntaxError(Cur().line, "*args and **kwargs in calls are not supported");
      }
      if (Cur().type == Tok::kName && Look().type == Tok::kOp && Look().text == "=") {
        std::string key = Cur().text;
        pos_ += 2;
        TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!node->kwargs.empty()) {
          return SyntaxError(Cur().line, "positional argument follows keyword argument");
        }
        TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node->args.push_back(std::move(value));
      }
      need_comma = true;
    }
    ++pos_;
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    ExprPtr node = MakeExpr(Expr::Op::kCall, Cur().line);
    node->args.push_back(std::move(callee));
    TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr input) {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
    if (!IsKnownFilter(name)) {
      return SyntaxError(line, absl::StrCat("no filter named '", name, "'"));
    }
    ExprPtr node = MakeExpr(Expr::Op::kFilter, line);
    node->name = std::move(name);
    node->args.push_back(std::move(input));
    if (IsOp("(")) TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (SkipOp("|")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseFilter(std::move(node)));
      } else if (IsName("is")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp("(")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr input) {
    int line = Cur().line;
    ++pos_;  // is
    bool negated = SkipName("not");
    TANDEM_ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
    if (!IsKnownTest(name)) return SyntaxError(line, absl::StrCat("no test named '", name, "'"));
    ExprPtr node = MakeExpr(Expr::Op::kTest, line);
    node->name = std::move(name);
    node->args.push_back(std::move(input));
    if (IsOp("(")) {
      TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString || Cur().type == Tok::kInt ||
                Cur().type == Tok::kFloat || IsOp("[") || IsOp("{")) &&
               !IsName("else") && !IsName("or") && !IsName("and")) {
      if (IsName("is")) return SyntaxError(Cur().line, "you cannot chain multiple tests with is");
      // A single argument without parentheses: `x is divisibleby 3`, `x is sameas none`.
      TANDEM_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      TANDEM_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      node->args.push_back(std::move(arg));
    }
    if (!negated) return node;
    ExprPtr not_node = MakeExpr(Expr::Op::kNot, line);
    not_node->args.push_back(std::move(node));
    return not_node;
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(std::vector<Token> tokens) {
  return Parser(std::move(tokens)).ParseTemplate();
}

}  // namespace tandem::text::jinja
