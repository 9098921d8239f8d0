// Compression end to end (issue 18): a real kvtierd with a codec pool (and a
// disk tier, or none), real client processes registering KV caches with a
// codec.
//   - without a disk tier, host memory holds more coded blocks than raw ones;
//   - lossless blocks come back bit-exact from disk, also after a restart;
//   - fp8 blocks come back within fp8's bound, in a namespace of their own:
//     a cache registered without fp8 never loads them;
//   - a tenant asks only for the codecs its config allows.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "kernels/codec.h"
#include "kernels/fp8_e4m3.h"
#include "tests/integration/disk_helpers.h"

namespace kvtier::testing {
namespace {

std::vector<std::string> Sets(const std::string& codecs) {
  std::vector<std::string> sets = DiskSets("auto");
  sets.back() = "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true, codecs: " + codecs + "}]";
  return sets;
}

// 64 KiB blocks: slots' and records' 4 KiB steps cost little, as with real
// models' blocks (a 16 KiB block that codes 1.3x saves no page on disk, and
// is written raw).
Layout BigLayout() {
  LayoutSpec spec = SmallLayout().spec();
  spec.num_layers = 8;
  return Layout::Create(spec).value();
}

struct CodedSession {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmKvCache> cache;
  CacheId id = 0;
};

Result<CodedSession> OpenCoded(const DaemonProcess& d, CodecChoice codec, const Layout& layout = SmallLayout()) {
  CodedSession s;
  KVTIER_ASSIGN_OR_RETURN(s.client, Client::Connect({.socket_path = d.socket_path(), .client_name = "coded"}));
  s.cache = std::make_unique<ShmKvCache>(ShmKvCache::Create(layout, 64).value());
  KVTIER_ASSIGN_OR_RETURN(s.id, s.client->RegisterKvCache(*s.cache, codec));
  return s;
}

// Stores `keys` from blocks of bf16 N(0,1) values; remembers the bytes.
void StoreKv(CodedSession& s, const std::vector<BlockKey>& keys, std::mt19937_64& rng,
             std::map<BlockKey, std::vector<uint8_t>>* stored) {
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < keys.size(); i += 16) {
    const size_t n = std::min<size_t>(16, keys.size() - i);
    std::vector<uint32_t> ids(n);
    for (size_t j = 0; j < n; ++j) {
      ids[j] = static_cast<uint32_t>(j);
      std::span<uint8_t> b = s.cache->block(ids[j]);
      for (size_t k = 0; k < b.size(); k += 2) {
        const uint16_t v = fp8::FloatToBf16(normal(rng));
        std::memcpy(&b[k], &v, 2);
      }
      (*stored)[keys[i + j]].assign(b.begin(), b.end());
    }
    Result<OpResult> r = s.client->Store(s.id, std::span(keys).subspan(i, n), ids);
    ASSERT_TRUE(r.has_value()) << r.error();
    ASSERT_EQ(r->blocks, n);
  }
}

// Flushes until every key is on disk.
bool Settle(CodedSession& s, const std::vector<BlockKey>& keys) {
  for (int i = 0; i < 1000; ++i) {
    if (!s.client->Flush()) return false;
    bool all = true;
    for (const BlockKey& k : keys) {
      Result<LookupResult> l = s.client->Lookup(s.id, std::span(&k, 1));
      all = all && l && l->hits == 1 && l->tiers[0] == BlockTier::kDisk;
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::optional<std::vector<uint8_t>> Load(CodedSession& s, const BlockKey& key) {
  std::span<uint8_t> b = s.cache->block(40);
  std::fill(b.begin(), b.end(), 0);
  Result<OpResult> r = s.client->Load(s.id, std::span(&key, 1), std::vector<uint32_t>{40});
  if (!r || r->blocks != 1) return std::nullopt;
  return std::vector<uint8_t>(b.begin(), b.end());
}

// Every element within fp8's bound of what was stored (groups of head_dim = 64).
bool WithinFp8Bound(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
  return kvtier::WithinFp8Bound({.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 64}, want, got);
}

TEST(CompressionTest, LosslessAndFp8BlocksComeBackFromDiskAndAfterARestart) {
  Result<DaemonProcess> d = DaemonProcess::Start(Sets("[none, lossless, fp8]"));
  ASSERT_TRUE(d.has_value()) << d.error();
  std::mt19937_64 rng(18);
  std::map<BlockKey, std::vector<uint8_t>> stored;
  std::map<BlockKey, std::vector<uint8_t>> fp8_stored;
  std::vector<BlockKey> lossless_keys;
  std::vector<BlockKey> fp8_keys;
  {
    Result<CodedSession> lossless = OpenCoded(*d, {.kind = CodecKind::kLossless}, BigLayout());
    ASSERT_TRUE(lossless.has_value()) << lossless.error();
    Result<CodedSession> fp8 = OpenCoded(*d, {.kind = CodecKind::kFp8}, BigLayout());
    ASSERT_TRUE(fp8.has_value()) << fp8.error();
    // The same prompt through both: the same chain keys, other blocks.
    lossless_keys = lossless->client->ComputeKeys(lossless->id, Prompt(1, 24)).value();
    fp8_keys = fp8->client->ComputeKeys(fp8->id, Prompt(1, 24)).value();
    ASSERT_EQ(lossless_keys, fp8_keys);
    StoreKv(*lossless, lossless_keys, rng, &stored);
    ASSERT_TRUE(Settle(*lossless, lossless_keys)) << d->Log();
    StoreKv(*fp8, fp8_keys, rng, &fp8_stored);
    ASSERT_TRUE(Settle(*fp8, fp8_keys)) << d->Log();
    const DaemonStats st = lossless->client->Stats().value();
    EXPECT_EQ(st.Counter("codec_encoded"), 48u) << "codec_pool_busy " << st.Counter("codec_pool_busy");
    EXPECT_LT(st.Counter("codec_stored_bytes") * 13, st.Counter("codec_raw_bytes") * 10);
    for (const BlockKey& k : lossless_keys) {
      std::optional<std::vector<uint8_t>> got = Load(*lossless, k);
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(*got, stored.at(k)) << "a lossless block must come back bit-exact";
    }
    for (const BlockKey& k : fp8_keys) {
      std::optional<std::vector<uint8_t>> got = Load(*fp8, k);
      ASSERT_TRUE(got.has_value());
      EXPECT_TRUE(WithinFp8Bound(fp8_stored.at(k), *got));
      EXPECT_NE(*got, stored.at(k)) << "the fp8 cache loaded the lossless namespace's block";
    }
    // A cache registered without a codec shares the lossless blocks (they
    // are bit-exact) and never sees the fp8 ones.
    Result<CodedSession> plain = OpenCoded(*d, {}, BigLayout());
    ASSERT_TRUE(plain.has_value()) << plain.error();
    std::optional<std::vector<uint8_t>> got = Load(*plain, lossless_keys[3]);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(*got, stored.at(lossless_keys[3]));
  }
  const int status = d->Stop();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  ASSERT_TRUE(d->Restart().ok()) << d->Log();
  Result<CodedSession> lossless = OpenCoded(*d, {.kind = CodecKind::kLossless}, BigLayout());
  ASSERT_TRUE(lossless.has_value()) << lossless.error();
  for (const BlockKey& k : lossless_keys) {
    std::optional<std::vector<uint8_t>> got = Load(*lossless, k);
    ASSERT_TRUE(got.has_value()) << "a restart must be warm";
    EXPECT_EQ(*got, stored.at(k));
  }
  Result<CodedSession> fp8 = OpenCoded(*d, {.kind = CodecKind::kFp8}, BigLayout());
  ASSERT_TRUE(fp8.has_value()) << fp8.error();
  for (const BlockKey& k : fp8_keys) {
    std::optional<std::vector<uint8_t>> got = Load(*fp8, k);
    ASSERT_TRUE(got.has_value()) << "a restart must be warm";
    EXPECT_TRUE(WithinFp8Bound(fp8_stored.at(k), *got));
  }
  EXPECT_EQ(fp8->client->Stats().value().Counter("codec_decode_failures"), 0u);
}

// Without a disk or remote tier, host memory holds the coded blocks: full
// and evicting, it holds more of them than of raw ones, and loads decode
// them straight into the engine's pages.
TEST(CompressionTest, AHostOnlyDaemonKeepsCodedBlocksInHostAndLoadsThemRight) {
  const std::string tenants =
      "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true, codecs: [none, lossless, fp8]}]";
  uint64_t held[3] = {};
  const CodecKind kinds[3] = {CodecKind::kNone, CodecKind::kLossless, CodecKind::kFp8};
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE(std::string(CodecName(kinds[run])));
    Result<DaemonProcess> d = DaemonProcess::Start({"tiers.host.bytes=16MiB", tenants});
    ASSERT_TRUE(d.has_value()) << d.error();
    Result<CodedSession> s = OpenCoded(*d, {.kind = kinds[run]}, BigLayout());
    ASSERT_TRUE(s.has_value()) << s.error();
    std::mt19937_64 rng(7);
    std::map<BlockKey, std::vector<uint8_t>> stored;
    // 512 blocks of 64 KiB through a host tier of 256.
    const std::vector<BlockKey> keys = s->client->ComputeKeys(s->id, Prompt(3, 512)).value();
    StoreKv(*s, keys, rng, &stored);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    DaemonStats st = s->client->Stats().value();
    while (kinds[run] != CodecKind::kNone && st.Counter("codec_host_coded") < 400 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      st = s->client->Stats().value();
    }
    for (const TierStats& t : st.tiers) {
      if (t.tier == BlockTier::kHost) held[run] = t.blocks;
    }
    if (kinds[run] != CodecKind::kNone) {
      EXPECT_GE(st.Counter("codec_host_coded"), 400u);
    }
    // The newest blocks are there and load right.
    for (size_t i = keys.size() - 8; i < keys.size(); ++i) {
      std::optional<std::vector<uint8_t>> got = Load(*s, keys[i]);
      ASSERT_TRUE(got.has_value()) << i;
      if (kinds[run] == CodecKind::kFp8) {
        EXPECT_TRUE(WithinFp8Bound(stored.at(keys[i]), *got));
      } else {
        EXPECT_EQ(*got, stored.at(keys[i]));
      }
    }
    EXPECT_EQ(s->client->Stats().value().Counter("codec_decoded"), 0u) << "decoded by the loads' copies";
  }
  EXPECT_EQ(held[0], 256u);
  std::printf("a host tier of 256 raw blocks holds %llu lossless ones, %llu fp8 ones\n",
              static_cast<unsigned long long>(held[1]), static_cast<unsigned long long>(held[2]));
  EXPECT_GT(held[1] * 100, held[0] * 105) << "lossless " << held[1] << " of raw " << held[0];
  EXPECT_GT(held[2] * 100, held[0] * 140) << "fp8 " << held[2] << " of raw " << held[0];
}

TEST(CompressionTest, ATenantAsksOnlyForTheCodecsItsConfigAllowsAndThatFitTheLayout) {
  Result<DaemonProcess> d = DaemonProcess::Start(Sets("[none, lossless]"));
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<CodedSession> fp8 = OpenCoded(*d, {.kind = CodecKind::kFp8});
  ASSERT_FALSE(fp8.has_value());
  EXPECT_EQ(fp8.error().code(), StatusCode::kPermissionDenied) << fp8.error();
  EXPECT_NE(fp8.error().message().find("tenants[].codecs"), std::string::npos) << fp8.error();
  EXPECT_TRUE(OpenCoded(*d, {.kind = CodecKind::kLossless}).has_value());

  Result<DaemonProcess> all = DaemonProcess::Start(Sets("[fp8]"));
  ASSERT_TRUE(all.has_value()) << all.error();
  EXPECT_EQ(OpenCoded(*all, {}).error().code(), StatusCode::kPermissionDenied) << "none is not listed";
  LayoutSpec fp32 = SmallLayout().spec();
  fp32.dtype = DType::kFp32;
  Result<CodedSession> wide = OpenCoded(*all, {.kind = CodecKind::kFp8}, Layout::Create(fp32).value());
  ASSERT_FALSE(wide.has_value());
  EXPECT_EQ(wide.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wide.error().message().find("fp16 or bf16"), std::string::npos) << wide.error();
  LayoutSpec mla = SmallLayout().spec();
  mla.kv_kind = KvKind::kLatent;
  mla.num_kv_heads = 1;
  Result<CodedSession> latent = OpenCoded(*all, {.kind = CodecKind::kFp8}, Layout::Create(mla).value());
  ASSERT_FALSE(latent.has_value());
  EXPECT_NE(latent.error().message().find("latent"), std::string::npos) << latent.error();
  Result<CodedSession> grouped = OpenCoded(*all, {.kind = CodecKind::kFp8, .fp8_group = 32});
  EXPECT_TRUE(grouped.has_value()) << grouped.error();
}

}  // namespace
}  // namespace kvtier::testing
