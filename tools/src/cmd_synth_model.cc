// `tandem synth-model`: writes a synthetic Hugging Face checkpoint (see synth_model.h).
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/tools/args.h"
#include "tandem/tools/synth_model.h"

namespace tandem::tools {
namespace {

absl::StatusOr<DType> ParseDType(const std::string& name) {
  const std::optional<DType> dtype = ParseDTypeFlag(name);
  if (!dtype.has_value() || DTypeSize(*dtype) == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dtype must be bfloat16, float16 or float32 (or bf16, f16, f32), got '", name, "'"));
  }
  return *dtype;
}

absl::Status Run(int argc, char** argv) {
  Args args("synth-model");
  args.Declare("out", "DIR", "output directory (created if missing)");
  args.Declare("preset", "NAME", "tiny | small | medium | llama3-8b (default tiny)");
  args.Declare("arch", "NAME", "llama | mistral | qwen2 | qwen3 (default llama)");
  args.Declare("seed", "N", "weight seed (default 0)");
  args.Declare("late-layer-scale", "S",
               "scale the o_proj/down_proj outputs of layers from --late-layers-from on by S "
               "(near 0: late layers barely change the residual stream; default 1)");
  args.Declare("late-layers-from", "L", "first layer --late-layer-scale applies to (default 0)");
  args.Declare("num-layers", "N",
               "the preset's shape with N layers; with the same --seed, exactly the first N "
               "layers of the full model (a draft for --speculative-model; default: the "
               "preset's)");
  args.Declare("vocab-size", "N",
               "keep only the first N token ids in the embedding and LM head (a small-vocabulary "
               "model for statistical tests; default: the tokenizer's)");
  args.Declare("dtype", "TYPE", "bfloat16 | float16 | float32 (default bfloat16)");
  args.Declare("tokenizer", "FILE", "tokenizer.json to copy (default: train a small BPE)");
  args.Declare("max-shard-bytes", "N", "shard the weights into files of at most N bytes");
  args.Declare("quant", "METHOD",
               "int8 (compressed-tensors W8A16) | awq (4-bit GEMM) | gptq (4-bit); default none");
  args.Declare("group-size", "N", "awq/gptq inputs per scale and zero point (default 128)");
  args.DeclareSwitch("desc-act", "gptq: act order (g_idx scatters each group over the inputs)");
  args.DeclareSwitch("asym", "gptq: asymmetric (a zero point per group; default symmetric)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  SynthModelOptions options;
  if (!args.Has("out")) return absl::InvalidArgumentError("--out DIR is required");
  options.out_dir = *args.Get("out");
  options.preset = args.GetOr("preset", options.preset);
  options.arch = args.GetOr("arch", options.arch);
  TANDEM_ASSIGN_OR_RETURN(int64_t seed, args.Int("seed", 0));
  if (seed < 0) return absl::InvalidArgumentError("--seed must be >= 0");
  options.seed = static_cast<uint64_t>(seed);
  TANDEM_ASSIGN_OR_RETURN(int64_t vocab_size, args.Int("vocab-size", 0));
  if (vocab_size < 0 || vocab_size > (1 << 24)) {
    return absl::InvalidArgumentError("--vocab-size must be in [0, 16777216]");
  }
  options.vocab_size = static_cast<int>(vocab_size);
  TANDEM_ASSIGN_OR_RETURN(double late_scale, args.Double("late-layer-scale", 1.0));
  if (!(late_scale >= 0.0 && late_scale <= 1e3)) {
    return absl::InvalidArgumentError("--late-layer-scale must be in [0, 1000]");
  }
  options.late_layer_scale = static_cast<float>(late_scale);
  TANDEM_ASSIGN_OR_RETURN(int64_t late_from, args.Int("late-layers-from", 0));
  if (late_from < 0 || late_from > 4096) {
    return absl::InvalidArgumentError("--late-layers-from must be in [0, 4096]");
  }
  options.late_layers_from = static_cast<int>(late_from);
  TANDEM_ASSIGN_OR_RETURN(int64_t num_layers, args.Int("num-layers", 0));
  if (num_layers < 0 || num_layers > 4096) {
    return absl::InvalidArgumentError("--num-layers must be in [1, 4096]");
  }
  options.num_layers = static_cast<int>(num_layers);
  TANDEM_ASSIGN_OR_RETURN(options.dtype, ParseDType(args.GetOr("dtype", "bf16")));
  options.tokenizer_json_path = args.GetOr("tokenizer", "");
  TANDEM_ASSIGN_OR_RETURN(int64_t shard_bytes, args.Int("max-shard-bytes", 0));
  if (shard_bytes < 0) {
    return absl::InvalidArgumentError("--max-shard-bytes must be >= 0");
  }
  options.max_shard_bytes = static_cast<uint64_t>(shard_bytes);
  options.quant = args.GetOr("quant", "");
  TANDEM_ASSIGN_OR_RETURN(int64_t group_size, args.Int("group-size", 128));
  if (group_size <= 0 || group_size > (1 << 20)) {
    return absl::InvalidArgumentError("--group-size must be positive");
  }
  options.group_size = static_cast<int>(group_size);
  options.desc_act = args.Switch("desc-act");
  options.sym = !args.Switch("asym");
  if (options.quant != "gptq" && args.Switch("asym")) {
    return absl::InvalidArgumentError("--asym is a gptq option");
  }

  TANDEM_RETURN_IF_ERROR(WriteSyntheticModel(options));

  // Reports what is on disk, read back through the loader.
  TANDEM_ASSIGN_OR_RETURN(auto ckpt, engine::Checkpoint::Open(options.out_dir));
  uint64_t bytes = 0;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(options.out_dir)) {
    if (entry.path().extension() == ".safetensors") {
      bytes += entry.file_size();
      ++files;
    }
  }
  const text::ModelConfig& c = ckpt->config();
  const std::string weights = ckpt->quantization().method == engine::QuantMethod::kNone
                                  ? DTypeName(options.dtype)
                                  : absl::StrCat(ckpt->quantization().Describe(), " (others ",
                                                 DTypeName(options.dtype), ")");
  std::printf(
      "wrote %s: %s (%s preset), %lld parameters, vocab %d, %s weights in %d file(s), "
      "%llu bytes\n",
      options.out_dir.c_str(), c.architecture_name.c_str(), options.preset.c_str(),
      static_cast<long long>(c.NumParameters()), c.vocab_size, weights.c_str(), files,
      static_cast<unsigned long long>(bytes));
  return absl::OkStatus();
}

}  // namespace

int RunSynthModel(int argc, char** argv) { return ExitCode("synth-model", Run(argc, argv)); }

}  // namespace tandem::tools
