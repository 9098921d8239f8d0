// Chain keys and stored keys (specified byte for byte in docs/hashing.md).
//
//   key[0]   = XXH3-128-withSecret(hash secret, encode(fingerprint, tokens[0], extra[0]))
//   key[i]   = XXH3-128-withSecret(hash secret, encode(key[i-1],   tokens[i], extra[i]))
//   stored   = XXH3-128-withSecret(tenant salt, "KVTSTOR1" || fingerprint || key)
//
// Only full blocks get keys. Equal keys mean an identical token prefix (and
// identical extra keys) under the same layout and secret; the secret comes from
// the daemon, so someone who only writes prompts cannot craft collisions.
// Engines that already hash their blocks (vLLM's SHA-256 block hashes) may use
// those instead: 16-byte hashes are used as they are, 32-byte ones are folded
// to 16 bytes with the same secret.
//
// ChainHasher is immutable after Create: thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/key128.h"
#include "common/layout.h"
#include "common/secret.h"
#include "common/status.h"

namespace kvtier {

// What changes a block's KV besides its tokens: LoRA adapter id, multimodal
// item hashes, a cache salt. Opaque byte strings, hashed in the given order.
using ExtraKeys = std::vector<std::string>;

class ChainHasher {
 public:
  static constexpr size_t kMaxExtraKeysPerBlock = 64;
  static constexpr size_t kMaxExtraKeyBytes = 4096;

  ChainHasher(Secret hash_secret, const Layout& layout)
      : secret_(std::move(hash_secret)),
        root_(BlockKey{layout.fingerprint().bytes}),
        block_tokens_(layout.spec().block_tokens) {}

  uint32_t block_tokens() const { return block_tokens_; }
  // The parent of block 0: the layout fingerprint's bytes.
  const BlockKey& root() const { return root_; }

  // Keys of every full block of `tokens`. `extra_keys_per_block[i]` applies to
  // block i; it may be shorter than the number of blocks (the rest have none),
  // and may have one more entry than there are full blocks (for the trailing
  // partial block, which gets no key). `parent` continues a chain from a
  // known key instead of the root.
  // Errors: kInvalidArgument when extra_keys_per_block is longer than the
  // number of (full or partial) blocks, or an extra key exceeds its bounds.
  Result<std::vector<BlockKey>> ComputeKeys(
      std::span<const uint32_t> tokens,
      std::span<const ExtraKeys> extra_keys_per_block = {},
      const std::optional<BlockKey>& parent = std::nullopt) const;

  // The key of one block. REQUIRES: block.size() == block_tokens(), extras
  // within the bounds above (ComputeKeys checks both).
  BlockKey NextKey(const BlockKey& parent, std::span<const uint32_t> block,
                   const ExtraKeys& extra_keys) const;

  // An engine-supplied block hash in place of a chain key.
  // Errors: kInvalidArgument unless it is 16 or 32 bytes.
  Result<BlockKey> KeyFromEngineHash(std::span<const uint8_t> engine_hash) const;

 private:
  BlockKey NextKeyInto(std::vector<uint8_t>* scratch, const BlockKey& parent,
                       std::span<const uint32_t> block, const ExtraKeys& extra_keys) const;

  Secret secret_;
  BlockKey root_;
  uint32_t block_tokens_;
};

// The daemon's index key for a tenant's block: keyed by the tenant's (or its
// sharing group's) salt, so tenants never hit or probe each other's entries.
StoredKey DeriveStoredKey(const Secret& tenant_salt, const LayoutFingerprint& ns,
                          const BlockKey& key);

}  // namespace kvtier
