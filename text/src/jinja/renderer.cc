// The renderer: statements, expressions, and attribute and item access (see renderer.h).

#include "text/src/jinja/renderer.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/utf8.h"

namespace tandem::text::jinja {
namespace {

ScopePtr NewScope(const ScopePtr& parent) {
  auto scope = std::make_shared<Scope>();
  scope->parent = parent;
  return scope;
}

}  // namespace

// ---- statements -----------------------------------------------------------------------------

absl::Status Renderer::ExecBody(const Body& body, const ScopePtr& scope) {
  for (const auto& node : body) {
    TANDEM_RETURN_IF_ERROR(Exec(*node, scope));
    if (jump_ != Jump::kNone) break;
  }
  return absl::OkStatus();
}

absl::Status Renderer::Exec(const Node& n, const ScopePtr& scope) {
  DepthGuard guard(this);
  TANDEM_RETURN_IF_ERROR(guard.Check());
  line_ = n.line;
  TANDEM_RETURN_IF_ERROR(Step());
  switch (n.type) {
    case Node::Type::kText:
      return Write(n.text);
    case Node::Type::kOutput: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*n.expr, scope));
      return Write(PyStr(v));
    }
    case Node::Type::kIf:
      for (size_t i = 0; i < n.conds.size(); ++i) {
        TANDEM_ASSIGN_OR_RETURN(Value c, Eval(*n.conds[i], scope));
        if (Truthy(c)) return ExecBody(n.branches[i], scope);
      }
      if (n.branches.size() > n.conds.size()) return ExecBody(n.branches.back(), scope);
      return absl::OkStatus();
    case Node::Type::kFor:
      return ExecFor(n, scope);
    case Node::Type::kSet: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*n.expr, scope));
      line_ = n.line;
      return Assign(n.target, v, scope);
    }
    case Node::Type::kSetBlock: {
      TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(n.body, NewScope(scope)));
      TANDEM_ASSIGN_OR_RETURN(Value v, ApplyFilters(n.filters, Value::Str(std::move(text)), scope));
      line_ = n.line;
      return Assign(n.target, v, scope);
    }
    case Node::Type::kMacro: {
      const Node* macro = &n;
      std::weak_ptr<Scope> closure = scope;  // Weak: the scope holds the macro itself.
      scope->vars[n.text] = Value::Function(n.text, [macro, closure](Renderer& r, CallArgs& args) {
        return r.CallMacro(*macro, closure.lock(), args);
      });
      return absl::OkStatus();
    }
    case Node::Type::kBreak:
      jump_ = Jump::kBreak;
      return absl::OkStatus();
    case Node::Type::kContinue:
      jump_ = Jump::kContinue;
      return absl::OkStatus();
    case Node::Type::kWith: {
      std::vector<Value> values;
      for (const auto& v : n.with_values) {
        TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*v, scope));
        values.push_back(std::move(value));
      }
      ScopePtr inner = NewScope(scope);
      for (size_t i = 0; i < values.size(); ++i) {
        TANDEM_RETURN_IF_ERROR(Assign(n.with_targets[i], values[i], inner));
      }
      return ExecBody(n.body, inner);
    }
    case Node::Type::kFilterBlock: {
      TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(n.body, NewScope(scope)));
      TANDEM_ASSIGN_OR_RETURN(Value v, ApplyFilters(n.filters, Value::Str(std::move(text)), scope));
      return Write(PyStr(v));
    }
    case Node::Type::kPassThrough:
      // Rendered like the body of a call block, which has a scope of its own.
      return ExecBody(n.body, NewScope(scope));
  }
  return absl::OkStatus();
}

