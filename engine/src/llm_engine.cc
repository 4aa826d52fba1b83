#include "tandem/engine/llm_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/collective/nccl_communicator.h"
#include "tandem/kernels/cuda_backend.h"
#include "disagg_role.h"
#include "grammar_mask_prefetch.h"

namespace tandem::engine {

struct LlmEngine::Choice {
  std::unique_ptr<Sequence> seq;
  std::unique_ptr<text::IncrementalDetokenizer> detokenizer;
  std::string held;  // decoded text not yet released: it may begin a stop string
  bool done = false;
};

struct LlmEngine::Request {
  std::string id;
  RequestTask task = RequestTask::kGenerate;
  std::shared_ptr<const SamplingParams> params;
  std::vector<Choice> choices;
  int num_prompt_tokens = 0;
  int num_generation_tokens = 0;
  size_t max_stop_bytes = 0;
  // For the step trace: when it arrived (GenerateRequest::arrival, else when AddRequest took
  // it), and whether its first token was recorded.
  std::chrono::steady_clock::time_point added = std::chrono::steady_clock::now();
  bool first_token_traced = false;
};

LlmEngine::~LlmEngine() = default;

std::vector<int> DecodeGraphBatchSizes(int max_tokens) {
  const int largest = std::min(max_tokens, 512);
  std::vector<int> sizes;
  for (int size : {1, 2, 4}) {
    if (size <= largest) sizes.push_back(size);
  }
  for (int size = 8; size <= largest; size += 8) sizes.push_back(size);
  if (largest >= 1 && sizes.back() != largest) sizes.push_back(largest);
  return sizes;
}

namespace {

// The most blocks one sequence of an engine holds.
int MaxBlocksPerSeq(const EngineOptions& options, int max_model_len, int num_blocks) {
  return std::max(1, std::min(num_blocks, (max_model_len + options.block_size - 1) /
                                              options.block_size));
}

// The backend of `options.device`. CUDA's attention metadata and split-KV workspace are sized
// for the longest context and the largest step this engine can run.
absl::StatusOr<std::unique_ptr<kernels::Backend>> CreateBackend(const EngineOptions& options,
                                                                const text::ModelConfig& config,
                                                                int max_model_len, int num_blocks) {
  if (options.device == Device::kCpu) {
    return kernels::CreateCpuBackend({.num_threads = options.num_threads, .isa = options.cpu_isa});
  }
  // Rank r of a tensor-parallel group on GPU r % (the devices this process sees).
  int device = 0;
  if (options.tensor_parallel != nullptr && options.tensor_parallel->size() > 1) {
    const int devices = kernels::CudaDeviceCount();
    if (devices > 0) device = options.tensor_parallel->rank() % devices;
  }
  kernels::CudaBackendOptions cuda{
      .device = device,
      .max_seqs = options.max_num_seqs,
      .max_blocks_per_seq = MaxBlocksPerSeq(options, max_model_len, num_blocks),
      .attention_workspace_bytes = kernels::CudaAttentionWorkspaceBytes(
          options.max_num_batched_tokens, config.num_heads, config.head_dim, max_model_len)};
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kernels::CudaBackend> backend,
                          kernels::CreateCudaBackend(cuda));
  return std::unique_ptr<kernels::Backend>(std::move(backend));
}

// Tensor parallelism on the CUDA backend: the NCCL group that carries the activations, joined
// over the tensor-parallel (host) group on the backend's GPU and stream, so that collectives
// follow the kernels that produce their input. Null on the CPU backend (the host group carries
// the activations) and without a group. Every rank calls it at the same point of its start.
absl::StatusOr<std::unique_ptr<collective::Communicator>> CreateDeviceCollective(
    const EngineOptions& options, kernels::Backend* backend) {
  collective::Communicator* comm = options.tensor_parallel;
  if (comm == nullptr || comm->size() == 1 || options.device == Device::kCpu) return nullptr;
  if (!collective::NcclBuilt()) {
    return absl::FailedPreconditionError(
        "tensor parallelism on the CUDA backend needs NCCL, and this build has none (configure "
        "with CUDA where nccl.h and libnccl are found)");
  }
  // NCCL's start waits for every rank without a deadline: first make sure every rank has its
  // backend, so that a rank that failed before here fails the others' barrier (at once when its
  // process is gone, else after the group's timeout) instead of leaving them waiting.
  if (absl::Status ready = comm->Barrier(); !ready.ok()) {
    return absl::Status(ready.code(), absl::StrCat("before starting NCCL, another rank failed: ",
                                                   ready.message()));
  }
  auto* cuda = static_cast<kernels::CudaBackend*>(backend);
  absl::StatusOr<std::unique_ptr<collective::Communicator>> nccl =
      collective::CreateNcclCommunicator(
          *comm, {.device = cuda->device(), .stream = cuda->stream(), .timeout = absl::Seconds(60)});
  if (!nccl.ok()) {
    return absl::Status(nccl.status().code(),
                        absl::StrCat("NCCL on GPU ", cuda->device(), " failed to start: ",
                                     nccl.status().message()));
  }
  return nccl;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmEngine::Create(const EngineOptions& options) {
  if (options.block_size <= 0 || options.block_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size must be in [1, 1024], got ", options.block_size));
  }
  TANDEM_RETURN_IF_ERROR(options.speculative.Validate());
  std::unique_ptr<LlmEngine> engine(new LlmEngine());
  engine->options_ = options;
  // A prefill engine samples only first tokens: nothing to speculate on.
  const bool speculates = options.speculative.enabled() && options.role != EngineRole::kPrefill;
  if (!speculates) engine->options_.speculative = {};
  const int num_spec = engine->options_.speculative.num_speculative_tokens;
  if (engine->options_.speculative.method == SpeculativeMethod::kNgram) {
    engine->ngram_ = std::make_unique<NgramProposer>(options.speculative.ngram_min,
                                                     options.speculative.ngram_max);
  }
  engine->spec_tokens_ = num_spec;
  if (num_spec > 0 && engine->options_.speculative.adaptive) {
    engine->spec_length_ = std::make_unique<SpeculationLength>(num_spec);
  }
  engine->spec_proposed_by_position_.assign(num_spec, 0);
  engine->spec_accepted_by_position_.assign(num_spec, 0);
  engine->role_ = std::make_unique<internal::DisaggRole>(options.role);
  engine->telemetry_ = StepTelemetry(options.step_trace, engine->role_->name(), options.clock);
  TANDEM_ASSIGN_OR_RETURN(engine->checkpoint_, Checkpoint::Open(options.model_dir));
  TANDEM_ASSIGN_OR_RETURN(engine->tokenizer_,
                          text::Tokenizer::FromFile(options.model_dir + "/tokenizer.json"));
  TANDEM_ASSIGN_OR_RETURN(engine->chat_formatter_, text::ChatFormatter::Load(options.model_dir));
  const text::ModelConfig& config = engine->checkpoint_->config();
  if (engine->options_.speculative.method == SpeculativeMethod::kEarlyExit &&
      options.speculative.draft_layers >= config.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("early-exit speculation: draft_layers (", options.speculative.draft_layers,
                     ") must be fewer than the model's ", config.num_layers, " layers"));
  }
  engine->max_model_len_ = config.max_position_embeddings;
  if (options.max_model_len > 0) {
    engine->max_model_len_ = std::min(engine->max_model_len_, options.max_model_len);
  }

  const int tp_size = options.tensor_parallel ? options.tensor_parallel->size() : 1;
  if (tp_size > 1) {
    if (options.tensor_parallel->rank() != 0) {
      return absl::InvalidArgumentError(
          "an engine runs on rank 0 of its tensor-parallel group; other ranks run followers");
    }
  }
  TANDEM_ASSIGN_OR_RETURN(RunnerDTypes dtypes,
                          ResolveRunnerDTypes(config, options.dtype, options.kv_cache_dtype));
  // Each rank's cache holds its KV heads only: the same budget holds more blocks per rank.
  int64_t block_bytes =
      ModelRunner::KvBytesPerBlock(config, options.block_size, dtypes.kv_cache, tp_size);
  std::optional<RunnerDTypes> draft_dtypes;
  if (engine->options_.speculative.method == SpeculativeMethod::kDraftModel) {
    const std::string& dir = engine->options_.speculative.draft_model;
    if (tp_size > 1) {
      return absl::UnimplementedError("a draft model does not run with tensor parallelism yet");
    }
    absl::StatusOr<std::unique_ptr<Checkpoint>> draft = Checkpoint::Open(dir);
    if (!draft.ok()) {
      return absl::Status(draft.status().code(), absl::StrCat("draft model ", dir, ": ",
                                                              draft.status().message()));
    }
    engine->draft_checkpoint_ = std::move(draft).value();
    const text::ModelConfig& dc = engine->draft_checkpoint_->config();
    if (dc.vocab_size != config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "draft model ", dir, ": its vocabulary has ", dc.vocab_size, " tokens, the model's ",
          config.vocab_size, "; a draft must share the model's tokenizer"));
    }
    if (dc.max_position_embeddings < engine->max_model_len_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "draft model ", dir, ": it reaches ", dc.max_position_embeddings,
          " positions, fewer than the context length ", engine->max_model_len_,
          " (lower --max-model-len)"));
    }
    // The draft holds its weights in the model's dtype where it can (an 8-bit model's draft in
    // its own), and its KV in the cache's.
    absl::StatusOr<RunnerDTypes> resolved =
        ResolveRunnerDTypes(dc, options.dtype, options.kv_cache_dtype);
    if (!resolved.ok()) resolved = ResolveRunnerDTypes(dc, std::nullopt, std::nullopt);
    if (!resolved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("draft model ", dir, ": ", resolved.status().message()));
    }
    draft_dtypes = *resolved;
    // Every block holds the draft's KV of its tokens too, in the draft's own cache.
    block_bytes += ModelRunner::KvBytesPerBlock(dc, options.block_size, draft_dtypes->kv_cache);
  }
  const int64_t num_blocks = options.kv_cache_bytes / block_bytes;
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache budget of ", options.kv_cache_bytes,
                                                   " bytes holds no block of ", block_bytes,
                                                   " bytes"));
  }
  engine->blocks_ =
      std::make_unique<BlockManager>(static_cast<int>(std::min<int64_t>(num_blocks, 1 << 30)),
                                     options.block_size, options.enable_prefix_caching);
  engine->scheduler_ = std::make_unique<Scheduler>(
      SchedulerOptions{options.max_num_seqs, options.max_num_batched_tokens, options.role,
                       options.queue_policy},
      engine->blocks_.get());
  TANDEM_ASSIGN_OR_RETURN(engine->backend_, CreateBackend(options, config, engine->max_model_len_,
                                                         engine->blocks_->num_blocks()));
  TANDEM_ASSIGN_OR_RETURN(engine->device_collective_,
                          CreateDeviceCollective(options, engine->backend_.get()));
  std::vector<int> graph_sizes;
  if (options.device == Device::kCuda && !options.enforce_eager) {
    // Verification steps count 1 + the drafts per sequence.
    graph_sizes = DecodeGraphBatchSizes(options.max_num_seqs * (1 + num_spec));
  }
  engine->backend_sampling_ =
      options.sampling_device == SamplingDevice::kBackend ||
      (options.sampling_device == SamplingDevice::kAuto && options.device == Device::kCuda);
  TANDEM_ASSIGN_OR_RETURN(
      engine->runner_,
      ModelRunner::Create(*engine->checkpoint_, engine->backend_.get(),
                          {.max_num_batched_tokens = options.max_num_batched_tokens,
                           .max_num_seqs = options.max_num_seqs,
                           .num_kv_blocks = engine->blocks_->num_blocks(),
                           .block_size = options.block_size,
                           .weight_dtype = dtypes.weights,
                           .kv_cache_dtype = dtypes.kv_cache,
                           .max_logit_rows_per_seq = 1 + num_spec,
                           .tensor_parallel = options.tensor_parallel,
                           .device_collective = engine->device_collective_.get(),
                           .backend_sampling = engine->backend_sampling_,
                           .graph_batch_sizes = graph_sizes,
                           .max_blocks_per_seq = MaxBlocksPerSeq(options, engine->max_model_len_,
                                                                 engine->blocks_->num_blocks())}));
  if (engine->draft_checkpoint_ != nullptr) {
    // The CPU backend serves any model; a device backend's attention workspace is sized for one.
    kernels::Backend* draft_backend = engine->backend_.get();
    if (options.device != Device::kCpu) {
      TANDEM_ASSIGN_OR_RETURN(engine->draft_backend_,
                              CreateBackend(options, engine->draft_checkpoint_->config(),
                                            engine->max_model_len_, engine->blocks_->num_blocks()));
      draft_backend = engine->draft_backend_.get();
    }
    TANDEM_ASSIGN_OR_RETURN(
        engine->draft_runner_,
        ModelRunner::Create(*engine->draft_checkpoint_, draft_backend,
                            {.max_num_batched_tokens = options.max_num_batched_tokens,
                             .max_num_seqs = options.max_num_seqs,
                             .num_kv_blocks = engine->blocks_->num_blocks(),
                             .block_size = options.block_size,
                             .weight_dtype = draft_dtypes->weights,
                             .kv_cache_dtype = draft_dtypes->kv_cache,
                             .max_logit_rows_per_seq = 1}));
    engine->draft_checkpoint_->DropAllPages();
  }
  // The runners hold their own copies of the weights now.
  engine->checkpoint_->DropAllPages();
  engine->sampler_ = std::make_unique<Sampler>(config.eos_token_ids);
  {
    // Rows of the embedding past the tokenizer's ids are no text: empty, never allowed.
    const text::Tokenizer& tok = *engine->tokenizer_;
    std::vector<std::string> bytes(config.vocab_size);
    std::vector<int32_t> special;
    for (int32_t id = 0; id < config.vocab_size && id < tok.vocab_size(); ++id) {
      bytes[id] = tok.TokenBytes(id);
      if (tok.IsSpecial(id)) special.push_back(id);
    }
    std::vector<int32_t> stops;
    for (int32_t id : config.eos_token_ids) {
      if (id >= 0 && id < config.vocab_size) stops.push_back(id);
    }
    TANDEM_ASSIGN_OR_RETURN(
        engine->grammar_vocab_,
        grammar::TokenVocabulary::Create(std::move(bytes), std::move(stops), std::move(special)));
    engine->grammar_cache_ = std::make_unique<grammar::GrammarCache>();
    if (options.overlap_grammar_masks) {
      engine->mask_prefetch_ = std::make_unique<internal::GrammarMaskPrefetch>();
    }
  }
  if (options.on_layer_kv_written) {
    LlmEngine* self = engine.get();
    engine->runner_->set_layer_written_hook([self](int layer) {
      self->options_.on_layer_kv_written(layer, self->step_writes_);
    });
  }
  return engine;
}

