// What the Jinja tests share: parse and render a source in one call.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"

namespace tandem::text::jinja {

inline std::string Msg(const absl::Status& status) { return std::string(status.message()); }

// Parses `source` with `limits` and renders it with `context`: the first error, or the text.
inline absl::StatusOr<std::string> Render(const std::string& source,
                                          const nlohmann::json& context = nlohmann::json::object(),
                                          const JinjaLimits& limits = JinjaLimits{}) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t = JinjaTemplate::Parse(source, limits);
  if (!t.ok()) return t.status();
  return (*t)->Render(context);
}

// Render, failing the test on an error (then returning "").
inline std::string RenderOk(const std::string& source,
                            const nlohmann::json& context = nlohmann::json::object()) {
  absl::StatusOr<std::string> out = Render(source, context);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

}  // namespace tandem::text::jinja
