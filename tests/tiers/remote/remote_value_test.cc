// The remote tier's value format: what is served, and every way a value read
// back from Redis can be wrong, each a kCorruption (a miss), never data.
#include "tiers/remote/remote_value.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <vector>

namespace kvtier {
namespace {

struct Value {
  RemoteValueHeader header;
  std::vector<uint8_t> bytes;
};

Value MakeValue(uint8_t key_byte, size_t payload_bytes) {
  Value v;
  v.header.ns.bytes.fill(0x11);
  v.header.key.bytes.fill(key_byte);
  v.header.payload_bytes = payload_bytes;
  v.header.raw_bytes = payload_bytes;
  std::vector<uint8_t> payload(payload_bytes);
  for (size_t i = 0; i < payload_bytes; ++i) payload[i] = static_cast<uint8_t>(i * 31 + key_byte);
  v.header.payload_checksum = RemotePayloadChecksum(payload);
  v.bytes.resize(RemoteValueHeader::kBytes);
  EncodeRemoteValueHeader(v.header, v.bytes);
  v.bytes.insert(v.bytes.end(), payload.begin(), payload.end());
  return v;
}

void ExpectCorrupt(const Result<RemoteValueHeader>& r, const std::string& what) {
  ASSERT_FALSE(r.has_value()) << what;
  EXPECT_EQ(r.error().code(), StatusCode::kCorruption) << what;
  EXPECT_NE(r.error().message().find(what), std::string::npos) << r.error().message();
}

TEST(RemoteValueTest, AValueRoundTrips) {
  const Value v = MakeValue(7, 4096);
  Result<RemoteValueHeader> h = CheckRemoteValue(v.bytes, v.header.ns, v.header.key);
  ASSERT_TRUE(h.has_value()) << h.error();
  EXPECT_EQ(*h, v.header);
  EXPECT_EQ(RemoteValueHeader::kBytes, 80u);
}

TEST(RemoteValueTest, EveryWrongValueIsCorruption) {
  const Value v = MakeValue(7, 1000);
  const LayoutFingerprint ns = v.header.ns;
  const StoredKey key = v.header.key;

  ExpectCorrupt(CheckRemoteValue(std::span(v.bytes).first(40), ns, key), "shorter than its header");
  std::vector<uint8_t> bad = v.bytes;
  bad[0] ^= 1;
  ExpectCorrupt(CheckRemoteValue(bad, ns, key), "bad magic");
  bad = v.bytes;
  bad[20] ^= 1;  // inside the namespace: the header checksum catches it
  ExpectCorrupt(CheckRemoteValue(bad, ns, key), "header checksum");
  bad = v.bytes;
  bad.back() ^= 0x80;  // a bit flip in the payload
  ExpectCorrupt(CheckRemoteValue(bad, ns, key), "payload checksum");
  bad = v.bytes;
  bad.pop_back();  // truncated
  ExpectCorrupt(CheckRemoteValue(bad, ns, key), "holds 999 payload bytes");
  bad = v.bytes;
  bad.push_back(0);  // appended to
  ExpectCorrupt(CheckRemoteValue(bad, ns, key), "holds 1001 payload bytes");

  // Another block's value under this key (replaced by someone writing to
  // the cluster directly), or this block's value asked for in another
  // namespace: well formed, but not what was asked for.
  const Value other = MakeValue(8, 1000);
  ExpectCorrupt(CheckRemoteValue(other.bytes, ns, key), "names key");
  LayoutFingerprint other_ns = ns;
  other_ns.bytes[0] ^= 1;
  ExpectCorrupt(CheckRemoteValue(v.bytes, other_ns, key), "names namespace");
}

TEST(RemoteValueTest, CopyRemoteValueChecksAsItCopies) {
  const Value v = MakeValue(7, 5000);
  std::vector<uint8_t> out(5000);
  Result<RemoteValueHeader> h = CopyRemoteValue(v.bytes, v.header.ns, v.header.key, out);
  ASSERT_TRUE(h.has_value()) << h.error();
  EXPECT_EQ(*h, v.header);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), v.bytes.begin() + RemoteValueHeader::kBytes));

  std::vector<uint8_t> bad = v.bytes;
  bad[RemoteValueHeader::kBytes + 4321] ^= 0x10;
  ExpectCorrupt(CopyRemoteValue(bad, v.header.ns, v.header.key, out), "payload checksum");
  std::vector<uint8_t> small(4999);
  ExpectCorrupt(CopyRemoteValue(v.bytes, v.header.ns, v.header.key, small), "5000 bytes for a block of 4999");
  const Value other = MakeValue(8, 5000);
  ExpectCorrupt(CopyRemoteValue(other.bytes, v.header.ns, v.header.key, out), "names key");
}

TEST(RemoteValueTest, ALaterFormatVersionIsRefused) {
  Value v = MakeValue(7, 16);
  v.bytes[8] = 2;  // version 2, with a header checksum that matches it
  const uint64_t checksum = XXH3_64bits(v.bytes.data(), 72);
  for (size_t i = 0; i < 8; ++i) v.bytes[72 + i] = static_cast<uint8_t>(checksum >> (8 * i));
  ExpectCorrupt(CheckRemoteValue(v.bytes, v.header.ns, v.header.key), "format version 2 is not 1");
}

TEST(RemoteValueTest, KeysArePrefixedHex) {
  StoredKey key;
  key.bytes.fill(0xab);
  std::string hex;
  for (int i = 0; i < 16; ++i) hex += "ab";
  EXPECT_EQ(RemoteKey("kvtier:prod:", key), "kvtier:prod:" + hex);
}

}  // namespace
}  // namespace kvtier
