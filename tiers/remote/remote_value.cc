#include "tiers/remote/remote_value.h"

#include <xxhash.h>

#include <cstring>
#include <string>
#include <utility>

#include "common/check.h"
#include "kernels/copy_reference.h"

namespace kvtier {
namespace {

// Offsets of the version-1 fields (docs/remote-tier.md has the same table).
constexpr size_t kMagicOffset = 0;
constexpr size_t kVersionOffset = 8;
constexpr size_t kCodecOffset = 10;
constexpr size_t kHeaderBytesOffset = 12;  // u32: kBytes, for readers of later versions
constexpr size_t kNsOffset = 16;
constexpr size_t kKeyOffset = 32;
constexpr size_t kPayloadBytesOffset = 48;
constexpr size_t kRawBytesOffset = 56;
constexpr size_t kPayloadChecksumOffset = 64;
constexpr size_t kHeaderChecksumOffset = 72;
static_assert(kHeaderChecksumOffset + 8 == RemoteValueHeader::kBytes);

void Put(uint8_t* out, uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
Status Corrupt(std::string message) { return Status(StatusCode::kCorruption, std::move(message)); }

uint64_t Get(const uint8_t* in, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= uint64_t{in[i]} << (8 * i);
  return v;
}

}  // namespace

uint64_t RemotePayloadChecksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

void EncodeRemoteValueHeader(const RemoteValueHeader& header, std::span<uint8_t> out) {
  KVTIER_CHECK(out.size() == RemoteValueHeader::kBytes);
  uint8_t* p = out.data();
  Put(p + kMagicOffset, RemoteValueHeader::kMagic, 8);
  Put(p + kVersionOffset, RemoteValueHeader::kVersion, 2);
  Put(p + kCodecOffset, header.codec, 2);
  Put(p + kHeaderBytesOffset, RemoteValueHeader::kBytes, 4);
  std::memcpy(p + kNsOffset, header.ns.bytes.data(), LayoutFingerprint::kSize);
  std::memcpy(p + kKeyOffset, header.key.bytes.data(), StoredKey::kSize);
  Put(p + kPayloadBytesOffset, header.payload_bytes, 8);
  Put(p + kRawBytesOffset, header.raw_bytes, 8);
  Put(p + kPayloadChecksumOffset, header.payload_checksum, 8);
  Put(p + kHeaderChecksumOffset, XXH3_64bits(p, kHeaderChecksumOffset), 8);
}

Result<RemoteValueHeader> DecodeRemoteValueHeader(std::span<const uint8_t> value) {
  if (value.size() < RemoteValueHeader::kBytes) {
    return Err(Corrupt("remote value of " + std::to_string(value.size()) +
                       " bytes is shorter than its header"));
  }
  const uint8_t* p = value.data();
  if (Get(p + kMagicOffset, 8) != RemoteValueHeader::kMagic)
    return Err(Corrupt("remote value: bad magic"));
  if (Get(p + kHeaderChecksumOffset, 8) != XXH3_64bits(p, kHeaderChecksumOffset)) {
    return Err(Corrupt("remote value: header checksum mismatch"));
  }
  const uint64_t version = Get(p + kVersionOffset, 2);
  if (version != RemoteValueHeader::kVersion ||
      Get(p + kHeaderBytesOffset, 4) != RemoteValueHeader::kBytes) {
    return Err(Corrupt("remote value: format version " + std::to_string(version) + " is not " +
                       std::to_string(RemoteValueHeader::kVersion)));
  }
  RemoteValueHeader h;
  h.codec = static_cast<uint16_t>(Get(p + kCodecOffset, 2));
  std::memcpy(h.ns.bytes.data(), p + kNsOffset, LayoutFingerprint::kSize);
  std::memcpy(h.key.bytes.data(), p + kKeyOffset, StoredKey::kSize);
  h.payload_bytes = Get(p + kPayloadBytesOffset, 8);
  h.raw_bytes = Get(p + kRawBytesOffset, 8);
  h.payload_checksum = Get(p + kPayloadChecksumOffset, 8);
  return h;
}

namespace {

// Everything CheckRemoteValue checks but the payload's checksum.
Result<RemoteValueHeader> CheckHeaderOf(std::span<const uint8_t> value, const LayoutFingerprint& ns,
                                        const StoredKey& key) {
  KVTIER_ASSIGN_OR_RETURN(RemoteValueHeader h, DecodeRemoteValueHeader(value));
  if (h.key != key)
    return Err(Corrupt("remote value names key " + h.key.ToHex() + ", not " + key.ToHex()));
  if (h.ns != ns)
    return Err(Corrupt("remote value names namespace " + h.ns.ToHex() + ", not " + ns.ToHex()));
  const uint64_t payload = value.size() - RemoteValueHeader::kBytes;
  if (h.payload_bytes != payload) {
    return Err(Corrupt("remote value holds " + std::to_string(payload) +
                       " payload bytes; its header says " + std::to_string(h.payload_bytes)));
  }
  return h;
}

Status PayloadChecksumMismatch() { return Corrupt("remote value: payload checksum mismatch"); }

}  // namespace

Result<RemoteValueHeader> CheckRemoteValue(std::span<const uint8_t> value,
                                           const LayoutFingerprint& ns, const StoredKey& key) {
  KVTIER_ASSIGN_OR_RETURN(RemoteValueHeader h, CheckHeaderOf(value, ns, key));
  if (RemotePayloadChecksum(value.subspan(RemoteValueHeader::kBytes)) != h.payload_checksum) {
    return Err(PayloadChecksumMismatch());
  }
  return h;
}

Result<RemoteValueHeader> CopyRemoteValue(std::span<const uint8_t> value, const LayoutFingerprint& ns,
                                          const StoredKey& key, std::span<uint8_t> out) {
  KVTIER_ASSIGN_OR_RETURN(RemoteValueHeader h, CheckHeaderOf(value, ns, key));
  if (h.payload_bytes != out.size()) {
    return Err(Corrupt("remote value of " + std::to_string(h.payload_bytes) + " bytes for a block of " +
                       std::to_string(out.size())));
  }
  if (CopyWithChecksum(out.data(), value.data() + RemoteValueHeader::kBytes, out.size()) != h.payload_checksum) {
    return Err(PayloadChecksumMismatch());
  }
  return h;
}

Result<std::pair<RemoteValueHeader, uint64_t>> DecodeRemoteValue(std::span<const uint8_t> value,
                                                                 const LayoutFingerprint& ns, const StoredKey& key,
                                                                 const CodecParams& codec, BlockCodec& coder,
                                                                 std::span<uint8_t> out) {
  KVTIER_ASSIGN_OR_RETURN(RemoteValueHeader h, CheckRemoteValue(value, ns, key));
  if (h.codec != static_cast<uint16_t>(codec.kind) || codec.kind == CodecKind::kNone) {
    return Err(Corrupt("remote value of codec " + std::to_string(h.codec) + " where its namespace's is " +
                       std::string(CodecName(codec.kind))));
  }
  if (h.raw_bytes != out.size()) {
    return Err(Corrupt("remote value decodes to " + std::to_string(h.raw_bytes) + " bytes for a block of " +
                       std::to_string(out.size())));
  }
  KVTIER_RETURN_IF_ERROR(coder.Decode(codec, value.subspan(RemoteValueHeader::kBytes), out));
  return std::pair(h, RemotePayloadChecksum(out));
}

std::string RemoteKey(std::string_view prefix, const StoredKey& key) {
  std::string out(prefix);
  out += key.ToHex();
  return out;
}

}  // namespace kvtier
