// KV events' msgpack bytes, pinned: the map encoding is what vLLM 0.33.0's
// own classes (vllm.distributed.kv_events, msgspec) encode for the same
// batch; the positional one is what vLLM did before #42892 (notes:
// shared/notes/kv-events.md). The Python tests decode kvtierd's batches
// with vLLM's classes too.
#include "daemon/kv_events.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier {
namespace {

std::string Hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

constexpr double kTs = 1700000000.5;
constexpr uint64_t kHash = 15760518052499183552ull;

BlockStoredEvent Stored() {
  return BlockStoredEvent{.block_hashes = {EngineBlockHash::FromU64(kHash)},
                          .parent_block_hash = std::nullopt,
                          .token_ids = {151644, 872, 198, 9064},
                          .block_size = 4,
                          .lora_name = std::nullopt,
                          .medium = KvEventMedium::kGpu};
}

std::string Encode(KvEvent e, bool positional, std::optional<int32_t> dp = 0, bool bytes = false) {
  const KvEvent events[] = {std::move(e)};
  return Hex(EncodeKvEventBatch(kTs, events, dp, {.positional = positional, .hashes_as_bytes = bytes}));
}

TEST(KvEventsTest, MapEncodingIsVllms) {
  // KVEventBatch(ts=1700000000.5, events=[BlockStored(...)], data_parallel_rank=0)
  EXPECT_EQ(Encode(Stored(), false),
            "93cb41d954fc4020000091de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdab89baa7b"
            "5857c0b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce0002505ccd0368ccc6cd2368aa626c6f63"
            "6b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000");
  EXPECT_EQ(Encode(BlockRemovedEvent{.block_hashes = {EngineBlockHash::FromU64(kHash)}, .medium = KvEventMedium::kCpu},
                   false),
            "93cb41d954fc402000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdab89baa7b58"
            "57c0a66d656469756da343505500");
  EXPECT_EQ(Encode(AllBlocksClearedEvent{}, false),
            "93cb41d954fc402000009181a474797065b0416c6c426c6f636b73436c656172656400");
}

TEST(KvEventsTest, HashesAsBytesWithAParentALoraAndNoRank) {
  BlockStoredEvent e{.block_hashes = {*EngineBlockHash::From(std::vector<uint8_t>(32, 0x01))},
                     .parent_block_hash = EngineBlockHash::From(std::vector<uint8_t>(32, 0x02)),
                     .token_ids = {1, 2},
                     .block_size = 2,
                     .lora_name = "ad",
                     .medium = KvEventMedium::kDisk};
  EXPECT_EQ(Encode(e, false, std::nullopt, /*bytes=*/true),
            "93cb41d954fc4020000091de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c42001010101"
            "01010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f636b5f68617368c420020202"
            "0202020202020202020202020202020202020202020202020202020202a9746f6b656e5f696473920102aa626c6f636b5f7369"
            "7a6502a76c6f72615f6964c0a66d656469756da44449534ba96c6f72615f6e616d65a26164c0");
}

TEST(KvEventsTest, PositionalEncodingIsTheOlderVllms) {
  EXPECT_EQ(Encode(Stored(), true),
            "93cb41d954fc402000009198ab426c6f636b53746f72656491cfdab89baa7b5857c0c094ce0002505ccd0368ccc6cd236804c0"
            "a3475055c000");
  EXPECT_EQ(Encode(Stored(), true).size() / 2, 57u);  // the notes' hand-encoded example
  EXPECT_EQ(Encode(BlockRemovedEvent{.block_hashes = {EngineBlockHash::FromU64(kHash)}, .medium = KvEventMedium::kCpu},
                   true),
            "93cb41d954fc402000009193ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a343505500");
  EXPECT_EQ(Encode(AllBlocksClearedEvent{}, true), "93cb41d954fc402000009191b0416c6c426c6f636b73436c656172656400");
}

TEST(KvEventsTest, HashesAreTheirLow64BitsBigEndian) {
  std::vector<uint8_t> digest(32);
  for (size_t i = 0; i < digest.size(); ++i) digest[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(EngineBlockHash::From(digest)->Low64(), 0x18191a1b1c1d1e1full);
  EXPECT_EQ(EngineBlockHash::From(std::vector<uint8_t>{0x12, 0x34})->Low64(), 0x1234u);
  EXPECT_EQ(EngineBlockHash::FromU64(kHash).Low64(), kHash);
  EXPECT_FALSE(EngineBlockHash::From(std::vector<uint8_t>(33)).has_value());
  EXPECT_EQ(KvEventMediumName(KvEventMedium::kExternal), "EXTERNAL");
}

}  // namespace
}  // namespace kvtier
