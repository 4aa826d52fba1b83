// The renderer: walks the syntax tree with a scope of variables and writes the text, within
// the bounds of JinjaLimits. Its parts: statements, expressions, attribute and item access
// (renderer.cc), operators (operators.cc), methods of str and dict (methods.cc), filters
// (filters.cc), tests (tests.cc) and the global functions (globals.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
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
#include "absl/strings/string_view.h"
#include "tandem/base/status_macros.h"
#include "tandem/text/chat_template.h"
#include "text/src/jinja/ast.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {

// Variables visible at one point. A for-loop iteration, macro call, {% with %} and block
// captures get their own scope, so `set` inside them does not leak out (namespaces aside);
// {% if %} shares its parent's.
struct Scope {
  std::shared_ptr<Scope> parent;
  absl::flat_hash_map<std::string, Value> vars;
};
using ScopePtr = std::shared_ptr<Scope>;

// Call arguments bound to a function's parameters (see Renderer::Bind); empty where not passed.
using Params = std::vector<std::optional<Value>>;

// One render of a template: writes text to *out, counting steps, nesting and bytes against the
// limits. Builtins get it to raise errors at the current line and to call back into rendering.
class Renderer {
 public:
  Renderer(const JinjaLimits& limits, std::string* out) : limits_(limits), out_(out) {}

  absl::Status ExecBody(const Body& body, const ScopePtr& scope);
  absl::StatusOr<Value> Eval(const Expr& e, const ScopePtr& scope);

