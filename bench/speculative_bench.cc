// Speculative decoding on the CPU: greedy decode tokens/s with and without speculation, against
// the acceptance measured in the same run, at batch 1 and 8. Random weights accept almost
// nothing, so the target's agreement with its early-exit draft is dialled: the synthetic model's
// layers from --draft-layers on get their residual-branch outputs scaled by s (s = 1: a plain
// random model; s -> 0: the late layers barely change the residual stream, and the first layers
// predict what the whole model does). A draft model of the target's first --draft-layers
// layers (`synth-model --num-layers`, the same seed: the same weights as a model of its own,
// with a KV cache of its own) and the n-gram proposer run on the same prompts.
//
//   tandem_bench_speculative [--preset small] [--draft-layers 2] [--k 4] [--tokens 96]
//                            [--threads 2] [--dir /tmp/tandem-spec-bench] [--scales 1,0.3,0]
// prints one markdown table (bench/results/speculative-*.md).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/tools/synth_model.h"

namespace tandem {
namespace {

struct Flags {
  std::string preset = "small";
  int draft_layers = 2;
  int k = 4;
  int tokens = 96;
  int threads = 2;
  std::string dir = "/tmp/tandem-spec-bench";
  std::vector<float> scales = {1.0f, 0.3f, 0.1f, 0.03f, 0.0f};
};

struct Result {
  double tokens_per_second = 0;
  double acceptance = 0;   // accepted / proposed draft tokens
  double mean_length = 0;  // tokens per verifying sequence-step
  int64_t steps = 0;
};

// Prompts of 32 random tokens, one per sequence of the batch.
std::vector<std::vector<int32_t>> RandomPrompts(int batch, int vocab) {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(32));
  for (auto& prompt : prompts) {
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  }
  return prompts;
}

absl::StatusOr<Result> Run(const std::string& model, const Flags& flags,
                           const std::vector<std::vector<int32_t>>& prompts,
                           engine::SpeculativeOptions spec,
                           std::vector<std::vector<int32_t>>* generated = nullptr) {
  engine::EngineOptions options;
  options.model_dir = model;
  options.num_threads = flags.threads;
  options.kv_cache_bytes = 256ll << 20;
  options.max_num_seqs = 16;
  options.speculative = spec;
  TANDEM_ASSIGN_OR_RETURN(auto engine, engine::LlmEngine::Create(options));
  std::vector<engine::GenerateRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    requests.push_back({absl::StrCat("r", i),
                        prompts[i],
                        {.temperature = 0, .max_tokens = flags.tokens, .ignore_eos = true}});
  }
  // A warm-up request (page faults of the weights, thread pool start) outside the timing.
  TANDEM_RETURN_IF_ERROR(
      engine::GenerateAll(*engine, {{"warm",
                                     requests[0].prompt_tokens,
                                     {.temperature = 0, .max_tokens = 4, .ignore_eos = true}}})
          .status());
  const engine::EngineStats before = engine->stats();
  const auto start = std::chrono::steady_clock::now();
  TANDEM_ASSIGN_OR_RETURN(auto outputs, engine::GenerateAll(*engine, std::move(requests)));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const engine::EngineStats after = engine->stats();
  int64_t num_generated = 0;
  for (const auto& o : outputs) {
    num_generated += o.num_generation_tokens;
    if (generated != nullptr) generated->push_back(o.choices[0].token_ids);
  }
  Result r;
  r.tokens_per_second = static_cast<double>(num_generated) / seconds;
  const double proposed =
      static_cast<double>(after.spec_proposed_tokens - before.spec_proposed_tokens);
  const double accepted =
      static_cast<double>(after.spec_accepted_tokens - before.spec_accepted_tokens);
  const double verify = static_cast<double>(after.spec_verify_steps - before.spec_verify_steps);
  r.acceptance = proposed > 0 ? accepted / proposed : 0;
  r.mean_length = verify > 0 ? 1 + accepted / verify : 1;
  r.steps = after.steps - before.steps;
  return r;
}

