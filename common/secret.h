// Secret: key material for keyed XXH3 (tenant salts and chain-hash secrets).
//
// At least 136 bytes (XXH3_SECRET_SIZE_MIN) of random-looking bytes. Files
// hold the raw bytes; the daemon generates missing ones with getrandom() and
// writes them with mode 0600. The bytes are wiped when a Secret is destroyed.
// Value type; thread-compatible.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier {

class Secret {
 public:
  static constexpr size_t kMinBytes = 136;  // XXH3_SECRET_SIZE_MIN
  static constexpr size_t kMaxBytes = 4096;
  static constexpr size_t kGeneratedBytes = 256;
  // Fewer distinct byte values than this means the bytes are not random
  // (a zero-filled file, a repeated character, a short password).
  static constexpr size_t kMinDistinctByteValues = 16;

  // Errors: kInvalidArgument if the size is outside [kMinBytes, kMaxBytes] or
  // the bytes have fewer than kMinDistinctByteValues distinct values.
  static Result<Secret> FromBytes(std::vector<uint8_t> bytes);
  // kGeneratedBytes from getrandom().
  static Result<Secret> Generate();
  // Reads a secret file. Errors: kNotFound, kPermissionDenied, the read
  // errno, or FromBytes' errors; messages name the path.
  static Result<Secret> LoadFile(const std::string& path);
  // Reads `path`, or when it does not exist generates a secret and creates the
  // file with mode 0600 atomically (written and fsynced under a temporary
  // name, then linked into place, so a crash never leaves a short file and a
  // concurrent creator's file wins). The directory must exist.
  static Result<Secret> LoadOrCreateFile(const std::string& path);

  Secret(const Secret&) = default;
  Secret& operator=(const Secret&) = default;
  Secret(Secret&&) noexcept = default;
  Secret& operator=(Secret&&) noexcept = default;
  ~Secret();

  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  explicit Secret(std::vector<uint8_t> bytes) : bytes_(std::move(bytes)) {}
  std::vector<uint8_t> bytes_;
};

}  // namespace kvtier