  // An error at the template line being evaluated.
  absl::Status Fail(absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat("template line ", line_, ": ", msg));
  }
  absl::Status UndefinedError(const Value& v) const {
    return Fail(v.hint().empty() ? "value is undefined" : v.hint());
  }
  absl::Status CheckNesting(int nesting) const {
    if (nesting > kMaxValueNesting) {
      return Fail(absl::StrCat("value nests deeper than ", kMaxValueNesting, " levels"));
    }
    return absl::OkStatus();
  }
  // Rejects a string or list of `n` bytes or items that would exceed the output limit.
  absl::Status CheckSize(size_t n) const {
    if (n > limits_.max_output_bytes) {
      return Fail(absl::StrCat("value exceeds the template size limit of ",
                               limits_.max_output_bytes, " bytes"));
    }
    return absl::OkStatus();
  }

  // Binds call arguments to named parameters like a Python signature; parameters the caller
  // did not pass stay empty.
  absl::StatusOr<Params> Bind(absl::string_view fn, const CallArgs& args,
                              std::initializer_list<std::string_view> names) const {
    if (args.positional.size() > names.size()) {
      return Fail(absl::StrCat(fn, "() takes at most ", names.size(), " argument(s), ",
                               args.positional.size(), " given"));
    }
    Params out(names.size());
    for (size_t i = 0; i < args.positional.size(); ++i) out[i] = args.positional[i];
    for (const auto& [key, value] : args.keyword) {
      auto it = std::find(names.begin(), names.end(), key);
      if (it == names.end()) {
        return Fail(absl::StrCat(fn, "() got an unexpected keyword argument '", key, "'"));
      }
      size_t i = it - names.begin();
      if (out[i]) return Fail(absl::StrCat(fn, "() got multiple values for argument '", key, "'"));
      out[i] = value;
    }
    return out;
  }
  absl::StatusOr<int64_t> IntParam(const std::optional<Value>& v, absl::string_view what,
                                   int64_t def) const {
    if (!v || v->is(Kind::kNone)) return def;
    if (v->is(Kind::kInt) || v->is_bool()) return v->as_int();
    return Fail(absl::StrCat(what, " must be an integer, not ", TypeName(*v)));
  }
  static bool BoolParam(const std::optional<Value>& v, bool def) { return v ? Truthy(*v) : def; }

  absl::StatusOr<std::shared_ptr<const ValueList>> Iterate(const Value& v) const;
  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) const;
  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) const;
  // `item.a.b` or `item.0` for the attribute= arguments of filters.
  absl::StatusOr<Value> AttrPath(const Value& item, const Value& path) const;
  absl::StatusOr<Value> CallValue(const Value& fn, CallArgs& args);
  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name, CallArgs& args);
  absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<Value> Arith(absl::string_view op, const Value& a, const Value& b) const;
  absl::StatusOr<bool> Less(const Value& a, const Value& b) const;
  absl::StatusOr<bool> Contains(const Value& container, const Value& item) const;
  // Sorts like Python's sorted(): stable, by `<`, failing on values that do not compare.
  absl::Status Sort(std::vector<std::pair<Value, Value>>* keyed, bool reverse) const;
  absl::StatusOr<Value> CallMacro(const Node& macro, const ScopePtr& closure, CallArgs& args);

 private:
  // Bounds the nesting of evaluation, so that deep or recursive templates fail cleanly.
  class DepthGuard {
   public:
    explicit DepthGuard(Renderer* r) : r_(r) { ++r_->depth_; }
    ~DepthGuard() { --r_->depth_; }
    absl::Status Check() const {
      if (r_->depth_ > r_->limits_.max_depth) {
        return r_->Fail(absl::StrCat("template nesting exceeds ", r_->limits_.max_depth,
                                     " levels (runaway recursion?)"));
      }
      return absl::OkStatus();
    }

   private:
    Renderer* r_;
  };

  enum class Jump { kNone, kBreak, kContinue };

  absl::Status Exec(const Node& n, const ScopePtr& scope);
  absl::Status ExecFor(const Node& n, const ScopePtr& scope);
  absl::Status Step() {
    if (++steps_ > limits_.max_steps) {
      return Fail(absl::StrCat("template exceeded its limit of ", limits_.max_steps, " steps"));
    }
    return absl::OkStatus();
  }
  absl::Status Write(std::string_view s) {
    written_ += s.size();
    if (written_ > limits_.max_output_bytes) {
      return Fail(absl::StrCat("template output exceeds ", limits_.max_output_bytes, " bytes"));
    }
    out_->append(s);
    return absl::OkStatus();
  }
  // Renders `body` in a child scope and returns the text instead of writing it.
  absl::StatusOr<std::string> Capture(const Body& body, const ScopePtr& scope) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    absl::Status status = ExecBody(body, scope);
    out_ = saved;
    TANDEM_RETURN_IF_ERROR(status);
    return buf;
  }
  absl::Status Assign(const Target& target, const Value& value, const ScopePtr& scope);
  Value Lookup(const std::string& name, const ScopePtr& scope) const;
  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, size_t first, const ScopePtr& scope);
  absl::StatusOr<Value> EvalCall(const Expr& e, const ScopePtr& scope);
  absl::StatusOr<Value> EvalSlice(const Expr& e, const ScopePtr& scope);
  absl::StatusOr<Value> ApplyFilters(const std::vector<ExprPtr>& filters, Value value,
                                     const ScopePtr& scope);
  absl::StatusOr<Value> LoopAttr(const Value& loop, const std::string& name) const;
  absl::StatusOr<Value> StrMethod(const std::string& s, const std::string& name, CallArgs& args);

  const JinjaLimits& limits_;
  std::string* out_;  // Where text goes: the result, or a capture buffer. Not owned.
  int line_ = 1;
  int depth_ = 0;
  int64_t steps_ = 0;
  size_t written_ = 0;
  Jump jump_ = Jump::kNone;
};

// The global functions and their names: range, dict, namespace, raise_exception, strftime_now.
const absl::flat_hash_map<std::string, Value>& Globals();

// Python's slice.indices() followed by the walk it describes.
absl::StatusOr<std::vector<int64_t>> SliceIndices(Renderer& r, int64_t n,
                                                  std::optional<int64_t> start,
                                                  std::optional<int64_t> stop,
                                                  std::optional<int64_t> step_opt);

// Python's `format % args` for the conversions templates use: %s %r %a %d %i %u %x %X %o %c
// %e %E %f %F %g %G %%, with flags, width, precision and %(key)s lookups in a dict.
absl::StatusOr<Value> PyPercentFormat(const Renderer& r, const std::string& format,
                                      const Value& args);

// str.strip(chars) / lstrip / rstrip; no chars (or None) strips whitespace.
absl::StatusOr<std::string> PyStrip(Renderer& r, const std::string& s,
                                    const std::optional<Value>& chars, bool left, bool right);

}  // namespace tandem::text::jinja
