#include "tandem/engine/quantization_config.h"

#include <algorithm>
#include <cctype>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string QuantizationConfig::Describe() const {
  switch (method) {
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kCompressedInt8:
      return "compressed-tensors int8 (W8A16, per output channel)";
    case QuantMethod::kAwq:
      return absl::StrCat("awq 4-bit, group ", group_size);
    case QuantMethod::kGptq:
      return absl::StrCat("gptq 4-bit, ",
                          group_size > 0 ? absl::StrCat("group ", group_size) : "one group per row",
                          desc_act ? ", act order" : "", sym ? "" : ", asymmetric");
  }
  return "?";
}

absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const json& config,
                                                           std::string_view source) {
  QuantizationConfig out;
  if (!config.is_object() || !config.contains("quantization_config") ||
      config["quantization_config"].is_null()) {
    return out;
  }
  const json& q = config["quantization_config"];
  auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ": quantization_config: ", what));
  };
  if (!q.is_object()) return error("is not an object");
  if (!q.contains("quant_method") || !q["quant_method"].is_string()) {
    return error("no quant_method");
  }
  const std::string method = Lower(q["quant_method"].get<std::string>());
  // An integer field, from the first of `names` present.
  auto get_int = [&](const json& object, std::initializer_list<const char*> names,
                     int fallback) -> absl::StatusOr<int> {
    for (const char* name : names) {
      if (!object.contains(name) || object[name].is_null()) continue;
      if (!object[name].is_number_integer()) return error(absl::StrCat(name, " is not an integer"));
      return object[name].get<int>();
    }
    return fallback;
  };
  auto get_bool = [&](const json& object, const char* name, bool fallback) -> absl::StatusOr<bool> {
    if (!object.contains(name) || object[name].is_null()) return fallback;
    if (!object[name].is_boolean()) return error(absl::StrCat(name, " is not true or false"));
    return object[name].get<bool>();
  };
  auto read_ignore = [&](const char* name) -> absl::Status {
    if (!q.contains(name) || q[name].is_null()) return absl::OkStatus();
    if (!q[name].is_array()) return error(absl::StrCat(name, " is not a list"));
    for (const json& entry : q[name]) {
      if (!entry.is_string()) return error(absl::StrCat(name, " holds a non-string"));
      out.ignore.push_back(entry.get<std::string>());
    }
    return absl::OkStatus();
  };

  if (method == "compressed-tensors") {
    out.method = QuantMethod::kCompressedInt8;
    const std::string format = q.value("format", std::string());
    if (format != "int-quantized" && format != "naive-quantized") {
      return error(absl::StrCat("compressed-tensors format '", format,
                                "' is not supported (Tandem reads int8 weights stored "
                                "int-quantized or naive-quantized)"));
    }
    if (!q.contains("config_groups") || !q["config_groups"].is_object() ||
        q["config_groups"].size() != 1) {
      return error("compressed-tensors needs exactly one entry in config_groups");
    }
    const json& group = q["config_groups"].begin().value();
    if (group.contains("input_activations") && !group["input_activations"].is_null()) {
      return error("input_activations are quantised (W8A8); Tandem runs weight-only int8 (W8A16)");
    }
    if (!group.contains("weights") || !group["weights"].is_object()) {
      return error("config group without a weights scheme");
    }
    const json& w = group["weights"];
    auto bits = get_int(w, {"num_bits"}, 0);
    if (!bits.ok()) return bits.status();
    if (*bits != 8)
      return error(absl::StrCat("num_bits ", *bits, ": compressed-tensors weights must be 8-bit"));
    if (w.value("type", std::string("int")) != "int") {
      return error(absl::StrCat("weights type '", w.value("type", std::string()), "' is not int"));
    }
    auto sym = get_bool(w, "symmetric", true);
    if (!sym.ok()) return sym.status();
    if (!*sym) return error("asymmetric int8 weights are not supported (symmetric: true)");
    if (w.value("strategy", std::string()) != "channel") {
      return error(absl::StrCat("weights strategy '", w.value("strategy", std::string()),
                                "' is not supported (channel)"));
    }
    out.bits = 8;
    TANDEM_RETURN_IF_ERROR(read_ignore("ignore"));
    return out;
  }

  if (method == "awq" || method == "gptq") {
    auto bits = get_int(q, {"bits", "w_bit"}, 0);
    if (!bits.ok()) return bits.status();
    if (*bits != 4) {
      return error(absl::StrCat("bits ", *bits, ": Tandem reads 4-bit ", method, " checkpoints"));
    }
    out.bits = 4;
    auto group = get_int(q, {"group_size", "q_group_size"}, 0);
    if (!group.ok()) return group.status();
    TANDEM_RETURN_IF_ERROR(read_ignore("modules_to_not_convert"));
    if (method == "awq") {
      out.method = QuantMethod::kAwq;
      if (*group <= 0) return error(absl::StrCat("group_size ", *group, " (awq needs groups)"));
      out.group_size = *group;
      const std::string version = Lower(q.value("version", std::string("gemm")));
      if (version != "gemm") {
        return error(absl::StrCat("awq version '", version,
                                  "' is not supported (Tandem reads the gemm packing)"));
      }
      auto zero_point = get_bool(q, "zero_point", true);
      if (!zero_point.ok()) return zero_point.status();
      if (!*zero_point) return error("awq with zero_point false is not supported");
      return out;
    }
    out.method = QuantMethod::kGptq;
    if (*group == 0 || *group < -1) {
      return error(absl::StrCat("group_size ", *group, " (gptq needs a positive size or -1)"));
    }
    out.group_size = *group == -1 ? 0 : *group;
    auto desc_act = get_bool(q, "desc_act", false);
    if (!desc_act.ok()) return desc_act.status();
    out.desc_act = *desc_act;
    auto sym = get_bool(q, "sym", true);
    if (!sym.ok()) return sym.status();
    out.sym = *sym;
    const std::string format = q.value("checkpoint_format", std::string("gptq"));
    if (format != "gptq") {
      return error(absl::StrCat("gptq checkpoint_format '", format,
                                "' is not supported (Tandem reads 'gptq': zero points stored "
                                "minus one)"));
    }
    return out;
  }
  return error(absl::StrCat("quant_method '", method,
                            "' is not supported (Tandem reads compressed-tensors int8, awq and "
                            "gptq)"));
}

