#include "tiers/disk/record.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/layout.h"

namespace kvtier {
namespace {

// Offsets of the version-1 fields (docs/disk-format.md has the same table).
constexpr size_t kMagicOffset = 0;
constexpr size_t kVersionOffset = 8;
constexpr size_t kEncodedBytesOffset = 12;
constexpr size_t kKeyOffset = 16;
constexpr size_t kNsOffset = 32;
constexpr size_t kSequenceOffset = 48;
constexpr size_t kPayloadBytesOffset = 56;
constexpr size_t kPayloadChecksumOffset = 64;
constexpr size_t kOwnerLenOffset = 72;
constexpr size_t kOwnerOffset = 76;
constexpr size_t kChecksumBytes = 8;
// encoded_bytes counts everything up to and including the header checksum, so
// for version 1 it is exactly this plus owner_len.
constexpr size_t kFixedEncodedBytes = kOwnerOffset + kChecksumBytes;
// Version 2 adds annotation_len (u32) and the annotation after the owner.
constexpr size_t kAnnotationLenBytes = 4;
constexpr size_t kMaxEncodedBytes =
    kFixedEncodedBytes + RecordHeader::kMaxOwnerBytes + kAnnotationLenBytes + RecordHeader::kMaxAnnotationBytes;
static_assert(kMaxEncodedBytes <= RecordHeader::kBytes);

// Explicit byte-by-byte little-endian so the format does not depend on the
// host's byte order.
void PutU32(uint8_t* out, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* out, uint64_t v) {
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* in) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}
uint64_t GetU64(const uint8_t* in) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

std::string Hex64(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out = "0x";
  for (int shift = 60; shift >= 0; shift -= 4) out.push_back(kDigits[(v >> shift) & 0xf]);
  return out;
}

tl::unexpected<Status> Corrupt(std::string what) {
  return Err(StatusCode::kCorruption, "record header: " + std::move(what));
}

}  // namespace

void EncodeRecordHeader(const RecordHeader& header, std::span<uint8_t> out) {
  KVTIER_CHECK_MSG(out.size() == RecordHeader::kBytes, "record header buffer must be 4096 bytes");
  KVTIER_CHECK_MSG(header.owner.size() <= RecordHeader::kMaxOwnerBytes, "record owner too long");
  KVTIER_CHECK_MSG(header.annotation.size() <= RecordHeader::kMaxAnnotationBytes, "record annotation too long");
  const size_t owner_len = header.owner.size();
  const bool annotated = !header.annotation.empty();
  const size_t annotation_part = annotated ? kAnnotationLenBytes + header.annotation.size() : 0;
  const size_t encoded_bytes = kFixedEncodedBytes + owner_len + annotation_part;
  uint8_t* p = out.data();
  // Zero first: the tail is part of every O_DIRECT write, and stale bytes from
  // a reused slot must not reach the disk.
  std::fill(out.begin(), out.end(), uint8_t{0});
  PutU64(p + kMagicOffset, RecordHeader::kMagic);
  PutU32(p + kVersionOffset, annotated ? RecordHeader::kAnnotatedVersion : RecordHeader::kVersion);
  PutU32(p + kEncodedBytesOffset, static_cast<uint32_t>(encoded_bytes));
  std::memcpy(p + kKeyOffset, header.key.bytes.data(), StoredKey::kSize);
  std::memcpy(p + kNsOffset, header.ns.bytes.data(), LayoutFingerprint::kSize);
  PutU64(p + kSequenceOffset, header.sequence);
  PutU64(p + kPayloadBytesOffset, header.payload_bytes);
  PutU64(p + kPayloadChecksumOffset, header.payload_checksum);
  PutU32(p + kOwnerLenOffset, static_cast<uint32_t>(owner_len));
  if (owner_len > 0) std::memcpy(p + kOwnerOffset, header.owner.data(), owner_len);
  if (annotated) {
    uint8_t* a = p + kOwnerOffset + owner_len;
    PutU32(a, static_cast<uint32_t>(header.annotation.size()));
    std::memcpy(a + kAnnotationLenBytes, header.annotation.data(), header.annotation.size());
  }
  const size_t checksum_offset = kOwnerOffset + owner_len + annotation_part;
  PutU64(p + checksum_offset, XXH3_64bits(p, checksum_offset));
}

