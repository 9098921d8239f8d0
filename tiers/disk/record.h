// The disk tier's record: what one block looks like in a segment file
// (docs/disk-format.md describes it byte for byte).
//
//   [ header: 4096 bytes ][ payload: payload_bytes, zero-padded to 4096 ]
//
// The header's first kEncodedBytes hold the fields below, little-endian,
// ending with an XXH3-64 of everything before it; the rest of the 4 KiB is
// zero. Everything is 4 KiB aligned so records are written and read with
// O_DIRECT straight from the host pool's slots.
//
// A record is served only if its header decodes (magic, version, header
// checksum), names the expected key, and its payload's XXH3-64 matches:
// torn writes, stale regions and bit flips are misses, never data.
//
// Pure functions over caller buffers; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/key128.h"
#include "common/status.h"

namespace kvtier {

struct RecordHeader {
  static constexpr uint64_t kMagic = 0x3130434552545650ull;  // "PVTREC01" little-endian
  // Version 1 has no annotation; a record with one is written as version 2.
  // Both are read.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint32_t kAnnotatedVersion = 2;
  static constexpr uint64_t kBytes = 4096;
  static constexpr size_t kMaxOwnerBytes = 64;
  static constexpr size_t kMaxAnnotationBytes = 3072;

  StoredKey key;
  LayoutFingerprint ns;
  uint64_t sequence = 0;          // monotonic per disk tier: newer records win on recovery
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;  // XXH3-64 of the payload bytes (without padding)
  std::string owner;              // tenant name, at most kMaxOwnerBytes
  // Opaque bytes its owner keeps with the block (KV events' block metadata),
  // at most kMaxAnnotationBytes; carried forward with the record and kept in
  // the index, so a restart gives them back.
  std::string annotation;

  friend bool operator==(const RecordHeader&, const RecordHeader&) = default;
};

inline constexpr uint64_t kRecordAlignBytes = 4096;

// Bytes a record with this payload takes on disk.
inline uint64_t RecordBytes(uint64_t payload_bytes) {
  return RecordHeader::kBytes + (payload_bytes + kRecordAlignBytes - 1) / kRecordAlignBytes * kRecordAlignBytes;
}

// Writes the header into `out` (exactly RecordHeader::kBytes; zero-filled
// beyond the encoded fields). REQUIRES: owner.size() <= kMaxOwnerBytes,
// annotation.size() <= kMaxAnnotationBytes.
void EncodeRecordHeader(const RecordHeader& header, std::span<uint8_t> out);

// Errors: kCorruption naming what is wrong (magic, version, header checksum,
// a length out of range) — the caller counts it and treats it as a miss.
Result<RecordHeader> DecodeRecordHeader(std::span<const uint8_t> in);

// XXH3-64 of a payload, as stored in the header.
uint64_t PayloadChecksum(std::span<const uint8_t> payload);

}  // namespace kvtier