absl::Status Renderer::ExecFor(const Node& n, const ScopePtr& scope) {
  TANDEM_ASSIGN_OR_RETURN(Value seq, Eval(*n.expr, scope));
  line_ = n.line;
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(seq));
  if (n.cond) {
    // `for x in xs if cond`: loop.* then describe the filtered sequence.
    auto kept = std::make_shared<ValueList>();
    for (const Value& item : *items) {
      TANDEM_RETURN_IF_ERROR(Step());
      ScopePtr probe = NewScope(scope);
      TANDEM_RETURN_IF_ERROR(Assign(n.target, item, probe));
      TANDEM_ASSIGN_OR_RETURN(Value keep, Eval(*n.cond, probe));
      if (Truthy(keep)) kept->push_back(item);
    }
    items = std::move(kept);
  }
  const int64_t length = static_cast<int64_t>(items->size());
  for (int64_t i = 0; i < length; ++i) {
    line_ = n.line;
    TANDEM_RETURN_IF_ERROR(Step());
    ScopePtr inner = NewScope(scope);
    auto info = std::make_shared<LoopInfo>();
    info->index0 = i;
    info->length = length;
    info->items = items;
    inner->vars["loop"] = Value::Loop(std::move(info));
    TANDEM_RETURN_IF_ERROR(Assign(n.target, (*items)[i], inner));
    TANDEM_RETURN_IF_ERROR(ExecBody(n.body, inner));
    if (jump_ == Jump::kBreak) {
      jump_ = Jump::kNone;
      break;
    }
    jump_ = Jump::kNone;
  }
  if (length == 0 && !n.else_body.empty()) return ExecBody(n.else_body, NewScope(scope));
  return absl::OkStatus();
}

namespace {

// How deeply containers nest in `v`, following namespaces, loops and bound methods as they are
// now; -1 if `target` is reachable from it. Heights are memoized by identity, so shared
// substructures are measured once.
int HeightReaching(const Value& v, const void* target,
                   absl::flat_hash_map<const void*, int>* heights) {
  std::vector<const Value*> children;
  switch (v.kind()) {
    case Kind::kList:
      for (const Value& c : v.list()) children.push_back(&c);
      break;
    case Kind::kDict:
    case Kind::kNamespace:
      for (const auto& [k, c] : v.dict()) {
        children.push_back(&k);
        children.push_back(&c);
      }
      break;
    case Kind::kLoop:
      for (const Value& c : *v.loop().items) children.push_back(&c);
      break;
    case Kind::kCallable:
      if (v.callable().receiver) children.push_back(v.callable().receiver.get());
      break;
    default:
      return 0;
  }
  const void* id = v.identity();
  if (id == target) return -1;
  if (auto it = heights->find(id); it != heights->end()) return it->second;
  int height = 0;
  for (const Value* c : children) {
    int h = HeightReaching(*c, target, heights);
    if (h < 0) return -1;
    height = std::max(height, h + 1);
  }
  (*heights)[id] = height;
  return height;
}

}  // namespace

