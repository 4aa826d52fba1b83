// `tandem roofline`: per-operator FLOPs, bytes, intensity and bound for prefill and decode of a
// model on a hardware profile, with predicted step times (see roofline.h).
#include <cstdio>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/text/model_config.h"
#include "tandem/tools/args.h"
#include "tandem/tools/roofline.h"

namespace tandem::tools {
namespace {

// Overrides `*field` with flag `name` when it is given.
absl::Status OverrideInt(const Args& args, const std::string& name, int64_t* field) {
  if (!args.Has(name)) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(*field, args.Int(name, *field));
  return absl::OkStatus();
}

absl::StatusOr<HardwareProfile> HardwareFromFlags(const Args& args) {
  const bool custom = args.Has("flops") || args.Has("bandwidth");
  if (custom) {
    if (args.Has("hardware")) {
      return absl::InvalidArgumentError("give either --hardware or --flops/--bandwidth, not both");
    }
    if (!args.Has("flops") || !args.Has("bandwidth")) {
      return absl::InvalidArgumentError("--flops and --bandwidth go together");
    }
    TANDEM_ASSIGN_OR_RETURN(double tflops, args.Double("flops", 0));
    TANDEM_ASSIGN_OR_RETURN(double gbps, args.Double("bandwidth", 0));
    return CustomHardware(tflops, gbps);
  }
  return FindHardware(args.GetOr("hardware", "A100-80G"));
}

absl::StatusOr<RooflineShape> ShapeFromFlags(const Args& args) {
  RooflineShape shape;
  if (args.Has("model")) {
    if (args.Has("preset")) return absl::InvalidArgumentError("give --model or --preset, not both");
    const std::filesystem::path dir = *args.Get("model");
    TANDEM_ASSIGN_OR_RETURN(text::ModelConfig config,
                            text::ModelConfig::FromFile((dir / "config.json").string()));
    shape = ShapeFromConfig(config);
    shape.batch = TextbookShape().batch;
    shape.seq_len = TextbookShape().seq_len;
    TANDEM_ASSIGN_OR_RETURN(shape.weight_bytes,
                            CheckpointWeightBytes((dir / "config.json").string()));
  } else {
    TANDEM_ASSIGN_OR_RETURN(shape, FindShape(args.GetOr("preset", "textbook")));
  }
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "hidden", &shape.hidden));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "heads", &shape.heads));
  if (args.Has("hidden") || args.Has("heads")) {
    if (shape.heads <= 0 || shape.hidden % shape.heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--hidden (", shape.hidden,
                                                     ") must be a positive multiple of --heads (",
                                                     shape.heads, ")"));
    }
    shape.head_dim = shape.hidden / shape.heads;
  }
  if (args.Has("heads") && !args.Has("kv-heads")) shape.kv_heads = shape.heads;
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "kv-heads", &shape.kv_heads));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "head-dim", &shape.head_dim));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "intermediate", &shape.intermediate));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "layers", &shape.layers));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "vocab", &shape.vocab));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "batch", &shape.batch));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "seq-len", &shape.seq_len));
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "dtype-bytes", &shape.dtype_bytes));
  int64_t group_size = 128;
  TANDEM_RETURN_IF_ERROR(OverrideInt(args, "group-size", &group_size));
  TANDEM_RETURN_IF_ERROR(SetPrecision(args.GetOr("weight-dtype", "auto"),
                                      args.GetOr("kv-cache-dtype", "auto"),
                                      static_cast<int>(group_size), &shape));
  TANDEM_RETURN_IF_ERROR(shape.Validate());
  return shape;
}

absl::Status Run(int argc, char** argv) {
  Args args("roofline");
  args.Declare("hardware", "NAME",
               absl::StrCat(absl::StrJoin(HardwareNames(), " | "), " (default A100-80G)"));
  args.Declare("flops", "TFLOPS", "custom peak dense TFLOP/s (with --bandwidth)");
  args.Declare("bandwidth", "GBPS", "custom memory bandwidth in GB/s, GB = 2^30 bytes");
  args.Declare("model", "DIR", "read the shape from DIR/config.json");
  args.Declare("preset", "NAME", "textbook | llama-3-8b (default textbook)");
  args.Declare("hidden", "H", "hidden size (head-dim becomes H / heads)");
  args.Declare("heads", "N", "query heads (kv-heads follow unless given)");
  args.Declare("kv-heads", "N", "key/value heads");
  args.Declare("head-dim", "D", "head dimension");
  args.Declare("intermediate", "H'", "MLP width");
  args.Declare("layers", "L", "decoder layers");
  args.Declare("vocab", "V", "vocabulary size");
  args.Declare("batch", "B", "sequences per step (default 8)");
  args.Declare("seq-len", "T", "prompt length (prefill) and context (decode), default 1024");
  args.Declare("dtype-bytes", "N", "bytes per element (default 2, or the checkpoint's dtype)");
  args.Declare("weight-dtype", "TYPE",
               "projection weights: bfloat16 | float16 | float32 | int8 | int4 (default: "
               "--dtype-bytes, or the checkpoint's quantization_config)");
  args.Declare("group-size", "N", "int4 inputs per scale and zero point (default 128)");
  args.Declare("kv-cache-dtype", "TYPE",
               "bfloat16 | float16 | float32 | fp8_e4m3 | fp8_e5m2 (default: --dtype-bytes)");
  args.DeclareSwitch("json", "print one JSON object");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(HardwareProfile hardware, HardwareFromFlags(args));
  TANDEM_ASSIGN_OR_RETURN(RooflineShape shape, ShapeFromFlags(args));
  TANDEM_ASSIGN_OR_RETURN(RooflineReport report, AnalyzeRoofline(shape, hardware));
  if (args.Switch("json")) {
    std::printf("%s\n", report.ToJson().dump(2).c_str());
  } else {
    std::fputs(report.ToText().c_str(), stdout);
  }
  return absl::OkStatus();
}

}  // namespace

int RunRoofline(int argc, char** argv) { return ExitCode("roofline", Run(argc, argv)); }

}  // namespace tandem::tools
