// The OpenAI server's endpoints other than generation: /metrics, /v1/models, /tokenize,
// /detokenize and the /ready probe.
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "openai_server_impl.h"

namespace tandem::router::internal {

void ApiServerImpl::HandleMetrics(http::HttpExchange& ex) {
  engine::EngineStats stats = engine_->stats();
  metrics_.running->Set(stats.running);
  metrics_.waiting->Set(stats.waiting);
  metrics_.kv_used->Set(stats.kv_blocks_used);
  metrics_.kv_total->Set(stats.kv_blocks_total);
  metrics::AdvanceTo(*metrics_.preemptions, static_cast<double>(stats.preemptions));
  metrics::AdvanceTo(*metrics_.collective_seconds, stats.collective_seconds);
  metrics::AdvanceTo(*metrics_.collective_bytes, static_cast<double>(stats.collective_bytes));
  const engine::GeneratorCounters counters = engine_->counters();
  metrics::AdvanceTo(*metrics_.prefill_retries, static_cast<double>(counters.prefill_retries));
  metrics::AdvanceTo(*metrics_.migrations, static_cast<double>(counters.migrations));
  metrics::AdvanceTo(*metrics_.kv_handoffs, static_cast<double>(counters.kv_handoffs));
  metrics::AdvanceTo(*metrics_.kv_handoff_bytes, static_cast<double>(counters.kv_handoff_bytes));
  metrics_.workers[0][0]->Set(counters.prefill_workers_up);
  metrics_.workers[0][1]->Set(counters.prefill_workers - counters.prefill_workers_up);
  metrics_.workers[1][0]->Set(counters.decode_workers_up);
  metrics_.workers[1][1]->Set(counters.decode_workers - counters.decode_workers_up);
  metrics_.PrefixCacheAndRouting(stats, counters);
  {
    std::lock_guard<std::mutex> lock(metrics_.spec_mu);
    metrics_.spec.Record(stats);
    metrics_.sampling.Record(stats);
  }
  metrics_.in_flight->Set(active_.load());
  if (const http::HttpServer* server = http_for_handlers_.load(std::memory_order_acquire)) {
    metrics_.connections->Set(server->num_connections());
  }
  // Counted before rendering so the scrape includes itself.
  metrics_.Http(200)->Increment();
  ex.Reply(http::HttpResponse{200, metrics::Registry::kContentType, metrics_.registry.Render(), {}});
}

json ApiServerImpl::ModelObject(const std::string& name) const {
  return {{"id", name},
          {"object", "model"},
          {"created", started_},
          {"owned_by", "tandem"},
          {"root", options_.served_model_names.front()},
          {"max_model_len", engine_->max_model_len()}};
}

void ApiServerImpl::HandleModels(http::HttpExchange& ex) {
  json data = json::array();
  for (const std::string& name : options_.served_model_names) data.push_back(ModelObject(name));
  Reply(ex, 200, Dump({{"object", "list"}, {"data", data}}));
}

void ApiServerImpl::HandleModel(http::HttpExchange& ex, const std::string& name) {
  if (absl::Status s = CheckModelName(name); !s.ok()) return ReplyError(ex, s);
  Reply(ex, 200, Dump(ModelObject(name)));
}

void ApiServerImpl::HandleTokenize(http::HttpExchange& ex) {
  absl::StatusOr<json> body = ParseJsonObject(ex.request().body);
  if (!body.ok()) return ReplyError(ex, body.status());
  if (absl::Status s = CheckModel(*body); !s.ok()) return ReplyError(ex, s);
  auto get_bool = [&](const char* name, bool fallback) -> absl::StatusOr<bool> {
    auto it = body->find(name);
    if (it == body->end() || it->is_null()) return fallback;
    if (!it->is_boolean()) return ParamError(name, absl::StrCat(name, " must be a boolean"));
    return it->get<bool>();
  };
  const bool has_prompt = body->contains("prompt") && !(*body)["prompt"].is_null();
  const bool has_messages = body->contains("messages") && !(*body)["messages"].is_null();
  if (has_prompt == has_messages) {
    return ReplyError(ex, ParamError("prompt", "give exactly one of prompt and messages"));
  }
  std::vector<int32_t> tokens;
  if (has_prompt) {
    const json& prompt = (*body)["prompt"];
    if (!prompt.is_string())
      return ReplyError(ex, ParamError("prompt", "prompt must be a string"));
    absl::StatusOr<bool> special = get_bool("add_special_tokens", true);
    if (!special.ok()) return ReplyError(ex, special.status());
    tokens = engine_->tokenizer().Encode(prompt.get<std::string>(), *special);
  } else {
    absl::StatusOr<json> messages = NormalizeMessages((*body)["messages"]);
    if (!messages.ok()) return ReplyError(ex, messages.status());
    absl::StatusOr<bool> special = get_bool("add_special_tokens", false);
    if (!special.ok()) return ReplyError(ex, special.status());
    absl::StatusOr<bool> gen = get_bool("add_generation_prompt", true);
    if (!gen.ok()) return ReplyError(ex, gen.status());
    // The tools render into the prompt as they do for /v1/chat/completions, in the client's
    // key order.
    std::optional<nlohmann::ordered_json> ordered;
    if (body->contains("tools")) {
      ordered = nlohmann::ordered_json::parse(ex.request().body, nullptr, false);
      if (ordered->is_discarded()) ordered.reset();
    }
    absl::StatusOr<ToolRequest> tools = ParseToolRequest(*body, ordered ? &*ordered : nullptr);
    if (!tools.ok()) return ReplyError(ex, tools.status());
    absl::StatusOr<std::vector<int32_t>> chat = ChatTokens(*messages, *gen, *special, *tools);
    if (!chat.ok()) return ReplyError(ex, chat.status());
    tokens = std::move(*chat);
  }
  Reply(ex, 200,
        Dump({{"tokens", tokens},
              {"count", tokens.size()},
              {"max_model_len", engine_->max_model_len()}}));
}

void ApiServerImpl::HandleDetokenize(http::HttpExchange& ex) {
  absl::StatusOr<json> body = ParseJsonObject(ex.request().body);
  if (!body.ok()) return ReplyError(ex, body.status());
  if (absl::Status s = CheckModel(*body); !s.ok()) return ReplyError(ex, s);
  auto it = body->find("tokens");
  if (it == body->end() || it->is_null()) {
    return ReplyError(ex, ParamError("tokens", "tokens is required"));
  }
  absl::StatusOr<std::vector<int32_t>> ids = ParseTokenIds(*it, "tokens", vocab_size_);
  if (!ids.ok()) return ReplyError(ex, ids.status());
  std::string text = engine_->tokenizer().Decode(*ids, /*skip_special_tokens=*/false);
  Reply(ex, 200, Dump({{"prompt", text}}));
}

void ApiServerImpl::HandleReady(const std::shared_ptr<http::HttpExchange>& ex) {
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    if (ready_at_ && Clock::now() - *ready_at_ < options_.ready_cache) {
      return Reply(*ex, 200, R"({"status":"ready"})");
    }
    ready_waiters_.push_back(ex);
    if (ready_probing_) return;
    ready_probing_ = true;
  }
  // One greedy token through the whole engine path: tokenizer, scheduler, model, sampler.
  engine::GenerateRequest probe;
  probe.request_id = NewId("ready-");
  probe.prompt_tokens = engine_->tokenizer().Encode("ready", /*add_special_tokens=*/true);
  if (probe.prompt_tokens.empty()) probe.prompt_tokens = {0};
  probe.params.temperature = 0.0f;
  probe.params.max_tokens = 1;
  absl::Status submitted = engine_->Submit(
      std::move(probe), [this](const engine::RequestOutput& out, const absl::Status& status) {
        if (!status.ok()) return ReadyDone(status);
        if (!out.finished) return;
        if (out.num_generation_tokens < 1) {
          return ReadyDone(absl::UnavailableError("the engine generated no token"));
        }
        ReadyDone(absl::OkStatus());
      });
  if (!submitted.ok()) ReadyDone(submitted);
}

void ApiServerImpl::ReadyDone(const absl::Status& status) {
  std::vector<std::shared_ptr<http::HttpExchange>> waiters;
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    waiters.swap(ready_waiters_);
    ready_probing_ = false;
    if (status.ok()) ready_at_ = Clock::now();
  }
  for (auto& ex : waiters) {
    if (status.ok()) {
      Reply(*ex, 200, R"({"status":"ready"})");
    } else {
      ReplyError(*ex, absl::UnavailableError(
                          absl::StrCat("the engine is not ready: ", status.message())));
    }
  }
}

}  // namespace tandem::router::internal