absl::Status Renderer::Assign(const Target& target, const Value& value, const ScopePtr& scope) {
  switch (target.kind) {
    case Target::Kind::kName:
      TANDEM_RETURN_IF_ERROR(CheckNesting(value.nesting()));
      scope->vars[target.names[0]] = value;
      return absl::OkStatus();
    case Target::Kind::kTuple: {
      TANDEM_RETURN_IF_ERROR(CheckNesting(value.nesting()));
      TANDEM_ASSIGN_OR_RETURN(auto items, Iterate(value));
      if (items->size() != target.names.size()) {
        return Fail(absl::StrCat(items->size() < target.names.size() ? "not enough" : "too many",
                                 " values to unpack (expected ", target.names.size(), ", got ",
                                 items->size(), ")"));
      }
      for (size_t i = 0; i < items->size(); ++i) scope->vars[target.names[i]] = (*items)[i];
      return absl::OkStatus();
    }
    case Target::Kind::kNamespaceAttr: {
      Value ns = Lookup(target.names[0], scope);
      if (ns.is_undefined()) return UndefinedError(ns);
      if (!ns.is(Kind::kNamespace)) return Fail("cannot assign attribute on non-namespace object");
      // Namespaces are the only mutable values, so this is where a value could come to contain
      // itself or grow deeper than its recorded nesting: measure what it holds now.
      absl::flat_hash_map<const void*, int> heights;
      int height = HeightReaching(value, ns.identity(), &heights);
      if (height < 0) return Fail("a namespace cannot contain itself");
      TANDEM_RETURN_IF_ERROR(CheckNesting(height));
      ValueDict& attrs = ns.namespace_attrs();
      for (auto& [k, v] : attrs) {
        if (k.is_string() && k.str() == target.attr) {
          v = value;
          return absl::OkStatus();
        }
      }
      attrs.emplace_back(Value::Str(target.attr), value);
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

Value Renderer::Lookup(const std::string& name, const ScopePtr& scope) const {
  for (const Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return it->second;
  }
  auto it = Globals().find(name);
  if (it != Globals().end()) return it->second;
  return Value::Undefined(absl::StrCat("'", name, "' is undefined"));
}

absl::StatusOr<Value> Renderer::CallMacro(const Node& macro, const ScopePtr& closure,
                                          CallArgs& args) {
  if (closure == nullptr) {
    return Fail(absl::StrCat("macro '", macro.text, "' called after its scope ended"));
  }
  const size_t n = macro.params.size();
  if (args.positional.size() > n) {
    return Fail(absl::StrCat("macro '", macro.text, "' takes not more than ", n, " argument(s)"));
  }
  std::vector<std::optional<Value>> bound(n);
  for (size_t i = 0; i < args.positional.size(); ++i) bound[i] = std::move(args.positional[i]);
  for (auto& [key, value] : args.keyword) {
    auto it = std::find(macro.params.begin(), macro.params.end(), key);
    if (it == macro.params.end()) {
      return Fail(absl::StrCat("macro '", macro.text, "' takes no keyword argument '", key, "'"));
    }
    bound[it - macro.params.begin()] = std::move(value);
  }
  ScopePtr scope = NewScope(closure);
  for (size_t i = 0; i < n; ++i) {
    Value v;
    if (bound[i]) {
      v = std::move(*bound[i]);
    } else if (macro.defaults[i]) {
      TANDEM_ASSIGN_OR_RETURN(v, Eval(*macro.defaults[i], scope));
    } else {
      v = Value::Undefined(absl::StrCat("parameter '", macro.params[i], "' was not provided"));
    }
    scope->vars[macro.params[i]] = std::move(v);
  }
  TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(macro.body, scope));
  return Value::Str(std::move(text));
}

// ---- expressions ----------------------------------------------------------------------------

absl::StatusOr<Value> Renderer::Eval(const Expr& e, const ScopePtr& scope) {
  DepthGuard guard(this);
  TANDEM_RETURN_IF_ERROR(guard.Check());
  switch (e.op) {
    case Expr::Op::kLiteral:
      return e.literal;
    case Expr::Op::kName:
      return Lookup(e.name, scope);
    case Expr::Op::kList:
    case Expr::Op::kTuple: {
      ValueList items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) {
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
        items.push_back(std::move(v));
      }
      Value list = Value::List(std::move(items), e.op == Expr::Op::kTuple ? Value::Flavor::kTuple
                                                                          : Value::Flavor::kList);
      TANDEM_RETURN_IF_ERROR(CheckNesting(list.nesting()));
      return list;
    }
    case Expr::Op::kDict: {
      ValueDict items;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        TANDEM_ASSIGN_OR_RETURN(Value k, Eval(*e.args[i], scope));
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i + 1], scope));
        bool replaced = false;
        for (auto& [k2, v2] : items) {
          if (PyEquals(k2, k)) {
            v2 = v;
            replaced = true;
            break;
          }
        }
        if (!replaced) items.emplace_back(std::move(k), std::move(v));
      }
      Value dict = Value::Dict(std::move(items));
      TANDEM_RETURN_IF_ERROR(CheckNesting(dict.nesting()));
      return dict;
    }
    case Expr::Op::kGetAttr: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
      line_ = e.line;
      return GetAttr(obj, e.name);
    }
    case Expr::Op::kGetItem: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(Value key, Eval(*e.args[1], scope));
      line_ = e.line;
      return GetItem(obj, key);
    }
    case Expr::Op::kSlice:
      return EvalSlice(e, scope);
    case Expr::Op::kCall:
      return EvalCall(e, scope);
    case Expr::Op::kFilter: {
      TANDEM_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
      line_ = e.line;
      return ApplyFilter(e.name, input, args);
    }
    case Expr::Op::kTest: {
      TANDEM_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
      line_ = e.line;
      TANDEM_ASSIGN_OR_RETURN(bool result, ApplyTest(e.name, input, args));
      return Value::Bool(result);
    }
    case Expr::Op::kNeg:
    case Expr::Op::kPos: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
      line_ = e.line;
      if (v.is_undefined()) return UndefinedError(v);
      if (!v.is_number()) {
        return Fail(absl::StrCat("bad operand type for unary ", e.op == Expr::Op::kNeg ? "-" : "+",
                                 ": '", TypeName(v), "'"));
      }
      if (e.op == Expr::Op::kPos) return v.is_bool() ? Value::Int(v.as_int()) : v;
      if (v.is(Kind::kFloat)) return Value::Float(-v.as_double());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) return Fail("integer overflow");
      return Value::Int(-v.as_int());
    }
    case Expr::Op::kNot: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
      return Value::Bool(!Truthy(v));
    }
    case Expr::Op::kAnd:
    case Expr::Op::kOr: {
      TANDEM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      if (Truthy(left) == (e.op == Expr::Op::kOr)) return left;
      return Eval(*e.args[1], scope);
    }
    case Expr::Op::kBinary: {
      TANDEM_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(Value b, Eval(*e.args[1], scope));
      line_ = e.line;
      return Arith(e.name, a, b);
    }
    case Expr::Op::kCompare: {
      TANDEM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      for (size_t i = 0; i < e.compare_ops.size(); ++i) {
        TANDEM_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1], scope));
        line_ = e.line;
        const std::string& op = e.compare_ops[i];
        bool result;
        if (op == "==" || op == "!=") {
          result = PyEquals(left, right) == (op == "==");
        } else if (op == "in" || op == "not in") {
          TANDEM_ASSIGN_OR_RETURN(bool in, Contains(right, left));
          result = in == (op == "in");
        } else if (op == "<" || op == ">=") {
          TANDEM_ASSIGN_OR_RETURN(bool less, Less(left, right));
          result = less == (op == "<");
        } else {
          TANDEM_ASSIGN_OR_RETURN(bool greater, Less(right, left));
          result = greater == (op == ">");
        }
        if (!result) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case Expr::Op::kConcat: {
      std::string s;
      for (const auto& a : e.args) {
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
        s += PyStr(v);
        TANDEM_RETURN_IF_ERROR(CheckSize(s.size()));
      }
      return Value::Str(std::move(s));
    }
    case Expr::Op::kCond: {
      TANDEM_ASSIGN_OR_RETURN(Value c, Eval(*e.args[1], scope));
      if (Truthy(c)) return Eval(*e.args[0], scope);
      if (e.args[2]) return Eval(*e.args[2], scope);
      return Value::Undefined(
          "the inline if-expression evaluated to false and no else section "
          "was defined");
    }
  }
  return Fail("unhandled expression");
}

