// The safetensors format: an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets: [begin, end)} (offsets relative to the byte after
// the header), then the raw tensor bytes.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/engine/checkpoint.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; a larger length is corruption
// (or a file that is not safetensors at all), not a checkpoint with very many tensors.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

// Values streamed through the writer this many at a time, bounding its memory for large
// synthetic checkpoints.
constexpr int64_t kWriteChunkElements = 1 << 20;

bool ParseDType(const std::string& name, DType* dtype) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kI32}) {
    if (name == DTypeName(d)) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void EncodeFloats(const float* in, int64_t n, DType dtype, unsigned char* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, in, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = FloatToF16(in[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = FloatToBf16(in[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kI32:
      for (int64_t i = 0; i < n; ++i) StoreFromFloat(out, dtype, i, in[i]);
      return;
  }
}

int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Owns a FILE* and removes the temporary file unless the write was committed by a rename.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path)
      : path_(std::move(path)), temp_(absl::StrCat(path_, ".tmp.", ::getpid())) {}
  ~AtomicFileWriter() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) std::remove(temp_.c_str());
  }

  absl::Status Open() {
    file_ = std::fopen(temp_.c_str(), "wb");
    if (file_ == nullptr) return Errno("cannot create");
    return absl::OkStatus();
  }
  absl::Status Write(const void* data, size_t n) {
    if (n > 0 && std::fwrite(data, 1, n, file_) != n) return Errno("write failed");
    return absl::OkStatus();
  }
  absl::Status Commit() {
    int rc = std::fclose(file_);
    file_ = nullptr;
    if (rc != 0) return Errno("write failed");
    if (std::rename(temp_.c_str(), path_.c_str()) != 0) return Errno("cannot rename into place");
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  absl::Status Errno(absl::string_view what) const {
    return absl::InternalError(absl::StrCat(path_, ": ", what, ": ", std::strerror(errno)));
  }
  std::string path_;
  std::string temp_;
  FILE* file_ = nullptr;
  bool committed_ = false;
};

}  // namespace

int64_t TensorView::NumElements() const { return ElementCount(shape); }

void TensorView::ToFloat(float* out) const {
  const int64_t n = NumElements();
  const auto* bytes = static_cast<const unsigned char*>(data);
  // memcpy per element: tensor data inside a safetensors file need not be aligned.
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, bytes, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = F16ToFloat(h);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = Bf16ToFloat(h);
      }
      return;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kI32:
      for (int64_t i = 0; i < n; ++i) out[i] = LoadAsFloat(bytes, dtype, i);
      return;
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  auto error = [&](absl::string_view message) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
  };
  const size_t size = file->size();
  if (size < 8) {
    return error(absl::StrCat("truncated: ", size, " bytes is too short for a safetensors file"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file->data()[i];
  if (header_len > kMaxHeaderBytes) {
    return error(absl::StrCat("header length ", header_len,
                              " is not sane (over 100 MB); not a safetensors file?"));
  }
  if (header_len > size - 8) {
    return error(
        absl::StrCat("truncated: header length ", header_len, " is beyond the file size ", size));
  }
  const char* header_begin = reinterpret_cast<const char*>(file->data() + 8);
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_len);
  } catch (const json::exception& e) {
    return error(absl::StrCat("bad JSON header: ", e.what()));
  }
  if (!header.is_object()) return error("header is not a JSON object");

  const unsigned char* data = file->data() + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  auto out = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto tensor_error = [&](absl::string_view message) {
      return error(absl::StrCat("tensor ", name, ": ", message));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
      return tensor_error("entry needs dtype, shape and data_offsets [begin, end]");
    }
    TensorView view;
    view.name = name;
    view.file = path;
    std::string dtype = entry["dtype"].get<std::string>();
    if (!ParseDType(dtype, &view.dtype)) {
      return tensor_error(
          absl::StrCat("unsupported dtype ", dtype, " (Tandem reads F32, F16, BF16, I8 and I32)"));
    }
    // Guard the element count product against overflow with a generous cap (2^50 elements).
    int64_t elements = 1;
    for (const json& d : entry["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 50)) {
        return tensor_error("shape must hold non-negative integers");
      }
      view.shape.push_back(d.get<int64_t>());
      elements *= view.shape.back();
      if (elements > (int64_t{1} << 50)) return tensor_error("shape is implausibly large");
    }
    const json& offsets = entry["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return tensor_error("data_offsets must be non-negative integers");
    }
    uint64_t begin = offsets[0].get<uint64_t>();
    uint64_t end = offsets[1].get<uint64_t>();
    if (begin > end) {
      return tensor_error(absl::StrCat("data_offsets [", begin, ", ", end, "] are reversed"));
    }
    if (end > data_size) {
      return tensor_error(absl::StrCat("truncated: data ends at byte ", end, " of the data section",
                                       " but the file holds only ", data_size));
    }
    uint64_t expected = static_cast<uint64_t>(elements) * DTypeSize(view.dtype);
    if (end - begin != expected) {
      return tensor_error(absl::StrCat("misshaped: ", end - begin, " bytes for shape ",
                                       ShapeString(view.shape), " of ", dtype, " (expected ",
                                       expected, ")"));
    }
    view.data = data + begin;
    view.nbytes = static_cast<size_t>(end - begin);
    out->tensors_.emplace(name, std::move(view));
  }
  out->file_ = std::move(file);
  return out;
}