absl::Status LlmEngine::Validate(const GenerateRequest& request) const {
  TANDEM_RETURN_IF_ERROR(ValidateRequest(request, checkpoint_->config(), max_model_len_));
  const int prompt_len = static_cast<int>(request.prompt_tokens.size());
  if (request.task == RequestTask::kEmbed) {
    if (blocks_->BlocksFor(prompt_len) > blocks_->num_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the prompt (", prompt_len, " tokens) needs more KV cache than this engine",
                       " has (", blocks_->num_blocks() * blocks_->block_size(), " tokens)"));
    }
    return absl::OkStatus();
  }
  const int64_t total = static_cast<int64_t>(prompt_len) + request.params.max_tokens;
  if (blocks_->BlocksFor(static_cast<int>(total)) > blocks_->num_blocks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt (", prompt_len, " tokens) plus max_tokens (",
                     request.params.max_tokens, ") needs more KV cache than this engine has (",
                     blocks_->num_blocks() * blocks_->block_size(), " tokens)"));
  }
  return CompiledConstraint(request.params).status();
}

absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> LlmEngine::CompiledConstraint(
    const SamplingParams& params) const {
  const StructuredOutput& c = params.structured;
  if (!c.active()) return nullptr;
  if (grammar_vocab_->stop_ids().empty()) {
    return absl::InvalidArgumentError(
        "structured output: this model has no end-of-sequence token, so no grammar can end");
  }
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled =
      grammar_cache_->GetOrCompile(ConstraintKindName(c.kind), c.source, grammar_vocab_,
                                   [&] { return BuildGrammar(c); });
  if (!compiled.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "structured output (", ConstraintKindName(c.kind), "): ", compiled.status().message()));
  }
  return compiled;
}