absl::StatusOr<CallArgs> Renderer::EvalArgs(const Expr& e, size_t first, const ScopePtr& scope) {
  CallArgs args;
  for (size_t i = first; i < e.args.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i], scope));
    args.positional.push_back(std::move(v));
  }
  for (const auto& [key, expr] : e.kwargs) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr, scope));
    args.keyword.emplace_back(key, std::move(v));
  }
  return args;
}

absl::StatusOr<Value> Renderer::EvalCall(const Expr& e, const ScopePtr& scope) {
  const Expr& callee = *e.args[0];
  Value fn;
  if (callee.op == Expr::Op::kGetAttr) {
    TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*callee.args[0], scope));
    line_ = callee.line;
    TANDEM_ASSIGN_OR_RETURN(fn, GetAttr(obj, callee.name));
  } else {
    TANDEM_ASSIGN_OR_RETURN(fn, Eval(callee, scope));
  }
  TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
  line_ = e.line;
  return CallValue(fn, args);
}

absl::StatusOr<Value> Renderer::CallValue(const Value& fn, CallArgs& args) {
  if (fn.is(Kind::kCallable)) return fn.callable().fn(*this, args);
  if (fn.is_undefined()) return UndefinedError(fn);
  return Fail(absl::StrCat("'", TypeName(fn), "' object is not callable"));
}

absl::StatusOr<Value> Renderer::ApplyFilters(const std::vector<ExprPtr>& filters, Value value,
                                             const ScopePtr& scope) {
  for (const auto& f : filters) {
    TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(*f, 1, scope));
    line_ = f->line;
    TANDEM_ASSIGN_OR_RETURN(value, ApplyFilter(f->name, value, args));
  }
  return value;
}

