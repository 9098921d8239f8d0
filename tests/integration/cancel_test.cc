// Ops given up on, against a real kvtierd stopped with SIGSTOP (a hung
// daemon): a client whose call ran past call_timeout, or that cancels an op,
// may reuse the op's engine blocks at once, so the daemon must never touch
// them after it continues. A load that ran anyway would overwrite what the
// engine recomputed there; a store that ran anyway would keep whatever the
// engine wrote there since under the old key: a wrong block, served later.
//
// Each test sends its op while the daemon is stopped, so that the daemon
// reads it only once the client has given up: the order is certain.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "client/sealed_memfd.h"
#include "common/block_pattern.h"
#include "common/memory_mapping.h"
#include "common/op_fence.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/raw_session.h"
#include "tests/integration/stats_when.h"
#include "tests/integration/stopped_daemon.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;
using std::chrono::milliseconds;

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "kvtier/cancel",
                                   .num_layers = 2,
                                   .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2,
                                   .head_dim = 64,
                                   .dtype = DType::kBf16,
                                   .block_tokens = 16})
      .value();
}

std::unique_ptr<Client> MustConnect(const DaemonProcess& d, milliseconds call_timeout = milliseconds(0)) {
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = d.socket_path(), .client_name = "test", .call_timeout = call_timeout});
  EXPECT_TRUE(c.has_value()) << c.error() << "\n" << d.Log();
  return c ? std::move(*c) : nullptr;
}

void Paint(const ShmKvCache& cache, uint32_t block, uint8_t value) {
  std::ranges::fill(cache.block(block), value);
}
bool Painted(const ShmKvCache& cache, uint32_t block, uint8_t value) {
  return std::ranges::all_of(cache.block(block), [&](uint8_t b) { return b == value; });
}

// The daemon's count of ops that ended cancelled, once it reaches `n`.
uint64_t CancelledOps(Client& c, uint64_t n) {
  return StatsWhen(c, [&](const DaemonStats& s) { return s.Counter("ops_cancelled") >= n; })
      .Counter("ops_cancelled");
}

// The engines' call timeout in the tests that hang kvtierd: each hung call
// waits this long, and the calls before the hang (a registration, a store)
// must answer within it on a Debug daemon and a busy 2-core machine (300 ms
// failed 1 run in 40 there, registering).
constexpr milliseconds kHungCallTimeout{2000};

class CancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<DaemonProcess> d = DaemonProcess::Start({});
    ASSERT_TRUE(d.has_value()) << d.error();
    daemon_.emplace(std::move(*d));
    admin_ = MustConnect(*daemon_);
    ASSERT_NE(admin_, nullptr);
  }
  void TearDown() override {
    if (!daemon_) return;
    const int status = daemon_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n" << daemon_->Log();
  }

  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<Client> admin_;
};

TEST_F(CancelTest, ALoadGivenUpOnAHungDaemonNeverWritesTheBlocksAfter) {
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  auto engine = MustConnect(*daemon_, kHungCallTimeout);
  ASSERT_NE(engine, nullptr);
  const CacheId id = engine->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = engine->ComputeKeys(id, PseudoTokens(1, 4 * 16)).value();
  for (uint32_t i = 0; i < 4; ++i) FillKvFromKey(keys[i], cache.block(i));
  Result<OpResult> stored = engine->Store(id, keys, std::vector<uint32_t>{0, 1, 2, 3});
  ASSERT_TRUE(stored.has_value()) << stored.error();
  ASSERT_EQ(stored->blocks, 4u);

  for (uint32_t b = 8; b < 12; ++b) Paint(cache, b, 0xA5);
  {
    Stopped hung(*daemon_);
    const auto start = std::chrono::steady_clock::now();
    Result<OpHandle> op = engine->LoadAsync(id, keys, std::vector<uint32_t>{8, 9, 10, 11});
    ASSERT_FALSE(op.has_value());
    EXPECT_EQ(op.error().code(), StatusCode::kDeadlineExceeded) << op.error();
    EXPECT_LT(std::chrono::steady_clock::now() - start, kHungCallTimeout + std::chrono::seconds(3));
    // The engine recomputes the blocks: they are its own from now on.
    for (uint32_t b = 8; b < 12; ++b) Paint(cache, b, 0x5A);
  }
  // The daemon reads the Load after the client gave up, and skips its copies.
  EXPECT_EQ(CancelledOps(*admin_, 1), 1u) << daemon_->Log();
  for (uint32_t b = 8; b < 12; ++b) EXPECT_TRUE(Painted(cache, b, 0x5A)) << "block " << b << " was overwritten";

  // The client reconnects (after its reconnect_interval), and loads again.
  Result<OpResult> loaded = engine->Load(id, keys, std::vector<uint32_t>{8, 9, 10, 11});
  for (int tries = 0; !loaded && loaded.error().code() == StatusCode::kUnavailable && tries < 100; ++tries) {
    std::this_thread::sleep_for(milliseconds(50));
    loaded = engine->Load(id, keys, std::vector<uint32_t>{8, 9, 10, 11});
  }
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 4u);
  for (uint32_t b = 8; b < 12; ++b) EXPECT_TRUE(MatchesKvKey(keys[b - 8], cache.block(b)));

  // A negative timeout is refused (it once wrapped to 49 days), and the op
  // is still there to wait for.
  Result<OpHandle> op = engine->LoadAsync(id, keys, std::vector<uint32_t>{8, 9, 10, 11});
  ASSERT_TRUE(op.has_value()) << op.error();
  Result<OpResult> negative = engine->Wait(*op, milliseconds(-1));
  ASSERT_FALSE(negative.has_value());
  EXPECT_EQ(negative.error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Cancel(*op, milliseconds(-5)).code(), StatusCode::kInvalidArgument);
  Result<OpResult> waited = engine->Wait(*op, milliseconds(10000));
  ASSERT_TRUE(waited.has_value()) << waited.error();
  EXPECT_EQ(waited->blocks, 4u);
}

