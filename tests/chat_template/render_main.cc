// tandem_render_template: renders chat template test cases with Tandem, for the golden test
// (tests/chat_template/golden_test.py), which renders the same cases with Jinja2.
//
// Usage: tandem_render_template CASES.json
// CASES.json is a JSON array of cases, each either
//   {"id": ..., "template": "...", "context": {...}}              rendered by JinjaTemplate, or
//   {"id": ..., "model_dir": "...", "messages": [...],
//    "add_generation_prompt": bool, "extra": {...}}                 applied by ChatFormatter.
// Prints a JSON array with {"id", "output"} or {"id", "error"} per case, in order.

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"

namespace {

using OrderedJson = nlohmann::ordered_json;
using tandem::text::ChatFormatter;
using tandem::text::JinjaTemplate;

absl::StatusOr<std::string> RenderCase(const OrderedJson& c) {
  if (c.contains("template")) {
    absl::StatusOr<std::unique_ptr<JinjaTemplate>> t =
        JinjaTemplate::Parse(c["template"].get<std::string>());
    if (!t.ok()) return t.status();
    return (*t)->RenderOrdered(c.value("context", OrderedJson::object()));
  }
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f =
      ChatFormatter::Load(c["model_dir"].get<std::string>());
  if (!f.ok()) return f.status();
  return (*f)->ApplyOrdered(c["messages"], c.value("add_generation_prompt", false),
                            c.value("extra", OrderedJson::object()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " CASES.json\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  std::stringstream text;
  text << in.rdbuf();
  OrderedJson cases = OrderedJson::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!in || cases.is_discarded() || !cases.is_array()) {
    std::cerr << argv[1] << ": expected a JSON array of cases\n";
    return 2;
  }
  OrderedJson results = OrderedJson::array();
  for (const OrderedJson& c : cases) {
    OrderedJson r = {{"id", c.value("id", OrderedJson())}};
    absl::StatusOr<std::string> out = RenderCase(c);
    if (out.ok()) {
      r["output"] = *out;
    } else {
      r["error"] = std::string(out.status().message());
    }
    results.push_back(std::move(r));
  }
  // Invalid UTF-8 in an output is replaced rather than aborting, so the comparison reports it.
  std::cout << results.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return 0;
}