absl::StatusOr<std::vector<int64_t>> SliceIndices(Renderer& r, int64_t n,
                                                  std::optional<int64_t> start,
                                                  std::optional<int64_t> stop,
                                                  std::optional<int64_t> step_opt) {
  int64_t step = step_opt.value_or(1);
  if (step == 0) return r.Fail("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= n) {
      x = step < 0 ? n - 1 : n;
    }
    return x;
  };
  int64_t b = clamp(start, step > 0 ? 0 : n - 1);
  int64_t e = clamp(stop, step > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t i = b; step > 0 ? i < e : i > e; i += step) out.push_back(i);
  return out;
}

absl::StatusOr<Value> Renderer::EvalSlice(const Expr& e, const ScopePtr& scope) {
  TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
  std::optional<int64_t> bounds[3];
  bool valid = true;
  for (int k = 0; k < 3; ++k) {
    if (!e.args[k + 1]) continue;
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[k + 1], scope));
    if (v.is(Kind::kInt) || v.is_bool()) {
      bounds[k] = v.as_int();
    } else if (!v.is(Kind::kNone)) {
      valid = false;
    }
  }
  line_ = e.line;
  if (obj.is_undefined()) return UndefinedError(obj);
  if (!valid) return Value::Undefined("slice indices must be integers or None");
  if (obj.is_string()) {
    std::vector<size_t> starts = CodePointStarts(obj.str());
    TANDEM_ASSIGN_OR_RETURN(auto idx, SliceIndices(*this, static_cast<int64_t>(starts.size()),
                                                   bounds[0], bounds[1], bounds[2]));
    std::string out;
    for (int64_t i : idx) {
      size_t b = starts[i];
      size_t end = static_cast<size_t>(i) + 1 < starts.size() ? starts[i + 1] : obj.str().size();
      out.append(obj.str(), b, end - b);
    }
    return Value::Str(std::move(out));
  }
  if (obj.is_list() && obj.flavor() != Value::Flavor::kIterator) {
    TANDEM_ASSIGN_OR_RETURN(auto idx, SliceIndices(*this, static_cast<int64_t>(obj.list().size()),
                                                   bounds[0], bounds[1], bounds[2]));
    ValueList out;
    out.reserve(idx.size());
    for (int64_t i : idx) out.push_back(obj.list()[i]);
    return Value::List(std::move(out), obj.flavor());
  }
  return Value::Undefined(absl::StrCat("'", TypeName(obj), "' object is not subscriptable"));
}

absl::StatusOr<std::shared_ptr<const ValueList>> Renderer::Iterate(const Value& v) const {
  switch (v.kind()) {
    case Kind::kList:
      return v.list_ptr();
    case Kind::kDict: {
      auto keys = std::make_shared<ValueList>();
      for (const auto& [k, val] : v.dict()) keys->push_back(k);
      return std::shared_ptr<const ValueList>(std::move(keys));
    }
    case Kind::kString: {
      auto chars = std::make_shared<ValueList>();
      const std::string& s = v.str();
      for (size_t i = 0; i < s.size();) {
        size_t len = Utf8SeqLen(static_cast<unsigned char>(s[i]));
        chars->push_back(Value::Str(s.substr(i, len)));
        i += len;
      }
      return std::shared_ptr<const ValueList>(std::move(chars));
    }
    case Kind::kUndefined:
      return std::make_shared<const ValueList>();
    default:
      return Fail(absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

namespace {

bool IsStrMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {
      "startswith", "endswith", "split",      "rsplit",  "strip",   "lstrip",  "rstrip", "upper",
      "lower",      "title",    "capitalize", "replace", "find",    "rfind",   "count",  "join",
      "splitlines", "isdigit",  "isalpha",    "isalnum", "isspace", "islower", "isupper"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}

bool IsDictMethod(std::string_view name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

// Dict attributes that would mutate it: the sandbox hides them, so they read as undefined even
// when the dict has such a key.
bool IsUnsafeDictAttr(std::string_view name) {
  return name == "pop" || name == "popitem" || name == "update" || name == "clear" ||
         name == "setdefault" || name == "copy" || name == "fromkeys";
}

Value BoundMethod(const Value& self, const std::string& name) {
  auto receiver = std::make_shared<const Value>(self);
  return Value::Function(
      name,
      [receiver, name](Renderer& r, CallArgs& args) { return r.CallMethod(*receiver, name, args); },
      receiver);
}

}  // namespace

absl::StatusOr<Value> Renderer::GetAttr(const Value& obj, const std::string& name) const {
  switch (obj.kind()) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict: {
      if (IsDictMethod(name)) return BoundMethod(obj, name);
      if (!IsUnsafeDictAttr(name)) {
        if (const Value* v = DictFind(obj.dict(), name)) return *v;
      }
      break;
    }
    case Kind::kString:
      if (IsStrMethod(name)) return BoundMethod(obj, name);
      break;
    case Kind::kNamespace:
      if (const Value* v = DictFind(obj.dict(), name)) return *v;
      break;
    case Kind::kLoop:
      return LoopAttr(obj, name);
    default:
      break;
  }
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), " object' has no attribute '", name, "'"));
}

