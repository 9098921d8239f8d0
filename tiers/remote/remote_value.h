// The remote tier's value: one Redis value per block, a fixed header and the
// block's bytes (docs/remote-tier.md describes it byte for byte).
//
//   [ header: kBytes ][ payload: payload_bytes ]
//
// The header holds, little-endian: magic, format version, codec (0: the
// block's bytes; 1 lossless, 2 fp8: a codec's output, kernels/codec.h), the
// namespace fingerprint, the tenant-salted key, the payload's length, its raw
// length (as the codec restores it), an XXH3-64 of the payload (the stored
// bytes) and an XXH3-64 of the header before it. A value is served only if it decodes, names the
// key and namespace it was fetched for, is as long as it says, and its
// payload checksum matches: a truncated, replaced or corrupted value is a
// miss, never data.
//
// Redis keys: "<prefix><hex of the salted key>". The salted key already
// differs per tenant (common/chain_hash.h), so tenants never reach each
// other's values, and two fleets share a cluster through their prefixes.
//
// Pure functions over caller buffers; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/key128.h"
#include "common/status.h"
#include "kernels/codec.h"

namespace kvtier {

struct RemoteValueHeader {
  static constexpr uint64_t kMagic = 0x31305452564b5652ull;  // "RVKVTR01" little-endian
  static constexpr uint16_t kVersion = 1;
  static constexpr size_t kBytes = 80;
  static constexpr uint16_t kCodecRaw = 0;

  LayoutFingerprint ns;
  StoredKey key;
  uint16_t codec = kCodecRaw;
  uint64_t payload_bytes = 0;
  uint64_t raw_bytes = 0;         // the block's size before the codec (== payload_bytes when raw)
  uint64_t payload_checksum = 0;  // XXH3-64 of the payload bytes

  friend bool operator==(const RemoteValueHeader&, const RemoteValueHeader&) = default;
};

// Writes the header into `out` (exactly RemoteValueHeader::kBytes).
void EncodeRemoteValueHeader(const RemoteValueHeader& header, std::span<uint8_t> out);

// The header of a value, checked on its own. Errors: kCorruption naming what
// is wrong (short, magic, version, header checksum).
Result<RemoteValueHeader> DecodeRemoteValueHeader(std::span<const uint8_t> value);

// A whole value fetched for (ns, key): its header, checked against the
// payload that follows it. Errors: kCorruption for a header that does not
// decode, names another key or namespace, a length that is not the value's,
// or a payload checksum mismatch.
Result<RemoteValueHeader> CheckRemoteValue(std::span<const uint8_t> value,
                                           const LayoutFingerprint& ns, const StoredKey& key);

// CheckRemoteValue that also copies the payload into `out` (exactly its
// size), hashing it as it copies: one pass over the bytes. On an error `out`
// may hold part of the value: never serve it. Errors: as CheckRemoteValue's,
// and kCorruption for a payload that is not out's size.
Result<RemoteValueHeader> CopyRemoteValue(std::span<const uint8_t> value, const LayoutFingerprint& ns,
                                          const StoredKey& key, std::span<uint8_t> out);

// A value whose codec is not raw: checked as CheckRemoteValue does, its codec
// must be `codec`'s kind and its raw length out's size; then decoded into
// `out` with `coder`. Returns the header and the XXH3-64 of the decoded
// block. A raw value goes through CopyRemoteValue (its checksum is the
// block's). Errors: as CheckRemoteValue's, and kCorruption for a codec or
// raw length that is not the expected one, or bytes that do not decode; `out`
// is then not to be served.
Result<std::pair<RemoteValueHeader, uint64_t>> DecodeRemoteValue(std::span<const uint8_t> value,
                                                                 const LayoutFingerprint& ns, const StoredKey& key,
                                                                 const CodecParams& codec, BlockCodec& coder,
                                                                 std::span<uint8_t> out);

// XXH3-64 of a payload, as the header stores it.
uint64_t RemotePayloadChecksum(std::span<const uint8_t> payload);

// The Redis key of a block: `prefix` followed by the salted key in hex.
std::string RemoteKey(std::string_view prefix, const StoredKey& key);

}  // namespace kvtier
