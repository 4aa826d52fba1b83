// The global functions templates can call: range, dict, namespace, raise_exception and
// strftime_now.

#include <cmath>
#include <cstdint>
#include <ctime>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {
namespace {

absl::StatusOr<ValueDict> DictFromArgs(Renderer& r, absl::string_view fn, const CallArgs& args) {
  ValueDict out;
  auto put = [&](const Value& k, const Value& v) {
    for (auto& [k2, v2] : out) {
      if (PyEquals(k2, k)) {
        v2 = v;
        return;
      }
    }
    out.emplace_back(k, v);
  };
  if (args.positional.size() > 1) return r.Fail(absl::StrCat(fn, "() takes at most 1 argument"));
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_dict() || src.is(Kind::kNamespace)) {
      for (const auto& [k, v] : src.dict()) put(k, v);
    } else {
      TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(src));
      for (const Value& pair : *items) {
        TANDEM_ASSIGN_OR_RETURN(auto kv, r.Iterate(pair));
        if (kv->size() != 2) return r.Fail(absl::StrCat(fn, "() needs key/value pairs"));
        put((*kv)[0], (*kv)[1]);
      }
    }
  }
  for (const auto& [k, v] : args.keyword) put(Value::Str(k), v);
  return out;
}

}  // namespace

const absl::flat_hash_map<std::string, Value>& Globals() {
  static const auto* globals = [] {
    auto* g = new absl::flat_hash_map<std::string, Value>();
    (*g)["range"] = Value::Function("range", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      if (!a.keyword.empty() || a.positional.empty() || a.positional.size() > 3) {
        return r.Fail("range() takes 1 to 3 integer arguments");
      }
      int64_t v[3] = {0, 0, 1};
      for (size_t i = 0; i < a.positional.size(); ++i) {
        const Value& x = a.positional[i];
        if (!x.is(Kind::kInt) && !x.is_bool()) {
          return r.Fail(
              absl::StrCat("'", TypeName(x), "' object cannot be interpreted as an integer"));
        }
        v[a.positional.size() == 1 ? 1 : i] = x.as_int();
      }
      if (v[2] == 0) return r.Fail("range() arg 3 must not be zero");
      // The sandbox's limit on range sizes.
      constexpr int64_t kMaxRange = 100000;
      long double count = v[2] > 0 ? std::ceil((static_cast<long double>(v[1]) - v[0]) / v[2])
                                   : std::ceil((static_cast<long double>(v[0]) - v[1]) / -v[2]);
      if (count > kMaxRange) {
        return r.Fail("range too big, the sandbox blocks ranges larger than 100000");
      }
      ValueList items;
      for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2])
        items.push_back(Value::Int(i));
      return Value::List(std::move(items));
    });
    (*g)["dict"] = Value::Function("dict", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      TANDEM_ASSIGN_OR_RETURN(ValueDict d, DictFromArgs(r, "dict", a));
      return Value::Dict(std::move(d));
    });
    (*g)["namespace"] =
        Value::Function("namespace", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
          TANDEM_ASSIGN_OR_RETURN(ValueDict d, DictFromArgs(r, "namespace", a));
          return Value::Namespace(std::move(d));
        });
    // The message becomes the error, unprefixed, as Hugging Face surfaces TemplateError.
    (*g)["raise_exception"] =
        Value::Function("raise_exception", [](Renderer&, CallArgs& a) -> absl::StatusOr<Value> {
          return absl::InvalidArgumentError(a.positional.empty() ? "" : PyStr(a.positional[0]));
        });
    (*g)["strftime_now"] =
        Value::Function("strftime_now", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
          if (a.positional.size() != 1 || !a.positional[0].is_string()) {
            return r.Fail("strftime_now() takes one format string");
          }
          std::time_t now = std::time(nullptr);
          std::tm tm{};
          localtime_r(&now, &tm);
          std::string buf(256, '\0');
          size_t n = std::strftime(buf.data(), buf.size(), a.positional[0].str().c_str(), &tm);
          buf.resize(n);
          return Value::Str(std::move(buf));
        });
    return g;
  }();
  return *globals;
}

}  // namespace tandem::text::jinja
