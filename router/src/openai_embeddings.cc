// POST /v1/embeddings: each input becomes one embedding request (engine::RequestTask::kEmbed) on
// the generator, a prefill batched with everything else that samples nothing; the response
// lists each input's pooled vector (the last token's final hidden state, L2-normalised) as
// floats or as base64 of little-endian float32 bytes.
#include <bit>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openai_server_impl.h"

namespace tandem::router::internal {
namespace {

// The OpenAI client's base64 format: the float32 values' little-endian bytes, base64-encoded.
std::string Base64Floats(const std::vector<float>& values) {
  std::string bytes;
  bytes.reserve(values.size() * 4);
  for (float v : values) {
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    for (int shift = 0; shift < 32; shift += 8) bytes.push_back(static_cast<char>(bits >> shift));
  }
  return absl::Base64Escape(bytes);
}

// One /v1/embeddings request from acceptance to its reply. Its methods run on the connection's
// I/O thread (engine outputs are handed over with http::HttpExchange::Run): no lock.
struct EmbeddingJob {
  ApiServerImpl* server = nullptr;  // outlives every request (see ApiServerImpl::Shutdown)
  std::shared_ptr<http::HttpExchange> exchange;
  std::string id;
  std::string model;
  int64_t created = 0;
  bool base64 = false;
  int prompt_tokens = 0;
  std::vector<std::string> request_ids;  // the engine request of input i
  std::vector<std::vector<float>> vectors;
  std::vector<bool> finished;
  int remaining = 0;
  bool done = false;