void SafetensorsWriter::Add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t nbytes) {
  TANDEM_CHECK(static_cast<size_t>(ElementCount(shape)) * DTypeSize(dtype) == nbytes)
      << name << ": " << nbytes << " bytes do not match shape " << ShapeString(shape);
  Entry entry{name, dtype, std::move(shape), {}, nullptr, nullptr};
  const auto* bytes = static_cast<const unsigned char*>(data);
  entry.bytes.assign(bytes, bytes + nbytes);
  entries_.push_back(std::move(entry));
}

void SafetensorsWriter::AddFloat(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                 const std::vector<float>& values) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == ElementCount(shape))
      << name << ": " << values.size() << " values do not match shape " << ShapeString(shape);
  Entry entry{name, dtype, std::move(shape), {}, nullptr, nullptr};
  entry.bytes.resize(values.size() * DTypeSize(dtype));
  EncodeFloats(values.data(), static_cast<int64_t>(values.size()), dtype, entry.bytes.data());
  entries_.push_back(std::move(entry));
}

void SafetensorsWriter::AddGenerated(const std::string& name, DType dtype,
                                     std::vector<int64_t> shape, ValueGenerator generate) {
  entries_.push_back(Entry{name, dtype, std::move(shape), {}, std::move(generate), nullptr});
}

void SafetensorsWriter::AddGeneratedBytes(const std::string& name, DType dtype,
                                          std::vector<int64_t> shape,
                                          std::function<std::vector<unsigned char>()> generate) {
  Entry entry{name, dtype, std::move(shape), {}, nullptr, nullptr};
  entry.generate_bytes = std::move(generate);
  entries_.push_back(std::move(entry));
}

size_t SafetensorsWriter::TotalBytes() const {
  size_t total = 0;
  for (const Entry& e : entries_) total += ElementCount(e.shape) * DTypeSize(e.dtype);
  return total;
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    uint64_t n = static_cast<uint64_t>(ElementCount(e.shape)) * DTypeSize(e.dtype);
    header[e.name] = {
        {"dtype", DTypeName(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  // Spaces keep the JSON valid and put the data section on an 8-byte boundary, so fp32 and
  // 16-bit tensors are naturally aligned in the mapping.
  text.resize((text.size() + 7) / 8 * 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  AtomicFileWriter out(path);
  TANDEM_RETURN_IF_ERROR(out.Open());
  TANDEM_RETURN_IF_ERROR(out.Write(length, 8));
  TANDEM_RETURN_IF_ERROR(out.Write(text.data(), text.size()));
  std::vector<float> values;
  std::vector<unsigned char> encoded;
  for (const Entry& e : entries_) {
    if (e.generate_bytes) {
      const std::vector<unsigned char> bytes = e.generate_bytes();
      TANDEM_CHECK(bytes.size() == ElementCount(e.shape) * static_cast<size_t>(DTypeSize(e.dtype)))
          << e.name << ": generated " << bytes.size() << " bytes";
      TANDEM_RETURN_IF_ERROR(out.Write(bytes.data(), bytes.size()));
      continue;
    }
    if (!e.generate) {
      TANDEM_RETURN_IF_ERROR(out.Write(e.bytes.data(), e.bytes.size()));
      continue;
    }
    const int64_t total = ElementCount(e.shape);
    for (int64_t first = 0; first < total; first += kWriteChunkElements) {
      int64_t count = std::min(kWriteChunkElements, total - first);
      values.resize(count);
      encoded.resize(count * DTypeSize(e.dtype));
      e.generate(first, count, values.data());
      EncodeFloats(values.data(), count, e.dtype, encoded.data());
      TANDEM_RETURN_IF_ERROR(out.Write(encoded.data(), encoded.size()));
    }
  }
  return out.Commit();
}

}  // namespace tandem::engine