absl::StatusOr<Value> Renderer::GetItem(const Value& obj, const Value& key) const {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.is_dict()) {
    if (const Value* v = DictFind(obj.dict(), key)) return *v;
  } else if ((key.is(Kind::kInt) || key.is_bool()) &&
             ((obj.is_list() && obj.flavor() != Value::Flavor::kIterator) || obj.is_string())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      int64_t n = static_cast<int64_t>(obj.list().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.list()[i];
    } else {
      std::vector<size_t> starts = CodePointStarts(obj.str());
      int64_t n = static_cast<int64_t>(starts.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        size_t end = i + 1 < n ? starts[i + 1] : obj.str().size();
        return Value::Str(obj.str().substr(starts[i], end - starts[i]));
      }
    }
    return Value::Undefined(absl::StrCat(TypeName(obj), " object has no element ", i));
  }
  // obj[name] falls back to obj.name, as in Jinja.
  if (key.is_string() && !obj.is_dict()) return GetAttr(obj, key.str());
  if (key.is_string() && IsDictMethod(key.str())) return BoundMethod(obj, key.str());
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), " object' has no attribute ", PyRepr(key)));
}

absl::StatusOr<Value> Renderer::AttrPath(const Value& item, const Value& path) const {
  if (!path.is_string()) return GetItem(item, path);
  Value v = item;
  size_t start = 0;
  const std::string& p = path.str();
  while (true) {
    size_t dot = p.find('.', start);
    std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), IsAsciiDigit);
    Value key = numeric ? Value::Int(std::strtoll(part.c_str(), nullptr, 10)) : Value::Str(part);
    TANDEM_ASSIGN_OR_RETURN(v, GetItem(v, key));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

absl::StatusOr<Value> Renderer::LoopAttr(const Value& loop, const std::string& name) const {
  const LoopInfo& l = loop.loop();
  if (name == "index") return Value::Int(l.index0 + 1);
  if (name == "index0") return Value::Int(l.index0);
  if (name == "revindex") return Value::Int(l.length - l.index0);
  if (name == "revindex0") return Value::Int(l.length - l.index0 - 1);
  if (name == "first") return Value::Bool(l.index0 == 0);
  if (name == "last") return Value::Bool(l.index0 == l.length - 1);
  if (name == "length") return Value::Int(l.length);
  if (name == "depth") return Value::Int(l.depth0 + 1);
  if (name == "depth0") return Value::Int(l.depth0);
  if (name == "previtem") {
    if (l.index0 == 0) return Value::Undefined("there is no previous item");
    return (*l.items)[l.index0 - 1];
  }
  if (name == "nextitem") {
    if (l.index0 + 1 >= l.length) return Value::Undefined("there is no next item");
    return (*l.items)[l.index0 + 1];
  }
  if (name == "cycle") {
    int64_t index0 = l.index0;
    return Value::Function("cycle", [index0](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      if (a.positional.empty()) return r.Fail("no items for cycling given");
      return a.positional[index0 % a.positional.size()];
    });
  }
  return Value::Undefined(absl::StrCat("'LoopContext object' has no attribute '", name, "'"));
}

}  // namespace tandem::text::jinja