absl::StatusOr<std::unique_ptr<LlmEngine::Request>> LlmEngine::NewRequest(
    GenerateRequest& request) {
  if (request.task == RequestTask::kEmbed) {
    // Nothing is sampled: one step's worth of max_tokens, so that no stage plans for more
    // (speculative drafts propose up to max_tokens - 1).
    request.params = SamplingParams{};
    request.params.max_tokens = 1;
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<const grammar::CompiledGrammar> compiled,
                          CompiledConstraint(request.params));
  auto req = std::make_unique<Request>();
  req->id = request.request_id;
  req->task = request.task;
  if (request.arrival != std::chrono::steady_clock::time_point{}) req->added = request.arrival;
  req->params = std::make_shared<const SamplingParams>(std::move(request.params));
  req->num_prompt_tokens = static_cast<int>(request.prompt_tokens.size());
  for (const std::string& s : req->params->stop) {
    req->max_stop_bytes = std::max(req->max_stop_bytes, s.size());
  }
  req->choices.resize(req->params->n);
  for (int i = 0; i < req->params->n; ++i) {
    Choice& choice = req->choices[i];
    choice.seq = std::make_unique<Sequence>();
    Sequence& seq = *choice.seq;
    seq.seq_id = next_seq_id_++;
    seq.request_id = req->id;
    seq.choice_index = i;
    seq.tokens = request.prompt_tokens;
    seq.num_prompt_tokens = req->num_prompt_tokens;
    seq.params = req->params;
    seq.prefix_root = PrefixRoot(request.cache_salt);
    choice.detokenizer = std::make_unique<text::IncrementalDetokenizer>(
        *tokenizer_, req->params->skip_special_tokens);
    if (compiled == nullptr) continue;
    seq.matcher = std::make_unique<grammar::GrammarMatcher>(compiled, /*max_rollback_tokens=*/0);
    const int replay = req->params->structured.replay_prompt_tokens;
    for (int t = req->num_prompt_tokens - replay; t < req->num_prompt_tokens; ++t) {
      if (!seq.matcher->AcceptToken(seq.tokens[t])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "structured output: prompt token ", t, " (id ", seq.tokens[t],
            "), generated earlier under the constraint, is not allowed by its grammar"));
      }
    }
  }
  return req;
}

absl::Status LlmEngine::AddRequest(GenerateRequest request) {
  if (requests_.count(request.request_id) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("request ", request.request_id, " exists"));
  }
  TANDEM_RETURN_IF_ERROR(Validate(request));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Request> req, NewRequest(request));
  const SamplingParams& params = *req->params;
  uint64_t base_seed =
      params.seed.has_value()
          ? *params.seed
          : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  for (int i = 0; i < params.n; ++i) {
    // Sample i of a seeded request draws from its own stream derived from (seed, i).
    req->choices[i].seq->rng =
        SamplerRng(base_seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i));
  }
  for (Choice& choice : req->choices) {
    // The other samples share sample 0's prompt KV.
    if (options_.enable_prefix_caching && choice.seq->choice_index > 0) {
      choice.seq->prompt_source = req->choices[0].seq.get();
    }
    scheduler_->Add(choice.seq.get());
  }
  requests_[req->id] = std::move(req);
  return absl::OkStatus();
}

void LlmEngine::Abort(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  for (Choice& choice : it->second->choices) {
    if (!choice.done) scheduler_->Finish(choice.seq.get(), FinishReason::kAbort);
  }
  requests_.erase(it);
  // First tokens of an AddPrefilled request not yet returned by Step() are dropped with it.
  role_->DropFirstTokens(request_id);
}

void LlmEngine::FinishChoice(Choice& choice, FinishReason reason, ChoiceDelta& delta) {
  scheduler_->Finish(choice.seq.get(), reason);
  choice.done = true;
  delta.finish_reason = reason;
}

void LlmEngine::ProcessToken(Request& request, Choice& choice, int32_t token, ChoiceDelta& delta) {
  Sequence& seq = *choice.seq;
  const SamplingParams& params = *request.params;
  seq.tokens.push_back(token);
  ++request.num_generation_tokens;
  delta.token_ids.push_back(token);
  if (params.logprobs >= 0) {
    delta.logprobs.push_back(seq.last_logprob);
    delta.top_logprobs.push_back(seq.last_top_logprobs);
  }

  FinishReason reason = FinishReason::kNone;
  const auto& eos = checkpoint_->config().eos_token_ids;
  const bool is_eos = std::find(eos.begin(), eos.end(), token) != eos.end();
  const bool is_stop_id = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(),
                                    token) != params.stop_token_ids.end();
  // A grammar that accepted EOS has ended: nothing more may follow, ignore_eos or not.
  const bool grammar_ended = seq.matcher != nullptr && seq.matcher->IsTerminated();
  bool stopped_by_string = false;
  if ((is_eos && (!params.ignore_eos || grammar_ended)) || is_stop_id) {
    reason = FinishReason::kStop;  // the stopping token's text is not part of the output
  } else {
    choice.held += choice.detokenizer->Add(token);
    size_t best = std::string::npos;
    size_t best_len = 0;
    for (const std::string& s : params.stop) {
      size_t pos = choice.held.find(s);
      if (pos != std::string::npos && pos < best) {
        best = pos;
        best_len = s.size();
      }
    }
    if (best != std::string::npos) {
      choice.held.resize(params.include_stop_str_in_output ? best + best_len : best);
      reason = FinishReason::kStop;
      stopped_by_string = true;
    }
  }
  if (reason == FinishReason::kNone && (seq.num_output_tokens() >= params.max_tokens ||
                                        static_cast<int>(seq.tokens.size()) >= max_model_len_)) {
    reason = FinishReason::kLength;
  }
  if (reason == FinishReason::kNone && role_->HandsOverPrefilled()) {
    // The decode engine detokenizes from the first token on; this engine emits no text.
    delta.finish_reason = FinishReason::kPrefilled;
    PrefillHandoff handoff{request.id,       seq.choice_index,      token,
                           seq.last_logprob, seq.last_top_logprobs, seq.rng.state(),
                           HandOver(choice)};
    role_->AddHandoff(std::move(handoff));
    return;
  }
  if (reason != FinishReason::kNone) {
    if (!stopped_by_string) choice.held += choice.detokenizer->Finish();
    delta.text += choice.held;
    choice.held.clear();
    FinishChoice(choice, reason, delta);
    return;
  }
  ReleaseHeld(request, choice, delta.text);
}

