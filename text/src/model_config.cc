#include "tandem/text/model_config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"

namespace tandem::text {
namespace {

using nlohmann::json;

struct ArchitectureInfo {
  const char* name;
  Architecture architecture;
};

constexpr ArchitectureInfo kArchitectures[] = {
    {"LlamaForCausalLM", Architecture::kLlama},
    {"MistralForCausalLM", Architecture::kMistral},
    {"Qwen2ForCausalLM", Architecture::kQwen2},
    {"Qwen3ForCausalLM", Architecture::kQwen3},
};

// Reads config.json fields and turns every type or range problem into an error that names the
// file and the field, so a user can fix the checkpoint rather than guess.
class FieldReader {
 public:
  FieldReader(const json& root, std::string source) : root_(root), source_(std::move(source)) {}

  absl::Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", message));
  }

  bool Present(const char* key) const { return root_.contains(key) && !root_[key].is_null(); }

  // A positive int; `fallback` (when >0) is used if the key is absent.
  absl::StatusOr<int> PositiveInt(const char* key, int fallback = 0) const {
    if (!Present(key)) {
      if (fallback > 0) return fallback;
      return Error(absl::StrCat("missing required field \"", key, "\""));
    }
    const json& v = root_[key];
    if (!v.is_number_integer()) return Error(absl::StrCat("\"", key, "\" must be an integer"));
    int64_t x = v.get<int64_t>();
    if (x <= 0 || x > std::numeric_limits<int>::max()) {
      return Error(absl::StrCat("\"", key, "\" must be a positive integer, got ", x));
    }
    return static_cast<int>(x);
  }

  absl::StatusOr<double> Number(const json& object, const char* key, double fallback,
                                bool required = false) const {
    if (!object.contains(key) || object[key].is_null()) {
      if (required) return Error(absl::StrCat("missing required field \"", key, "\""));
      return fallback;
    }
    if (!object[key].is_number()) return Error(absl::StrCat("\"", key, "\" must be a number"));
    double x = object[key].get<double>();
    if (!std::isfinite(x)) return Error(absl::StrCat("\"", key, "\" must be finite"));
    return x;
  }

  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    if (!Present(key)) return fallback;
    if (!root_[key].is_boolean()) return Error(absl::StrCat("\"", key, "\" must be true or false"));
    return root_[key].get<bool>();
  }

  // A token id (int) or -1 when absent or null.
  absl::StatusOr<int> TokenId(const json& v, const char* key) const {
    if (v.is_null()) return -1;
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Error(absl::StrCat("\"", key, "\" must be a non-negative integer token id"));
    }
    return static_cast<int>(v.get<int64_t>());
  }

  const json& root() const { return root_; }

 private:
  const json& root_;
  std::string source_;
};

absl::StatusOr<DType> ParseTorchDtype(const FieldReader& reader) {
  // Newer transformers write "dtype"; older ones "torch_dtype".
  const char* key = reader.Present("torch_dtype") ? "torch_dtype" : "dtype";
  if (!reader.Present(key)) return DType::kBF16;
  const json& v = reader.root()[key];
  if (!v.is_string()) return reader.Error(absl::StrCat("\"", key, "\" must be a string"));
  std::string name = v.get<std::string>();
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  if (name == "float32") return DType::kF32;
  return reader.Error(absl::StrCat("unsupported ", key, " \"", name, "\""));
}

// rope_scaling: null, {"rope_type": "default"} or the Llama 3.1 frequency-dependent scaling.
absl::Status ParseRopeScaling(const FieldReader& reader, RopeConfig& rope) {
  if (!reader.Present("rope_scaling")) return absl::OkStatus();
  const json& s = reader.root()["rope_scaling"];
  if (!s.is_object()) return reader.Error("\"rope_scaling\" must be an object or null");
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (s.contains(key) && s[key].is_string()) {
      type = s[key].get<std::string>();
      break;
    }
  }
  if (type == "default") return absl::OkStatus();
  if (type != "llama3") {
    return reader.Error(
        absl::StrCat("unsupported rope_scaling type ", type.empty() ? "(none given)" : type));
  }
  TANDEM_ASSIGN_OR_RETURN(double factor, reader.Number(s, "factor", 0, /*required=*/true));
  TANDEM_ASSIGN_OR_RETURN(double low, reader.Number(s, "low_freq_factor", 0, true));
  TANDEM_ASSIGN_OR_RETURN(double high, reader.Number(s, "high_freq_factor", 0, true));
  TANDEM_ASSIGN_OR_RETURN(double original,
                          reader.Number(s, "original_max_position_embeddings", 0, true));
  // high > low keeps the smoothing interpolation's denominator non-zero.
  if (factor <= 0 || low <= 0 || high <= low || original < 1) {
    return reader.Error(
        "rope_scaling llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
        "original_max_position_embeddings >= 1");
  }
  rope.llama3_scaling = true;
  rope.factor = static_cast<float>(factor);
  rope.low_freq_factor = static_cast<float>(low);
  rope.high_freq_factor = static_cast<float>(high);
  rope.original_max_position = static_cast<int>(original);
  return absl::OkStatus();
}

