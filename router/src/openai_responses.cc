// The OpenAI server's /v1/responses output: a chat generation (see ResponsesToChat) rendered as
// a Responses API object, or streamed as its typed events (response.created,
// response.output_item.added, response.output_text.delta,
// response.function_call_arguments.delta, ..., response.completed).
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "openai_server_impl.h"

namespace tandem::router::internal {

json Generation::ResponseObject(const std::string& status, json output) const {
  json response = {{"id", id},
                   {"object", "response"},
                   {"created_at", created},
                   {"status", status},
                   {"error", nullptr},
                   {"incomplete_details", nullptr},
                   {"model", model},
                   {"output", std::move(output)},
                   {"previous_response_id", nullptr},
                   {"store", false}};
  for (auto& [key, value] : response_fields.items()) response[key] = value;
  if (status == "incomplete") {
    response["incomplete_details"] = {{"reason", "max_output_tokens"}};
  }
  if (status != "in_progress") {
    response["usage"] = {{"input_tokens", prompt_tokens},
                         {"input_tokens_details", {{"cached_tokens", 0}}},
                         {"output_tokens", generation_tokens},
                         {"output_tokens_details", {{"reasoning_tokens", 0}}},
                         {"total_tokens", prompt_tokens + generation_tokens}};
  } else {
    response["usage"] = nullptr;
  }
  return response;
}

std::string Generation::ResponseStatus(const Choice& c) const {
  return c.finish == engine::FinishReason::kLength ? "incomplete" : "completed";
}

json Generation::ResponseOutput(const Choice& c) const {
  int num_calls = 0;
  json message = ChatMessage(c, &num_calls);
  json output = json::array();
  const std::string status = ResponseStatus(c);
  if (message["content"].is_string() && !message["content"].get<std::string>().empty()) {
    output.push_back({{"type", "message"},
                      {"id", NewId("msg_")},
                      {"status", status},
                      {"role", "assistant"},
                      {"content", json::array({{{"type", "output_text"},
                                                {"text", message["content"]},
                                                {"annotations", json::array()}}})}});
  }
  if (message.contains("tool_calls")) {
    for (const json& call : message["tool_calls"]) {
      output.push_back({{"type", "function_call"},
                        {"id", NewId("fc_")},
                        {"call_id", call["id"]},
                        {"name", call["function"]["name"]},
                        {"arguments", call["function"]["arguments"]},
                        {"status", "completed"}});
    }
  }
  return output;
}

void Generation::ResponsesEvent(const std::string& type, json data) {
  data["type"] = type;
  data["sequence_number"] = responses_stream.sequence++;
  exchange->Send(absl::StrCat("event: ", type, "\ndata: ", Dump(data), "\n\n"));
}

void Generation::ResponsesStart() {
  ResponsesEvent("response.created", {{"response", ResponseObject("in_progress", json::array())}});
  ResponsesEvent("response.in_progress",
                 {{"response", ResponseObject("in_progress", json::array())}});
}

void Generation::ResponsesCloseItem() {
  ResponsesStream& s = responses_stream;
  if (s.open.is_null()) return;
  const int index = static_cast<int>(s.output.size());
  json item = std::move(s.open);
  s.open = nullptr;
  const std::string item_id = item["id"];
  if (item["type"] == "message") {
    json part = {{"type", "output_text"}, {"text", s.text}, {"annotations", json::array()}};
    ResponsesEvent("response.output_text.done", {{"item_id", item_id},
                                                 {"output_index", index},
                                                 {"content_index", 0},
                                                 {"text", s.text},
                                                 {"logprobs", json::array()}});
    ResponsesEvent(
        "response.content_part.done",
        {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"part", part}});
    item["content"] = json::array({part});
  } else {
    ResponsesEvent("response.function_call_arguments.done", {{"item_id", item_id},
                                                             {"output_index", index},
                                                             {"name", item["name"]},
                                                             {"arguments", s.text}});
    item["arguments"] = s.text;
  }
  item["status"] = "completed";
  ResponsesEvent("response.output_item.done", {{"output_index", index}, {"item", item}});
  s.output.push_back(std::move(item));
  s.text.clear();
}

void Generation::ResponsesText(const std::string& text) {
  ResponsesStream& s = responses_stream;
  if (text.empty()) return;
  const int index = static_cast<int>(s.output.size());
  if (s.open.is_null() || s.open["type"] != "message") {
    ResponsesCloseItem();
    s.open = {{"type", "message"},
              {"id", NewId("msg_")},
              {"status", "in_progress"},
              {"role", "assistant"},
              {"content", json::array()}};
    ResponsesEvent("response.output_item.added", {{"output_index", index}, {"item", s.open}});
    ResponsesEvent(
        "response.content_part.added",
        {{"item_id", s.open["id"]},
         {"output_index", index},
         {"content_index", 0},
         {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}});
  }
  ResponsesEvent("response.output_text.delta", {{"item_id", s.open["id"]},
                                                {"output_index", index},
                                                {"content_index", 0},
                                                {"delta", text},
                                                {"logprobs", json::array()}});
  s.text += text;
}

void Generation::ResponsesDelta(const engine::ChoiceDelta& d, Choice& c) {
  ResponsesStream& s = responses_stream;
  ParsedText parsed;
  const bool finished = d.finish_reason != engine::FinishReason::kNone;
  if (c.tool_parser) {
    parsed = c.tool_parser->Feed(d.text);
    if (finished) {
      ParsedText rest = c.tool_parser->Finish();
      parsed.content += rest.content;
      parsed.calls.insert(parsed.calls.end(), rest.calls.begin(), rest.calls.end());
    }
  } else {
    parsed.content = d.text;
  }
  ResponsesText(parsed.content);
  for (const ToolCallDelta& call : parsed.calls) {
    if (call.first) {
      ResponsesCloseItem();
      c.tool_call_ids.push_back(NewId("call_"));
      s.open = {
          {"type", "function_call"}, {"id", NewId("fc_")}, {"call_id", c.tool_call_ids.back()},
          {"name", call.name},       {"arguments", ""},    {"status", "in_progress"}};
      ResponsesEvent("response.output_item.added",
                     {{"output_index", static_cast<int>(s.output.size())}, {"item", s.open}});
    } else if (!s.open.is_null() && s.open["type"] == "function_call") {
      ResponsesEvent("response.function_call_arguments.delta",
                     {{"item_id", s.open["id"]},
                      {"output_index", static_cast<int>(s.output.size())},
                      {"delta", call.arguments}});
      s.text += call.arguments;
    }
  }
}

void Generation::ResponsesFinish(const Choice& c) {
  if (!stream) {
    server->Reply(*exchange, 200, Dump(ResponseObject(ResponseStatus(c), ResponseOutput(c))));
    return;
  }
  ResponsesCloseItem();
  const std::string status = ResponseStatus(c);
  ResponsesEvent(status == "completed" ? "response.completed" : "response.incomplete",
                 {{"response", ResponseObject(status, responses_stream.output)}});
  exchange->EndStream();
}

}  // namespace tandem::router::internal