void LlmEngine::ReleaseHeld(const Request& request, Choice& choice, std::string& text) {
  // Release all but the bytes that could still begin a stop string, on a character boundary.
  size_t keep = request.max_stop_bytes > 0 ? request.max_stop_bytes - 1 : 0;
  if (choice.held.size() > keep) {
    size_t cut = choice.held.size() - keep;
    while (cut > 0 && (static_cast<unsigned char>(choice.held[cut]) & 0xC0) == 0x80) --cut;
    text += choice.held.substr(0, cut);
    choice.held.erase(0, cut);
  }
}

// The serving loop's one step: schedule, execute, sample, process the outputs. What is measured
// about it lives in telemetry_, what its role changes in role_ (the hand-over at HandOver).
absl::StatusOr<std::vector<RequestOutput>> LlmEngine::Step() {
  std::vector<RequestOutput> outputs = role_->TakeFirstTokens();
  if (!scheduler_->has_work()) return outputs;
  if (options_.before_step && !options_.before_step()) return outputs;
  telemetry_.BeginStep();
  TANDEM_ASSIGN_OR_RETURN(SchedulerStep step, ScheduleStep());
  TANDEM_RETURN_IF_ERROR(DraftStep(step));
  const bool prefetching = StartGrammarMasks(step);
  absl::StatusOr<std::span<const float>> logits = ExecuteStep(step);
  if (prefetching) mask_prefetch_->Wait();  // before any return: the masks use the matchers
  if (!logits.ok()) return logits.status();
  TANDEM_ASSIGN_OR_RETURN(std::span<const float> hidden, PooledHidden(step));
  SampleStep(step, *logits, hidden, outputs);
  telemetry_.EndStep(scheduler_->has_work());
  FinishOutputs(outputs);
  return outputs;
}

absl::StatusOr<SchedulerStep> LlmEngine::ScheduleStep() {
  ChooseSpeculationLength();
  ApplySloLimits();
  ProposeDrafts();
  SchedulerStep step = scheduler_->Schedule();
  if (step.empty()) {
    return absl::InternalError("scheduler made no progress with requests pending");
  }
  telemetry_.Scheduled(step);
  return step;
}

absl::StatusOr<std::span<const float>> LlmEngine::ExecuteStep(const SchedulerStep& step) {
  const bool attach = options_.tensor_parallel != nullptr &&
                      static_cast<bool>(options_.tensor_parallel_step_attachment);
  if (options_.on_layer_kv_written || attach) {
    step_writes_.clear();
    for (const ScheduledSequence& s : step.seqs) {
      const Sequence& seq = *s.seq;
      step_writes_.push_back({seq.request_id, seq.choice_index, seq.num_computed_tokens,
                              seq.num_computed_tokens + s.num_new_tokens, &seq.block_table});
    }
  }
  std::string attachment;
  if (attach) attachment = options_.tensor_parallel_step_attachment(step_writes_);
  const bool reports = !attachment.empty();
  if (reports) runner_->set_step_attachment(std::move(attachment));
  step_sampled_in_backend_ = backend_sampling_ && PlanBackendSampling(step);
  TANDEM_ASSIGN_OR_RETURN(std::span<const float> logits, runner_->Execute(step));
  if (reports && options_.tensor_parallel_step_reports) {
    options_.tensor_parallel_step_reports(runner_->step_reports());
  }
  scheduler_->Commit(step);
  return logits;
}

void LlmEngine::ChooseSpeculationLength() {
  if (spec_length_ == nullptr) return;
  int num_seqs = 0;
  int64_t context = 0;
  for (const Sequence* seq : scheduler_->running()) {
    if (seq->num_uncomputed_tokens() != 1) continue;
    ++num_seqs;
    context += seq->num_computed_tokens + 1;
  }
  spec_tokens_ = spec_length_->Choose(telemetry_.latency_model(), num_seqs, context,
                                      telemetry_.draft_pass_seconds(),
                                      telemetry_.last_target_step_seconds());
}

void LlmEngine::ProposeDrafts() {
  if (!options_.speculative.enabled()) return;
  const int k = spec_tokens_;
  for (Sequence* seq : scheduler_->running()) {
    seq->draft_tokens.clear();
    seq->draft_dists.clear();
    if (seq->num_uncomputed_tokens() != 1) continue;  // still prefilling
    // Never more than the sequence may still produce: max_tokens and the context length, one
    // token coming after the drafts either way.
    const int limit = std::min({k, seq->params->max_tokens - seq->num_output_tokens() - 1,
                                max_model_len_ - static_cast<int>(seq->tokens.size())});
    if (limit <= 0) continue;
    if (ngram_ != nullptr) {
      seq->draft_tokens = ngram_->Propose(seq->tokens, limit);
    } else {
      seq->draft_tokens.assign(limit, 0);  // places, for DraftStep to fill
    }
  }
}

