#include "tandem/tools/synth_model.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/quantization_config.h"
#include "tandem/tools/bpe_trainer.h"

namespace tandem::tools {
namespace {

using nlohmann::json;
using text::Architecture;
using text::ModelConfig;
namespace fs = std::filesystem;

// The Llama 3 chat template, as shipped in Meta-Llama-3's tokenizer_config.json.
constexpr char kLlama3ChatTemplate[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' "
    "}}";

constexpr char kBeginOfText[] = "<|begin_of_text|>";
constexpr char kEndOfText[] = "<|end_of_text|>";
constexpr char kEndOfTurn[] = "<|eot_id|>";

struct Preset {
  const char* name;
  int hidden;
  int layers;
  int heads;
  int kv_heads;
  int intermediate;
  int max_position;
  int bpe_vocab;  // size of the BPE trained when no tokenizer is given
  int min_vocab;  // the embedding keeps at least this many rows
};

constexpr Preset kPresets[] = {
    // Non-power-of-two intermediate sizes catch kernels that assume tile multiples.
    {"tiny", 64, 2, 4, 2, 160, 2048, 512, 0},
    {"small", 512, 8, 8, 4, 1536, 4096, 4096, 0},
    // Larger than any last-level cache (1.5 GB of bf16 weights): decode benchmarks that must
    // stream weights from memory.
    {"medium", 2048, 16, 16, 8, 5632, 4096, 4096, 0},
    {"llama3-8b", 4096, 32, 32, 8, 14336, 131072, 4096, 128256},
};

// ---------------------------------------------------------------------------------------------
// Deterministic weights. Element i of a tensor is the i-th output of a SplitMix64 stream keyed
// by (seed, tensor name), turned into a bounded normal-like value with integer arithmetic only,
// so the bytes do not depend on the standard library, the shard layout or the write order.

uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

uint64_t TensorKey(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return SplitMix64Mix(seed * kGolden ^ h);
}

// Sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit variance: close to a
// standard normal, bounded by +-3.46 so no single weight blows up an activation.
float NormalLike(uint64_t bits) {
  int32_t sum = 0;
  for (int k = 0; k < 4; ++k) sum += static_cast<int32_t>((bits >> (16 * k)) & 0xffff);
  // sum has mean 4 * 32767.5 and variance 4 * (65536^2 - 1) / 12.
  constexpr double kMean = 4 * 32767.5;
  constexpr double kInvStd = 1.0 / 37837.22620210879;  // sqrt(4 * (65536^2 - 1) / 12)
  return static_cast<float>((sum - kMean) * kInvStd);
}

// How a tensor's values are drawn: mean + std * NormalLike.
struct Init {
  float mean;
  float std;
};

// Scales that keep a random network's activations finite and its logits informative: unit
// embeddings, projections with std 1/sqrt(fan_in) (variance preserving), residual-branch outputs
// shrunk by 1/sqrt(2 * layers) so the residual stream stays O(1) at any depth, and norm weights
// near 1. reference_selftest.py checks the result: finite logits of std ~1 and greedy decoding
// that does not collapse onto a few tokens. Biases and q/k-norm weights are large enough that
// leaving one out changes the logits visibly.
Init InitFor(const std::string& name, const std::vector<int64_t>& shape, const ModelConfig& c) {
  auto ends_with = [&](const char* suffix) {
    size_t n = std::strlen(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  const float residual_scale = 1.0f / std::sqrt(2.0f * c.num_layers);
  // The gated product silu(g) * u of unit inputs has variance ~0.36, and attention averages
  // over context; a gain on down_proj lets the MLP branch (a random function of the current
  // token) carry the residual stream, which keeps greedy decoding from settling on one token.
  constexpr float kMlpGain = 3.0f;
  if (ends_with("norm.weight")) return {1.0f, 0.1f};
  if (ends_with(".bias")) return {0.0f, 0.2f};
  if (name == "model.embed_tokens.weight") {
    // Tied embeddings double as lm_head. With unit rows the current token's own embedding
    // dominates the residual stream and its logit, and greedy decoding repeats one token
    // forever; rows of std 1/sqrt(hidden) keep that self-match to about one logit std.
    return {0.0f,
            c.tie_word_embeddings ? 1.0f / std::sqrt(static_cast<float>(c.hidden_size)) : 1.0f};
  }
  const float fan_in = static_cast<float>(shape.back());
  float std = 1.0f / std::sqrt(fan_in);
  if (ends_with("o_proj.weight")) std *= residual_scale;
  if (ends_with("down_proj.weight")) std *= kMlpGain * residual_scale;
  return {0.0f, std};
}

// SynthModelOptions::late_layer_scale on the residual branches (o_proj, down_proj) of layers
// from late_layers_from on; 1 elsewhere.
float LateLayerScale(const std::string& name, const SynthModelOptions& options) {
  constexpr char kLayers[] = "model.layers.";
  if (options.late_layer_scale == 1.0f || name.rfind(kLayers, 0) != 0) return 1.0f;
  const bool branch_output =
      name.find("o_proj.") != std::string::npos || name.find("down_proj.") != std::string::npos;
  const int layer = std::atoi(name.c_str() + sizeof(kLayers) - 1);
  return branch_output && layer >= options.late_layers_from ? options.late_layer_scale : 1.0f;
}

// Tensors in checkpoint order (embedding, layers by number, final norm, lm_head), which is the
// order a reader streams them in and the order shards are filled.
std::vector<std::pair<std::string, std::vector<int64_t>>> OrderedTensors(const ModelConfig& c) {
  auto expected = text::ExpectedTensors(c);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out(expected.begin(), expected.end());
  auto rank = [](const std::string& name) -> int64_t {
    if (name == "model.embed_tokens.weight") return -1;
    constexpr char kLayers[] = "model.layers.";
    if (name.rfind(kLayers, 0) == 0) return std::atoll(name.c_str() + sizeof(kLayers) - 1);
    return int64_t{1} << 40;  // model.norm, lm_head
  };
  std::stable_sort(out.begin(), out.end(),
                   [&](const auto& a, const auto& b) { return rank(a.first) < rank(b.first); });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Quantised linear layers: the float weights above, rounded as each tool does and packed in its
// exact layout (engine/quantization_config.h).

constexpr int kAwqPackOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// The quantization_config block config.json carries for `options`.
json QuantizationConfigJson(const SynthModelOptions& options) {
  if (options.quant == "int8") {
    const json weights = {{"num_bits", 8},         {"type", "int"},         {"symmetric", true},
                          {"strategy", "channel"}, {"group_size", nullptr}, {"dynamic", false},
                          {"observer", "minmax"},  {"actorder", nullptr}};
    return {{"quant_method", "compressed-tensors"},
            {"format", "int-quantized"},
            {"quantization_status", "compressed"},
            {"config_groups",
             {{"group_0",
               {{"targets", {"Linear"}},
                {"weights", weights},
                {"input_activations", nullptr},
                {"output_activations", nullptr}}}}},
            {"ignore", {"lm_head"}},
            {"kv_cache_scheme", nullptr}};
  }
  if (options.quant == "awq") {
    return {{"quant_method", "awq"}, {"bits", 4},         {"group_size", options.group_size},
            {"zero_point", true},    {"version", "gemm"}, {"modules_to_not_convert", nullptr}};
  }
  return {{"quant_method", "gptq"},
          {"bits", 4},
          {"group_size", options.group_size},
          {"desc_act", options.desc_act},
          {"sym", options.sym},
          {"true_sequential", true},
          {"damp_percent", 0.01},
          {"static_groups", false},
          {"checkpoint_format", "gptq"},
          {"model_name_or_path", nullptr},
          {"model_file_base_name", nullptr}};
}

// The act-order permutation of a GPTQ layer's inputs: position j of the quantisation order is
// input perm[j]. Layers reading the same activations (q/k/v, gate/up) share one, as GPTQ's
// Hessian order does.
std::vector<int32_t> ActOrder(uint64_t seed, const std::string& module, int in) {
  std::string input = module;
  for (const char* shared : {"q_proj", "k_proj", "v_proj"}) {
    if (auto at = input.rfind(shared); at != std::string::npos) input.replace(at, 6, "qkv_in");
  }
  for (const char* shared : {"gate_proj", "up_proj"}) {
    if (auto at = input.rfind(shared); at != std::string::npos)
      input.replace(at, std::strlen(shared), "mlp_in");
  }
  std::vector<int32_t> perm(in);
  for (int i = 0; i < in; ++i) perm[i] = i;
  uint64_t state = TensorKey(seed, input + ".act_order");
  for (int i = in - 1; i > 0; --i) {  // Fisher-Yates on SplitMix64
    state += kGolden;
    const auto j = static_cast<int>(SplitMix64Mix(state) % static_cast<uint64_t>(i + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

template <typename T>
std::vector<unsigned char> Bytes(const std::vector<T>& v) {
  std::vector<unsigned char> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<unsigned char> Encoded(const std::vector<float>& v, DType dtype) {
  std::vector<unsigned char> out(v.size() * DTypeSize(dtype));
  for (size_t i = 0; i < v.size(); ++i)
    StoreFromFloat(out.data(), dtype, static_cast<int64_t>(i), v[i]);
  return out;
}

// The tensors of quantised `module`, W [out, in] row-major, by name.
std::map<std::string, std::vector<unsigned char>> QuantizeLinear(const SynthModelOptions& options,
                                                                 const std::string& module,
                                                                 const std::vector<float>& w,
                                                                 int out, int in) {
  std::map<std::string, std::vector<unsigned char>> tensors;
  const std::string p = module + ".";
  if (options.quant == "int8") {
    // llm-compressor's symmetric per-channel minmax: scale = max |w| / 127, stored in the
    // checkpoint's dtype, and the values rounded against the stored scale.
    std::vector<float> scales(out);
    std::vector<int8_t> q(static_cast<size_t>(out) * in);
    for (int o = 0; o < out; ++o) {
      float max = 0;
      for (int i = 0; i < in; ++i) max = std::max(max, std::abs(w[int64_t{o} * in + i]));
      unsigned char stored[4];
      StoreFromFloat(stored, options.dtype, 0, std::max(max, 1e-8f) / 127.0f);
      scales[o] = LoadAsFloat(stored, options.dtype, 0);
      for (int i = 0; i < in; ++i) {
        const float v = std::round(w[int64_t{o} * in + i] / scales[o]);
        q[int64_t{o} * in + i] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
      }
    }
    tensors[p + "weight"] = Bytes(q);
    tensors[p + "weight_scale"] = Encoded(scales, options.dtype);
    return tensors;
  }
  // 4-bit: per output row and group, scale and zero point from the group's range as AutoAWQ and
  // GPTQ's quantizer compute them; scales stored as fp16 and the values rounded against the
  // stored scale.
  const bool gptq = options.quant == "gptq";
  const int g = options.group_size;
  const int groups = in / g;
  std::vector<int32_t> perm(in);
  for (int i = 0; i < in; ++i) perm[i] = i;
  if (gptq && options.desc_act) perm = ActOrder(options.seed, module, in);
  std::vector<int32_t> g_idx(in);  // group of each input
  for (int j = 0; j < in; ++j) g_idx[perm[j]] = j / g;
  std::vector<int> q(static_cast<size_t>(out) * in);             // [out, in]
  std::vector<float> scales(static_cast<size_t>(groups) * out);  // [groups, out]
  std::vector<int> zeros(static_cast<size_t>(groups) * out);     // [groups, out]
  for (int o = 0; o < out; ++o) {
    for (int gi = 0; gi < groups; ++gi) {
      float lo = 0, hi = 0;  // the range always includes 0, as both quantizers make it
      for (int j = gi * g; j < (gi + 1) * g; ++j) {
        const float v = w[int64_t{o} * in + perm[j]];
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      float scale;
      int zero;
      if (gptq && options.sym) {
        const float m = std::max(std::abs(lo), hi);
        scale = std::max(2 * m / 15.0f, 1e-8f);
        zero = 8;
      } else {
        scale = std::max((hi - lo) / 15.0f, 1e-8f);
        zero = static_cast<int>(std::clamp(std::round(-lo / scale), 0.0f, 15.0f));
        // GPTQ stores zero - 1 in four bits, so its zero points are 1..15 (AutoGPTQ's pack would
        // overflow a 0 into the neighbouring nibbles).
        if (gptq) zero = std::max(zero, 1);
      }
      scale = F16ToFloat(FloatToF16(scale));
      scales[int64_t{gi} * out + o] = scale;
      zeros[int64_t{gi} * out + o] = zero;
      for (int j = gi * g; j < (gi + 1) * g; ++j) {
        const int64_t at = int64_t{o} * in + perm[j];
        q[at] = static_cast<int>(std::clamp(std::round(w[at] / scale) + zero, 0.0f, 15.0f));
      }
    }
  }
  const int words = out / 8;
  std::vector<int32_t> qzeros(static_cast<size_t>(groups) * words, 0);
  for (int gi = 0; gi < groups; ++gi) {
    for (int c = 0; c < words; ++c) {
      uint32_t word = 0;
      for (int n = 0; n < 8; ++n) {
        const int o = 8 * c + (gptq ? n : kAwqPackOrder[n]);
        const int stored = gptq ? zeros[int64_t{gi} * out + o] - 1 : zeros[int64_t{gi} * out + o];
        word |= static_cast<uint32_t>(stored & 15) << (4 * n);
      }
      qzeros[int64_t{gi} * words + c] = static_cast<int32_t>(word);
    }
  }
  std::vector<int32_t> qweight;
  if (gptq) {
    // [in / 8, out]: eight consecutive inputs per word, in order.
    qweight.assign(static_cast<size_t>(in / 8) * out, 0);
    for (int r = 0; r < in / 8; ++r) {
      for (int o = 0; o < out; ++o) {
        uint32_t word = 0;
        for (int n = 0; n < 8; ++n) {
          word |= static_cast<uint32_t>(q[int64_t{o} * in + 8 * r + n]) << (4 * n);
        }
        qweight[int64_t{r} * out + o] = static_cast<int32_t>(word);
      }
    }
  } else {
    // [in, out / 8]: eight output columns per word, in AWQ's interleaved order.
    qweight.assign(static_cast<size_t>(in) * words, 0);
    for (int i = 0; i < in; ++i) {
      for (int c = 0; c < words; ++c) {
        uint32_t word = 0;
        for (int n = 0; n < 8; ++n) {
          word |= static_cast<uint32_t>(q[int64_t{8 * c + kAwqPackOrder[n]} * in + i]) << (4 * n);
        }
        qweight[int64_t{i} * words + c] = static_cast<int32_t>(word);
      }
    }
  }
  tensors[p + "qweight"] = Bytes(qweight);
  tensors[p + "qzeros"] = Bytes(qzeros);
  tensors[p + "scales"] = Encoded(scales, DType::kF16);
  if (gptq) tensors[p + "g_idx"] = Bytes(g_idx);
  return tensors;
}

// ---------------------------------------------------------------------------------------------
// Files.

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.close();
    if (!out) {
      std::remove(temp.c_str());
      return absl::InternalError(absl::StrCat(path, ": write failed"));
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(temp.c_str());
    return absl::InternalError(
        absl::StrCat(path, ": cannot rename into place: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

absl::StatusOr<json> ParseJson(const std::string& text, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": bad JSON: ", e.what()));
  }
}

// Removes earlier weights so a shard layout from a previous run cannot mix with this one, and
// temporary files a killed run left behind.
void RemoveOldWeights(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    bool shard = name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
                 name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
    bool interrupted = name.find(".tmp.") != std::string::npos;  // left by a killed run
    if (shard || interrupted || name == "model.safetensors" ||
        name == "model.safetensors.index.json") {
      fs::remove(entry.path(), ec);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer.

struct TokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  int vocab_size = 0;
  int bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
};

std::string SyntheticTokenizerConfig(int max_position) {
  json j;
  j["bos_token"] = kBeginOfText;
  j["eos_token"] = kEndOfTurn;
  j["chat_template"] = kLlama3ChatTemplate;
  j["clean_up_tokenization_spaces"] = false;
  j["model_max_length"] = max_position;
  j["tokenizer_class"] = "PreTrainedTokenizerFast";
  return j.dump(2) + "\n";
}

// The token named by a tokenizer_config.json entry: "<s>" or {"content": "<s>", ...}.
std::string SpecialTokenName(const json& config, const char* key) {
  if (!config.contains(key)) return "";
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return "";
}

// Fills vocab size and bos/eos ids from the tokenizer.json and tokenizer_config.json texts.
absl::Status ResolveTokenIds(const std::string& source, TokenizerFiles& t) {
  TANDEM_ASSIGN_OR_RETURN(json tok, ParseJson(t.tokenizer_json, source));
  std::map<std::string, int> ids;
  int max_id = -1;
  auto add = [&](const std::string& token, const json& id) {
    if (!id.is_number_integer()) return;
    int v = id.get<int>();
    ids[token] = v;
    max_id = std::max(max_id, v);
  };
  if (tok.contains("model") && tok["model"].contains("vocab") &&
      tok["model"]["vocab"].is_object()) {
    for (const auto& [token, id] : tok["model"]["vocab"].items()) add(token, id);
  }
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array()) {
    for (const json& added : tok["added_tokens"]) {
      if (added.contains("content") && added["content"].is_string() && added.contains("id")) {
        add(added["content"].get<std::string>(), added["id"]);
      }
    }
  }
  if (max_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no model.vocab or added_tokens; not a Hugging Face tokenizer"));
  }
  t.vocab_size = max_id + 1;

  json config = json::object();
  if (!t.tokenizer_config_json.empty()) {
    TANDEM_ASSIGN_OR_RETURN(config, ParseJson(t.tokenizer_config_json, "tokenizer_config.json"));
  }
  auto id_of = [&](const std::string& token) {
    auto it = ids.find(token);
    return it == ids.end() ? -1 : it->second;
  };
  t.bos_token_id = id_of(SpecialTokenName(config, "bos_token"));
  if (t.bos_token_id < 0) t.bos_token_id = id_of(kBeginOfText);
  // End of text and end of turn both stop generation, as in Llama 3 and Qwen releases.
  for (const std::string& name :
       {std::string(kEndOfText), std::string(kEndOfTurn), SpecialTokenName(config, "eos_token"),
        std::string("<|endoftext|>"), std::string("<|im_end|>")}) {
    int id = id_of(name);
    if (id >= 0 &&
        std::find(t.eos_token_ids.begin(), t.eos_token_ids.end(), id) == t.eos_token_ids.end()) {
      t.eos_token_ids.push_back(id);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenizerFiles> PrepareTokenizer(const SynthModelOptions& options,
                                                const Preset& preset) {
  TokenizerFiles t;
  std::string source;
  if (!options.tokenizer_json_path.empty()) {
    source = options.tokenizer_json_path;
    TANDEM_ASSIGN_OR_RETURN(t.tokenizer_json, ReadFile(source));
    fs::path config_path = fs::path(source).parent_path() / "tokenizer_config.json";
    if (fs::exists(config_path)) {
      TANDEM_ASSIGN_OR_RETURN(t.tokenizer_config_json, ReadFile(config_path.string()));
    } else {
      t.tokenizer_config_json = SyntheticTokenizerConfig(preset.max_position);
    }
  } else {
    source = "trained tokenizer";
    const std::vector<std::string> specials = {kBeginOfText, kEndOfText, "<|start_header_id|>",
                                               "<|end_header_id|>", kEndOfTurn};
    TANDEM_ASSIGN_OR_RETURN(t.tokenizer_json,
                            TrainByteLevelBpe(BuiltinTrainingText(), preset.bpe_vocab, specials));
    t.tokenizer_config_json = SyntheticTokenizerConfig(preset.max_position);
  }
  TANDEM_RETURN_IF_ERROR(ResolveTokenIds(source, t));
  return t;
}

const Preset* FindPreset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

absl::Status UnknownPreset(const std::string& name) {
  return absl::InvalidArgumentError(
      absl::StrCat("unknown preset '", name, "' (choose tiny, small, medium or llama3-8b)"));
}

}  // namespace

absl::StatusOr<ModelConfig> SyntheticConfig(const std::string& preset_name, const std::string& arch,
                                            int vocab_size) {
  const Preset* preset = FindPreset(preset_name);
  if (preset == nullptr) return UnknownPreset(preset_name);
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be positive, got ", vocab_size));
  }
  ModelConfig c;
  c.vocab_size = std::max(vocab_size, preset->min_vocab);
  c.hidden_size = preset->hidden;
  c.intermediate_size = preset->intermediate;
  c.num_layers = preset->layers;
  c.num_heads = preset->heads;
  c.num_kv_heads = preset->kv_heads;
  c.head_dim = preset->hidden / preset->heads;
  c.max_position_embeddings = preset->max_position;
  const bool full_size = preset->min_vocab > 0;
  if (arch == "llama") {
    c.architecture = Architecture::kLlama;
    c.architecture_name = "LlamaForCausalLM";
    c.model_type = "llama";
    c.rms_norm_eps = 1e-5f;
    c.rope.theta = 500000.0f;
    // Llama 3.1 scaling; the small presets shrink original_max_position so that all three
    // bands (kept, smoothed, divided by factor) occur at their head_dim.
    c.rope.llama3_scaling = true;
    c.rope.factor = 8.0f;
    c.rope.low_freq_factor = 1.0f;
    c.rope.high_freq_factor = 4.0f;
    c.rope.original_max_position = full_size ? 8192 : preset->max_position / 8;
  } else if (arch == "mistral") {
    c.architecture = Architecture::kMistral;
    c.architecture_name = "MistralForCausalLM";
    c.model_type = "mistral";
    c.rms_norm_eps = 1e-5f;
    c.rope.theta = 1000000.0f;
  } else if (arch == "qwen2") {
    c.architecture = Architecture::kQwen2;
    c.architecture_name = "Qwen2ForCausalLM";
    c.model_type = "qwen2";
    c.rms_norm_eps = 1e-6f;
    c.rope.theta = 1000000.0f;
    c.attention_bias = true;
    c.tie_word_embeddings = !full_size;  // as in Qwen2.5-0.5B/1.5B
  } else if (arch == "qwen3") {
    c.architecture = Architecture::kQwen3;
    c.architecture_name = "Qwen3ForCausalLM";
    c.model_type = "qwen3";
    c.rms_norm_eps = 1e-6f;
    c.rope.theta = 1000000.0f;
    c.qk_norm = true;
    // Qwen3 decouples head_dim from hidden_size / heads (0.6B: 1024 hidden, 16 heads x 128);
    // tiny does the same so the engine is tested on q_dim != hidden_size.
    if (preset_name == "tiny") c.head_dim = 32;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown arch '", arch, "' (choose llama, mistral, qwen2 or qwen3)"));
  }
  c.rope.head_dim = c.head_dim;
  return c;
}

absl::Status WriteSyntheticModel(const SynthModelOptions& options) {
  const Preset* preset = FindPreset(options.preset);
  if (preset == nullptr) return UnknownPreset(options.preset);
  if (options.out_dir.empty()) return absl::InvalidArgumentError("no output directory given");
  if (!options.quant.empty() && options.quant != "int8" && options.quant != "awq" &&
      options.quant != "gptq") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --quant '", options.quant, "' (choose int8, awq or gptq)"));
  }
  if (options.desc_act && options.quant != "gptq") {
    return absl::InvalidArgumentError("--desc-act is a gptq option");
  }
  if ((options.quant == "awq" || options.quant == "gptq") && options.group_size <= 0) {
    return absl::InvalidArgumentError("--group-size must be positive");
  }
  // Validates arch before spending time on the tokenizer.
  TANDEM_RETURN_IF_ERROR(SyntheticConfig(options.preset, options.arch, 1).status());
  TANDEM_ASSIGN_OR_RETURN(TokenizerFiles tokenizer, PrepareTokenizer(options, *preset));
  TANDEM_ASSIGN_OR_RETURN(ModelConfig config,
                          SyntheticConfig(options.preset, options.arch, tokenizer.vocab_size));
  if (options.vocab_size > 0) config.vocab_size = options.vocab_size;
  if (options.num_layers < 0 || options.num_layers > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in [0, 4096], got ", options.num_layers));
  }
  if (options.num_layers > 0) config.num_layers = options.num_layers;
  config.torch_dtype = options.dtype;
  config.bos_token_id = tokenizer.bos_token_id;
  config.eos_token_ids = tokenizer.eos_token_ids;

  const std::string& dir = options.out_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  // config.json marks a complete checkpoint: drop it first, write it last.
  fs::remove(fs::path(dir) / "config.json", ec);
  RemoveOldWeights(dir);

  TANDEM_RETURN_IF_ERROR(WriteFileAtomically(dir + "/tokenizer.json", tokenizer.tokenizer_json));
  TANDEM_RETURN_IF_ERROR(
      WriteFileAtomically(dir + "/tokenizer_config.json", tokenizer.tokenizer_config_json));

  // What each tensor of the file is: a float tensor of options.dtype drawn element by element,
  // or one tensor of a quantised linear layer, produced with the layer's others.
  engine::QuantizationConfig quantization;
  json quantization_json;
  if (!options.quant.empty()) {
    quantization_json = QuantizationConfigJson(options);
    TANDEM_ASSIGN_OR_RETURN(quantization,
                            engine::ParseQuantizationConfig(
                                json{{"quantization_config", quantization_json}}, "synth-model"));
  }
  struct Item {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::string module;  // quantised layer it belongs to, or empty
    int64_t out = 0, in = 0;
    std::string weight_name;  // the layer's float weight, whose values it quantises
  };
  std::vector<Item> items;
  for (const auto& [name, shape] : OrderedTensors(config)) {
    const std::string module = name.size() > 7 ? name.substr(0, name.size() - 7) : name;
    if (shape.size() == 2 && name.ends_with(".weight") &&
        engine::IsQuantizedLinear(quantization, module)) {
      TANDEM_ASSIGN_OR_RETURN(auto specs,
                              engine::QuantizedTensors(quantization, module, shape[0], shape[1]));
      for (const engine::QuantizedTensorSpec& spec : specs) {
        const DType dtype = spec.dtypes.size() == 1   ? spec.dtypes[0]
                            : options.quant == "int8" ? options.dtype
                                                      : DType::kF16;
        items.push_back({spec.name, dtype, spec.shape, module, shape[0], shape[1], name});
      }
      continue;
    }
    items.push_back({name, options.dtype, shape, "", 0, 0, name});
  }

  // Plan shards: tensors in order, a new shard whenever the next tensor would overflow.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    uint64_t n = DTypeSize(items[i].dtype);
    for (int64_t d : items[i].shape) n *= static_cast<uint64_t>(d);
    // A quantised layer's tensors stay in one shard.
    const bool continues_layer =
        i > 0 && !items[i].module.empty() && items[i].module == items[i - 1].module;
    if (options.max_shard_bytes > 0 && !shards.back().empty() && !continues_layer &&
        shard_bytes + n > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
    total_bytes += n;
  }

  // The tensors of the quantised layer being written (one layer at a time).
  struct LayerCache {
    std::string module;
    std::map<std::string, std::vector<unsigned char>> tensors;
  };
  auto cache = std::make_shared<LayerCache>();
  json weight_map = json::object();
  // Weights are scaled for the preset's depth, so that fewer layers (num_layers) are exactly
  // the full model's first ones.
  ModelConfig init_config = config;
  init_config.num_layers = preset->layers;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string file =
        options.max_shard_bytes == 0
            ? "model.safetensors"
            : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    engine::SafetensorsWriter writer;
    for (size_t i : shards[s]) {
      const Item& item = items[i];
      const std::vector<int64_t> weight_shape =
          item.module.empty() ? item.shape : std::vector<int64_t>{item.out, item.in};
      Init init = InitFor(item.weight_name, weight_shape, init_config);
      init.std *= LateLayerScale(item.weight_name, options);
      const uint64_t key = TensorKey(options.seed, item.weight_name);
      auto generate = [init, key](int64_t first, int64_t count, float* out) {
        for (int64_t j = 0; j < count; ++j) {
          uint64_t state = key + kGolden * static_cast<uint64_t>(first + j + 1);
          out[j] = init.mean + init.std * NormalLike(SplitMix64Mix(state));
        }
      };
      if (item.module.empty()) {
        writer.AddGenerated(item.name, item.dtype, item.shape, generate);
      } else {
        writer.AddGeneratedBytes(
            item.name, item.dtype, item.shape, [cache, item, generate, &options]() {
              if (cache->module != item.module) {
                std::vector<float> w(static_cast<size_t>(item.out * item.in));
                generate(0, static_cast<int64_t>(w.size()), w.data());
                cache->tensors = QuantizeLinear(options, item.module, w, static_cast<int>(item.out),
                                                static_cast<int>(item.in));
                cache->module = item.module;
              }
              return std::move(cache->tensors[item.name]);
            });
      }
      weight_map[item.name] = file;
    }
    TANDEM_RETURN_IF_ERROR(writer.Write(dir + "/" + file));
  }
  if (options.max_shard_bytes > 0) {
    json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    TANDEM_RETURN_IF_ERROR(
        WriteFileAtomically(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  }

  json generation = json::object();
  generation["bos_token_id"] = config.bos_token_id >= 0 ? json(config.bos_token_id) : json();
  generation["eos_token_id"] = config.eos_token_ids;
  TANDEM_RETURN_IF_ERROR(
      WriteFileAtomically(dir + "/generation_config.json", generation.dump(2) + "\n"));
  if (options.quant.empty()) {
    TANDEM_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config.ToJson()));
  } else {
    json config_json = json::parse(config.ToJson());
    config_json["quantization_config"] = quantization_json;
    TANDEM_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config_json.dump(2) + "\n"));
  }

  // Proves the directory loads with the engine's own validation.
  TANDEM_RETURN_IF_ERROR(engine::Checkpoint::Open(dir).status());
  return absl::OkStatus();
}

}  // namespace tandem::tools
