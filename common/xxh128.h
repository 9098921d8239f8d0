// XXH3-128 into a Key128, in canonical byte order. Internal to common/.
// Thread-safe (pure functions).
#pragma once

#include <xxhash.h>

#include <cstring>
#include <span>

#include "common/check.h"
#include "common/key128.h"

namespace kvtier {

template <typename Key>
Key ToKey128(XXH128_hash_t hash) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  Key key;
  static_assert(sizeof(canonical.digest) == Key::kSize);
  std::memcpy(key.bytes.data(), canonical.digest, Key::kSize);
  return key;
}

// Unkeyed XXH3-128 (seed 0).
template <typename Key>
Key Xxh3_128(std::span<const uint8_t> data) {
  return ToKey128<Key>(XXH3_128bits(data.data(), data.size()));
}

// XXH3-128 keyed by a secret. REQUIRES: secret.size() >= XXH3_SECRET_SIZE_MIN.
template <typename Key>
Key Xxh3_128WithSecret(std::span<const uint8_t> data, std::span<const uint8_t> secret) {
  KVTIER_CHECK(secret.size() >= XXH3_SECRET_SIZE_MIN);
  return ToKey128<Key>(XXH3_128bits_withSecret(data.data(), data.size(), secret.data(), secret.size()));
}

}  // namespace kvtier