absl::Status Main(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i];
    const std::string value = argv[i + 1];
    if (name == "--preset") {
      flags.preset = value;
    } else if (name == "--draft-layers") {
      flags.draft_layers = std::atoi(value.c_str());
    } else if (name == "--k") {
      flags.k = std::atoi(value.c_str());
    } else if (name == "--tokens") {
      flags.tokens = std::atoi(value.c_str());
    } else if (name == "--threads") {
      flags.threads = std::atoi(value.c_str());
    } else if (name == "--dir") {
      flags.dir = value;
    } else if (name == "--scales") {
      flags.scales.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        flags.scales.push_back(std::strtof(std::string(part).c_str(), nullptr));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
    }
  }
  std::printf(
      "| late-layer scale | batch | method | acceptance | mean accepted length | steps | "
      "tokens/s | speed-up |\n|---|---|---|---|---|---|---|---|\n");
  for (float scale : flags.scales) {
    const std::string model =
        absl::StrCat(flags.dir, "/", flags.preset, "-late", flags.draft_layers, "-x", scale);
    const std::string draft = absl::StrCat(model, "-draft");
    for (const std::string& dir : {model, draft}) {
      if (std::filesystem::exists(dir + "/config.json")) continue;
      tools::SynthModelOptions synth;
      synth.out_dir = dir;
      synth.preset = flags.preset;
      synth.late_layers_from = flags.draft_layers;
      synth.late_layer_scale = scale;
      if (dir == draft) synth.num_layers = flags.draft_layers;
      TANDEM_RETURN_IF_ERROR(tools::WriteSyntheticModel(synth));
    }
    for (int batch : {1, 8}) {
      // Ids below 512: every preset's tokenizer has at least that many.
      const auto prompts = RandomPrompts(batch, 512);
      std::vector<std::vector<int32_t>> answers;
      TANDEM_ASSIGN_OR_RETURN(Result base, Run(model, flags, prompts, {}, &answers));
      std::printf("| %.2f | %d | none | - | 1 | %lld | %.1f | 1.00 |\n", scale, batch,
                  static_cast<long long>(base.steps), base.tokens_per_second);
      const engine::SpeculativeOptions methods[] = {
          {.method = engine::SpeculativeMethod::kEarlyExit,
           .num_speculative_tokens = flags.k,
           .draft_layers = flags.draft_layers,
           .adaptive = false},
          {.method = engine::SpeculativeMethod::kNgram,
           .num_speculative_tokens = flags.k,
           .adaptive = false},
          {.method = engine::SpeculativeMethod::kEarlyExit,
           .num_speculative_tokens = flags.k,
           .draft_layers = flags.draft_layers,
           .adaptive = true},
          {.method = engine::SpeculativeMethod::kDraftModel,
           .num_speculative_tokens = flags.k,
           .draft_model = draft,
           .adaptive = false},
          {.method = engine::SpeculativeMethod::kDraftModel,
           .num_speculative_tokens = flags.k,
           .draft_model = draft,
           .adaptive = true}};
      for (const engine::SpeculativeOptions& spec : methods) {
        TANDEM_ASSIGN_OR_RETURN(Result r, Run(model, flags, prompts, spec));
        std::string name;
        if (spec.method == engine::SpeculativeMethod::kNgram) {
          name = absl::StrCat("ngram k=", flags.k);
        } else if (spec.method == engine::SpeculativeMethod::kEarlyExit) {
          name = absl::StrCat("early-exit L=", flags.draft_layers, " k=", flags.k,
                              spec.adaptive ? " adaptive" : "");
        } else {
          name = absl::StrCat("draft model (", flags.draft_layers, " layers) k=", flags.k,
                              spec.adaptive ? " adaptive" : "");
        }
        std::printf("| %.2f | %d | %s | %.2f | %.2f | %lld | %.1f | %.2f |\n", scale, batch,
                    name.c_str(), r.acceptance, r.mean_length, static_cast<long long>(r.steps),
                    r.tokens_per_second, r.tokens_per_second / base.tokens_per_second);
        std::fflush(stdout);
      }
      // Output that repeats the context, as in editing or rewriting a document: the prompt is
      // P + the model's own answer to P + P again, so the answer tends to recur and the n-gram
      // proposer finds it; how often it does is the measured acceptance.
      std::vector<std::vector<int32_t>> echo = prompts;
      for (size_t i = 0; i < echo.size(); ++i) {
        echo[i].insert(echo[i].end(), answers[i].begin(), answers[i].end());
        echo[i].insert(echo[i].end(), prompts[i].begin(), prompts[i].end());
      }
      TANDEM_ASSIGN_OR_RETURN(Result echo_base, Run(model, flags, echo, {}));
      std::printf("| %.2f | %d | none, echo prompt | - | 1 | %lld | %.1f | 1.00 |\n", scale, batch,
                  static_cast<long long>(echo_base.steps), echo_base.tokens_per_second);
      TANDEM_ASSIGN_OR_RETURN(Result r, Run(model, flags, echo,
                                            {.method = engine::SpeculativeMethod::kNgram,
                                             .num_speculative_tokens = flags.k,
                                             .adaptive = false}));
      std::printf("| %.2f | %d | ngram k=%d, echo prompt | %.2f | %.2f | %lld | %.1f | %.2f |\n",
                  scale, batch, flags.k, r.acceptance, r.mean_length,
                  static_cast<long long>(r.steps), r.tokens_per_second,
                  r.tokens_per_second / echo_base.tokens_per_second);
      std::fflush(stdout);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  absl::Status status = tandem::Main(argc, argv);
  if (!status.ok()) {
    std::fprintf(stderr, "tandem_bench_speculative: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
