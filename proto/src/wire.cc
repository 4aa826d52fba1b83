#include "tandem/proto/wire.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::proto {
tandem::v1::SamplingParams ToProto(const engine::SamplingParams& params) {
  tandem::v1::SamplingParams out;
  out.set_temperature(params.temperature);
  out.set_top_p(params.top_p);
  out.set_top_k(params.top_k);
  out.set_min_p(params.min_p);
  out.set_repetition_penalty(params.repetition_penalty);
  out.set_presence_penalty(params.presence_penalty);
  out.set_frequency_penalty(params.frequency_penalty);
  if (params.seed.has_value()) out.set_seed(*params.seed);
  out.set_max_tokens(params.max_tokens);
  out.set_min_tokens(params.min_tokens);
  out.set_ignore_eos(params.ignore_eos);
  out.mutable_stop_token_ids()->Add(params.stop_token_ids.begin(), params.stop_token_ids.end());
  for (const std::string& stop : params.stop) out.add_stop(stop);
  out.set_include_stop_str_in_output(params.include_stop_str_in_output);
  out.set_n(params.n);
  out.set_logprobs(params.logprobs);
  out.set_skip_special_tokens(params.skip_special_tokens);
  for (const engine::TokenBias& b : params.logit_bias) {
    tandem::v1::TokenBias* wire = out.add_logit_bias();
    wire->set_token_id(b.token);
    wire->set_bias(b.bias);
  }
  if (params.structured.active()) {
    tandem::v1::StructuredOutput* c = out.mutable_structured_output();
    // The wire's kinds are numbered as engine::ConstraintKind.
    c->set_kind(static_cast<tandem::v1::StructuredOutput::Kind>(params.structured.kind));
    c->set_source(params.structured.source);
    c->set_replay_prompt_tokens(params.structured.replay_prompt_tokens);
  }
  return out;
}

engine::SamplingParams FromProto(const tandem::v1::SamplingParams& params) {
  engine::SamplingParams out;  // its defaults stand for every field the message leaves unset
  if (params.has_temperature()) out.temperature = params.temperature();
  if (params.has_top_p()) out.top_p = params.top_p();
  if (params.has_top_k()) out.top_k = params.top_k();
  if (params.has_min_p()) out.min_p = params.min_p();
  if (params.has_repetition_penalty()) out.repetition_penalty = params.repetition_penalty();
  if (params.has_presence_penalty()) out.presence_penalty = params.presence_penalty();
  if (params.has_frequency_penalty()) out.frequency_penalty = params.frequency_penalty();
  if (params.has_seed()) out.seed = params.seed();
  if (params.has_max_tokens()) out.max_tokens = params.max_tokens();
  if (params.has_min_tokens()) out.min_tokens = params.min_tokens();
  if (params.has_ignore_eos()) out.ignore_eos = params.ignore_eos();
  out.stop_token_ids.assign(params.stop_token_ids().begin(), params.stop_token_ids().end());
  out.stop.assign(params.stop().begin(), params.stop().end());
  if (params.has_include_stop_str_in_output()) {
    out.include_stop_str_in_output = params.include_stop_str_in_output();
  }
  if (params.has_n()) out.n = params.n();
  if (params.has_logprobs()) out.logprobs = params.logprobs();
  if (params.has_skip_special_tokens()) out.skip_special_tokens = params.skip_special_tokens();
  for (const tandem::v1::TokenBias& b : params.logit_bias()) {
    out.logit_bias.push_back({b.token_id(), b.bias()});
  }
  if (params.has_structured_output()) {
    const tandem::v1::StructuredOutput& c = params.structured_output();
    // A kind this build does not know stays out of range: StructuredOutput::Validate refuses it.
    out.structured.kind = static_cast<engine::ConstraintKind>(c.kind());
    out.structured.source = c.source();
    out.structured.replay_prompt_tokens = c.replay_prompt_tokens();
  }
  return out;
}

tandem::v1::KvDtype ToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return tandem::v1::KV_DTYPE_F32;
    case DType::kF16:
      return tandem::v1::KV_DTYPE_F16;
    case DType::kBF16:
      return tandem::v1::KV_DTYPE_BF16;
    case DType::kF8E4M3:
      return tandem::v1::KV_DTYPE_FP8_E4M3;
    case DType::kF8E5M2:
      return tandem::v1::KV_DTYPE_FP8_E5M2;
    case DType::kI8:
    case DType::kI32:
      break;  // not KV cache types
  }
  return tandem::v1::KV_DTYPE_UNSPECIFIED;
}

