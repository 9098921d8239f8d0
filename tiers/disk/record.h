// The disk tier's record: what one block looks like in a segment file
// (docs/disk-format.md describes it byte for byte). New records are bare
// (version 4):
//
//   bare (kBare; raw or coded payload):
//     [ payload: payload_bytes, zero-padded to 4096 ]
//
// and every fact about the record (key, namespace, sequence, payload size
// and XXH3-64, owner, codec, annotation) lives in its index entry, which
// the tier writes only once the record is durable. A read is served only
// if the payload's XXH3-64 matches the one its owner got from the index:
// torn writes, stale regions and bit flips are misses, never data. A
// region reused by another block's record fails that check too (its bytes
// are another payload's), unless they are the very same bytes.
//
// Records of older releases are still read (and carried forward as bare
// ones):
//
//   header page (kHeaderPage; raw; versions 1 and 2):
//     [ header: 4096 bytes ][ payload: payload_bytes, zero-padded to 4096 ]
//   trailer (kTrailer; a codec's output; version 3):
//     [ payload: payload_bytes ][ zeros ][ trailer: 96 bytes ]
//     the whole zero-padded to 4096; the trailer ends the record.
//
// Their header holds the fields below, little-endian, ending with an
// XXH3-64 of everything before it; such a record is served only if its
// header (or trailer) decodes (magic, version, checksum), names the
// expected key, and its payload's XXH3-64 matches. The header page cost a
// raw 4 KiB block as much disk again (and a raw 16 KiB one a quarter);
// a bare record costs its payload rounded up to a page. Payloads start
// 4 KiB aligned in every format, so records are written and read with
// O_DIRECT straight from the host pool's slots. The checksum covers the
// stored (encoded) bytes.
//
// Pure functions over caller buffers; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/key128.h"
#include "common/status.h"
#include "kernels/codec.h"

namespace kvtier {

struct RecordHeader {
  static constexpr uint64_t kMagic = 0x3130434552545650ull;  // "PVTREC01" little-endian
  // Version 1 has no annotation; a record with one is written as version 2.
  // Both are read.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint32_t kAnnotatedVersion = 2;
  static constexpr uint32_t kPackedVersion = 3;  // the trailer of a packed record
  // A bare record has no header on disk: its index entry says so.
  static constexpr uint32_t kBareVersion = 4;
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
  // How the payload is stored. kNone: it is the block (a raw record).
  // Otherwise it is what the codec wrote, payload_bytes long (less than
  // raw_bytes, the block's size), with the element type and the fp8 group
  // the decoder needs; the record is packed.
  CodecKind codec = CodecKind::kNone;
  DType dtype = DType::kBf16;  // packed only
  uint32_t group_elems = 0;    // packed only: elements per fp8 scale (0 for lossless)
  uint64_t raw_bytes = 0;      // packed only

  bool packed() const { return codec != CodecKind::kNone; }

  friend bool operator==(const RecordHeader&, const RecordHeader&) = default;
};

inline constexpr uint64_t kRecordAlignBytes = 4096;
// A packed record's trailer.
inline constexpr uint64_t kRecordTrailerBytes = 96;

// How a record lies on disk (the comment at the top).
enum class RecordFormat : uint8_t {
  kBare = 0,        // version 4: the payload alone; what the tier writes
  kHeaderPage = 1,  // versions 1 and 2: a raw payload behind a header page
  kTrailer = 2,     // version 3: a coded payload with a trailer
};
// The format a record of an older release has: a header page for a raw
// payload, a trailer for a codec's.
inline constexpr RecordFormat LegacyFormat(bool packed) {
  return packed ? RecordFormat::kTrailer : RecordFormat::kHeaderPage;
}

inline constexpr uint64_t AlignUpToPage(uint64_t bytes) {
  return (bytes + kRecordAlignBytes - 1) / kRecordAlignBytes * kRecordAlignBytes;
}
// Bytes a record with this payload takes on disk.
inline constexpr uint64_t RecordBytes(uint64_t payload_bytes, RecordFormat format = RecordFormat::kBare) {
  switch (format) {
    case RecordFormat::kHeaderPage:
      return RecordHeader::kBytes + AlignUpToPage(payload_bytes);
    case RecordFormat::kTrailer:
      return AlignUpToPage(payload_bytes + kRecordTrailerBytes);
    case RecordFormat::kBare:
      break;
  }
  return AlignUpToPage(payload_bytes);
}
// A record's whole pages of payload, written and read straight from and
// into the caller's buffer; the rest of a bare or trailer record (its tail:
// the last bytes of payload, zeros, and the trailer if any) goes through a
// buffer of the tier's.
inline constexpr uint64_t PackedHeadBytes(uint64_t payload_bytes) {
  return payload_bytes / kRecordAlignBytes * kRecordAlignBytes;
}

// Writes the header into `out` (exactly RecordHeader::kBytes; zero-filled
// beyond the encoded fields). REQUIRES: owner.size() <= kMaxOwnerBytes,
// annotation.size() <= kMaxAnnotationBytes.
void EncodeRecordHeader(const RecordHeader& header, std::span<uint8_t> out);

// Errors: kCorruption naming what is wrong (magic, version, header checksum,
// a length out of range) — the caller counts it and treats it as a miss.
Result<RecordHeader> DecodeRecordHeader(std::span<const uint8_t> in);

// A packed record's trailer: writes exactly kRecordTrailerBytes into `out`.
// REQUIRES: header.packed(). Owner and annotation are not part of it.
void EncodeRecordTrailer(const RecordHeader& header, std::span<uint8_t> out);
// Decodes the trailer in the last kRecordTrailerBytes of `record_tail`.
// Errors: kCorruption naming what is wrong (magic, version, checksum, a
// codec, type or length out of range).
Result<RecordHeader> DecodeRecordTrailer(std::span<const uint8_t> record_tail);

// XXH3-64 of a payload, as stored in the header.
uint64_t PayloadChecksum(std::span<const uint8_t> payload);

}  // namespace kvtier
