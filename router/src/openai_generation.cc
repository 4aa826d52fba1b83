// The OpenAI server's completions and chat completions: accepting a request, then its engine
// outputs rendered as server-sent events or as one response, and its metrics when it ends.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "openai_server_impl.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/structured_output.h"

namespace tandem::router::internal {

absl::StatusOr<std::vector<int32_t>> ApiServerImpl::ChatTokens(const json& messages,
                                                               bool add_generation_prompt,
                                                               bool add_special_tokens,
                                                               const ToolRequest& tools) const {
  absl::StatusOr<std::string> text;
  if (tools.active()) {
    // The tools in the client's key order, as transformers hands them to the template.
    text = engine_->chat_formatter().ApplyOrdered(nlohmann::ordered_json::parse(messages.dump()),
                                                  add_generation_prompt,
                                                  nlohmann::ordered_json{{"tools", tools.tools}});
  } else {
    text = engine_->chat_formatter().Apply(messages, add_generation_prompt);
  }
  if (!text.ok()) {
    return ParamError("messages", absl::StrCat("the chat template refused the messages: ",
                                               text.status().message()));
  }
  return engine_->tokenizer().Encode(*text, add_special_tokens);
}

absl::Status ApiServerImpl::PrepareTools(CompletionRequest& r) const {
  if (!r.tools.parsed()) return absl::OkStatus();
  if (tool_format_ == ToolCallFormat::kNone) {
    return ParamError("tools",
                      "this model's chat template shows no tool-call format Tandem knows (hermes "
                      "<tool_call> blocks or Llama 3 JSON); start the server with "
                      "--tool-call-parser hermes|llama3_json to choose one");
  }
  if (!r.tools.forced()) return absl::OkStatus();
  if (r.params.structured.active()) {
    return ParamError("tool_choice",
                      "tool_choice 'required' or a named function constrains the output to tool "
                      "calls and cannot be combined with another structured-output constraint "
                      "(response_format, guided_*, structured_outputs)");
  }
  TANDEM_ASSIGN_OR_RETURN(std::string gbnf, ToolCallGbnf(r.tools, tool_format_));
  engine::StructuredOutput constraint{engine::ConstraintKind::kGrammar, std::move(gbnf), 0};
  absl::Status valid = constraint.Validate(/*num_prompt_tokens=*/1);
  if (valid.ok()) valid = engine::BuildGrammar(constraint).status();
  if (!valid.ok()) {
    return ParamError("tools",
                      absl::StrCat("the tools' call grammar is refused: ", valid.message()));
  }
  r.params.structured = std::move(constraint);
  return absl::OkStatus();
}

namespace {

// A chat field's error as the Responses field it came from.
absl::Status AsResponsesError(absl::Status status) {
  const std::string param = ParamOf(status);
  std::string renamed;
  if (param == "messages") renamed = "input";
  if (param == "max_tokens") renamed = "max_output_tokens";
  if (param == "response_format") renamed = "text";
  if (renamed.empty()) return status;
  absl::Status out = ParamError(renamed, std::string(status.message()));
  const std::string code = ErrorCodeOf(status);
  return code.empty() ? out : WithErrorCode(out, code);
}

}  // namespace

void ApiServerImpl::HandleGeneration(const std::shared_ptr<http::HttpExchange>& ex, ApiKind kind,
                                     bool responses, bool constraint_ready) {
  if (draining_) {
    return ReplyError(*ex, absl::UnavailableError("the server is shutting down"));
  }
  absl::StatusOr<json> body = ParseJsonObject(ex->request().body);
  if (!body.ok()) return ReplyError(*ex, body.status());
  std::string raw = ex->request().body;
  json response_fields = json::object();
  if (responses) {
    nlohmann::ordered_json ordered =
        nlohmann::ordered_json::parse(raw, nullptr, /*allow_exceptions=*/false);
    absl::StatusOr<nlohmann::ordered_json> chat = ResponsesToChat(ordered);
    if (!chat.ok()) return ReplyError(*ex, chat.status());
    raw = chat->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    body = json::parse(raw);
    // What the response object repeats of the request.
    const json& request = json::parse(ex->request().body);
    for (const char* key : {"instructions", "max_output_tokens", "temperature", "top_p",
                            "tool_choice", "tools", "parallel_tool_calls", "text", "metadata"}) {
      auto it = request.find(key);
      response_fields[key] = it == request.end() ? json(nullptr) : *it;
    }
    if (response_fields["tools"].is_null()) response_fields["tools"] = json::array();
    if (response_fields["tool_choice"].is_null()) response_fields["tool_choice"] = "auto";
    if (response_fields["parallel_tool_calls"].is_null()) {
      response_fields["parallel_tool_calls"] = true;
    }
    if (response_fields["text"].is_null())
      response_fields["text"] = {{"format", {{"type", "text"}}}};
  }
  absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(*body, kind, vocab_size_, raw);
  if (!parsed.ok()) {
    return ReplyError(*ex, responses ? AsResponsesError(parsed.status()) : parsed.status());
  }
  CompletionRequest& r = *parsed;
  if (r.model) {
    if (absl::Status s = CheckModelName(*r.model); !s.ok()) return ReplyError(*ex, s);
  }
  if (absl::Status s = PrepareTools(r); !s.ok()) return ReplyError(*ex, s);
  if (r.params.structured.active() && !constraint_ready && compiler_ != nullptr) {
    // The grammar is compiled for the engine's vocabulary on a compiler thread; the request
    // then starts over on this connection's thread (parsing again is cheap next to compiling).
    compiler_->Post([this, ex, kind, responses, params = r.params] {
      (void)engine_->PrepareConstraint(params);  // an error shows again at Submit
      ex->Run([this, ex, kind, responses] { HandleGeneration(ex, kind, responses, true); });
    });
    return;
  }

  // The engine requests: the chat's one prompt, or each prompt of a completions batch.
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> echoes;  // completions with echo: each prompt's text
  if (kind == ApiKind::kChat) {
    absl::StatusOr<std::vector<int32_t>> tokens =
        ChatTokens(r.messages, r.add_generation_prompt, r.add_special_tokens, r.tools);
    if (!tokens.ok()) return ReplyError(*ex, tokens.status());
    prompts.push_back(std::move(*tokens));
  } else {
    for (CompletionRequest::Prompt& p : r.prompts) {
      if (r.echo) {
        echoes.push_back(
            p.text ? *p.text
                   : engine_->tokenizer().Decode(p.tokens, /*skip_special_tokens=*/false));
      }
      std::vector<int32_t> tokens =
          p.text ? engine_->tokenizer().Encode(*p.text, r.add_special_tokens) : std::move(p.tokens);
      if (!r.suffix.empty()) {
        absl::StatusOr<std::vector<int32_t>> fim = FillInTheMiddle(std::move(tokens), r.suffix);
        if (!fim.ok()) return ReplyError(*ex, fim.status());
        tokens = std::move(*fim);
      }
      prompts.push_back(std::move(tokens));
    }
  }
  int prompt_len = 0;
  for (const std::vector<int32_t>& p : prompts) prompt_len += static_cast<int>(p.size());
  if (r.max_tokens) {
    r.params.max_tokens = *r.max_tokens;
  } else if (kind == ApiKind::kChat) {
    r.params.max_tokens = std::max(1, engine_->max_model_len() - prompt_len);
  } else {
    r.params.max_tokens = 16;
  }
  // best_of: the engine draws best_of samples per prompt, with their logprobs to rank them.
  const int n = r.params.n;
  const int user_logprobs = r.params.logprobs;
  if (r.best_of > n) {
    r.params.n = r.best_of;
    r.params.logprobs = std::max(r.params.logprobs, 0);
  }
  const int per_prompt = r.params.n;

  if (active_.fetch_add(1) >= options_.max_active_requests) {
    active_.fetch_sub(1);
    return ReplyError(*ex,
                      WithErrorCode(absl::ResourceExhaustedError(absl::StrCat(
                                        "the server is overloaded (", options_.max_active_requests,
                                        " requests in flight); retry shortly")),
                                    "overloaded"));
  }
  auto gen = std::make_shared<Generation>();
  gen->server = this;
  gen->exchange = ex;
  gen->kind = kind;
  gen->id = NewId(responses ? "resp_" : kind == ApiKind::kChat ? "chatcmpl-" : "cmpl-");
  gen->responses = responses;
  gen->response_fields = std::move(response_fields);
  gen->model = options_.served_model_names.front();
  gen->created = UnixSeconds();
  gen->stream = r.stream;
  gen->include_usage = r.include_usage;
  gen->logprobs = user_logprobs;
  gen->n = n;
  gen->per_prompt = per_prompt;
  gen->prompt_tokens = prompt_len;
  gen->start = Clock::now();
  gen->choices.resize(prompts.size() * per_prompt);
  gen->requests.resize(prompts.size());
  for (size_t k = 0; k < prompts.size(); ++k) {
    gen->requests[k].id = prompts.size() == 1 ? gen->id : absl::StrCat(gen->id, "-", k);
    gen->requests[k].prompt_tokens = static_cast<int>(prompts[k].size());
    if (r.echo) {
      for (int i = 0; i < per_prompt; ++i) gen->choices[k * per_prompt + i].echo = echoes[k];
    }
  }
  if (r.tools.parsed()) {
    gen->tool_format = tool_format_;
    if (gen->stream) {
      for (Generation::Choice& c : gen->choices) c.tool_parser.emplace(tool_format_);
    }
  }

  // Registered before Submit so that no output can be handled before it is in place.
  ex->OnClientGone([gen] { gen->OnClientGone(); });
  for (size_t k = 0; k < prompts.size(); ++k) {
    engine::GenerateRequest request{gen->requests[k].id, std::move(prompts[k]), r.params};
    request.cache_salt = r.cache_salt;
    const int index = static_cast<int>(k);
    absl::Status submitted = engine_->Submit(
        std::move(request),
        [this, gen, index](const engine::RequestOutput& out, const absl::Status& status) {
          DeliverOutput(*gen->exchange, [gen, index, out, status, received = Clock::now()] {
            gen->OnOutput(index, out, status, received);
          });
        });
    if (!submitted.ok()) {
      for (size_t j = 0; j < k; ++j) engine_->Abort(gen->requests[j].id);
      gen->done = true;
      RequestFinished();
      if (prompts.size() > 1) {
        submitted =
            absl::Status(submitted.code(), absl::StrCat("prompt[", k, "]: ", submitted.message()));
      }
      absl::Status error = AttachParam(submitted, kind);
      return ReplyError(*ex, responses ? AsResponsesError(error) : error);
    }
  }
  metrics_.prompt_tokens->Increment(prompt_len);
  if (gen->stream) {
    metrics_.Http(200)->Increment();
    ex->BeginStream(200, "text/event-stream",
                    {{"Cache-Control", "no-cache"}, {"X-Request-Id", gen->id}});
    if (responses) return gen->ResponsesStart();
    for (size_t i = 0; i < gen->choices.size(); ++i) {
      json choice;
      if (kind == ApiKind::kChat) {
        // OpenAI opens each chat choice with the assistant role and empty content.
        choice = {{"index", i},
                  {"delta", {{"role", "assistant"}, {"content", ""}}},
                  {"logprobs", nullptr},
                  {"finish_reason", nullptr}};
      } else if (r.echo) {
        choice = {{"index", i},
                  {"text", gen->choices[i].echo},
                  {"logprobs", nullptr},
                  {"finish_reason", nullptr}};
      } else {
        continue;
      }
      json chunk = {
          {"id", gen->id},
          {"object", kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", gen->created},
          {"model", gen->model},
          {"choices", json::array({choice})}};
      ex->Send(Sse(chunk));
    }
  }
}

absl::StatusOr<std::vector<int32_t>> ApiServerImpl::FillInTheMiddle(
    std::vector<int32_t> prompt, const std::string& suffix) const {
  // The fill-in-the-middle tokens of the code models that have them (prefix-suffix-middle order):
  // Qwen2.5-Coder and later Qwen, StarCoder / SantaCoder.
  static constexpr const char* kFimTokens[][3] = {
      {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"},
      {"<fim_prefix>", "<fim_suffix>", "<fim_middle>"},
  };
  const text::Tokenizer& tok = engine_->tokenizer();
  for (const auto& names : kFimTokens) {
    std::optional<int32_t> pre = tok.TokenToId(names[0]);
    std::optional<int32_t> suf = tok.TokenToId(names[1]);
    std::optional<int32_t> mid = tok.TokenToId(names[2]);
    if (!pre || !suf || !mid || *pre >= vocab_size_ || *suf >= vocab_size_ || *mid >= vocab_size_) {
      continue;
    }
    std::vector<int32_t> out = {*pre};
    out.insert(out.end(), prompt.begin(), prompt.end());
    out.push_back(*suf);
    std::vector<int32_t> suffix_tokens = tok.Encode(suffix, /*add_special_tokens=*/false);
    out.insert(out.end(), suffix_tokens.begin(), suffix_tokens.end());
    out.push_back(*mid);
    return out;
  }
  return ParamError("suffix",
                    "suffix needs fill-in-the-middle tokens (<|fim_prefix|> <|fim_suffix|> "
                    "<|fim_middle|>, or <fim_prefix> <fim_suffix> <fim_middle>), and this model's "
                    "tokenizer has none");
}

json Generation::LogprobsFor(const engine::ChoiceDelta& delta, Choice& choice) const {
  if (logprobs < 0 || delta.token_ids.empty()) return nullptr;
  const size_t count = delta.token_ids.size();
  auto top_at = [&](size_t i) -> const std::vector<engine::TokenLogprob>* {
    return i < delta.top_logprobs.size() ? &delta.top_logprobs[i] : nullptr;
  };
  auto lp_at = [&](size_t i) { return i < delta.logprobs.size() ? delta.logprobs[i] : 0.0f; };
  if (kind == ApiKind::kCompletion) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (size_t i = 0; i < count; ++i) {
      std::string s = server->TokenString(delta.token_ids[i]);
      tokens.push_back(s);
      token_logprobs.push_back(JsonLogprob(lp_at(i)));
      json alternatives = json::object();
      if (const auto* t = top_at(i)) {
        for (const engine::TokenLogprob& alt : *t) {
          std::string alt_s = server->TokenString(alt.token);
          if (!alternatives.contains(alt_s)) alternatives[alt_s] = JsonLogprob(alt.logprob);
        }
      }
      top.push_back(std::move(alternatives));
      offsets.push_back(choice.text_offset);
      choice.text_offset += static_cast<int>(s.size());
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }
  auto entry = [&](int32_t id, float lp) {
    std::string raw = server->TokenBytes(id);
    json bytes = json::array();
    for (unsigned char c : raw) bytes.push_back(static_cast<int>(c));
    return json{
        {"token", text::ReplaceInvalidUtf8(raw)}, {"logprob", JsonLogprob(lp)}, {"bytes", bytes}};
  };
  json content = json::array();
  for (size_t i = 0; i < count; ++i) {
    json e = entry(delta.token_ids[i], lp_at(i));
    json top = json::array();
    if (const auto* t = top_at(i)) {
      for (const engine::TokenLogprob& alt : *t) top.push_back(entry(alt.token, alt.logprob));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", content}, {"refusal", nullptr}};
}

void Generation::Merge(json& into, const json& delta) const {
  if (delta.is_null()) return;
  if (into.is_null()) {
    into = delta;
    return;
  }
  for (auto& [key, value] : delta.items()) {
    if (!value.is_array()) continue;
    for (const json& v : value) into[key].push_back(v);
  }
}

json Generation::Chunk(json choices_json) const {
  return {{"id", id},
          {"object", kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", std::move(choices_json)}};
}

json Generation::FinishReason(const Choice& choice, int num_calls) const {
  if (choice.finish == engine::FinishReason::kNone) return nullptr;
  if (num_calls > 0 && choice.finish == engine::FinishReason::kStop) return "tool_calls";
  return engine::FinishReasonName(choice.finish);
}

json Generation::ChatMessage(const Choice& c, int* num_calls) const {
  *num_calls = 0;
  if (tool_format == ToolCallFormat::kNone) {
    return {{"role", "assistant"}, {"content", c.text}};
  }
  // The same parser as streaming, over the whole text, so both give the same calls.
  ToolCallParser parser(tool_format);
  ParsedText parsed = parser.Feed(c.text);
  ParsedText rest = parser.Finish();
  parsed.content += rest.content;
  parsed.calls.insert(parsed.calls.end(), rest.calls.begin(), rest.calls.end());
  json calls = json::array();
  for (const ToolCallDelta& delta : parsed.calls) {
    if (delta.first) {
      calls.push_back({{"id", NewId("call_")},
                       {"type", "function"},
                       {"function", {{"name", delta.name}, {"arguments", ""}}}});
    }
    if (delta.index < static_cast<int>(calls.size())) {
      calls[delta.index]["function"]["arguments"] =
          calls[delta.index]["function"]["arguments"].get<std::string>() + delta.arguments;
    }
  }
  *num_calls = static_cast<int>(calls.size());
  json message = {{"role", "assistant"}};
  message["content"] = calls.empty() || !parsed.content.empty() ? json(parsed.content) : json();
  if (!calls.empty()) message["tool_calls"] = std::move(calls);
  return message;
}

void Generation::StreamChat(int index, const engine::ChoiceDelta& d, Choice& c, json lp) {
  const bool finished = d.finish_reason != engine::FinishReason::kNone;
  ParsedText parsed = c.tool_parser->Feed(d.text);
  if (finished) {
    ParsedText rest = c.tool_parser->Finish();
    parsed.content += rest.content;
    parsed.calls.insert(parsed.calls.end(), rest.calls.begin(), rest.calls.end());
  }
  auto send = [&](json delta, json logprobs, json finish) {
    json choice = {{"index", index},
                   {"delta", std::move(delta)},
                   {"logprobs", std::move(logprobs)},
                   {"finish_reason", std::move(finish)}};
    SendOutputChunk(Sse(Chunk(json::array({std::move(choice)}))));
  };
  // Content first, then each call's first delta (id, type, name) and argument fragments, each
  // its own chunk as OpenAI streams them; the logprobs ride on the first chunk, the finish
  // reason on a last one.
  if (!parsed.content.empty() || (!lp.is_null() && parsed.calls.empty())) {
    json delta = json::object();
    if (!parsed.content.empty()) delta["content"] = parsed.content;
    send(std::move(delta), std::move(lp), nullptr);
    lp = nullptr;
  }
  for (const ToolCallDelta& call : parsed.calls) {
    json entry = {{"index", call.index}};
    if (call.first) {
      c.tool_call_ids.push_back(NewId("call_"));
      entry["id"] = c.tool_call_ids.back();
      entry["type"] = "function";
      entry["function"] = {{"name", call.name}, {"arguments", ""}};
    } else {
      entry["function"] = {{"arguments", call.arguments}};
    }
    send({{"tool_calls", json::array({std::move(entry)})}}, std::move(lp), nullptr);
    lp = nullptr;
  }
  if (finished) {
    send(json::object(), std::move(lp), FinishReason(c, c.tool_parser->num_calls()));
  }
}

json Generation::Usage() const {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", generation_tokens},
          {"total_tokens", prompt_tokens + generation_tokens}};
}

void Generation::SendOutputChunk(std::string data) {
  if (output_timed) return exchange->Send(std::move(data));
  output_timed = true;
  exchange->Send(std::move(data),
                 [histogram = server->metrics().stream_write, received = output_received] {
                   histogram->Observe(Seconds(Clock::now() - received));
                 });
}

void Generation::OnOutput(int request, const engine::RequestOutput& out, const absl::Status& status,
                          Clock::time_point received) {
  if (done) return;
  output_received = received;
  output_timed = false;
  if (!status.ok()) {
    for (size_t k = 0; k < requests.size(); ++k) {
      if (static_cast<int>(k) != request && !requests[k].finished) {
        server->engine().Abort(requests[k].id);
      }
    }
    return Fail(status);
  }
  const Clock::time_point now = Clock::now();
  size_t new_tokens = 0;
  for (const engine::ChoiceDelta& d : out.choices)
    new_tokens = std::max(new_tokens, d.token_ids.size());
  ApiMetrics& m = server->metrics();
  if (new_tokens > 0) {
    if (!seen_token) {
      m.ttft->Observe(Seconds(now - start));
      first_token = now;
      seen_token = true;
    } else {
      m.itl->Observe(Seconds(now - last_token) / static_cast<double>(new_tokens));
    }
    last_token = now;
  }
  Request& req = requests[request];
  req.generation_tokens = out.num_generation_tokens;
  if (out.num_prompt_tokens > 0) req.prompt_tokens = out.num_prompt_tokens;
  generation_tokens = 0;
  prompt_tokens = 0;
  for (const Request& q : requests) {
    generation_tokens += q.generation_tokens;
    prompt_tokens += q.prompt_tokens;
  }

  for (const engine::ChoiceDelta& d : out.choices) {
    if (d.index < 0 || d.index >= per_prompt) continue;
    const int index = request * per_prompt + d.index;
    Choice& c = choices[index];
    c.tokens += static_cast<int>(d.token_ids.size());
    for (size_t i = 0; i < d.token_ids.size() && i < d.logprobs.size(); ++i) {
      c.cumulative_logprob += d.logprobs[i];
    }
    json lp = LogprobsFor(d, c);
    c.text += d.text;
    if (d.finish_reason != engine::FinishReason::kNone) c.finish = d.finish_reason;
    const bool finished = d.finish_reason != engine::FinishReason::kNone;
    if (!stream) {
      Merge(c.logprobs, lp);
      continue;
    }
    if (responses) {
      ResponsesDelta(d, c);
      continue;
    }
    if (c.tool_parser) {
      StreamChat(index, d, c, std::move(lp));
      continue;
    }
    if (d.text.empty() && !finished && lp.is_null()) continue;
    json finish = finished ? json(engine::FinishReasonName(d.finish_reason)) : json(nullptr);
    json choice;
    if (kind == ApiKind::kChat) {
      json delta = json::object();
      if (!d.text.empty()) delta["content"] = d.text;
      choice = {{"index", index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}};
    } else {
      choice = {{"index", index}, {"text", d.text}, {"logprobs", lp}, {"finish_reason", finish}};
    }
    SendOutputChunk(Sse(Chunk(json::array({choice}))));
  }
  if (out.finished) req.finished = true;
  for (const Request& q : requests) {
    if (!q.finished) return;
  }

  const std::string reason =
      choices.empty() ? "stop" : engine::FinishReasonName(choices.front().finish);
  if (responses && !choices.empty()) {
    ResponsesFinish(choices.front());
  } else if (stream) {
    if (include_usage) {
      json usage_chunk = Chunk(json::array());
      usage_chunk["usage"] = Usage();
      exchange->Send(Sse(usage_chunk));
    }
    exchange->Send("data: [DONE]\n\n");
    exchange->EndStream();
  } else {
    // Each prompt's choices, the n best by cumulative logprob when best_of drew more.
    std::vector<const Choice*> returned;
    for (size_t k = 0; k < requests.size(); ++k) {
      std::vector<const Choice*> drawn;
      for (int i = 0; i < per_prompt; ++i) drawn.push_back(&choices[k * per_prompt + i]);
      if (per_prompt > n) {
        std::stable_sort(drawn.begin(), drawn.end(), [](const Choice* a, const Choice* b) {
          return a->cumulative_logprob > b->cumulative_logprob;
        });
        drawn.resize(n);
      }
      returned.insert(returned.end(), drawn.begin(), drawn.end());
    }
    json list = json::array();
    for (size_t i = 0; i < returned.size(); ++i) {
      const Choice& c = *returned[i];
      if (kind == ApiKind::kChat) {
        int num_calls = 0;
        json message = ChatMessage(c, &num_calls);
        list.push_back({{"index", i},
                        {"message", std::move(message)},
                        {"logprobs", c.logprobs},
                        {"finish_reason", FinishReason(c, num_calls)}});
      } else {
        list.push_back({{"index", i},
                        {"text", c.echo + c.text},
                        {"logprobs", c.logprobs},
                        {"finish_reason", FinishReason(c, 0)}});
      }
    }
    json response = {{"id", id},
                     {"object", kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
                     {"created", created},
                     {"model", model},
                     {"choices", list},
                     {"usage", Usage()}};
    server->Reply(*exchange, 200, Dump(response));
  }
  Finalize(reason.empty() ? "stop" : reason);
}

void Generation::Fail(const absl::Status& status) {
  if (stream) {
    // The 200 and earlier chunks are already out: report the error in-band, as OpenAI does.
    const int code = HttpStatusOf(status, 503);
    json error = json::parse(
        ErrorBody(code, std::string(status.message()), ParamOf(status), ErrorCodeOf(status)));
    exchange->Send(absl::StrCat("event: error\ndata: ", Dump(error), "\n\n"));
    if (!responses) exchange->Send("data: [DONE]\n\n");
    exchange->EndStream();
  } else {
    server->ReplyError(*exchange, status);
  }
  Finalize("error");
}

void Generation::OnClientGone() {
  if (done) return;
  // Frees the requests' KV blocks before the engine's next step.
  for (const Request& r : requests) {
    if (!r.finished) server->engine().Abort(r.id);
  }
  Finalize("abort");
}

void Generation::Finalize(const std::string& reason) {
  done = true;
  const Clock::time_point now = Clock::now();
  ApiMetrics& m = server->metrics();
  m.Finished(reason)->Increment();
  m.generation_tokens->Increment(generation_tokens);
  const double e2e = Seconds(now - start);
  m.e2e->Observe(e2e);
  // Only requests that ran to their end are held to the SLOs: an abort (client gone) or an
  // error says nothing about the latency the server would have given.
  if (reason == "stop" || reason == "length") {
    const double ttft = seen_token ? Seconds(first_token - start) : e2e;
    int tokens = 0;
    for (const Choice& c : choices) tokens = std::max(tokens, c.tokens);
    std::optional<double> tpot;
    if (tokens >= 2) tpot = (e2e - ttft) / static_cast<double>(tokens - 1);
    m.Classify(ttft, tpot);
  }
  server->RequestFinished();
}

}  // namespace tandem::router::internal