TEST_F(CancelTest, AStoreGivenUpOnAHungDaemonIsNeverCommitted) {
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  auto engine = MustConnect(*daemon_, kHungCallTimeout);
  ASSERT_NE(engine, nullptr);
  const CacheId id = engine->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = engine->ComputeKeys(id, PseudoTokens(2, 2 * 16)).value();
  for (uint32_t i = 0; i < 2; ++i) FillKvFromKey(keys[i], cache.block(i));
  {
    Stopped hung(*daemon_);
    Result<OpHandle> op = engine->StoreAsync(id, keys, std::vector<uint32_t>{0, 1});
    ASSERT_FALSE(op.has_value());
    EXPECT_EQ(op.error().code(), StatusCode::kDeadlineExceeded) << op.error();
    // The engine reuses the blocks for another request.
    Paint(cache, 0, 0x11);
    Paint(cache, 1, 0x22);
  }
  EXPECT_EQ(CancelledOps(*admin_, 1), 1u) << daemon_->Log();
  // Nothing was stored under the keys: a reader gets a miss, not 0x11.
  auto reader = MustConnect(*daemon_);
  ASSERT_NE(reader, nullptr);
  ShmKvCache other = ShmKvCache::Create(SmallLayout(), 4).value();
  const CacheId rid = reader->RegisterKvCache(other).value();
  EXPECT_EQ(reader->Lookup(rid, keys).value().hits, 0u);
}

// The wire side, on a raw session with a fence page: a Load whose fence is
// cancelled, or whose slot was reopened for another op, ends kCancelled
// without touching the engine's block; one whose fence is open loads.
TEST_F(CancelTest, TheDaemonCopiesOnlyWhileTheFenceHoldsTheOpsGeneration) {
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 8).value();
  Result<UniqueFd> page_owner = NewSealedMemfd("fences", FencePage::kBytes);
  ASSERT_TRUE(page_owner.has_value()) << page_owner.error();
  const int page_fd = page_owner->get();
  FencePage page(MemoryMapping::Map(MemoryMapping::Options{.size_bytes = FencePage::kBytes,
                                                           .prot = PROT_READ | PROT_WRITE,
                                                           .flags = MAP_SHARED,
                                                           .fd = page_fd})
                     .value());

  RawSession raw(daemon_->socket_path());
  raw.Hello();
  flatbuffers::FlatBufferBuilder b;
  std::vector<wire::Placement> placements;
  for (const Placement& p : cache.placements()) placements.push_back(ipc::PlacementToWire(p));
  std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
      wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache.size_bytes(), 0)};
  const std::array<int, 2> fds = {cache.fd(), page_fd};
  ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 2,
                                          wire::CreateRegisterKvCacheDirect(
                                              b, ipc::LayoutToWire(b, cache.layout()), cache.num_blocks(),
                                              &regions, &placements, nullptr, -1, wire::Codec::None, 0, 1)),
                       fds)
                  .ok());
  ASSERT_EQ(raw.Receive().body, wire::Body::Registered);

  std::array<uint8_t, 16> key_bytes{};
  key_bytes[0] = 7;
  const std::vector<wire::Key> key = {wire::Key(flatbuffers::span<const uint8_t, 16>(key_bytes.data(), 16))};
  Paint(cache, 0, 0x33);
  const std::vector<uint32_t> from = {0};
  b.Clear();
  ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 3, wire::CreateStoreDirect(b, 1, &key, &from, nullptr, true))).ok());
  ASSERT_EQ(raw.Receive().code, StatusCode::kOk);

  const std::vector<uint32_t> into = {5};
  auto load = [&](uint64_t request, int32_t slot, uint64_t generation) {
    b.Clear();
    return ipc::FinishMessage(b, request,
                              wire::CreateLoadDirect(b, 1, &key, &into, true, -1, slot, generation));
  };
  Paint(cache, 5, 0x44);
  page.Open(3, 9);
  page.Open(4, 11);  // reopened for another op since generation 10 was named
  {
    Stopped stopped(*daemon_);
    ASSERT_TRUE(raw.Send(load(4, 3, 9)).ok());
    ASSERT_TRUE(raw.Send(load(5, 4, 10)).ok());
    EXPECT_TRUE(page.Cancel(3, 9)) << "no copy can be in progress while kvtierd is stopped";
  }
  for (int i = 0; i < 2; ++i) {
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.body, wire::Body::OpResult);
    EXPECT_EQ(r.code, StatusCode::kCancelled) << r.message;
  }
  EXPECT_TRUE(Painted(cache, 5, 0x44)) << "a cancelled load wrote the engine's block";
  EXPECT_EQ(CancelledOps(*admin_, 2), 2u);

  // Open: it loads, and the fence is left with no copy counted.
  ASSERT_TRUE(raw.Send(load(6, 4, 11)).ok());
  EXPECT_EQ(raw.Receive().code, StatusCode::kOk);
  EXPECT_TRUE(Painted(cache, 5, 0x33));
  EXPECT_TRUE(page.Quiet(4, 11));

  // A fence the daemon cannot use is refused with the request.
  for (auto [slot, generation] : {std::pair<int32_t, uint64_t>{512, 1}, {0, 0}, {0, uint64_t{1} << 48}, {-2, 1}}) {
    ASSERT_TRUE(raw.Send(load(7, slot, generation)).ok());
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument) << slot << "/" << generation;
    EXPECT_THAT(r.message, HasSubstr("fence"));
  }
}

}  // namespace
}  // namespace kvtier::testing
