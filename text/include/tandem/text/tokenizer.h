// Hugging Face `tokenizer.json` byte-level BPE (GPT-2 / Llama-3 / Qwen2 style).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::text {

// Encodes and decodes exactly as the reference tokenizers do for byte-level BPE models:
// added/special tokens, the Split pre-tokenizer regex (PCRE2, JIT), the ByteLevel byte to
// unicode mapping, merges applied by rank, and the post-processor's special tokens.
//   TANDEM_ASSIGN_OR_RETURN(auto tok, Tokenizer::FromFile(dir + "/tokenizer.json"));
//   std::vector<int32_t> ids = tok->Encode("Hello", /*add_special_tokens=*/true);
class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json);
  virtual ~Tokenizer() = default;

  // Special tokens in `text` (e.g. "<|eot_id|>") are always recognised as single ids.
  // add_special_tokens applies the post-processor template (e.g. Llama-3's BOS).
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const = 0;
  // Bytes of the ids joined; special tokens dropped when skip_special_tokens. Ill-formed
  // UTF-8 (from a cut multi-byte character) is replaced by U+FFFD as the references do.
  virtual std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const = 0;
  // The raw bytes one id stands for (special tokens: their content).
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  // Ids are 0 .. vocab_size() - 1, added tokens included.
  virtual int vocab_size() const = 0;
  // The raw-byte pieces the BPE model would see for `text`: added tokens removed, the
  // normalizer and pre-tokenizer applied. Used to train merges with the same word boundaries
  // as encoding; the default treats the whole text as one piece.
  virtual std::vector<std::string> PreTokenize(std::string_view text) const {
    return {std::string(text)};
  }
};

// `bytes` with every maximal ill-formed UTF-8 subpart replaced by U+FFFD, as a UTF-8 decoder
// with errors="replace" (Python, WHATWG TextDecoder) does. Valid input is returned unchanged.
std::string ReplaceInvalidUtf8(std::string_view bytes);

// Turns a stream of ids into text pieces for streaming. A piece never ends inside a UTF-8
// character: bytes of an incomplete character are held until it completes (or Finish()).
class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
      : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}
  // Text that became complete with this id (possibly empty).
  std::string Add(int32_t id);
  // Whatever is still held, with incomplete bytes replaced by U+FFFD.
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;  // not owned; outlives this object
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace tandem::text