absl::Status LlmEngine::DraftStep(const SchedulerStep& step) {
  const SpeculativeMethod method = options_.speculative.method;
  if (method != SpeculativeMethod::kEarlyExit && method != SpeculativeMethod::kDraftModel) {
    return absl::OkStatus();
  }
  int most = 0;
  for (const ScheduledSequence& s : step.seqs) most = std::max(most, s.num_draft_tokens);
  if (most == 0) {
    // The draft model's cache follows the target's block tables, copies included.
    if (draft_runner_ != nullptr) draft_runner_->CopyBlocks(step.block_copies);
    return absl::OkStatus();
  }
  const auto begin = telemetry_.Now();
  static const std::vector<std::pair<int32_t, int32_t>> kNoCopies;
  const std::vector<std::pair<int32_t, int32_t>>* copies = &step.block_copies;
  if (draft_runner_ != nullptr) {
    // A probe catches up over the last kProbeCatchUpTokens tokens only, marking what it skips
    // stale; a step that proposes for real first takes the draft back to the stale part.
    const bool probe = spec_length_ != nullptr && spec_length_->probing();
    for (const ScheduledSequence& s : step.seqs) {
      if (s.num_draft_tokens == 0) continue;
      Sequence& seq = *s.seq;
      const int from = static_cast<int>(seq.tokens.size()) - 1 - kProbeCatchUpTokens;
      if (probe && seq.draft_kv_tokens < from) {
        if (seq.draft_kv_stale_from < 0) seq.draft_kv_stale_from = seq.draft_kv_tokens;
        seq.draft_kv_tokens = from;
      } else if (!probe && seq.draft_kv_stale_from >= 0) {
        seq.draft_kv_tokens = std::min(seq.draft_kv_tokens, seq.draft_kv_stale_from);
        seq.draft_kv_stale_from = -1;
      }
    }
    // The draft's KV of every real token but the last (which the first pass runs), in passes
    // of at most a step's tokens: all of the prompt the first time (its KV came from the
    // target's prefill or another worker), what verification accepted since then afterwards.
    for (;;) {
      std::vector<ModelRunner::TokenRun> runs;
      std::vector<Sequence*> caught_up;
      int budget = draft_runner_->max_num_batched_tokens();
      for (const ScheduledSequence& s : step.seqs) {
        if (s.num_draft_tokens == 0) continue;
        const int behind = static_cast<int>(s.seq->tokens.size()) - 1 - s.seq->draft_kv_tokens;
        if (behind <= 0) continue;
        if (budget <= 0 || static_cast<int>(runs.size()) == draft_runner_->max_num_seqs()) break;
        const int n = std::min(behind, budget);
        runs.push_back({.seq = s.seq, .begin = s.seq->draft_kv_tokens,
                        .end = s.seq->draft_kv_tokens + n, .sample = false});
        caught_up.push_back(s.seq);
        budget -= n;
      }
      if (runs.empty()) break;
      TANDEM_RETURN_IF_ERROR(draft_runner_->ExecuteRuns(runs, draft_runner_->config().num_layers,
                                                        *copies).status());
      copies = &kNoCopies;
      for (size_t i = 0; i < runs.size(); ++i) caught_up[i]->draft_kv_tokens = runs[i].end;
    }
  }
  const size_t vocab = checkpoint_->config().vocab_size;
  // Early exit runs the target's first layers, a draft model all of its own.
  ModelRunner& drafter = draft_runner_ != nullptr ? *draft_runner_ : *runner_;
  const int draft_layers = draft_runner_ != nullptr ? draft_runner_->config().num_layers
                                                    : options_.speculative.draft_layers;
  for (int j = 0; j < most; ++j) {
    TANDEM_ASSIGN_OR_RETURN(std::span<const float> logits,
                            drafter.ExecuteDraft(step, j, draft_layers, *copies));
    copies = &kNoCopies;
    size_t r = 0;
    for (const ScheduledSequence& s : step.seqs) {
      if (s.num_draft_tokens <= j) continue;
      const float* row = logits.data() + r++ * vocab;
      Sequence& seq = *s.seq;
      if (j == 0) seq.draft_dists.assign(s.num_draft_tokens, DraftDistribution{});
      if (seq.params->greedy()) {
        // The draft's argmax (lowest id among equals): a point-mass proposal, which greedy
        // verification accepts when it is the target's argmax too.
        seq.draft_tokens[j] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      } else {
        // A draw from the draft's distribution, processed as the target's will be at this
        // position: its penalties and min_tokens see the drafts before this one.
        draft_row_.assign(row, row + vocab);
        const size_t known = seq.tokens.size();
        seq.tokens.insert(seq.tokens.end(), seq.draft_tokens.begin(),
                          seq.draft_tokens.begin() + j);
        seq.draft_tokens[j] = sampler_->SampleDraft(draft_row_, seq, &seq.draft_dists[j]);
        seq.tokens.resize(known);
      }
      // The draft's KV now reaches the position this pass ran.
      if (draft_runner_ != nullptr) {
        s.seq->draft_kv_tokens = static_cast<int>(s.seq->tokens.size()) + j;
      }
    }
  }
  telemetry_.DraftPasses(
      most, std::chrono::duration<double>(telemetry_.Now() - begin).count());
  return absl::OkStatus();
}

bool LlmEngine::StartGrammarMasks(const SchedulerStep& step) {
  step_mask_index_.assign(step.seqs.size(), -1);
  if (mask_prefetch_ == nullptr) return false;
  std::vector<grammar::GrammarMatcher*> matchers;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const ScheduledSequence& s = step.seqs[i];
    if (!s.samples || s.seq->matcher == nullptr) continue;
    step_mask_index_[i] = static_cast<int>(matchers.size());
    matchers.push_back(s.seq->matcher.get());
  }
  // One mask costs about what handing it to another thread does (bench/results/
  // structured-decode-2026-11-27.md): it is computed when its sample is drawn.
  if (matchers.size() < 2) {
    step_mask_index_.assign(step.seqs.size(), -1);
    return false;
  }
  mask_prefetch_->Start(std::move(matchers));
  return true;
}

absl::StatusOr<std::span<const float>> LlmEngine::PooledHidden(const SchedulerStep& step) {
  for (const ScheduledSequence& s : step.seqs) {
    if (s.samples && requests_.at(s.seq->request_id)->task == RequestTask::kEmbed) {
      return runner_->FinalHidden();
    }
  }
  return std::span<const float>();
}

bool LlmEngine::PlanBackendSampling(const SchedulerStep& step) {
  // Which sampling sequences the backend draws for (no drafts, no grammar); the others' rows
  // come back as logits for the host. Decided, and the edits' room checked, before any draw
  // is taken from a stream.
  size_t edits_bound = 0;
  bool any = false;
  step_in_backend_.assign(step.seqs.size(), false);
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const ScheduledSequence& s = step.seqs[i];
    if (!s.samples) continue;
    const Sequence& seq = *s.seq;
    if (requests_.at(seq.request_id)->task == RequestTask::kEmbed) {
      step_in_backend_[i] = true;  // its row is not sampled either way
      continue;
    }
    if (s.num_draft_tokens > 0 ||
        !sampler_->SamplesInBackend(seq, checkpoint_->config().vocab_size)) {
      continue;
    }
    const SamplingParams& p = *seq.params;
    edits_bound += seq.tokens.size() + p.logit_bias.size() + p.stop_token_ids.size() +
                   checkpoint_->config().eos_token_ids.size();
    step_in_backend_[i] = true;
    any = true;
  }
  if (!any || edits_bound > static_cast<size_t>(runner_->max_sample_edits())) return false;
  const int vocab = checkpoint_->config().vocab_size;
  sample_rows_.clear();
  sample_edits_.clear();
  sample_host_rows_.clear();
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const ScheduledSequence& s = step.seqs[i];
    if (!s.samples) continue;
    if (!step_in_backend_[i]) {
      // Greedy rows without edits leave these logits as they are, for the host.
      for (int j = 0; j <= s.num_draft_tokens; ++j) {
        sample_host_rows_.push_back(static_cast<int32_t>(sample_rows_.size()));
        sample_rows_.emplace_back();
      }
    } else if (requests_.at(s.seq->request_id)->task == RequestTask::kEmbed) {
      sample_rows_.emplace_back();  // a greedy row whose token nobody reads
    } else {
      sample_rows_.push_back(sampler_->BackendRow(*s.seq, vocab, &sample_edits_));
    }
  }
  runner_->set_backend_sampling(sample_rows_, sample_edits_, sample_host_rows_);
  return true;
}

void LlmEngine::SampleStep(const SchedulerStep& step, std::span<const float> logits,
                           std::span<const float> hidden, std::vector<RequestOutput>& outputs) {
  const size_t vocab = checkpoint_->config().vocab_size;
  const ModelRunner::BackendSamples drawn =
      step_sampled_in_backend_ ? runner_->backend_samples() : ModelRunner::BackendSamples{};
  const size_t hidden_size = checkpoint_->config().hidden_size;
  std::vector<float> row(vocab);
  std::map<std::string, size_t> output_index;
  for (size_t i = 0; i < outputs.size(); ++i) output_index[outputs[i].request_id] = i;
  size_t r = 0;
  size_t host_row = 0;  // in `logits`: with backend sampling, the host's rows only
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const ScheduledSequence& s = step.seqs[i];
    if (!s.samples) continue;
    const size_t num_rows = 1 + s.num_draft_tokens;
    const bool in_backend = step_sampled_in_backend_ && step_in_backend_[i];
    std::span<const float> rows;
    if (!in_backend) {
      rows = logits.subspan(host_row * vocab, num_rows * vocab);
      host_row += num_rows;
    }
    const size_t first_row = r;
    r += num_rows;
    const Request& request = *requests_.at(s.seq->request_id);
    auto [it, inserted] = output_index.try_emplace(request.id, outputs.size());
    if (inserted) {
      outputs.emplace_back();
      outputs.back().request_id = request.id;
      outputs.back().num_prompt_tokens = request.num_prompt_tokens;
    }
    if (request.task == RequestTask::kEmbed) {
      FinishEmbedding(s, hidden.subspan(first_row * hidden_size, hidden_size), outputs[it->second]);
      continue;
    }
    const int mask = step_mask_index_[i];
    std::optional<DrawnToken> token;
    if (in_backend) {
      const int logprobs = std::max(0, s.seq->params->logprobs);
      token = DrawnToken{drawn.tokens[first_row],
                         drawn.top.subspan(first_row * kernels::kMaxSampleLogprobs, logprobs)};
    }
    SampleSequence(s, rows, row, mask >= 0 ? &mask_prefetch_->mask(mask) : nullptr,
                   outputs[it->second], token ? &*token : nullptr);
  }
  // Draft tokens of sequences that did not run (past the batch cap) are proposed afresh.
  for (Sequence* seq : scheduler_->running()) {
    seq->draft_tokens.clear();
    seq->draft_dists.clear();
  }
}

