#include "tiers/disk/record.h"

#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // AVX2 where the CPU has it, for the payloads' checksums
#endif

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
  KVTIER_CHECK_MSG(!header.packed(), "a packed record has a trailer, not a header page");
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
  if (header.payload_bytes == 0 || header.payload_bytes > Layout::kMaxBlockBytes) {
    return Corrupt("payload_bytes " + std::to_string(header.payload_bytes) + " is not from 1 to " +
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

namespace {

// Offsets of the trailer's fields (version 3; docs/disk-format.md).
constexpr size_t kTrailerMagicOffset = 0;
constexpr size_t kTrailerVersionOffset = 8;
constexpr size_t kTrailerBytesOffset = 12;
constexpr size_t kTrailerKeyOffset = 16;
constexpr size_t kTrailerNsOffset = 32;
constexpr size_t kTrailerSequenceOffset = 48;
constexpr size_t kTrailerPayloadBytesOffset = 56;
constexpr size_t kTrailerPayloadChecksumOffset = 64;
constexpr size_t kTrailerRawBytesOffset = 72;
constexpr size_t kTrailerCodecOffset = 80;
constexpr size_t kTrailerDTypeOffset = 81;
constexpr size_t kTrailerReservedOffset = 82;  // u16, zero
constexpr size_t kTrailerGroupOffset = 84;
constexpr size_t kTrailerChecksumOffset = 88;
static_assert(kTrailerChecksumOffset + kChecksumBytes == kRecordTrailerBytes);

tl::unexpected<Status> CorruptTrailer(std::string what) {
  return Err(StatusCode::kCorruption, "record trailer: " + std::move(what));
}

}  // namespace

void EncodeRecordTrailer(const RecordHeader& header, std::span<uint8_t> out) {
  KVTIER_CHECK_MSG(out.size() == kRecordTrailerBytes, "record trailer buffer must be 96 bytes");
  KVTIER_CHECK_MSG(header.packed(), "only a packed record has a trailer");
  uint8_t* p = out.data();
  std::fill(out.begin(), out.end(), uint8_t{0});
  PutU64(p + kTrailerMagicOffset, RecordHeader::kMagic);
  PutU32(p + kTrailerVersionOffset, RecordHeader::kPackedVersion);
  PutU32(p + kTrailerBytesOffset, static_cast<uint32_t>(kRecordTrailerBytes));
  std::memcpy(p + kTrailerKeyOffset, header.key.bytes.data(), StoredKey::kSize);
  std::memcpy(p + kTrailerNsOffset, header.ns.bytes.data(), LayoutFingerprint::kSize);
  PutU64(p + kTrailerSequenceOffset, header.sequence);
  PutU64(p + kTrailerPayloadBytesOffset, header.payload_bytes);
  PutU64(p + kTrailerPayloadChecksumOffset, header.payload_checksum);
  PutU64(p + kTrailerRawBytesOffset, header.raw_bytes);
  p[kTrailerCodecOffset] = static_cast<uint8_t>(header.codec);
  p[kTrailerDTypeOffset] = static_cast<uint8_t>(header.dtype);
  PutU32(p + kTrailerGroupOffset, header.group_elems);
  PutU64(p + kTrailerChecksumOffset, XXH3_64bits(p, kTrailerChecksumOffset));
}

Result<RecordHeader> DecodeRecordTrailer(std::span<const uint8_t> record_tail) {
  if (record_tail.size() < kRecordTrailerBytes) {
    return CorruptTrailer("input is " + std::to_string(record_tail.size()) + " bytes, need " +
                          std::to_string(kRecordTrailerBytes));
  }
  const uint8_t* p = record_tail.data() + record_tail.size() - kRecordTrailerBytes;
  if (const uint64_t magic = GetU64(p + kTrailerMagicOffset); magic != RecordHeader::kMagic) {
    return CorruptTrailer("bad magic " + Hex64(magic));
  }
  if (const uint32_t version = GetU32(p + kTrailerVersionOffset); version != RecordHeader::kPackedVersion) {
    return CorruptTrailer("unsupported version " + std::to_string(version));
  }
  if (GetU32(p + kTrailerBytesOffset) != kRecordTrailerBytes) {
    return CorruptTrailer("trailer_bytes " + std::to_string(GetU32(p + kTrailerBytesOffset)) + " is not " +
                          std::to_string(kRecordTrailerBytes));
  }
  if (XXH3_64bits(p, kTrailerChecksumOffset) != GetU64(p + kTrailerChecksumOffset)) {
    return CorruptTrailer("trailer checksum mismatch");
  }
  // Checked after the checksum: values that pass it were written by us, so
  // one out of range means a bug or a foreign file, not a bit flip.
  RecordHeader h;
  std::memcpy(h.key.bytes.data(), p + kTrailerKeyOffset, StoredKey::kSize);
  std::memcpy(h.ns.bytes.data(), p + kTrailerNsOffset, LayoutFingerprint::kSize);
  h.sequence = GetU64(p + kTrailerSequenceOffset);
  h.payload_bytes = GetU64(p + kTrailerPayloadBytesOffset);
  h.payload_checksum = GetU64(p + kTrailerPayloadChecksumOffset);
  h.raw_bytes = GetU64(p + kTrailerRawBytesOffset);
  const uint8_t codec = p[kTrailerCodecOffset];
  const uint8_t dtype = p[kTrailerDTypeOffset];
  h.group_elems = GetU32(p + kTrailerGroupOffset);
  if (codec != static_cast<uint8_t>(CodecKind::kLossless) && codec != static_cast<uint8_t>(CodecKind::kFp8)) {
    return CorruptTrailer("codec " + std::to_string(codec) + " is not lossless (1) or fp8 (2)");
  }
  h.codec = static_cast<CodecKind>(codec);
  if (DTypeSizeBytes(static_cast<DType>(dtype)) == 0) return CorruptTrailer("unknown dtype " + std::to_string(dtype));
  h.dtype = static_cast<DType>(dtype);
  if (p[kTrailerReservedOffset] != 0 || p[kTrailerReservedOffset + 1] != 0) {
    return CorruptTrailer("reserved bytes are not zero");
  }
  if (h.payload_bytes == 0 || h.raw_bytes > Layout::kMaxBlockBytes || h.payload_bytes >= h.raw_bytes) {
    return CorruptTrailer("payload_bytes " + std::to_string(h.payload_bytes) + " and raw_bytes " +
                          std::to_string(h.raw_bytes) + " out of range (0 < payload < raw <= " +
                          std::to_string(Layout::kMaxBlockBytes) + ")");
  }
  if (Status st = CheckCodec(CodecParams{h.codec, h.dtype, h.group_elems}); !st.ok()) {
    return CorruptTrailer(st.message());
  }
  return h;
}

uint64_t PayloadChecksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

}  // namespace kvtier