// The shortest decimal that reads back as the same float, so 1e-5f is written as 1e-05 and not
// as 9.999999747378752e-06.
double ShortestDecimal(float x) {
  char buf[32];
  auto result = std::to_chars(buf, buf + sizeof(buf), x);
  return std::strtod(std::string(buf, result.ptr).c_str(), nullptr);
}

const char* TorchDtypeName(DType dtype) { return DTypeFlagName(dtype); }

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromJson(std::string_view text,
                                                  std::string_view source_view) {
  // The packaged Abseil's StrCat takes absl::string_view, which is not std::string_view here.
  const std::string source(source_view);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": bad JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  }
  FieldReader reader(root, source);

  ModelConfig c;
  if (!root.contains("architectures") || !root["architectures"].is_array() ||
      root["architectures"].empty() || !root["architectures"][0].is_string()) {
    return reader.Error("missing \"architectures\" (e.g. [\"LlamaForCausalLM\"])");
  }
  c.architecture_name = root["architectures"][0].get<std::string>();
  bool known = false;
  for (const ArchitectureInfo& info : kArchitectures) {
    if (c.architecture_name == info.name) {
      c.architecture = info.architecture;
      known = true;
    }
  }
  if (!known) {
    return reader.Error(
        absl::StrCat("unsupported architecture ", c.architecture_name,
                     " (Tandem serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                     "Qwen3ForCausalLM)"));
  }
  if (root.contains("model_type") && root["model_type"].is_string()) {
    c.model_type = root["model_type"].get<std::string>();
  }

  TANDEM_ASSIGN_OR_RETURN(c.vocab_size, reader.PositiveInt("vocab_size"));
  TANDEM_ASSIGN_OR_RETURN(c.hidden_size, reader.PositiveInt("hidden_size"));
  TANDEM_ASSIGN_OR_RETURN(c.intermediate_size, reader.PositiveInt("intermediate_size"));
  TANDEM_ASSIGN_OR_RETURN(c.num_layers, reader.PositiveInt("num_hidden_layers"));
  TANDEM_ASSIGN_OR_RETURN(c.num_heads, reader.PositiveInt("num_attention_heads"));
  // Multi-head attention checkpoints omit num_key_value_heads.
  TANDEM_ASSIGN_OR_RETURN(c.num_kv_heads, reader.PositiveInt("num_key_value_heads", c.num_heads));
  TANDEM_ASSIGN_OR_RETURN(c.max_position_embeddings, reader.PositiveInt("max_position_embeddings"));
  if (c.num_heads % c.num_kv_heads != 0) {
    return reader.Error(absl::StrCat("num_attention_heads (", c.num_heads,
                                     ") must be a multiple of num_key_value_heads (",
                                     c.num_kv_heads, ")"));
  }
  // Qwen3 sets head_dim explicitly and it need not equal hidden_size / num_attention_heads.
  if (reader.Present("head_dim")) {
    TANDEM_ASSIGN_OR_RETURN(c.head_dim, reader.PositiveInt("head_dim"));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return reader.Error(absl::StrCat("hidden_size (", c.hidden_size,
                                       ") must be divisible by num_attention_heads (", c.num_heads,
                                       ") when head_dim is not given"));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) {
    return reader.Error(
        absl::StrCat("head_dim must be even for rotary embeddings, got ", c.head_dim));
  }

  // transformers' default for Llama, Mistral and Qwen is 1e-6.
  TANDEM_ASSIGN_OR_RETURN(double eps, reader.Number(root, "rms_norm_eps", 1e-6));
  if (eps <= 0) return reader.Error("\"rms_norm_eps\" must be positive");
  c.rms_norm_eps = static_cast<float>(eps);

  TANDEM_ASSIGN_OR_RETURN(double theta, reader.Number(root, "rope_theta", 10000.0));
  if (theta <= 1) return reader.Error("\"rope_theta\" must be greater than 1");
  c.rope.theta = static_cast<float>(theta);
  c.rope.head_dim = c.head_dim;
  TANDEM_RETURN_IF_ERROR(ParseRopeScaling(reader, c.rope));

  TANDEM_ASSIGN_OR_RETURN(c.tie_word_embeddings, reader.Bool("tie_word_embeddings", false));
  // As in transformers: Qwen2 always biases q/k/v and its config.json has no flag for it;
  // Llama and Qwen3 bias q/k/v and o when "attention_bias" is true; Mistral never has biases
  // and ignores the key.
  if (c.architecture == Architecture::kQwen2) {
    c.attention_bias = true;
  } else if (c.architecture != Architecture::kMistral) {
    TANDEM_ASSIGN_OR_RETURN(c.attention_bias, reader.Bool("attention_bias", false));
    c.o_proj_bias = c.attention_bias;
  }
  c.qk_norm = c.architecture == Architecture::kQwen3;
  TANDEM_ASSIGN_OR_RETURN(c.torch_dtype, ParseTorchDtype(reader));

  // sliding_window (Mistral, Qwen) is deliberately not read: Tandem attends over the full
  // context, which matches those models up to their window length (4096+ tokens).
  if (root.contains("bos_token_id")) {
    TANDEM_ASSIGN_OR_RETURN(c.bos_token_id, reader.TokenId(root["bos_token_id"], "bos_token_id"));
  }
  if (root.contains("eos_token_id")) {
    const json& eos = root["eos_token_id"];
    if (eos.is_array()) {
      for (const json& id : eos) {
        TANDEM_ASSIGN_OR_RETURN(int v, reader.TokenId(id, "eos_token_id"));
        if (v >= 0) c.eos_token_ids.push_back(v);
      }
    } else {
      TANDEM_ASSIGN_OR_RETURN(int v, reader.TokenId(eos, "eos_token_id"));
      if (v >= 0) c.eos_token_ids.push_back(v);
    }
  }
  return c;
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return FromJson(buffer.str(), path);
}

std::map<std::string, std::vector<int64_t>> ExpectedTensors(const ModelConfig& c) {
  const int64_t hidden = c.hidden_size;
  const int64_t q_dim = int64_t{c.num_heads} * c.head_dim;
  const int64_t kv_dim = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::map<std::string, std::vector<int64_t>> t;
  t["model.embed_tokens.weight"] = {c.vocab_size, hidden};
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    t[p + "input_layernorm.weight"] = {hidden};
    t[p + "self_attn.q_proj.weight"] = {q_dim, hidden};
    t[p + "self_attn.k_proj.weight"] = {kv_dim, hidden};
    t[p + "self_attn.v_proj.weight"] = {kv_dim, hidden};
    t[p + "self_attn.o_proj.weight"] = {hidden, q_dim};
    if (c.o_proj_bias) t[p + "self_attn.o_proj.bias"] = {hidden};
    if (c.attention_bias) {
      t[p + "self_attn.q_proj.bias"] = {q_dim};
      t[p + "self_attn.k_proj.bias"] = {kv_dim};
      t[p + "self_attn.v_proj.bias"] = {kv_dim};
    }
    if (c.qk_norm) {
      t[p + "self_attn.q_norm.weight"] = {c.head_dim};
      t[p + "self_attn.k_norm.weight"] = {c.head_dim};
    }
    t[p + "post_attention_layernorm.weight"] = {hidden};
    t[p + "mlp.gate_proj.weight"] = {inter, hidden};
    t[p + "mlp.up_proj.weight"] = {inter, hidden};
    t[p + "mlp.down_proj.weight"] = {hidden, inter};
  }
  t["model.norm.weight"] = {hidden};
  if (!c.tie_word_embeddings) t["lm_head.weight"] = {c.vocab_size, hidden};
  return t;
}