  void OnOutput(int input, const engine::RequestOutput& out, const absl::Status& status) {
    if (done) return;
    if (status.ok() && out.finished && out.embedding.empty()) {
      return Fail(input, absl::InternalError(
                             absl::StrCat("input ", input, " finished without an embedding")));
    }
    if (!status.ok()) return Fail(input, status);
    if (!out.finished || finished[input]) return;
    finished[input] = true;
    vectors[input] = out.embedding;
    if (--remaining > 0) return;
    json data = json::array();
    for (size_t i = 0; i < vectors.size(); ++i) {
      json embedding = base64 ? json(Base64Floats(vectors[i])) : json(vectors[i]);
      data.push_back({{"object", "embedding"}, {"index", i}, {"embedding", std::move(embedding)}});
    }
    json response = {
        {"id", id},
        {"object", "list"},
        {"created", created},
        {"model", model},
        {"data", std::move(data)},
        {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
    server->metrics().embeddings->Increment(static_cast<double>(vectors.size()));
    server->Reply(*exchange, 200, Dump(response));
    Finish();
  }

  void OnClientGone() {
    if (done) return;
    AbortUnfinished(-1);
    Finish();
  }

 private:
  void AbortUnfinished(int except) {
    for (size_t i = 0; i < request_ids.size(); ++i) {
      if (static_cast<int>(i) != except && !finished[i]) server->engine().Abort(request_ids[i]);
    }
  }
  void Fail(int input, const absl::Status& status) {
    AbortUnfinished(input);
    server->ReplyError(*exchange, status);
    Finish();
  }
  void Finish() {
    done = true;
    server->RequestFinished();
  }
};

}  // namespace

void ApiServerImpl::HandleEmbeddings(const std::shared_ptr<http::HttpExchange>& ex) {
  if (draining_) {
    return ReplyError(*ex, absl::UnavailableError("the server is shutting down"));
  }
  absl::StatusOr<json> body = ParseJsonObject(ex->request().body);
  if (!body.ok()) return ReplyError(*ex, body.status());
  absl::StatusOr<EmbeddingRequest> parsed =
      ParseEmbeddingRequest(*body, vocab_size_, engine_->config().hidden_size);
  if (!parsed.ok()) return ReplyError(*ex, parsed.status());
  EmbeddingRequest& r = *parsed;
  if (r.model) {
    if (absl::Status s = CheckModelName(*r.model); !s.ok()) return ReplyError(*ex, s);
  }
  const int max_len = engine_->max_model_len();
  int keep = 0;  // tokens kept of each input; 0: all
  if (r.truncate_prompt_tokens) {
    keep = *r.truncate_prompt_tokens == -1 ? max_len : *r.truncate_prompt_tokens;
    if (keep > max_len) {
      return ReplyError(*ex, ParamError("truncate_prompt_tokens",
                                        absl::StrCat("truncate_prompt_tokens (", keep,
                                                     ") is larger than this model's maximum "
                                                     "context length, ",
                                                     max_len, " tokens")));
    }
  }
  // Tokenized as a completions prompt is (special tokens: BOS), no chat template.
  std::vector<std::vector<int32_t>> prompts;
  int prompt_tokens = 0;
  for (size_t i = 0; i < r.inputs.size(); ++i) {
    CompletionRequest::Prompt& p = r.inputs[i];
    std::vector<int32_t> tokens =
        p.text ? engine_->tokenizer().Encode(*p.text, r.add_special_tokens) : std::move(p.tokens);
    if (keep > 0 && static_cast<int>(tokens.size()) > keep) {
      tokens.erase(tokens.begin(), tokens.end() - keep);
    }
    const std::string which = r.inputs.size() == 1 ? "the input" : absl::StrCat("input[", i, "]");
    if (tokens.empty()) {
      return ReplyError(*ex, ParamError("input", absl::StrCat(which, " has no tokens")));
    }
    if (static_cast<int>(tokens.size()) > max_len) {
      return ReplyError(
          *ex,
          WithErrorCode(ParamError("input", absl::StrCat("this model's maximum context "
                                                         "length is ",
                                                         max_len, " tokens, but ", which, " has ",
                                                         tokens.size(), " tokens; shorten it")),
                        "context_length_exceeded"));
    }
    prompt_tokens += static_cast<int>(tokens.size());
    prompts.push_back(std::move(tokens));
  }

  if (active_.fetch_add(1) >= options_.max_active_requests) {
    active_.fetch_sub(1);
    return ReplyError(*ex,
                      WithErrorCode(absl::ResourceExhaustedError(absl::StrCat(
                                        "the server is overloaded (", options_.max_active_requests,
                                        " requests in flight); retry shortly")),
                                    "overloaded"));
  }
  auto job = std::make_shared<EmbeddingJob>();
  job->server = this;
  job->exchange = ex;
  job->id = NewId("embd-");
  job->model = options_.served_model_names.front();
  job->created = UnixSeconds();
  job->base64 = r.base64;
  job->prompt_tokens = prompt_tokens;
  job->vectors.resize(prompts.size());
  job->finished.assign(prompts.size(), false);
  job->remaining = static_cast<int>(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    job->request_ids.push_back(absl::StrCat(job->id, "-", i));
  }

  // Registered before Submit so that no output can be handled before it is in place.
  ex->OnClientGone([job] { job->OnClientGone(); });
  for (size_t i = 0; i < prompts.size(); ++i) {
    engine::GenerateRequest request{job->request_ids[i], std::move(prompts[i]), {}};
    request.task = engine::RequestTask::kEmbed;
    const int index = static_cast<int>(i);
    absl::Status submitted = engine_->Submit(
        std::move(request),
        [this, job, index](const engine::RequestOutput& out, const absl::Status& status) {
          DeliverOutput(*job->exchange,
                        [job, index, out, status] { job->OnOutput(index, out, status); });
        });
    if (!submitted.ok()) {
      for (size_t j = 0; j < i; ++j) engine_->Abort(job->request_ids[j]);
      job->done = true;
      RequestFinished();
      if (prompts.size() > 1) {
        submitted =
            absl::Status(submitted.code(), absl::StrCat("input[", i, "]: ", submitted.message()));
      }
      if (submitted.code() == absl::StatusCode::kInvalidArgument) {
        submitted = ParamError("input", std::string(submitted.message()));
      }
      return ReplyError(*ex, submitted);
    }
  }
  metrics_.prompt_tokens->Increment(prompt_tokens);
}

}  // namespace tandem::router::internal
