// Methods of str and dict values: `s.split()`, `d.items()`, ... (see renderer.h).

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/utf8.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {
namespace {

// str.split(sep, maxsplit) / str.rsplit(...). No separator splits on runs of whitespace.
absl::StatusOr<ValueList> PySplit(Renderer& r, const std::string& s,
                                  const std::optional<Value>& sep, int64_t maxsplit,
                                  bool from_right) {
  std::vector<std::string> parts;
  if (!sep || sep->is(Kind::kNone)) {
    if (!from_right) {
      size_t pos = 0;
      while (true) {
        pos += SpaceRunFrom(s, pos);
        if (pos >= s.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(pos));
          break;
        }
        size_t end = pos;
        while (end < s.size()) {
          size_t len;
          if (IsPySpace(DecodeAt(s, end, &len))) break;
          end += len;
        }
        parts.push_back(s.substr(pos, end - pos));
        pos = end;
      }
    } else {
      size_t end = s.size();
      while (true) {
        end = RStripSpace(std::string_view(s).substr(0, end)).size();
        if (end == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(0, end));
          break;
        }
        size_t start = end;
        while (start > 0) {
          size_t prev = start - 1;
          while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
          size_t len;
          if (IsPySpace(DecodeAt(s, prev, &len))) break;
          start = prev;
        }
        parts.push_back(s.substr(start, end - start));
        end = start;
      }
      std::reverse(parts.begin(), parts.end());
    }
  } else {
    if (!sep->is_string()) return r.Fail("must be str or None");
    const std::string& d = sep->str();
    if (d.empty()) return r.Fail("empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (true) {
        size_t hit = s.find(d, pos);
        if (hit == std::string::npos ||
            (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(pos));
          break;
        }
        parts.push_back(s.substr(pos, hit - pos));
        pos = hit + d.size();
      }
    } else {
      size_t end = s.size();
      while (true) {
        size_t hit = end >= d.size() ? s.rfind(d, end - d.size()) : std::string::npos;
        if (hit == std::string::npos ||
            (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(0, end));
          break;
        }
        parts.push_back(s.substr(hit + d.size(), end - hit - d.size()));
        end = hit;
      }
      std::reverse(parts.begin(), parts.end());
    }
  }
  ValueList out;
  for (auto& p : parts) out.push_back(Value::Str(std::move(p)));
  return out;
}

}  // namespace

absl::StatusOr<std::string> PyStrip(Renderer& r, const std::string& s,
                                    const std::optional<Value>& chars, bool left, bool right) {
  if (!chars || chars->is(Kind::kNone)) {
    std::string_view v = s;
    if (left) v = LStripSpace(v);
    if (right) v = RStripSpace(v);
    return std::string(v);
  }
  if (!chars->is_string()) return r.Fail("strip arg must be None or str");
  return StripChars(s, chars->str(), left, right);
}

absl::StatusOr<Value> Renderer::CallMethod(const Value& self, const std::string& name,
                                           CallArgs& args) {
  if (self.is_string()) return StrMethod(self.str(), name, args);
  if (self.is_dict()) {
    if (name == "get") {
      TANDEM_ASSIGN_OR_RETURN(Params p, Bind("get", args, {"key", "default"}));
      if (!p[0]) return Fail("get() expected at least 1 argument");
      if (const Value* v = DictFind(self.dict(), *p[0])) return *v;
      return p[1] ? *p[1] : Value::None();
    }
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {}));
    ValueList out;
    for (const auto& [k, v] : self.dict()) {
      if (name == "keys") {
        out.push_back(k);
      } else if (name == "values") {
        out.push_back(v);
      } else {
        out.push_back(Value::List({k, v}, Value::Flavor::kTuple));
      }
    }
    return Value::List(std::move(out));
  }
  return Fail(absl::StrCat("'", TypeName(self), "' object has no method '", name, "'"));
}