tandem::v1::KvLayout EngineKvLayout(const text::ModelConfig& config, int block_size,
                                    DType kv_dtype, int tp_size, int tp_rank, int kv_head_begin,
                                    int num_kv_heads) {
  tandem::v1::KvLayout out;
  out.set_dtype(ToProto(kv_dtype));
  out.set_block_size(block_size);
  out.set_num_layers(config.num_layers);
  out.set_num_kv_heads(num_kv_heads > 0 ? num_kv_heads : config.num_kv_heads);
  out.set_head_dim(config.head_dim);
  out.set_tp_size(tp_size);
  out.set_tp_rank(tp_rank);
  out.set_kv_head_begin(kv_head_begin);
  out.set_total_kv_heads(config.num_kv_heads);
  out.set_layout_name("layer[2][blocks][block_size][kv_heads][head_dim]");
  return out;
}

tandem::v1::FinishReason ToProto(engine::FinishReason reason) {
  switch (reason) {
    case engine::FinishReason::kStop:
      return tandem::v1::FINISH_REASON_STOP;
    case engine::FinishReason::kLength:
      return tandem::v1::FINISH_REASON_LENGTH;
    case engine::FinishReason::kAbort:
      return tandem::v1::FINISH_REASON_ABORT;
    case engine::FinishReason::kNone:
    case engine::FinishReason::kPrefilled:
      break;
  }
  return tandem::v1::FINISH_REASON_NONE;
}

engine::FinishReason FromProto(tandem::v1::FinishReason reason) {
  switch (reason) {
    case tandem::v1::FINISH_REASON_NONE:
      return engine::FinishReason::kNone;
    case tandem::v1::FINISH_REASON_STOP:
      return engine::FinishReason::kStop;
    case tandem::v1::FINISH_REASON_LENGTH:
      return engine::FinishReason::kLength;
    default:
      return engine::FinishReason::kAbort;
  }
}

tandem::v1::Task ToProto(engine::RequestTask task) {
  switch (task) {
    case engine::RequestTask::kGenerate:
      return tandem::v1::TASK_GENERATE;
    case engine::RequestTask::kEmbed:
      return tandem::v1::TASK_EMBED;
  }
  return tandem::v1::TASK_GENERATE;
}

absl::StatusOr<engine::RequestTask> FromProto(tandem::v1::Task task) {
  switch (task) {
    case tandem::v1::TASK_GENERATE:
      return engine::RequestTask::kGenerate;
    case tandem::v1::TASK_EMBED:
      return engine::RequestTask::kEmbed;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("task ", static_cast<int>(task), " is not one this worker knows"));
}

tandem::v1::PrefilledChoice ToProto(int index, const engine::PrefillHandoff& handoff) {
  tandem::v1::PrefilledChoice out;
  out.set_index(index);
  tandem::v1::SampledToken* first = out.mutable_first_token();
  first->set_token_id(handoff.first_token);
  first->set_logprob(handoff.first_logprob);
  for (const engine::TokenLogprob& t : handoff.first_top_logprobs) {
    tandem::v1::TokenLogprob* entry = first->add_top_logprobs();
    entry->set_token_id(t.token);
    entry->set_logprob(t.logprob);
  }
  out.set_sampler_state(SamplerStateBytes(handoff.rng_state));
  return out;
}

std::string SamplerStateBytes(const std::array<uint64_t, 4>& rng_state) {
  std::string state(32, '\0');
  for (int w = 0; w < 4; ++w) {
    for (int b = 0; b < 8; ++b) {
      state[w * 8 + b] = static_cast<char>((rng_state[w] >> (8 * b)) & 0xff);
    }
  }
  return state;
}

absl::StatusOr<engine::PrefilledChoice> FromProto(const tandem::v1::PrefilledChoice& choice) {
  const std::string& state = choice.sampler_state();
  // Empty is allowed (greedy sampling draws no random numbers): the state is then all zeros.
  if (!state.empty() && state.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat("sampler_state of choice ", choice.index(),
                                                   " has ", state.size(), " bytes, not 32"));
  }
  engine::PrefilledChoice out;
  out.first_token = choice.first_token().token_id();
  out.first_logprob = choice.first_token().logprob();
  for (const tandem::v1::TokenLogprob& t : choice.first_token().top_logprobs()) {
    out.first_top_logprobs.push_back({t.token_id(), t.logprob()});
  }
  for (int w = 0; w < 4 && !state.empty(); ++w) {
    uint64_t word = 0;
    for (int b = 0; b < 8; ++b) {
      word |= static_cast<uint64_t>(static_cast<unsigned char>(state[w * 8 + b])) << (8 * b);
    }
    out.rng_state[w] = word;
  }
  out.generated.assign(choice.generated_token_ids().begin(), choice.generated_token_ids().end());
  return out;
}

}  // namespace tandem::proto
