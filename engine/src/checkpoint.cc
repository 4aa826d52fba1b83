#include "tandem/engine/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  try {
    return json::parse(buffer.str());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad JSON: ", e.what()));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = dir;
  TANDEM_ASSIGN_OR_RETURN(ckpt->config_, text::ModelConfig::FromFile(dir + "/config.json"));
  {
    TANDEM_ASSIGN_OR_RETURN(json config_json, ReadJsonFile(dir + "/config.json"));
    TANDEM_ASSIGN_OR_RETURN(ckpt->quantization_,
                            ParseQuantizationConfig(config_json, dir + "/config.json"));
  }

  // transformers prefers the single file when both exist; so do we.
  const std::string single_path = absl::StrCat(dir, "/", kSingleFile);
  const std::string index_path = absl::StrCat(dir, "/", kIndexFile);
  std::string source;  // the file named in "missing tensor" errors
  if (std::filesystem::exists(single_path)) {
    source = single_path;
    TANDEM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single_path));
    for (const auto& [name, view] : file->tensors()) ckpt->index_[name] = &view;
    ckpt->files_.push_back(std::move(file));
  } else if (std::filesystem::exists(index_path)) {
    source = index_path;
    TANDEM_ASSIGN_OR_RETURN(json index, ReadJsonFile(index_path));
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": expected an object with a \"weight_map\" object"));
    }
    // Each shard is mapped once however many tensors point at it.
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [name, shard_json] : index["weight_map"].items()) {
      if (!shard_json.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map entry for ", name, " is not a file name"));
      }
      std::string shard = shard_json.get<std::string>();
      // Shard names are plain file names; a path could escape the checkpoint directory.
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", name, ": shard \"",
                                                       shard, "\" is not a file name in ", dir));
      }
      auto it = shards.find(shard);
      if (it == shards.end()) {
        auto file = SafetensorsFile::Open(absl::StrCat(dir, "/", shard));
        if (!file.ok()) {
          return absl::Status(file.status().code(),
                              absl::StrCat(index_path, ": tensor ", name, " is in shard ", shard,
                                           ", which cannot be read: ", file.status().message()));
        }
        it = shards.emplace(shard, file->get()).first;
        ckpt->files_.push_back(std::move(file).value());
      }
      auto tensor = it->second->tensors().find(name);
      if (tensor == it->second->tensors().end()) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", name,
                                                       " is listed in shard ", shard, " but ",
                                                       it->second->path(), " does not hold it"));
      }
      ckpt->index_[name] = &tensor->second;
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no ", kSingleFile, " or ", kIndexFile, " in the checkpoint"));
  }

  // Extra tensors (rotary_emb.inv_freq in older exports, for example) are ignored.
  for (const auto& [name, shape] : ExpectedTensors(ckpt->config_)) {
    constexpr std::string_view kWeight = ".weight";
    const std::string module = name.substr(0, name.size() - kWeight.size());
    if (shape.size() == 2 && name.ends_with(kWeight) &&
        IsQuantizedLinear(ckpt->quantization_, module)) {
      TANDEM_RETURN_IF_ERROR(ckpt->CheckQuantizedLinear(source, module, shape[0], shape[1]));
      continue;
    }
    auto it = ckpt->index_.find(name);
    if (it == ckpt->index_.end()) {
      return absl::NotFoundError(absl::StrCat(source, ": missing tensor ", name, " (",
                                              ckpt->config_.architecture_name, " expects shape ",
                                              ShapeString(shape), ")"));
    }
    if (it->second->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          it->second->file, ": tensor ", name, " has shape ", ShapeString(it->second->shape),
          ", expected ", ShapeString(shape), " from config.json"));
    }
    const DType dtype = it->second->dtype;
    if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(it->second->file, ": tensor ", name, " holds ",
                                                     DTypeName(dtype),
                                                     ", expected F32, F16 or BF16"));
    }
  }
  return ckpt;
}

absl::Status Checkpoint::CheckQuantizedLinear(const std::string& source, const std::string& module,
                                              int64_t out, int64_t in) const {
  auto specs = QuantizedTensors(quantization_, module, out, in);
  if (!specs.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", specs.status().message()));
  }
  for (const QuantizedTensorSpec& spec : *specs) {
    auto it = index_.find(spec.name);
    if (it == index_.end()) {
      if (spec.optional) continue;
      return absl::NotFoundError(absl::StrCat(source, ": missing tensor ", spec.name, " (",
                                              quantization_.Describe(), " expects shape ",
                                              ShapeString(spec.shape), ")"));
    }
    const TensorView& t = *it->second;
    if (t.shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          t.file, ": tensor ", spec.name, " has shape ", ShapeString(t.shape), ", expected ",
          ShapeString(spec.shape), " (", quantization_.Describe(), ")"));
    }
    if (std::find(spec.dtypes.begin(), spec.dtypes.end(), t.dtype) == spec.dtypes.end()) {
      std::vector<std::string> names;
      for (DType d : spec.dtypes) names.push_back(DTypeName(d));
      return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor ", spec.name, " holds ",
                                                     DTypeName(t.dtype), ", expected ",
                                                     absl::StrJoin(names, " or ")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorView> Checkpoint::Tensor(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": no tensor ", name));
  }
  return *it->second;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadFloat(const std::string& name) const {
  TANDEM_ASSIGN_OR_RETURN(TensorView view, Tensor(name));
  std::vector<float> out(static_cast<size_t>(view.NumElements()));
  view.ToFloat(out.data());
  return out;
}

void Checkpoint::DropPages(const TensorView& tensor) const {
  for (const auto& f : files_) {
    if (f->path() == tensor.file) return f->file().DropPages(tensor.data, tensor.nbytes);
  }
}

void Checkpoint::DropAllPages() const {
  for (const auto& f : files_) f->file().DropAllPages();
}

}  // namespace tandem::engine