absl::StatusOr<Value> Renderer::StrMethod(const std::string& s, const std::string& name,
                                          CallArgs& args) {
  if (name == "startswith" || name == "endswith") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"prefix", "start", "end"}));
    if (!p[0]) return Fail(absl::StrCat(name, "() takes at least 1 argument"));
    std::string sub = s;
    if ((p[1] && !p[1]->is(Kind::kNone)) || (p[2] && !p[2]->is(Kind::kNone))) {
      std::vector<size_t> starts = CodePointStarts(s);
      TANDEM_ASSIGN_OR_RETURN(int64_t b, IntParam(p[1], "start", 0));
      TANDEM_ASSIGN_OR_RETURN(int64_t e,
                              IntParam(p[2], "end", static_cast<int64_t>(starts.size())));
      TANDEM_ASSIGN_OR_RETURN(auto idx,
                              SliceIndices(*this, static_cast<int64_t>(starts.size()), b, e, 1));
      sub.clear();
      for (int64_t i : idx) {
        size_t end = static_cast<size_t>(i) + 1 < starts.size() ? starts[i + 1] : s.size();
        sub.append(s, starts[i], end - starts[i]);
      }
      if (idx.empty() && b > static_cast<int64_t>(starts.size())) return Value::Bool(false);
    }
    std::vector<std::string> affixes;
    if (p[0]->is_string()) {
      affixes.push_back(p[0]->str());
    } else if (p[0]->is_list() && p[0]->flavor() == Value::Flavor::kTuple) {
      for (const Value& v : p[0]->list()) {
        if (!v.is_string()) return Fail(absl::StrCat(name, "() needs a str or a tuple of str"));
        affixes.push_back(v.str());
      }
    } else {
      return Fail(absl::StrCat(std::string(name), " first arg must be str or a tuple of str, not ",
                               TypeName(*p[0])));
    }
    for (const std::string& a : affixes) {
      bool hit = name == "startswith" ? sub.compare(0, a.size(), a) == 0
                                      : sub.size() >= a.size() &&
                                            sub.compare(sub.size() - a.size(), a.size(), a) == 0;
      if (hit) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "split" || name == "rsplit") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"sep", "maxsplit"}));
    TANDEM_ASSIGN_OR_RETURN(int64_t maxsplit, IntParam(p[1], "maxsplit", -1));
    TANDEM_ASSIGN_OR_RETURN(ValueList parts, PySplit(*this, s, p[0], maxsplit, name == "rsplit"));
    return Value::List(std::move(parts));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"chars"}));
    TANDEM_ASSIGN_OR_RETURN(std::string out,
                            PyStrip(*this, s, p[0], name != "rstrip", name != "lstrip"));
    return Value::Str(std::move(out));
  }
  if (name == "replace") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"old", "new", "count"}));
    if (!p[0] || !p[1] || !p[0]->is_string() || !p[1]->is_string()) {
      return Fail("replace() takes two str arguments");
    }
    TANDEM_ASSIGN_OR_RETURN(int64_t count, IntParam(p[2], "count", -1));
    std::string out = PyReplace(s, p[0]->str(), p[1]->str(), count);
    TANDEM_RETURN_IF_ERROR(CheckSize(out.size()));
    return Value::Str(std::move(out));
  }
  if (name == "find" || name == "rfind" || name == "count") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"sub"}));
    if (!p[0] || !p[0]->is_string()) return Fail(absl::StrCat(name, "() takes a str argument"));
    const std::string& sub = p[0]->str();
    if (name == "count") {
      if (sub.empty()) return Value::Int(static_cast<int64_t>(CodePointCount(s)) + 1);
      int64_t n = 0;
      for (size_t pos = s.find(sub); pos != std::string::npos;
           pos = s.find(sub, pos + sub.size())) {
        ++n;
      }
      return Value::Int(n);
    }
    size_t hit = name == "find" ? s.find(sub) : s.rfind(sub);
    if (hit == std::string::npos) return Value::Int(-1);
    return Value::Int(static_cast<int64_t>(CodePointCount(std::string_view(s).substr(0, hit))));
  }
  if (name == "join") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"iterable"}));
    if (!p[0]) return Fail("join() takes exactly one argument");
    TANDEM_ASSIGN_OR_RETURN(auto items, Iterate(*p[0]));
    std::string out;
    for (size_t i = 0; i < items->size(); ++i) {
      const Value& v = (*items)[i];
      if (!v.is_string()) {
        return Fail(
            absl::StrCat("sequence item ", i, ": expected str instance, ", TypeName(v), " found"));
      }
      if (i > 0) out += s;
      out += v.str();
      TANDEM_RETURN_IF_ERROR(CheckSize(out.size()));
    }
    return Value::Str(std::move(out));
  }
  if (name == "splitlines") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"keepends"}));
    ValueList out;
    for (std::string& line : PySplitLines(s, BoolParam(p[0], false))) {
      out.push_back(Value::Str(std::move(line)));
    }
    return Value::List(std::move(out));
  }
  TANDEM_ASSIGN_OR_RETURN(Params none, Bind(name, args, {}));
  if (name == "upper") return Value::Str(AsciiUpper(s));
  if (name == "lower") return Value::Str(AsciiLower(s));
  if (name == "title") return Value::Str(PyTitle(s));
  if (name == "capitalize") return Value::Str(PyCapitalize(s));
  auto all = [&](auto pred) {
    return Value::Bool(!s.empty() && std::all_of(s.begin(), s.end(), pred));
  };
  if (name == "isdigit") return all(IsAsciiDigit);
  if (name == "isalpha") return all(IsAsciiAlpha);
  if (name == "isalnum") return all([](char c) { return IsAsciiAlpha(c) || IsAsciiDigit(c); });
  if (name == "isspace") {
    return Value::Bool(!s.empty() && SpaceRunFrom(s, 0) == s.size());
  }
  if (name == "islower" || name == "isupper") {
    bool cased = false;
    for (char c : s) {
      if (!IsAsciiAlpha(c)) continue;
      cased = true;
      bool lower = c >= 'a' && c <= 'z';
      if (lower != (name == "islower")) return Value::Bool(false);
    }
    return Value::Bool(cased);
  }
  return Fail(absl::StrCat("'str' object has no method '", name, "'"));
}

}  // namespace tandem::text::jinja
