// The hash that names a full block of tokens in the prefix cache. Part of the engine API (no
// runtime), so that the router names a prompt's blocks exactly as every engine does and can
// look them up in the KV-event index of each worker (docs/architecture.md, "KV-aware
// routing").
//
//   std::vector<uint64_t> hashes;
//   ExtendBlockHashes(PrefixRoot(request.cache_salt), request.prompt_tokens, 16, hashes);
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace tandem::engine {

// Chained over the parent block's hash and the block's token ids, so equal hashes mean equal
// prefixes (up to a 64-bit collision). Stable across processes and runs, so two workers (and the
// router) name the same prefix alike. The chain of a sequence starts at PrefixRoot(cache_salt):
// requests with different salts never share a block. Never 0 (0 means "no hash").
uint64_t PrefixRoot(std::string_view cache_salt);
uint64_t ChainBlockHash(uint64_t parent, std::span<const int32_t> block_tokens);
// Extends `hashes` (the chain of `tokens`' first hashes.size() full blocks) to every full
// block of `tokens`.
void ExtendBlockHashes(uint64_t root, std::span<const int32_t> tokens, int block_size,
                       std::vector<uint64_t>& hashes);

}  // namespace tandem::engine
