// Key128: a 128-bit hash value as 16 bytes in XXH128's canonical (big-endian)
// order, so that its hex form equals what xxhsum prints for the same hash.
//
// Three distinct types share the shape so they cannot be mixed up:
//   LayoutFingerprint: names a namespace (common/layout.h);
//   BlockKey:          a block's chain key, computed by the client;
//   StoredKey:         the daemon's index key, salted per tenant.
// Value types; thread-compatible.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier {

namespace internal {
std::string BytesToHex(const uint8_t* data, size_t size);
// Parses exactly `size` bytes of lowercase or uppercase hex.
Status HexToBytes(std::string_view hex, uint8_t* out, size_t size);
}  // namespace internal

template <typename Tag>
struct Key128 {
  static constexpr size_t kSize = 16;
  std::array<uint8_t, kSize> bytes{};

  std::string ToHex() const { return internal::BytesToHex(bytes.data(), kSize); }
  // Errors: kInvalidArgument unless `hex` is exactly 32 hex digits.
  static Result<Key128> FromHex(std::string_view hex) {
    Key128 key;
    KVTIER_RETURN_IF_ERROR(internal::HexToBytes(hex, key.bytes.data(), kSize));
    return key;
  }
  // The low 64 bits (last 8 canonical bytes); uniformly distributed, so a
  // fine hash-table hash.
  uint64_t Low64() const {
    uint64_t v = 0;
    for (size_t i = 8; i < kSize; ++i) v = (v << 8) | bytes[i];
    return v;
  }

  friend auto operator<=>(const Key128&, const Key128&) = default;
  friend bool operator==(const Key128&, const Key128&) = default;
};

using LayoutFingerprint = Key128<struct LayoutFingerprintTag>;
using BlockKey = Key128<struct BlockKeyTag>;
using StoredKey = Key128<struct StoredKeyTag>;

// For unordered containers.
struct Key128Hash {
  template <typename Tag>
  size_t operator()(const Key128<Tag>& key) const {
    return static_cast<size_t>(key.Low64());
  }
};

}  // namespace kvtier
