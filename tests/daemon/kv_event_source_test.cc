// KvEventSource (daemon/kv_event_source.h): metadata kept within its bound
// and let go when its blocks are, only for tenants that publish, and the
// disk annotation that carries it across restarts. A real publisher on an
// ipc endpoint counts what went out.
#include "daemon/kv_event_source.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "tiers/disk/record.h"

namespace kvtier {
namespace {

StoredKey KeyOf(uint32_t i) {
  StoredKey k;
  for (int b = 0; b < 4; ++b) k.bytes[12 + b] = static_cast<uint8_t>(i >> (8 * (3 - b)));
  k.bytes[0] = 0x5a;
  return k;
}

class KvEventSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("kvtier-source-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<KvEventSource> Make(uint64_t max_metadata_bytes) {
    KvEventPublisherOptions options;
    options.endpoint = "ipc://" + (dir_ / "events").string();
    options.cadence = std::chrono::milliseconds(1);
    Result<std::unique_ptr<KvEventPublisher>> p = KvEventPublisher::Start(std::move(options));
    EXPECT_TRUE(p.has_value()) << p.error();
    publisher_ = p->get();
    // Tenant 0 publishes, tenant 1 does not.
    return std::make_unique<KvEventSource>(
        std::move(*p), std::vector<KvEventSource::TenantTopic>{{.publish = true, .topic = "kv@n@a"},
                                                               {.publish = false, .topic = "kv@n@b"}},
        max_metadata_bytes);
  }
  uint64_t PublishedSoon(const KvEventSource& s, uint64_t at_least) {
    for (int i = 0; i < 2000 && s.publisher_counters().events_published < at_least; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return s.publisher_counters().events_published;
  }

  std::filesystem::path dir_;
  KvEventPublisher* publisher_ = nullptr;
};

StoreEventFields Fields(const std::vector<uint8_t>& hashes, const std::vector<uint32_t>& tokens, uint32_t block_size) {
  return {.hash_bytes = 8, .engine_hashes = hashes, .parent_hash = {}, .token_ids = tokens,
          .block_size = block_size, .lora_name = {}};
}

TEST_F(KvEventSourceTest, MetadataPastTheBoundIsRefusedCountedAndNeverAnnounced) {
  constexpr uint32_t kBlocks = 100;
  std::vector<StoredKey> keys;
  for (uint32_t i = 0; i < kBlocks; ++i) keys.push_back(KeyOf(i));
  std::vector<uint8_t> hashes(kBlocks * 8, 7);
  std::vector<uint32_t> tokens(kBlocks * 16, 3);
  // Room for about ten blocks' metadata (each counts its map node and its 16 tokens).
  std::unique_ptr<KvEventSource> probe = Make(1 << 20);
  probe->Remember(std::span(keys).first(1), Fields(std::vector<uint8_t>(8, 7), std::vector<uint32_t>(16, 3), 16));
  const uint64_t per_block = probe->counters().metadata_bytes;
  ASSERT_GT(per_block, 16u * 4);
  probe.reset();

  std::unique_ptr<KvEventSource> s = Make(10 * per_block + per_block / 2);
  s->Remember(keys, Fields(hashes, tokens, 16));
  EXPECT_EQ(s->counters().blocks_tracked, 10u);
  EXPECT_EQ(s->counters().metadata_refused, kBlocks - 10);
  EXPECT_LE(s->counters().metadata_bytes, 10 * per_block + per_block / 2);
  for (const StoredKey& k : keys) s->OnBlockPresent(k, 0, 1, Presence::kHost);
  s->Release(keys);  // the store is over; present blocks stay tracked
  EXPECT_EQ(s->counters().blocks_tracked, 10u);
  EXPECT_EQ(PublishedSoon(*s, 10), 10u) << "only tracked blocks are announced";
  EXPECT_FALSE(s->DiskAnnotation(keys[0], 0).empty());
  EXPECT_TRUE(s->DiskAnnotation(keys[99], 0).empty());
  for (const StoredKey& k : keys) s->OnBlockGone(k, 0, 1, Presence::kHost);
  EXPECT_EQ(s->counters().blocks_tracked, 0u);
  EXPECT_EQ(s->counters().metadata_bytes, 0u);
  EXPECT_EQ(PublishedSoon(*s, 20), 20u);
}

TEST_F(KvEventSourceTest, AStoreThatPlacedNothingLetsGoAndOtherTenantsAreNotPublished) {
  std::unique_ptr<KvEventSource> s = Make(1 << 20);
  const std::vector<StoredKey> keys = {KeyOf(1), KeyOf(2)};
  const std::vector<uint8_t> hashes(16, 1);
  s->Remember(keys, Fields(hashes, {}, 16));
  EXPECT_EQ(s->counters().blocks_tracked, 2u);
  s->OnBlockPresent(keys[0], 0, 1, Presence::kHbm);
  s->Release(keys);  // keys[1] never became present
  EXPECT_EQ(s->counters().blocks_tracked, 1u);
  // A move: present in host before it leaves hbm, so nothing is lost between.
  s->OnBlockPresent(keys[0], 0, 1, Presence::kHost);
  s->OnBlockGone(keys[0], 0, 1, Presence::kHbm);
  EXPECT_EQ(s->counters().blocks_tracked, 1u);
  // Tenant 1 does not publish: its blocks are ignored whatever is tracked.
  s->OnBlockPresent(keys[0], 1, 1, Presence::kDisk);
  EXPECT_TRUE(s->DiskAnnotation(keys[0], 1).empty());
  EXPECT_EQ(PublishedSoon(*s, 3), 3u);  // GPU stored, CPU stored, GPU removed
  s->OnBlockGone(keys[0], 0, 1, Presence::kHost);
  EXPECT_EQ(s->counters().blocks_tracked, 0u);
}

TEST(BlockAnnotationTest, RoundTripsAndLeavesOutTokensThatDoNotFit) {
  const EngineBlockHash hash = EngineBlockHash::FromU64(0xfedcba9876543210ull);
  const EngineBlockHash parent = *EngineBlockHash::From(std::vector<uint8_t>(32, 9));
  std::vector<uint32_t> tokens(64);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 1000 + 7;
  const std::string a = EncodeBlockAnnotation(hash, parent, tokens, 64, "adapter-1");
  ASSERT_LE(a.size(), RecordHeader::kMaxAnnotationBytes);
  std::optional<DecodedBlockAnnotation> d = DecodeBlockAnnotation(a);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->hash, hash);
  EXPECT_EQ(d->parent, parent);
  EXPECT_EQ(d->tokens, tokens);
  EXPECT_EQ(d->block_size, 64u);
  EXPECT_EQ(d->lora, "adapter-1");

  // 1,000 tokens do not fit in a record header: the hash goes alone.
  const std::vector<uint32_t> many(1000, 5);
  const std::string big = EncodeBlockAnnotation(hash, std::nullopt, many, 1000, "");
  ASSERT_LE(big.size(), RecordHeader::kMaxAnnotationBytes);
  d = DecodeBlockAnnotation(big);
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(d->tokens.empty());
  EXPECT_FALSE(d->parent.has_value());
  EXPECT_EQ(d->block_size, 1000u);

  // Anything else is refused, never misread.
  for (size_t cut = 0; cut < a.size(); ++cut) EXPECT_FALSE(DecodeBlockAnnotation(a.substr(0, cut))) << cut;
  std::string other = a;
  other[0] = 2;  // a format this kvtierd does not know
  EXPECT_FALSE(DecodeBlockAnnotation(other));
  EXPECT_FALSE(DecodeBlockAnnotation(a + "x"));
}

}  // namespace
}  // namespace kvtier
