#include "common/chain_hash.h"

#include "common/byte_writer.h"
#include "common/check.h"
#include "common/xxh128.h"

namespace kvtier {
namespace {

constexpr std::string_view kStoredKeyTag = "KVTSTOR1";
constexpr std::string_view kEngineHashTag = "KVTENG32";

Status CheckExtraKeys(const ExtraKeys& extra, size_t block) {
  if (extra.size() > ChainHasher::kMaxExtraKeysPerBlock) {
    return InvalidArgument("block " + std::to_string(block) + " has " +
                           std::to_string(extra.size()) + " extra keys; at most " +
                           std::to_string(ChainHasher::kMaxExtraKeysPerBlock));
  }
  for (const std::string& k : extra) {
    if (k.size() > ChainHasher::kMaxExtraKeyBytes) {
      return InvalidArgument("an extra key of block " + std::to_string(block) + " is " +
                             std::to_string(k.size()) + " bytes; at most " +
                             std::to_string(ChainHasher::kMaxExtraKeyBytes));
    }
  }
  return Status::Ok();
}

const ExtraKeys& NoExtraKeys() {
  static const ExtraKeys* const kNone = new ExtraKeys();
  return *kNone;
}

}  // namespace

BlockKey ChainHasher::NextKeyInto(std::vector<uint8_t>* scratch, const BlockKey& parent,
                                  std::span<const uint32_t> block,
                                  const ExtraKeys& extra_keys) const {
  KVTIER_CHECK(block.size() == block_tokens_);
  ByteWriter w(std::move(*scratch));
  w.Reserve(16 + 4 + 4 * block.size() + 4);
  w.Bytes(parent.bytes);
  w.U32(static_cast<uint32_t>(block.size()));
  for (uint32_t t : block) w.U32(t);
  w.U32(static_cast<uint32_t>(extra_keys.size()));
  for (const std::string& k : extra_keys) w.LengthPrefixed(k);
  const BlockKey key = Xxh3_128WithSecret<BlockKey>(w.bytes(), secret_.bytes());
  *scratch = std::move(w).Take();
  return key;
}

BlockKey ChainHasher::NextKey(const BlockKey& parent, std::span<const uint32_t> block,
                              const ExtraKeys& extra_keys) const {
  std::vector<uint8_t> scratch;
  return NextKeyInto(&scratch, parent, block, extra_keys);
}

Result<std::vector<BlockKey>> ChainHasher::ComputeKeys(
    std::span<const uint32_t> tokens, std::span<const ExtraKeys> extra_keys_per_block,
    const std::optional<BlockKey>& parent) const {
  const size_t full_blocks = tokens.size() / block_tokens_;
  const size_t all_blocks = (tokens.size() + block_tokens_ - 1) / block_tokens_;
  if (extra_keys_per_block.size() > all_blocks) {
    return Err(InvalidArgument("extra keys for " + std::to_string(extra_keys_per_block.size()) +
                               " blocks, but the tokens make only " + std::to_string(all_blocks)));
  }
  for (size_t i = 0; i < extra_keys_per_block.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(CheckExtraKeys(extra_keys_per_block[i], i));
  }
  std::vector<BlockKey> keys;
  keys.reserve(full_blocks);
  std::vector<uint8_t> scratch;
  BlockKey prev = parent.value_or(root_);
  for (size_t i = 0; i < full_blocks; ++i) {
    const ExtraKeys& extra = i < extra_keys_per_block.size() ? extra_keys_per_block[i] : NoExtraKeys();
    prev = NextKeyInto(&scratch, prev, tokens.subspan(i * block_tokens_, block_tokens_), extra);
    keys.push_back(prev);
  }
  return keys;
}

Result<BlockKey> ChainHasher::KeyFromEngineHash(std::span<const uint8_t> engine_hash) const {
  if (engine_hash.size() == BlockKey::kSize) {
    BlockKey key;
    std::copy(engine_hash.begin(), engine_hash.end(), key.bytes.begin());
    return key;
  }
  if (engine_hash.size() == 32) {
    ByteWriter w;
    w.Bytes(kEngineHashTag);
    w.Bytes(engine_hash);
    return Xxh3_128WithSecret<BlockKey>(w.bytes(), secret_.bytes());
  }
  return Err(InvalidArgument("an engine block hash must be 16 or 32 bytes, got " +
                             std::to_string(engine_hash.size())));
}

StoredKey DeriveStoredKey(const Secret& tenant_salt, const LayoutFingerprint& ns,
                          const BlockKey& key) {
  uint8_t input[kStoredKeyTag.size() + 2 * BlockKey::kSize];
  std::memcpy(input, kStoredKeyTag.data(), kStoredKeyTag.size());
  std::memcpy(input + kStoredKeyTag.size(), ns.bytes.data(), LayoutFingerprint::kSize);
  std::memcpy(input + kStoredKeyTag.size() + LayoutFingerprint::kSize, key.bytes.data(),
              BlockKey::kSize);
  return Xxh3_128WithSecret<StoredKey>(input, tenant_salt.bytes());
}

}  // namespace kvtier
