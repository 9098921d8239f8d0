// Fuzz target: disk record headers, through the decoder the disk tier runs on
// every read and on recovery (tiers/disk/record.h).
//
// Two properties: decoding arbitrary bytes (as a header page, and as a
// packed record's trailer) never crashes and either fails with kCorruption
// or yields a header that re-encodes to the same bytes (the trailer) or to
// bytes that decode to the same header (the page); and any header built from the input's fields survives an
// encode/decode round trip unchanged.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "common/check.h"
#include "common/layout.h"
#include "tiers/disk/record.h"

using kvtier::RecordHeader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> page(RecordHeader::kBytes, 0);
  std::memcpy(page.data(), data, std::min<size_t>(size, page.size()));
  kvtier::Result<RecordHeader> h = kvtier::DecodeRecordHeader(page);
  if (h) {
    std::vector<uint8_t> again(RecordHeader::kBytes);
    kvtier::EncodeRecordHeader(*h, again);
    kvtier::Result<RecordHeader> back = kvtier::DecodeRecordHeader(again);
    KVTIER_CHECK(back.has_value() && *back == *h);
  } else {
    KVTIER_CHECK(h.error().code() == kvtier::StatusCode::kCorruption);
  }

  // The same for a packed record's trailer, read from the input's end.
  kvtier::Result<RecordHeader> t = kvtier::DecodeRecordTrailer(std::span<const uint8_t>(data, size));
  if (t) {
    std::vector<uint8_t> again(kvtier::kRecordTrailerBytes);
    kvtier::EncodeRecordTrailer(*t, again);
    KVTIER_CHECK(std::equal(again.begin(), again.end(), data + size - again.size()));
  } else {
    KVTIER_CHECK(t.error().code() == kvtier::StatusCode::kCorruption);
  }

  // A header from the input's fields.
  if (size < 16 + 16 + 8 * 3 + 1) return 0;
  RecordHeader built;
  std::memcpy(built.key.bytes.data(), data, 16);
  std::memcpy(built.ns.bytes.data(), data + 16, 16);
  std::memcpy(&built.sequence, data + 32, 8);
  std::memcpy(&built.payload_bytes, data + 40, 8);
  built.payload_bytes = 1 + built.payload_bytes % kvtier::Layout::kMaxBlockBytes;  // 0 is corruption
  std::memcpy(&built.payload_checksum, data + 48, 8);
  const size_t owner = std::min<size_t>(data[56] % (RecordHeader::kMaxOwnerBytes + 1), size - 57);
  built.owner.assign(reinterpret_cast<const char*>(data + 57), owner);
  std::vector<uint8_t> encoded(RecordHeader::kBytes);
  kvtier::EncodeRecordHeader(built, encoded);
  kvtier::Result<RecordHeader> decoded = kvtier::DecodeRecordHeader(encoded);
  KVTIER_CHECK(decoded.has_value() && *decoded == built);
  return 0;
}
