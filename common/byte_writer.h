// ByteWriter: builds the canonical little-endian encodings that kvtier hashes
// (docs/hashing.md). Internal to common/; not a wire format.
// Thread-compatible.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/check.h"

namespace kvtier {

class ByteWriter {
 public:
  // Reuses `buffer`'s capacity (cleared first), so hot loops avoid allocation.
  explicit ByteWriter(std::vector<uint8_t> buffer = {}) : out_(std::move(buffer)) { out_.clear(); }

  void U8(uint8_t v) { out_.push_back(v); }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void Bytes(std::span<const uint8_t> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }
  void Bytes(std::string_view bytes) {
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
  // u32 length, then the bytes. REQUIRES: size < 2^32.
  void LengthPrefixed(std::string_view bytes) {
    KVTIER_CHECK(bytes.size() <= UINT32_MAX);
    U32(static_cast<uint32_t>(bytes.size()));
    Bytes(bytes);
  }
  void Reserve(size_t size_bytes) { out_.reserve(size_bytes); }

  const std::vector<uint8_t>& bytes() const { return out_; }
  std::vector<uint8_t> Take() && { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

}  // namespace kvtier
