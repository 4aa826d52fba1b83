// Hugging Face checkpoints: config.json plus model.safetensors or a sharded
// model.safetensors.index.json, memory-mapped and validated against the config.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/base/mapped_file.h"
#include "tandem/engine/quantization_config.h"
#include "tandem/text/model_config.h"

namespace tandem::engine {

// One tensor inside a mapped safetensors file. `data` points into the mapping owned by
// the Checkpoint (or SafetensorsFile) it came from.
struct TensorView {
  std::string name;
  std::string file;  // path of the safetensors file holding it
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;

  int64_t NumElements() const;
  // Converts to fp32 into out[NumElements()].
  void ToFloat(float* out) const;
};

// A single mapped .safetensors file with its parsed and bounds-checked header.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return file_->path(); }
  const MappedFile& file() const { return *file_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
};

// Writes tensors to a .safetensors file (used by `tandem synth-model` and tests).
class SafetensorsWriter {
 public:
  // Adds a tensor; data is `dtype`-encoded bytes of prod(shape) elements, copied.
  void Add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  // Adds fp32 values, converting to `dtype`.
  void AddFloat(const std::string& name, DType dtype, std::vector<int64_t> shape,
                const std::vector<float>& values);
  // Fills out[0, count) with elements [first, first + count) of a tensor, in row-major order.
  using ValueGenerator = std::function<void(int64_t first, int64_t count, float* out)>;
  // Adds a tensor whose fp32 values `generate` produces while Write runs, chunk by chunk, so a
  // multi-gigabyte checkpoint is written without holding it in memory.
  void AddGenerated(const std::string& name, DType dtype, std::vector<int64_t> shape,
                    ValueGenerator generate);
  // Adds a tensor whose encoded bytes (prod(shape) elements of `dtype`) `generate` returns while
  // Write runs (integer tensors of quantised checkpoints, produced one layer at a time).
  void AddGeneratedBytes(const std::string& name, DType dtype, std::vector<int64_t> shape,
                         std::function<std::vector<unsigned char>()> generate);
  // Writes to a temporary file renamed into place, so `path` is either complete or untouched.
  absl::Status Write(const std::string& path) const;
  // Bytes of tensor data (the file adds an 8-byte length and a JSON header).
  size_t TotalBytes() const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<unsigned char> bytes;  // encoded data unless `generate` is set
    ValueGenerator generate;
    std::function<std::vector<unsigned char>()> generate_bytes;
  };
  std::vector<Entry> entries_;
};

// An opened, fully validated checkpoint directory.
//   TANDEM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open("/models/llama"));
//   TANDEM_ASSIGN_OR_RETURN(TensorView w, ckpt->Tensor("model.norm.weight"));
class Checkpoint {
 public:
  // Refuses, naming the file and tensor, a checkpoint that is truncated, misshaped, of an
  // unknown architecture, missing a tensor, or holding an unsupported dtype; and, in one line, a
  // quantization_config Tandem cannot serve. A quantised linear layer's tensors are checked
  // against its layout (quantization_config.h) instead of `<module>.weight`.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const text::ModelConfig& config() const { return config_; }
  // config.json's quantization_config (method kNone for a checkpoint of float weights).
  const QuantizationConfig& quantization() const { return quantization_; }
  const std::string& dir() const { return dir_; }
  absl::StatusOr<TensorView> Tensor(const std::string& name) const;
  // The tensor converted to fp32.
  absl::StatusOr<std::vector<float>> ReadFloat(const std::string& name) const;
  // Takes a tensor's pages, or every file's, out of resident memory once what is needed has
  // been copied out (MappedFile::DropPages): a served model then holds its weights once, not
  // also as mapped file pages. Tensors stay readable.
  void DropPages(const TensorView& tensor) const;
  void DropAllPages() const;

 private:
  // Presence, dtype and shape of the tensors of quantised linear `module` (W[out, in]).
  absl::Status CheckQuantizedLinear(const std::string& source, const std::string& module,
                                    int64_t out, int64_t in) const;

  std::string dir_;
  text::ModelConfig config_;
  QuantizationConfig quantization_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace tandem::engine
