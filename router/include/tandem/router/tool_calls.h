// Tool calling on the chat API: the request's `tools`, `tool_choice` and `parallel_tool_calls`
// checked; the grammar that makes a sample a well-formed call of the allowed functions (what
// tool_choice "required" or a named function is enforced by); and the parser that turns a
// sample's text back into OpenAI `tool_calls`, delta by delta as it streams or all at once.
//
//   TANDEM_ASSIGN_OR_RETURN(ToolRequest tools, ParseToolRequest(body, &ordered_body));
//   if (tools.forced()) {
//     TANDEM_ASSIGN_OR_RETURN(params.structured.source, ToolCallGbnf(tools, format));
//     params.structured.kind = engine::ConstraintKind::kGrammar;
//   }
//   ToolCallParser parser(format);
//   ParsedText got = parser.Feed(delta_text);  // content to show, and tool-call deltas
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::router {

// The syntax a model writes tool calls in (its chat template shows it the same syntax).
enum class ToolCallFormat {
  kNone,  // none recognised: requests that want tool calls are refused
  // `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call, text
  // before them is content (Hermes 2 Pro, Qwen2.5, Qwen3, QwQ).
  kHermes,
  // `{"name": ..., "parameters": {...}}` as the whole message, several joined by `;`, an optional
  // leading <|python_tag|> (Llama 3.1, 3.2 and 3.3 JSON tool calling).
  kLlama3Json,
};

// "none", "hermes", "llama3_json".
const char* ToolCallFormatName(ToolCallFormat format);
// "auto" (nullopt: detect from the chat template), "hermes" or "llama3_json".
absl::StatusOr<std::optional<ToolCallFormat>> ParseToolCallFormat(std::string_view name);
// The syntax a chat template teaches, from its Jinja source; kNone when neither is recognised.
ToolCallFormat DetectToolCallFormat(std::string_view chat_template);

inline constexpr int kMaxTools = 128;
inline constexpr int kMaxFunctionNameBytes = 64;

enum class ToolChoice { kAuto, kNone, kRequired, kFunction };

// A chat request's tools. Without tools (absent, null or []) nothing about the request changes.
struct ToolRequest {
  // The tools as the client sent them, in its key order: what the chat template renders.
  nlohmann::ordered_json tools = nullptr;
  std::vector<std::string> names;                  // tools[i].function.name
  std::vector<nlohmann::ordered_json> parameters;  // tools[i].function.parameters, or {}
  ToolChoice choice = ToolChoice::kAuto;
  std::string function;  // kFunction: the function tool_choice names
  bool parallel = true;  // parallel_tool_calls

  bool active() const { return !names.empty(); }
  // The output must be tool calls: the grammar (ToolCallGbnf) constrains it.
  bool forced() const {
    return active() && (choice == ToolChoice::kRequired || choice == ToolChoice::kFunction);
  }
  // The output is parsed for tool calls.
  bool parsed() const { return active() && choice != ToolChoice::kNone; }
};

// Reads tools, tool_choice and parallel_tool_calls from a chat request. `ordered_body` is the
// same body with the client's key order (the order properties are shown to the model and
// generated in); null: keys sorted. Errors are InvalidArgument naming the field (param "tools",
// "tool_choice" or "parallel_tool_calls") and, for a tool, its index.
absl::StatusOr<ToolRequest> ParseToolRequest(const nlohmann::json& body,
                                             const nlohmann::ordered_json* ordered_body);

// The GBNF of what tool_choice "required" or a named function allows in `format`: a call of one
// of the allowed functions whose arguments are valid against its parameters schema (the
// structured-outputs subset of grammar::JsonSchemaToGbnf), in the format's syntax; with
// parallel_tool_calls, in the hermes format, one call or more. InvalidArgument naming the tool
// whose parameters cannot be enforced (param "tools").
absl::StatusOr<std::string> ToolCallGbnf(const ToolRequest& request, ToolCallFormat format);

// One step of a tool call as OpenAI streams it: the call's first delta carries its name (the
// caller gives it an id and type "function"), later ones fragments of the arguments' JSON text.
struct ToolCallDelta {
  int index = 0;  // the call's position in the sample's tool_calls
  bool first = false;
  std::string name;  // first only
  std::string arguments;
};

struct ParsedText {
  std::string content;  // text to show as the message's content
  std::vector<ToolCallDelta> calls;
  bool empty() const { return content.empty() && calls.empty(); }
};

// Splits one sample's text into content and tool calls as it arrives. Whatever the text is cut
// into, the concatenated results are the same: streaming and non-streaming responses agree. Text
// that may still become a call (a partial `<tool_call>` tag, a call whose name has not arrived)
// is held back; a block that turns out not to be a call is given back as content. Whitespace
// just before a call and at the end of a sample with calls is dropped.
class ToolCallParser {
 public:
  explicit ToolCallParser(ToolCallFormat format);

  ParsedText Feed(std::string_view text);
  // The end of the sample: what was held back, as content (or the rest of a call cut short).
  ParsedText Finish();
  // Calls announced so far (each has had its first delta).
  int num_calls() const { return num_calls_; }

 private:
  enum class State {
    kStart,      // llama3_json: nothing but whitespace yet
    kText,       // hermes: content, looking for <tool_call>
    kCallOpen,   // hermes: after <tool_call>, before the call's '{'
    kCall,       // inside the call's JSON object
    kCallClose,  // hermes: after the object, before </tool_call>
    kBetween,    // llama3_json: after a call, before ';' and the next one
    kRaw,        // llama3_json: no (more) calls, everything is content
  };

  void Run(bool at_end);
  void StepCall(char c);
  void EndTopString();
  void EndValue();
  void BeginCall(std::string opening);
  void ResetCall();
  std::string* ValueTarget();
  void EndCall();
  void Announce();
  void EmitContent(std::string_view text);
  void EmitArguments();

  ToolCallFormat format_;
  State state_;
  std::string pending_;  // input not consumed yet
  std::string held_ws_;  // trailing whitespace of the content, not shown yet
  std::string between_;  // llama3_json: whitespace, `;` and <|python_tag|> before a call
  ParsedText out_;       // what the current Feed/Finish returns
  int num_calls_ = 0;

  // The call being read.
  enum class Phase { kKey, kColon, kValue, kAfterValue };
  std::string raw_call_;  // its text from the opening on, shown as content if it is no call
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  Phase phase_ = Phase::kKey;
  std::string key_raw_;
  std::string key_;
  std::string* capture_ = nullptr;  // where the current value's characters go
  bool capturing_scalar_ = false;
  std::string name_raw_;
  std::string name_;
  bool have_name_ = false;
  std::string arguments_;
  bool have_arguments_ = false;
  size_t arguments_sent_ = 0;
  bool announced_ = false;
};

}  // namespace tandem::router
