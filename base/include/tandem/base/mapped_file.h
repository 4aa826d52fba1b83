// A read-only memory map of a whole file.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tandem {

// Maps a file read-only for the object's lifetime. Checkpoint tensors are read in place from it.
//   TANDEM_ASSIGN_OR_RETURN(auto file, MappedFile::Open("model.safetensors"));
//   const uint8_t* bytes = file->data();
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  // Takes the pages holding [begin, begin + size) (within the mapping) out of the process's
  // resident memory, e.g. once a checkpoint tensor has been copied where it is used. The bytes
  // stay readable: a later read brings the pages back from the file.
  void DropPages(const void* begin, size_t size) const;
  void DropAllPages() const { DropPages(data_, size_); }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const unsigned char* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const unsigned char* data_;  // owned mapping, unmapped in the destructor
  size_t size_;
};

}  // namespace tandem