void LlmEngine::FinishEmbedding(const ScheduledSequence& s, std::span<const float> hidden,
                                RequestOutput& out) {
  Request& request = *requests_.at(s.seq->request_id);
  Choice& choice = request.choices[s.seq->choice_index];
  if (telemetry_.tracing() && !request.first_token_traced) {
    request.first_token_traced = true;
    telemetry_.FirstToken(request.id, request.num_prompt_tokens, request.added);
  }
  // L2 normalisation in double; a zero vector (which a real model never gives) stays zero.
  double sum = 0;
  for (float x : hidden) sum += static_cast<double>(x) * x;
  const double scale = sum > 0 ? 1.0 / std::sqrt(sum) : 0.0;
  out.embedding.resize(hidden.size());
  for (size_t i = 0; i < hidden.size(); ++i) {
    out.embedding[i] = static_cast<float>(hidden[i] * scale);
  }
  out.choices.emplace_back();
  out.choices.back().index = s.seq->choice_index;
  // Its blocks go back now (and stay named in the prefix cache): whatever the role, an
  // embedding hands nothing on.
  FinishChoice(choice, FinishReason::kStop, out.choices.back());
}

void LlmEngine::SampleSequence(const ScheduledSequence& s, std::span<const float> rows,
                               std::vector<float>& row, const grammar::TokenMask* grammar_mask,
                               RequestOutput& out, const DrawnToken* drawn) {
  const size_t vocab = row.size();
  Sequence& seq = *s.seq;
  Request& request = *requests_.at(seq.request_id);
  Choice& choice = request.choices[seq.choice_index];
  if (telemetry_.tracing() && !request.first_token_traced) {
    request.first_token_traced = true;
    telemetry_.FirstToken(request.id, request.num_prompt_tokens, request.added);
  }
  out.choices.emplace_back();
  out.choices.back().index = seq.choice_index;
  ChoiceDelta& delta = out.choices.back();
  // Row j is the distribution after the real tokens and drafts 0..j-1: it verifies draft j,
  // and the row after the last draft gives one more token when every draft was accepted. The
  // accepted tokens are in seq.tokens (penalties, min_tokens) and the matcher before the next
  // row is sampled, exactly as if each had been sampled in a step of its own.
  const std::vector<int32_t> drafts(seq.draft_tokens.begin(),
                                    seq.draft_tokens.begin() + s.num_draft_tokens);
  const int known = static_cast<int>(seq.tokens.size());
  int accepted = 0;
  for (int j = 0; j <= s.num_draft_tokens; ++j) {
    const int32_t draft = j < s.num_draft_tokens ? drafts[j] : -1;
    int32_t token = 0;
    if (drawn != nullptr) {
      // Drawn in the backend (no drafts, no grammar): what Sample would have given.
      token = drawn->token.token;
      ++backend_sampled_tokens_;
      if (seq.params->logprobs >= 0) {
        seq.last_logprob = drawn->token.logprob;
        seq.last_top_logprobs.clear();
        for (const kernels::TokenLogprob& t : drawn->top) {
          seq.last_top_logprobs.push_back({t.token, t.logprob});
        }
      }
    } else {
      const float* src = rows.data() + static_cast<size_t>(j) * vocab;
      row.assign(src, src + vocab);
      // The prefetched mask is of the state before this step's first token; later rows' masks
      // follow the drafts accepted here.
      const DraftDistribution* q =
          j < static_cast<int>(seq.draft_dists.size()) ? &seq.draft_dists[j] : nullptr;
      token = sampler_->Sample(row, seq, draft, j == 0 ? grammar_mask : nullptr, q);
      if (token >= 0) ++host_sampled_tokens_;
    }
    // The sampler draws from the grammar's mask: a refusal here is a defect, not bad input.
    const bool allowed = seq.matcher == nullptr || token < 0 || seq.matcher->AcceptToken(token);
    TANDEM_CHECK(allowed) << "token " << token << " was sampled outside the grammar's mask";
    if (token < 0) {
      // The grammar allows no token of this vocabulary here: the sample cannot go on, and what
      // it has is no complete document, so it ends as aborted, with the text it has.
      delta.text += choice.held + choice.detokenizer->Finish();
      choice.held.clear();
      FinishChoice(choice, FinishReason::kAbort, delta);
      break;
    }
    ProcessToken(request, choice, token, delta);
    if (choice.done || token != draft) break;
    ++accepted;
  }
  out.num_generation_tokens = request.num_generation_tokens;
  if (s.num_draft_tokens > 0) {
    spec_proposed_ += s.num_draft_tokens;
    spec_accepted_ += accepted;
    ++spec_verify_steps_;
    for (int j = 0; j < s.num_draft_tokens; ++j) ++spec_proposed_by_position_[j];
    for (int j = 0; j < accepted; ++j) ++spec_accepted_by_position_[j];
    if (spec_length_ != nullptr) spec_length_->Observe(s.num_draft_tokens, accepted);
  }
  // A draft model's KV past the accepted drafts is of rejected tokens.
  seq.draft_kv_tokens = std::min(seq.draft_kv_tokens, known + accepted);
  // A finished choice's blocks are gone already; a running one keeps the accepted tokens' KV.
  if (s.num_draft_tokens > 0 && !choice.done) scheduler_->AcceptDrafts(&seq, accepted);
}

void LlmEngine::FinishOutputs(std::vector<RequestOutput>& outputs) {
  for (RequestOutput& out : outputs) {
    auto it = requests_.find(out.request_id);
    if (it == requests_.end()) continue;  // already reported finished
    bool all_done = std::all_of(it->second->choices.begin(), it->second->choices.end(),
                                [](const Choice& c) { return c.done; });
    if (all_done) {
      out.finished = true;
      requests_.erase(it);
    }
  }
}

bool LlmEngine::has_unfinished() const {
  return !requests_.empty() || role_->has_first_tokens();
}

BlockTable LlmEngine::HandOver(Choice& choice) {
  Sequence& seq = *choice.seq;
  scheduler_->Finish(&seq, FinishReason::kPrefilled);  // keeps the blocks
  choice.done = true;
  BlockTable blocks = std::move(seq.block_table);
  seq.block_table.clear();
  return blocks;
}

std::vector<PrefillHandoff> LlmEngine::TakeHandoffs() { return role_->TakeHandoffs(); }

void LlmEngine::ReleaseHandoff(const PrefillHandoff& handoff) {
  BlockTable blocks = handoff.blocks;
  blocks_->Free(blocks);
}

