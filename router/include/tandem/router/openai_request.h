// The OpenAI API's request bodies, parsed and checked field by field, and its error format.
// Every refusal is an absl::Status whose payload names the offending parameter, so the HTTP
// layer can answer with {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/sampling_params.h"
#include "tandem/router/tool_calls.h"

namespace tandem::router {

// Limits of the API layer, on top of those of engine/sampling_params.h.
inline constexpr int kMaxMessagesPerRequest = 256;
inline constexpr int kMaxJsonDepth = 32;  // nesting of the request body
inline constexpr size_t kMaxCacheSaltBytes = 1024;
inline constexpr int kMaxPromptsPerRequest = 32;  // a completions batch

// InvalidArgument naming the request field `param` (e.g. "temperature", "messages").
absl::Status ParamError(std::string_view param, std::string_view message);
// Attaches an OpenAI error `code` (e.g. "context_length_exceeded") to a status.
absl::Status WithErrorCode(absl::Status status, std::string_view code);
// The parameter or code a status carries, or "" when none.
std::string ParamOf(const absl::Status& status);
std::string ErrorCodeOf(const absl::Status& status);

// {"error": {"message", "type", "param", "code"}} for an HTTP status; empty param and code
// become null.
std::string ErrorBody(int http_status, std::string_view message, std::string_view param = "",
                      std::string_view code = "");

// Parses a request body that must be a JSON object. Syntax errors report the byte offset and
// never repeat the input; nesting deeper than kMaxJsonDepth is refused before parsing.
absl::StatusOr<nlohmann::json> ParseJsonObject(std::string_view body);

enum class ApiKind { kCompletion, kChat };

// A /v1/completions or /v1/chat/completions request, checked but not yet tokenized.
struct CompletionRequest {
  ApiKind kind = ApiKind::kCompletion;
  std::optional<std::string> model;
  // Completions: the prompts, each as text or as token ids when given so (a batch of several
  // answers with choices indexed prompt by prompt: prompt k's sample i is choice k * n + i).
  struct Prompt {
    std::optional<std::string> text;
    std::vector<int32_t> tokens;
  };
  std::vector<Prompt> prompts;
  // Completions: each choice's text starts with its prompt's.
  bool echo = false;
  // Completions: samples generated per prompt, of which the n with the highest cumulative
  // logprob are returned; 0: n.
  int best_of = 0;
  // Completions: text after the completion (fill-in-the-middle); "" for none.
  std::string suffix;
  bool add_special_tokens = true;
  // Chat: [{"role", "content": string, ...}], content parts joined; roles checked; an
  // assistant's tool_calls and a tool message's tool_call_id kept (see NormalizeMessages).
  nlohmann::json messages;
  bool add_generation_prompt = true;
  // Chat: tools, tool_choice and parallel_tool_calls (tool_calls.h).
  ToolRequest tools;

  // Isolates this request's tenant in the prefix cache (vLLM's `cache_salt`): it reuses cached
  // KV only of requests with the same salt. Empty: the shared cache.
  std::string cache_salt;

  bool stream = false;
  bool include_usage = false;
  // Unset: 16 for completions, the rest of the context for chat.
  std::optional<int> max_tokens;
  // max_tokens is set from the above once the prompt length is known; logprobs is the
  // engine's (-1 none, k >= 0 top-k) whichever API spelling was used.
  engine::SamplingParams params;
};

// Checks every field's type and range; `vocab_size` bounds token ids. Unknown fields are
// ignored, but fields whose meaning Tandem does not implement (echo with logprobs, best_of
// with streaming, functions, tools on completions, ...) are refused rather than silently
// dropped. Structured outputs
// (response_format json_object / json_schema, guided_json / guided_regex / guided_grammar /
// guided_choice, structured_outputs) become params.structured, at most one of them, its
// grammar built to refuse a bad schema, regex or grammar here (param: the field it came from).
// `raw_body`, the text `body` was parsed from, gives a schema's properties in the client's order
// (nlohmann::json sorts keys); without it they come sorted by name.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(const nlohmann::json& body, ApiKind kind,
                                                         int vocab_size,
                                                         std::string_view raw_body = {});

// Inputs one /v1/embeddings request may hold (OpenAI's limit).
inline constexpr int kMaxEmbeddingInputs = 2048;

// A /v1/embeddings request, checked but not yet tokenized.
struct EmbeddingRequest {
  std::optional<std::string> model;
  // Each input as text or as token ids; the response's data[i] is inputs[i]'s vector.
  std::vector<CompletionRequest::Prompt> inputs;
  // encoding_format "base64": each vector as the base64 of its little-endian float32 bytes.
  bool base64 = false;
  // Text inputs are tokenized as completions prompts are: with the tokenizer's special tokens
  // (BOS) unless false.
  bool add_special_tokens = true;
  // vLLM's truncate_prompt_tokens: keep only the last k tokens of each input; -1: the last
  // max_model_len. Unset: an input longer than the context is refused.
  std::optional<int> truncate_prompt_tokens;
};

// Checks an embeddings body: `input` a non-empty string, array of strings, array of token ids
// or array of token-id arrays (none empty, at most kMaxEmbeddingInputs; ids in [0,
// vocab_size)); encoding_format "float" or "base64"; dimensions absent or `hidden_size` (the
// vectors are the model's hidden states, which Tandem does not shorten); user a string
// (ignored); add_special_tokens; truncate_prompt_tokens; normalize absent or true.
absl::StatusOr<EmbeddingRequest> ParseEmbeddingRequest(const nlohmann::json& body, int vocab_size,
                                                       int hidden_size);

// Token ids from a JSON array: integers in [0, vocab_size), else an error naming `param`.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const nlohmann::json& array, const char* param,
                                                   int vocab_size);

// Checks a chat `messages` array and returns it with every content a string (null for an
// assistant's tool calls becomes ""): roles system (or developer), user, assistant and tool; an
// assistant's tool_calls [{id, type "function", function {name, arguments}}] kept with their
// arguments parsed from JSON text into objects (what chat templates render), a tool message's
// tool_call_id and name kept.
absl::StatusOr<nlohmann::json> NormalizeMessages(const nlohmann::json& messages);

// Maps a SamplingParams::Validate or LlmEngine::Validate message to the request field it is
// about, and attaches it (plus code "context_length_exceeded" for a context overflow).
absl::Status AttachParam(absl::Status status, ApiKind kind);

}  // namespace tandem::router

namespace tandem::router {

// A /v1/responses request turned into the chat completions body that means the same:
// `instructions` and `input` (a string, or items: messages with input_text / output_text parts,
// function_call and function_call_output) become `messages`, flat function `tools` and a
// function `tool_choice` take the chat shape, `max_output_tokens` becomes `max_tokens`,
// `text.format` becomes `response_format`; temperature, top_p, seed, stream, parallel_tool_calls
// and the vLLM sampling fields carry over. What Responses offers and Tandem does not
// (previous_response_id, background, built-in tools, non-text inputs) is an InvalidArgument
// naming the field; the rest (store, metadata, reasoning, include, truncation, user) is ignored.
// Keys keep the client's order.
absl::StatusOr<nlohmann::ordered_json> ResponsesToChat(const nlohmann::ordered_json& body);

}  // namespace tandem::router
