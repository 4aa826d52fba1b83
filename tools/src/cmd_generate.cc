// `tandem generate`: offline generation from a checkpoint directory.
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/strings/str_split.h"
#include "commands.h"
#include "device_flag.h"
#include "nlohmann/json.hpp"
#include "server_flags.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/tools/args.h"
#include "tandem/tools/sampling_flags.h"
#include "tensor_parallel_group.h"

namespace tandem::tools {
namespace {

absl::Status GenerateOn(const engine::EngineOptions& options, const Args& args,
                        engine::SamplingParams params);

absl::Status Generate(int argc, char** argv) {
  Args args("generate");
  args.Declare("model", "DIR", "Hugging Face checkpoint directory (required)");
  args.Declare("prompt", "TEXT", "raw prompt text");
  args.Declare("chat", "TEXT", "a user message, rendered with the model's chat template");
  args.Declare("system", "TEXT", "system message for --chat");
  args.Declare("threads", "N", "CPU threads (default: all cores)");
  args.Declare("kv-cache-bytes", "N", "KV cache budget in bytes (default 512 MiB)");
  DeclareDeviceFlag(args);
  args.DeclareSwitch("json", "print one JSON object per sample instead of the text");
  DeclareSamplingFlags(args);
  DeclareSpeculativeFlags(args);
  DeclareTensorParallelFlags(args);
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TensorParallelGroup tp;
  TANDEM_RETURN_IF_ERROR(tp.Configure(args, argc, argv));
  auto model = args.Get("model");
  if (!model) return absl::InvalidArgumentError("generate: --model DIR is required");
  if (args.Has("prompt") == args.Has("chat")) {
    return absl::InvalidArgumentError("generate: give exactly one of --prompt and --chat");
  }
  TANDEM_ASSIGN_OR_RETURN(engine::SamplingParams params, ParseSamplingFlags(args));
  TANDEM_ASSIGN_OR_RETURN(int64_t threads, args.Int("threads", 0));
  TANDEM_ASSIGN_OR_RETURN(int64_t kv_bytes, args.Int("kv-cache-bytes", 512ll << 20));

  engine::EngineOptions options;
  TANDEM_ASSIGN_OR_RETURN(options.device, DeviceFlag(args));
  TANDEM_ASSIGN_OR_RETURN(options.cpu_isa, CpuIsaFlag(args));
  TANDEM_ASSIGN_OR_RETURN(options.sampling_device, SamplingDeviceFlag(args));
  options.enforce_eager = args.Switch("enforce-eager");
  options.model_dir = *model;
  options.num_threads = static_cast<int>(threads);
  options.kv_cache_bytes = kv_bytes;
  TANDEM_RETURN_IF_ERROR(SpeculativeFlags(args, options));
  if (tp.follower()) return tp.RunFollower(options);
  TANDEM_RETURN_IF_ERROR(tp.CheckModel(options));
  TANDEM_RETURN_IF_ERROR(tp.Start());
  options.tensor_parallel = tp.communicator();
  // The engine is gone (its followers released) before the group finishes.
  return tp.Finish(GenerateOn(options, args, params));
}

absl::Status GenerateOn(const engine::EngineOptions& options, const Args& args,
                        engine::SamplingParams params) {
  TANDEM_ASSIGN_OR_RETURN(auto llm, engine::LlmEngine::Create(options));

  std::vector<int32_t> prompt;
  if (args.Has("prompt")) {
    prompt = llm->tokenizer().Encode(*args.Get("prompt"), /*add_special_tokens=*/true);
  } else {
    nlohmann::json messages = nlohmann::json::array();
    if (args.Has("system"))
      messages.push_back({{"role", "system"}, {"content", *args.Get("system")}});
    messages.push_back({{"role", "user"}, {"content", *args.Get("chat")}});
    TANDEM_ASSIGN_OR_RETURN(std::string text, llm->chat_formatter().Apply(messages, true));
    // The template already wrote any BOS it wants.
    prompt = llm->tokenizer().Encode(text, /*add_special_tokens=*/false);
  }
  const bool json = args.Switch("json");
  if (json && params.logprobs < 0) params.logprobs = 0;
  TANDEM_ASSIGN_OR_RETURN(auto results, engine::GenerateAll(*llm, {{"generate", prompt, params}}));
  for (const engine::ChoiceDelta& choice : results[0].choices) {
    if (json) {
      nlohmann::json out = {{"token_ids", choice.token_ids},
                            {"text", choice.text},
                            {"logprobs", choice.logprobs},
                            {"finish_reason", engine::FinishReasonName(choice.finish_reason)},
                            {"prompt_tokens", results[0].num_prompt_tokens}};
      if (params.n > 1) out["index"] = choice.index;
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      std::cout << choice.text << "\n";
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunGenerate(int argc, char** argv) { return ExitCode("generate", Generate(argc, argv)); }

}  // namespace tandem::tools