absl::StatusOr<BlockTable> LlmEngine::ReserveBlocks(int num_tokens, std::span<const int32_t> prompt,
                                                    std::string_view cache_salt,
                                                    int* num_cached_tokens) {
  if (num_tokens <= 0) return absl::InvalidArgumentError("reserve at least one token");
  if (num_cached_tokens != nullptr) *num_cached_tokens = 0;
  BlockTable table;
  int cached = 0;
  if (blocks_->prefix_caching() && static_cast<int>(prompt.size()) == num_tokens) {
    std::vector<uint64_t> hashes;
    ExtendBlockHashes(PrefixRoot(cache_salt), prompt, blocks_->block_size(), hashes);
    const int shared = blocks_->CountCached(hashes);
    const int needed =
        blocks_->CountCachedFree(hashes, shared) + blocks_->BlocksFor(num_tokens) - shared;
    if (needed <= blocks_->num_free_blocks()) {
      cached = blocks_->AllocateCached(table, hashes, shared) * blocks_->block_size();
    }
    scheduler_->RecordPrefixCacheLookup(num_tokens, cached);
  }
  auto copy = blocks_->Append(table, cached, num_tokens - cached);
  if (!copy.ok()) {
    blocks_->Free(table);
    return copy.status();
  }
  if (num_cached_tokens != nullptr) *num_cached_tokens = cached;
  return table;
}

void LlmEngine::FreeReservation(BlockTable& blocks) { blocks_->Free(blocks); }

absl::Status LlmEngine::AddPrefilled(GenerateRequest request,
                                     std::vector<PrefilledChoice> choices) {
  if (requests_.count(request.request_id) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("request ", request.request_id, " exists"));
  }
  TANDEM_RETURN_IF_ERROR(Validate(request));
  const int prompt_len = static_cast<int>(request.prompt_tokens.size());
  if (static_cast<int>(choices.size()) != request.params.n) {
    return absl::InvalidArgumentError(absl::StrCat("request asks for n = ", request.params.n,
                                                   " but ", choices.size(), " were prefilled"));
  }
  const int vocab = checkpoint_->config().vocab_size;
  for (const PrefilledChoice& c : choices) {
    const int generated = static_cast<int>(c.generated.size());
    const int kv_tokens = generated > 0 ? c.num_kv_tokens : prompt_len;
    if (generated > 0) {
      if (generated >= request.params.max_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("a continued sample has generated ", generated,
                         " tokens already, max_tokens is ", request.params.max_tokens));
      }
      if (kv_tokens <= 0 || kv_tokens >= prompt_len + generated) {
        return absl::InvalidArgumentError(
            absl::StrCat("a continued sample of ", prompt_len, " prompt and ", generated,
                         " generated tokens has the KV of ", kv_tokens,
                         "; want at least 1 and fewer than all"));
      }
      for (int32_t t : c.generated) {
        if (t < 0 || t >= vocab) {
          return absl::InvalidArgumentError(
              absl::StrCat("generated token ", t, " is outside the vocabulary"));
        }
      }
    }
    if (blocks_->BlocksFor(kv_tokens) > static_cast<int>(c.blocks.size())) {
      return absl::InvalidArgumentError(absl::StrCat("a prefilled sample brings ", c.blocks.size(),
                                                     " blocks for ", kv_tokens, " tokens"));
    }
    for (int32_t b : c.blocks) {
      if (b < 0 || b >= blocks_->num_blocks() || blocks_->ref_count(b) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("block ", b, " is not reserved here"));
      }
    }
    if (c.first_token < 0 || c.first_token >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("first token ", c.first_token, " is outside the vocabulary"));
    }
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Request> req, NewRequest(request));
  // A constrained sample's matcher is rebuilt from the tokens it generated elsewhere (the first
  // token, or every token of a continuation); tokens its grammar refuses are refused here.
  for (size_t i = 0; i < choices.size(); ++i) {
    grammar::GrammarMatcher* matcher = req->choices[i].seq->matcher.get();
    if (matcher == nullptr) continue;
    const std::vector<int32_t> first = {choices[i].first_token};
    const std::vector<int32_t>& replay =
        choices[i].generated.empty() ? first : choices[i].generated;
    for (size_t t = 0; t < replay.size(); ++t) {
      if (!matcher->AcceptToken(replay[t])) {
        return absl::InvalidArgumentError(absl::StrCat("structured output: generated token ", t,
                                                       " (id ", replay[t], ") of sample ", i,
                                                       " is not allowed by the request's grammar"));
      }
    }
  }
  req->first_token_traced = true;  // sampled by the prefill worker, which traces it
  RequestOutput out;
  out.request_id = req->id;
  out.num_prompt_tokens = prompt_len;
  for (size_t i = 0; i < choices.size(); ++i) {
    Choice& choice = req->choices[i];
    Sequence& seq = *choice.seq;
    seq.num_computed_tokens = prompt_len;
    seq.block_table = std::move(choices[i].blocks);
    seq.rng = SamplerRng::FromState(choices[i].rng_state);
    if (!choices[i].generated.empty()) {
      // A continuation: replay the generated tokens through the detokenizer and the hold-back
      // of ProcessToken (which only depend on the tokens), so the held text and the next text
      // are what the parking engine would have produced; none of it is emitted again.
      seq.num_computed_tokens = choices[i].num_kv_tokens;
      std::string released;
      for (int32_t t : choices[i].generated) {
        seq.tokens.push_back(t);
        choice.held += choice.detokenizer->Add(t);
        ReleaseHeld(*req, choice, released);
      }
      seq.status = SequenceStatus::kRunning;
      scheduler_->AddPrefilled(choice.seq.get());
      continue;
    }
    seq.last_logprob = choices[i].first_logprob;
    seq.last_top_logprobs = std::move(choices[i].first_top_logprobs);
    seq.status = SequenceStatus::kRunning;
    out.choices.emplace_back();
    out.choices.back().index = static_cast<int>(i);
    ProcessToken(*req, choice, choices[i].first_token, out.choices.back());
    if (!choice.done) scheduler_->AddPrefilled(choice.seq.get());
  }
  out.num_generation_tokens = req->num_generation_tokens;
  out.finished =
      std::all_of(req->choices.begin(), req->choices.end(), [](const Choice& c) { return c.done; });
  if (!out.finished) requests_[req->id] = std::move(req);
  // Continued samples emit nothing until their next token.
  if (!out.choices.empty()) role_->AddFirstTokens(std::move(out));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ParkedSample>> LlmEngine::Park(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", request_id, " is not running"));
  }
  if (role_->HasFirstTokens(request_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " has output not yet returned by Step()"));
  }
  Request& request = *it->second;
  std::vector<ParkedSample> parked;
  for (Choice& choice : request.choices) {
    if (choice.done) continue;
    const Sequence& seq = *choice.seq;
    ParkedSample& p = parked.emplace_back();
    p.choice_index = seq.choice_index;
    p.state.generated.assign(seq.tokens.begin() + seq.num_prompt_tokens, seq.tokens.end());
    p.state.rng_state = seq.rng.state();
    // The last sampled token's KV is never in the cache yet.
    p.state.num_kv_tokens =
        std::min(seq.num_computed_tokens, static_cast<int>(seq.tokens.size()) - 1);
    p.state.blocks = HandOver(choice);  // the caller's from here on
    if (p.state.num_kv_tokens <= 0) {
      blocks_->Free(p.state.blocks);
      p.state.num_kv_tokens = 0;
    }
  }
  requests_.erase(it);
  return parked;
}