int64_t ModelConfig::NumParameters() const {
  // Counted from the tensor list so the two can never disagree.
  int64_t total = 0;
  for (const auto& [name, shape] : ExpectedTensors(*this)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  return total;
}

std::string ModelConfig::ToJson() const {
  json j;
  j["architectures"] = json::array({architecture_name});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = ShortestDecimal(rms_norm_eps);
  j["rope_theta"] = ShortestDecimal(rope.theta);
  if (rope.llama3_scaling) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", ShortestDecimal(rope.factor)},
        {"low_freq_factor", ShortestDecimal(rope.low_freq_factor)},
        {"high_freq_factor", ShortestDecimal(rope.high_freq_factor)},
        {"original_max_position_embeddings", rope.original_max_position},
    };
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = tie_word_embeddings;
  // Qwen2's and Mistral's configs have no such flag: their biases follow from the architecture.
  if (architecture == Architecture::kLlama || architecture == Architecture::kQwen3) {
    j["attention_bias"] = attention_bias;
  }
  j["torch_dtype"] = TorchDtypeName(torch_dtype);
  if (bos_token_id >= 0) {
    j["bos_token_id"] = bos_token_id;
  } else {
    j["bos_token_id"] = nullptr;
  }
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  return j.dump(2) + "\n";
}

}  // namespace tandem::text
