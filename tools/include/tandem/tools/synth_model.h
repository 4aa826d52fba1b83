// Synthetic Hugging Face checkpoints: real architectures and shapes with deterministic random
// weights, so the engine, its tests and demos run without downloading a model.
//
//   SynthModelOptions options;
//   options.out_dir = "/tmp/tiny";
//   options.arch = "qwen3";
//   TANDEM_RETURN_IF_ERROR(WriteSyntheticModel(options));
//   TANDEM_ASSIGN_OR_RETURN(auto ckpt, engine::Checkpoint::Open("/tmp/tiny"));
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/text/model_config.h"

namespace tandem::tools {

struct SynthModelOptions {
  std::string out_dir;
  // "tiny" (CI: hidden 64, 2 layers, ~512 tokens), "small" (demo: ~30M parameters, ~4096
  // tokens) or "llama3-8b" (the real Llama-3-8B shape; ~16 GB in bf16).
  std::string preset = "tiny";
  // "llama", "mistral", "qwen2" (q/k/v biases; tied embeddings for tiny and small) or
  // "qwen3" (per-head q/k RMSNorm).
  std::string arch = "llama";
  uint64_t seed = 0;  // same seed, preset and arch: byte-identical weights
  // > 0: the embedding and LM head hold only the first vocab_size token ids (fewer than the
  // tokenizer has; ids past them are never produced). A small-vocabulary model whose output
  // distributions statistical tests can count (speculative decoding's exactness test).
  int vocab_size = 0;
  // Scales the residual-branch outputs (o_proj, down_proj) of layers late_layers_from.. by
  // late_layer_scale: near 0 those layers barely change the residual stream, so the first
  // late_layers_from layers predict what the whole model does (an early-exit draft whose
  // agreement with the target is dialled; speculative decoding's benchmark).
  float late_layer_scale = 1.0f;
  int late_layers_from = 0;
  // > 0: the preset's shape with this many layers. Weights are drawn per tensor name, so the
  // same seed with fewer layers gives exactly the first layers of the full model, its
  // embedding, final norm and LM head: a draft model for speculative decoding that agrees with
  // the target as much as its first layers do (with late_layer_scale, dialled).
  int num_layers = 0;
  DType dtype = DType::kBF16;
  std::string tokenizer_json_path;  // empty: train a small byte-level BPE on built-in text
  // 0 writes model.safetensors; otherwise shards of at most this many bytes (one tensor larger
  // than that gets a shard of its own) plus model.safetensors.index.json.
  uint64_t max_shard_bytes = 0;
  // Weight-only quantisation of every linear layer but lm_head, in the exact on-disk layout of
  // the tool that writes it (engine/quantization_config.h): "" (none), "int8"
  // (compressed-tensors W8A16, per-channel scales of `dtype`), "awq" (AutoAWQ GEMM, 4-bit, fp16
  // scales) or "gptq" (AutoGPTQ, 4-bit, fp16 scales, zero points stored minus one). Values are
  // rounded from the float weights the same seed gives unquantised.
  std::string quant;
  int group_size = 128;   // awq and gptq: inputs per group
  bool desc_act = false;  // gptq: act order (a seeded permutation of each layer's inputs)
  bool sym = true;        // gptq: symmetric (zero point 8)
};

// Writes config.json, generation_config.json, tokenizer.json, tokenizer_config.json and the
// weights into out_dir, then opens the result with engine::Checkpoint to prove it loads. Each
// file is renamed into place once complete and config.json comes last, so an interrupted run
// never leaves a directory that loads as a checkpoint.
absl::Status WriteSyntheticModel(const SynthModelOptions& options);

// The config of `preset` for `arch` with `vocab_size` tokens. The llama3-8b preset keeps its
// real 128256-row embedding when the tokenizer is smaller (the extra rows are never produced by
// the tokenizer, as in checkpoints whose embedding is padded).
absl::StatusOr<text::ModelConfig> SyntheticConfig(const std::string& preset,
                                                  const std::string& arch, int vocab_size);

}  // namespace tandem::tools