void LlmEngine::ApplySloLimits() {
  // Share of the TPOT target a step may take: the rest covers what happens outside the step
  // (streaming, the loop's other work) and the model's error.
  constexpr double kTpotMargin = 0.9;
  // Share of the TTFT target one step may take: a request arriving mid-step waits at most this
  // before its first chunk runs.
  constexpr double kTtftStepShare = 0.25;
  if (options_.tpot_slo_seconds > 0 && role_->SizesDecodeBatch()) {
    std::vector<int64_t> contexts;
    contexts.reserve(scheduler_->running().size());
    // A decode step reads each sequence's computed tokens plus the one it runs.
    for (const Sequence* seq : scheduler_->running()) {
      contexts.push_back(seq->num_computed_tokens + 1);
    }
    // What the caller's loop spends between steps is part of every token's time too.
    // So do the step's draft passes, which the latency model leaves out.
    const double step_target = kTpotMargin * options_.tpot_slo_seconds -
                               telemetry_.step_gap_seconds() -
                               spec_tokens_ * telemetry_.draft_pass_seconds();
    // A verification step runs each sequence's draft tokens too.
    decode_batch_limit_ = DecodeBatchLimit(telemetry_.latency_model(), contexts,
                                           options_.max_num_seqs, step_target, 1 + spec_tokens_);
    // Sequences that ran in the last step (the front of the running list) keep running when
    // the cap drops: parking one would add its wait to its own time per token. The batch comes
    // down as they finish, while nothing new joins above the cap.
    const int keep = std::min(telemetry_.last_step_seqs(), scheduler_->num_running());
    scheduler_->set_max_running(std::max(decode_batch_limit_, keep));
  }
  if (options_.ttft_slo_seconds > 0 && role_->SizesPrefillSteps()) {
    scheduler_->set_token_budget(PrefillTokenBudget(telemetry_.latency_model(), options_.max_num_batched_tokens,
                                                    options_.block_size, options_.block_size,
                                                    kTtftStepShare * options_.ttft_slo_seconds));
  }
}

EngineStats LlmEngine::stats() const {
  EngineStats stats;
  stats.running = scheduler_->num_running();
  stats.waiting = scheduler_->num_waiting();
  stats.kv_blocks_total = blocks_->num_blocks();
  stats.kv_blocks_used = blocks_->num_used_blocks();
  stats.preemptions = scheduler_->num_preemptions();
  stats.prefix_cache_queries_tokens = scheduler_->prefix_cache_queries_tokens();
  stats.prefix_cache_hits_tokens = scheduler_->prefix_cache_hits_tokens();
  stats.prefix_cache_evictions = blocks_->num_evictions();
  stats.batch_limit = decode_batch_limit_ > 0 ? decode_batch_limit_ : scheduler_->max_running();
  stats.token_budget = scheduler_->token_budget();
  stats.steps = telemetry_.steps();
  stats.last_step_seconds = telemetry_.last_step_seconds();
  stats.last_predicted_step_seconds = telemetry_.last_predicted_step_seconds();
  stats.step_gap_seconds = telemetry_.step_gap_seconds();
  stats.step_model = telemetry_.latency_model().coefficients();
  stats.step_model_samples = telemetry_.latency_model().num_observed();
  stats.step_model_error_ratio = telemetry_.latency_model().error_ratio();
  stats.spec_proposed_tokens = spec_proposed_;
  stats.spec_accepted_tokens = spec_accepted_;
  stats.spec_verify_steps = spec_verify_steps_;
  stats.backend_sampled_tokens = backend_sampled_tokens_;
  stats.host_sampled_tokens = host_sampled_tokens_;
  stats.graph_steps = runner_->graph_replays();
  stats.graphs_captured = runner_->graphs_captured();
  stats.spec_proposed_by_position = spec_proposed_by_position_;
  stats.spec_accepted_by_position = spec_accepted_by_position_;
  if (options_.tensor_parallel != nullptr) {
    const collective::CollectiveStats& c = options_.tensor_parallel->stats();
    stats.collective_seconds = c.seconds;
    stats.collective_bytes = static_cast<int64_t>(c.bytes);
  }
  if (device_collective_ != nullptr) {
    const collective::CollectiveStats& c = device_collective_->stats();
    stats.collective_seconds += c.seconds;
    stats.collective_bytes += static_cast<int64_t>(c.bytes);
  }
  return stats;
}

absl::StatusOr<std::vector<RequestOutput>> GenerateAll(LlmEngine& engine,
                                                       std::vector<GenerateRequest> requests) {
  std::vector<RequestOutput> results(requests.size());
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i].request_id = requests[i].request_id;
    results[i].num_prompt_tokens = static_cast<int>(requests[i].prompt_tokens.size());
    results[i].choices.resize(requests[i].params.n);
    for (int c = 0; c < requests[i].params.n; ++c) results[i].choices[c].index = c;
    index[requests[i].request_id] = i;
    TANDEM_RETURN_IF_ERROR(engine.AddRequest(std::move(requests[i])));
  }
  while (engine.has_unfinished()) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<RequestOutput> step, engine.Step());
    for (RequestOutput& out : step) {
      RequestOutput& total = results[index.at(out.request_id)];
      total.finished = out.finished;
      total.num_generation_tokens = out.num_generation_tokens;
      if (!out.embedding.empty()) total.embedding = std::move(out.embedding);
      for (ChoiceDelta& d : out.choices) {
        AccumulateDelta(total.choices[d.index], d);
      }
    }
  }
  return results;
}

absl::StatusOr<std::unique_ptr<TensorParallelFollower>> TensorParallelFollower::Create(
    const EngineOptions& options) {
  collective::Communicator* comm = options.tensor_parallel;
  if (comm == nullptr || comm->rank() == 0) {
    return absl::InvalidArgumentError("a tensor-parallel follower is rank 1.. of a group");
  }
  std::unique_ptr<TensorParallelFollower> follower(new TensorParallelFollower());
  TANDEM_ASSIGN_OR_RETURN(follower->checkpoint_, Checkpoint::Open(options.model_dir));
  const text::ModelConfig& config = follower->checkpoint_->config();
  // A device backend's attention workspace is sized as the leader's (the ranks run with the
  // same flags), for as many blocks per sequence as the context length takes: the follower
  // learns the leader's block count only once its runner is created.
  int max_model_len = config.max_position_embeddings;
  if (options.max_model_len > 0) max_model_len = std::min(max_model_len, options.max_model_len);
  const int max_blocks = (max_model_len + options.block_size - 1) / std::max(options.block_size, 1);
  TANDEM_ASSIGN_OR_RETURN(follower->backend_,
                          CreateBackend(options, config, max_model_len, max_blocks));
  TANDEM_ASSIGN_OR_RETURN(follower->device_collective_,
                          CreateDeviceCollective(options, follower->backend_.get()));
  TANDEM_ASSIGN_OR_RETURN(
      follower->runner_,
      ModelRunner::Create(*follower->checkpoint_, follower->backend_.get(),
                          {.weight_dtype = std::nullopt,
                           .kv_cache_dtype = std::nullopt,
                           .tensor_parallel = comm,
                           .device_collective = follower->device_collective_.get()}));
  follower->checkpoint_->DropAllPages();
  return follower;
}

TensorParallelFollower::~TensorParallelFollower() = default;

absl::Status TensorParallelFollower::Run() { return runner_->RunFollower(); }

absl::Status RunTensorParallelFollower(const EngineOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<TensorParallelFollower> follower,
                          TensorParallelFollower::Create(options));
  return follower->Run();
}

}  // namespace tandem::engine
