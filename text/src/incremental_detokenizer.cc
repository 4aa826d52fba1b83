// Streaming detokenization: holds back only the bytes of a character that is not complete yet,
// so the pieces joined equal Decode() of all ids (the same U+FFFD for ill-formed bytes).
#include <cstdint>
#include <string>
#include <string_view>

#include "tandem/text/tokenizer.h"

namespace tandem::text {
namespace {

// How many trailing bytes of `bytes` are the start of a UTF-8 character that more bytes could
// still complete (0 when the text ends on a character boundary or on ill-formed bytes that no
// continuation can repair).
size_t IncompleteTailLength(std::string_view bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  // A character is at most 4 bytes, so its lead byte is among the last 3.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const uint8_t b = p[n - back];
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    int need = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) {
      need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return 0;  // ASCII or a byte that never starts a character
    }
    if (static_cast<int>(back) >= need) return 0;  // complete (or overlong) already
    if (back >= 2 && (p[n - back + 1] < lo || p[n - back + 1] > hi)) return 0;
    return back;
  }
  return 0;
}

}  // namespace

std::string IncrementalDetokenizer::Add(int32_t id) {
  if (skip_special_tokens_ && tokenizer_.IsSpecial(id)) return "";
  pending_ += tokenizer_.TokenBytes(id);
  size_t hold = IncompleteTailLength(pending_);
  std::string out =
      ReplaceInvalidUtf8(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string IncrementalDetokenizer::Finish() {
  std::string out = ReplaceInvalidUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::text