Result<RecordHeader> DecodeRecordHeader(std::span<const uint8_t> in) {
  if (in.size() < RecordHeader::kBytes) {
    return Corrupt("input is " + std::to_string(in.size()) + " bytes, need " +
                   std::to_string(RecordHeader::kBytes));
  }
  const uint8_t* p = in.data();
  if (const uint64_t magic = GetU64(p + kMagicOffset); magic != RecordHeader::kMagic) {
    return Corrupt("bad magic " + Hex64(magic));
  }
  const uint32_t version = GetU32(p + kVersionOffset);
  if (version != RecordHeader::kVersion && version != RecordHeader::kAnnotatedVersion) {
    return Corrupt("unsupported version " + std::to_string(version));
  }
  const uint32_t encoded_bytes = GetU32(p + kEncodedBytesOffset);
  if (encoded_bytes < kFixedEncodedBytes || encoded_bytes > kMaxEncodedBytes) {
    return Corrupt("encoded_bytes " + std::to_string(encoded_bytes) + " out of range [" +
                   std::to_string(kFixedEncodedBytes) + ", " + std::to_string(kMaxEncodedBytes) +
                   "]");
  }
  const uint32_t owner_len = GetU32(p + kOwnerLenOffset);
  if (owner_len > RecordHeader::kMaxOwnerBytes) {
    return Corrupt("owner_len " + std::to_string(owner_len) + " exceeds " +
                   std::to_string(RecordHeader::kMaxOwnerBytes));
  }
  size_t annotation_len = 0;
  if (version == RecordHeader::kAnnotatedVersion) {
    annotation_len = GetU32(p + kOwnerOffset + owner_len);
    if (annotation_len == 0 || annotation_len > RecordHeader::kMaxAnnotationBytes) {
      return Corrupt("annotation_len " + std::to_string(annotation_len) + " out of range [1, " +
                     std::to_string(RecordHeader::kMaxAnnotationBytes) + "]");
    }
  }
  const size_t annotation_part = version == RecordHeader::kAnnotatedVersion ? kAnnotationLenBytes + annotation_len : 0;
  if (encoded_bytes != kFixedEncodedBytes + owner_len + annotation_part) {
    return Corrupt("encoded_bytes " + std::to_string(encoded_bytes) + " inconsistent with owner_len " +
                   std::to_string(owner_len) + " and annotation_len " + std::to_string(annotation_len));
  }
  const size_t checksum_offset = kOwnerOffset + owner_len + annotation_part;
  const uint64_t stored_checksum = GetU64(p + checksum_offset);
  if (XXH3_64bits(p, checksum_offset) != stored_checksum) {
    return Corrupt("header checksum mismatch");
  }
  // Checked after the checksum: a value that passes it was written by us, so
  // an oversized payload means a bug or a foreign file, not a bit flip.
  RecordHeader header;
  header.payload_bytes = GetU64(p + kPayloadBytesOffset);
  if (header.payload_bytes > Layout::kMaxBlockBytes) {
    return Corrupt("payload_bytes " + std::to_string(header.payload_bytes) + " exceeds " +
                   std::to_string(Layout::kMaxBlockBytes));
  }
  std::memcpy(header.key.bytes.data(), p + kKeyOffset, StoredKey::kSize);
  std::memcpy(header.ns.bytes.data(), p + kNsOffset, LayoutFingerprint::kSize);
  header.sequence = GetU64(p + kSequenceOffset);
  header.payload_checksum = GetU64(p + kPayloadChecksumOffset);
  header.owner.assign(reinterpret_cast<const char*>(p + kOwnerOffset), owner_len);
  header.annotation.assign(reinterpret_cast<const char*>(p + kOwnerOffset + owner_len + kAnnotationLenBytes),
                           annotation_len);
  return header;
}

uint64_t PayloadChecksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

}  // namespace kvtier
