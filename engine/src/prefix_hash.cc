#include "tandem/engine/prefix_hash.h"

namespace tandem::engine {
namespace {

// splitmix64's finalizer: a bijection that spreads every input bit over the output.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t PrefixRoot(std::string_view cache_salt) {
  uint64_t h = Mix(0x7461'6e64'656d'0001ull ^ cache_salt.size());
  for (unsigned char c : cache_salt) h = Mix(h ^ c);
  return h;
}

uint64_t ChainBlockHash(uint64_t parent, std::span<const int32_t> block_tokens) {
  uint64_t h = Mix(parent ^ 0x6b76'626c'6f63'6bull);
  for (int32_t t : block_tokens) h = Mix(h ^ static_cast<uint32_t>(t));
  return h == 0 ? 1 : h;  // 0 means "no hash" to the block manager
}

void ExtendBlockHashes(uint64_t root, std::span<const int32_t> tokens, int block_size,
                       std::vector<uint64_t>& hashes) {
  const size_t full = tokens.size() / block_size;
  while (hashes.size() < full) {
    const uint64_t parent = hashes.empty() ? root : hashes.back();
    hashes.push_back(
        ChainBlockHash(parent, tokens.subspan(hashes.size() * block_size, block_size)));
  }
}

}  // namespace tandem::engine