bool IsQuantizedLinear(const QuantizationConfig& config, const std::string& module) {
  if (config.method == QuantMethod::kNone) return false;
  if (module == "lm_head" || module.find("embed_tokens") != std::string::npos) return false;
  for (const std::string& pattern : config.ignore) {
    if (pattern.rfind("re:", 0) == 0) {
      try {
        if (std::regex_match(module, std::regex(pattern.substr(3)))) return false;
      } catch (const std::regex_error&) {
        continue;  // an expression std::regex cannot read matches nothing
      }
    } else if (module == pattern || EndsWith(module, "." + pattern) ||
               (config.method != QuantMethod::kCompressedInt8 &&
                module.find(pattern) != std::string::npos)) {
      // AutoAWQ and transformers skip a module whose name contains an entry.
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::vector<QuantizedTensorSpec>> QuantizedTensors(const QuantizationConfig& config,
                                                                  const std::string& module,
                                                                  int64_t out, int64_t in) {
  auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(module, " [", out, ", ", in, "]: ", config.Describe(), ": ", what));
  };
  const std::vector<DType> floats = {DType::kF16, DType::kBF16, DType::kF32};
  const std::string p = module + ".";
  switch (config.method) {
    case QuantMethod::kNone:
      return std::vector<QuantizedTensorSpec>{};
    case QuantMethod::kCompressedInt8:
      return std::vector<QuantizedTensorSpec>{
          {p + "weight", {DType::kI8}, {out, in}},
          {p + "weight_scale", floats, {out, 1}},
      };
    case QuantMethod::kAwq: {
      const int64_t g = config.group_size;
      if (out % 8 != 0) return error("output size not a multiple of 8");
      if (in % g != 0) return error("input size not a multiple of the group size");
      return std::vector<QuantizedTensorSpec>{
          {p + "qweight", {DType::kI32}, {in, out / 8}},
          {p + "qzeros", {DType::kI32}, {in / g, out / 8}},
          {p + "scales", floats, {in / g, out}},
      };
    }
    case QuantMethod::kGptq: {
      const int64_t g = config.group_size > 0 ? config.group_size : in;
      if (out % 8 != 0) return error("output size not a multiple of 8");
      if (in % 8 != 0) return error("input size not a multiple of 8");
      if (in % g != 0) return error("input size not a multiple of the group size");
      return std::vector<QuantizedTensorSpec>{
          {p + "qweight", {DType::kI32}, {in / 8, out}},
          {p + "qzeros", {DType::kI32}, {in / g, out / 8}},
          {p + "scales", floats, {in / g, out}},
          {p + "g_idx", {DType::kI32}, {in}, /*optional=*/!config.desc_act},
      };
    }
  }
  return error("unknown method");
}

}  // namespace tandem::engine
