// The in-process daemon (Server) with fakes at the device-backend seam
// (STYLE.md), for what a real backend does only on a GPU:
//   - a backend that can copy no more (a GPU whose CUDA context a sticky
//     error lost, issue 31 item 8): the daemon stops on its own, writes its
//     host blocks to disk, and Run() returns the backend's error (kvtierd then
//     exits non-zero, and its supervisor starts a new process, which finds
//     the blocks on disk). CudaBackend's own detection runs on a GPU
//     (tests/gpu/cuda_backend_gpu_test.cc);
//   - a backend whose mappings take seconds (cuda: pinning a large CPU
//     engine's cache, opening IPC handles; issue 31 item 10): the event loop
//     serves every other session meanwhile.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "common/mutex.h"
#include "config/config_loader.h"
#include "daemon/server.h"
#include "ipc/seqpacket.h"
#include "ipc/wire.h"
#include "tests/tiers/forwarding_backend.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

Status LostStatus() {
  return Status(StatusCode::kUnavailable, "the GPU's CUDA context is lost (test): kvtierd must be restarted");
}

// A HostBackend until `lost` is set; then health() says so and every batch
// fails with it, copying nothing, on the inner backend's thread.
class LosingBackend final : public tiers_test::ForwardingBackend {
 public:
  LosingBackend(std::unique_ptr<DeviceBackend> inner, std::shared_ptr<std::atomic<bool>> lost)
      : ForwardingBackend(std::move(inner)), lost_(std::move(lost)) {}
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override {
    if (lost_->load()) return Err(LostStatus());
    return inner().MapClientMemory(std::move(regions), std::move(events));
  }
  bool Submit(CopyBatch batch, CopyDone done) override {
    if (!lost_->load()) return inner().Submit(std::move(batch), std::move(done));
    inner().Submit(CopyBatch{.direction = CopyDirection::kSlotToSlot, .priority = batch.priority},
                   [done = std::move(done)](CopyResult) { done(CopyResult{.status = LostStatus()}); });
    return false;
  }
  Status health() const override { return lost_->load() ? LostStatus() : Status::Ok(); }

 private:
  std::shared_ptr<std::atomic<bool>> lost_;
};

// A HostBackend whose MapClientMemory takes `delay`; `mapping` is set while
// one is in progress.
class SlowMappingBackend final : public tiers_test::ForwardingBackend {
 public:
  SlowMappingBackend(std::unique_ptr<DeviceBackend> inner, std::chrono::milliseconds delay,
                     std::shared_ptr<std::atomic<bool>> mapping)
      : ForwardingBackend(std::move(inner)), delay_(delay), mapping_(std::move(mapping)) {}
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override {
    mapping_->store(true);
    std::this_thread::sleep_for(delay_);
    Result<std::shared_ptr<ClientMapping>> m = inner().MapClientMemory(std::move(regions), std::move(events));
    mapping_->store(false);
    return m;
  }

 private:
  const std::chrono::milliseconds delay_;
  std::shared_ptr<std::atomic<bool>> mapping_;
};

// A HostBackend that holds loads (kSlotToEngine batches) until Release(),
// and can stall the event loop: the next Submit after StallNextSubmit()
// sleeps there, as a daemon that hangs for a moment would.
class GatedBackend final : public tiers_test::ForwardingBackend {
 public:
  struct Gate {
    Mutex mu;
    bool hold_loads KVTIER_GUARDED_BY(mu) = false;
    std::vector<std::pair<CopyBatch, CopyDone>> held KVTIER_GUARDED_BY(mu);
    std::atomic<int64_t> stall_ms{0};
    std::atomic<bool> stalling{false};
    std::atomic<int> loads_done{0};
  };
  GatedBackend(std::unique_ptr<DeviceBackend> inner, std::shared_ptr<Gate> gate)
      : ForwardingBackend(std::move(inner)), gate_(std::move(gate)) {}
  ~GatedBackend() override { Release(); }
  bool Submit(CopyBatch batch, CopyDone done) override {
    if (const int64_t ms = gate_->stall_ms.exchange(0); ms > 0) {
      gate_->stalling = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      gate_->stalling = false;
    }
    if (batch.direction == CopyDirection::kSlotToEngine) {
      done = [gate = gate_, done = std::move(done)](CopyResult r) {
        done(std::move(r));
        ++gate->loads_done;
      };
      MutexLock lock(&gate_->mu);
      if (gate_->hold_loads) {
        gate_->held.emplace_back(std::move(batch), std::move(done));
        return true;
      }
    }
    return inner().Submit(std::move(batch), std::move(done));
  }

  // Submits the held loads (from the caller's thread) and stops holding.
  void Release() {
    std::vector<std::pair<CopyBatch, CopyDone>> held;
    {
      MutexLock lock(&gate_->mu);
      gate_->hold_loads = false;
      held.swap(gate_->held);
    }
    for (auto& [batch, done] : held) inner().Submit(std::move(batch), std::move(done));
  }

 private:
  std::shared_ptr<Gate> gate_;
};

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "test/backend-lost", .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 16, .dtype = DType::kBf16, .block_tokens = 4})
      .value();
}

std::vector<uint32_t> Tokens(uint32_t seed, uint32_t n) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = seed * 100003 + i * 7 + 1;
  return t;
}

// A session that says Hello and asks to register `cache`, over a raw socket
// (the client library would wait for the reply): the socket, reply unread.
UniqueFd SendRegistration(const std::string& socket, const ShmKvCache& cache) {
  UniqueFd fd = ipc::Connect(socket).value();
  flatbuffers::FlatBufferBuilder b;
  KVTIER_CHECK(
      ipc::SendMessage(fd.get(), ipc::FinishMessage(b, 1, wire::CreateHelloDirect(b, ipc::kProtocolVersion, nullptr)))
          .ok());
  KVTIER_CHECK(ipc::ReceiveMessage(fd.get(), ipc::kMaxReplyBytes).has_value());  // Welcome
  b.Clear();
  std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
      wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache.size_bytes(), 0)};
  std::vector<wire::Placement> placements;
  for (const Placement& p : cache.placements()) placements.push_back(ipc::PlacementToWire(p));
  const int memfd = cache.fd();
  KVTIER_CHECK(ipc::SendMessage(fd.get(),
                                ipc::FinishMessage(b, 2, wire::CreateRegisterKvCacheDirect(
                                                             b, ipc::LayoutToWire(b, SmallLayout()),
                                                             cache.num_blocks(), &regions, &placements)),
                                std::span(&memfd, 1))
                   .ok());
  return fd;
}

class ServerBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-lost-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Config MakeConfig() const {
    Result<Config> c = LoadConfig(ConfigSource{
        .overrides = {"socket.path=" + dir_ + "/kvtierd.sock", "state_dir=" + dir_ + "/state",
                      "tiers.disk.enabled=true", "tiers.disk.paths=[" + dir_ + "/disk]", "tiers.disk.bytes=16MiB",
                      "tiers.disk.region_bytes=1MiB", "tiers.host.bytes=8MiB", "tiers.hbm.enabled=false",
                      "metrics.enabled=false"}});
    KVTIER_CHECK_MSG(c.has_value(), c.error().ToString().c_str());
    return *c;
  }

  // A server on its own thread; `result` gets what Run() returned.
  std::unique_ptr<Server> StartServer(std::unique_ptr<DeviceBackend> backend, std::future<Status>* result) {
    Server::Options options;
    options.config = MakeConfig();
    options.backend = std::move(backend);
    Result<std::unique_ptr<Server>> s = Server::Create(std::move(options));
    KVTIER_CHECK_MSG(s.has_value(), s.error().ToString().c_str());
    std::packaged_task<Status()> run([server = s->get()] { return server->Run(); });
    *result = run.get_future();
    loop_ = std::thread(std::move(run));
    return std::move(*s);
  }

  std::unique_ptr<DeviceBackend> Host() const {
    return std::move(HostBackend::Create({.copy_threads = 2, .populate_host = false}).value());
  }

  std::string socket() const { return dir_ + "/kvtierd.sock"; }

  std::string dir_;
  std::thread loop_;
};

TEST_F(ServerBackendTest, TheDaemonStopsWritesHostBlocksToDiskAndReportsTheError) {
  auto lost = std::make_shared<std::atomic<bool>>(false);
  std::future<Status> ran;
  std::unique_ptr<Server> server = StartServer(std::make_unique<LosingBackend>(Host(), lost), &ran);

  std::vector<BlockKey> keys;
  {
    std::unique_ptr<Client> c = Client::Connect({.socket_path = socket()}).value();
    ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
    const CacheId id = c->RegisterKvCache(cache).value();
    keys = c->ComputeKeys(id, Tokens(1, 32)).value();
    ASSERT_EQ(keys.size(), 8u);
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < keys.size(); ++i) {
      std::memset(cache.block(i).data(), static_cast<int>(i + 1), cache.block(i).size());
      ids.push_back(i);
    }
    Result<OpResult> stored = c->Store(id, keys, ids);
    ASSERT_TRUE(stored.has_value()) << stored.error();
    ASSERT_EQ(stored->blocks, keys.size());
    EXPECT_EQ(c->Stats().value().Counter("disk_demotions"), 0u) << "write-back: nothing is on disk yet";

    lost->store(true);
    // The next copy fails with the backend's error, and the daemon stops on
    // its own (no signal, no Stop()).
    const std::vector<BlockKey> more = c->ComputeKeys(id, Tokens(2, 8)).value();
    Result<OpResult> refused = c->Store(id, more, std::vector<uint32_t>{8, 9});
    EXPECT_TRUE(!refused.has_value() || refused->blocks == 0);
  }
  ASSERT_EQ(ran.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the daemon did not stop";
  const Status st = ran.get();
  loop_.join();
  server.reset();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("context is lost"), std::string::npos) << st;

  // A new process (here: a new Server) finds every block on disk.
  std::future<Status> ran_again;
  server = StartServer(Host(), &ran_again);
  {
    std::unique_ptr<Client> c = Client::Connect({.socket_path = socket()}).value();
    ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
    const CacheId id = c->RegisterKvCache(cache).value();
    Result<LookupResult> found = c->Lookup(id, keys);
    ASSERT_TRUE(found.has_value()) << found.error();
    EXPECT_EQ(found->hits, keys.size()) << "the blocks stored before the loss were written to disk at the stop";
    for (uint32_t t = 0; t < found->hits; ++t) EXPECT_EQ(found->tiers[t], BlockTier::kDisk);
  }
  server->Stop();
  EXPECT_TRUE(ran_again.get().ok());
  loop_.join();
}

TEST_F(ServerBackendTest, ARegistrationBeingMappedHoldsUpNoOtherSession) {
  constexpr auto kMapping = std::chrono::milliseconds(2000);
  auto mapping = std::make_shared<std::atomic<bool>>(false);
  std::future<Status> ran;
  std::unique_ptr<Server> server = StartServer(std::make_unique<SlowMappingBackend>(Host(), kMapping, mapping), &ran);
  std::unique_ptr<Client> other = Client::Connect({.socket_path = socket()}).value();

  // A registers a cache; while the backend maps it, B's calls are answered.
  std::future<std::chrono::steady_clock::duration> registered = std::async(std::launch::async, [&] {
    std::unique_ptr<Client> a = Client::Connect({.socket_path = socket()}).value();
    ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
    const auto start = std::chrono::steady_clock::now();
    Result<CacheId> id = a->RegisterKvCache(cache);
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_TRUE(id.has_value()) << id.error();
    return took;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!mapping->load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(mapping->load()) << "the registration never reached the backend";
  int answered = 0;
  std::chrono::steady_clock::duration slowest{};
  while (mapping->load()) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(other->Stats().has_value());
    slowest = std::max(slowest, std::chrono::steady_clock::now() - start);
    if (mapping->load()) ++answered;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(answered, 5) << "Stats was not answered while a registration was being mapped";
  EXPECT_LT(slowest, std::chrono::milliseconds(500)) << "a Stats round trip waited for the mapping";
  EXPECT_GE(registered.get(), kMapping) << "the registration's reply came before its mapping was made";

  // A session that leaves while its cache is being mapped leaves no mapping
  // and no charge behind.
  {
    ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
    UniqueFd fd = SendRegistration(socket(), cache);
    while (!mapping->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }  // the socket closes while the cache is being mapped
  DaemonStats st = other->Stats().value();
  for (int i = 0; i < 500 && (st.mappings != 0 || mapping->load()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    st = other->Stats().value();
  }
  EXPECT_FALSE(mapping->load());
  EXPECT_EQ(st.mappings, 0u) << "a mapping made for a session that had gone is still live (A has gone too)";
  server->Stop();
  EXPECT_TRUE(ran.get().ok());
  loop_.join();
}

// Issue 31, item 11: a client that drops its connection while a load of
// its is queued (here: its call ran past call_timeout while the loop hung).
// Its Wait reports the op lost only once no copy of it can touch the
// engine's blocks: the load, started afterwards, writes none of them.
TEST_F(ServerBackendTest, ALoadOfAClientThatDroppedItsConnectionNeverWritesItsBlocks) {
  auto gate = std::make_shared<GatedBackend::Gate>();
  auto backend = std::make_unique<GatedBackend>(Host(), gate);
  GatedBackend* gated = backend.get();
  std::future<Status> ran;
  std::unique_ptr<Server> server = StartServer(std::move(backend), &ran);

  std::unique_ptr<Client> a =
      Client::Connect({.socket_path = socket(), .call_timeout = std::chrono::milliseconds(300)}).value();
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  const CacheId id = a->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = a->ComputeKeys(id, Tokens(3, 32)).value();
  std::vector<uint32_t> stored_ids, load_ids;
  for (uint32_t i = 0; i < 8; ++i) {
    std::memset(cache.block(i).data(), 0x11, cache.block(i).size());
    std::memset(cache.block(8 + i).data(), 0xee, cache.block(8 + i).size());
    stored_ids.push_back(i);
    load_ids.push_back(8 + i);
  }
  ASSERT_EQ(a->Store(id, keys, stored_ids).value().blocks, 8u);

  {
    MutexLock lock(&gate->mu);
    gate->hold_loads = true;
  }
  const OpHandle op = a->LoadAsync(id, keys, load_ids).value();

  // The loop hangs for 1.5 s in the next Submit (another client's store);
  // A's Lookup meanwhile runs past its call_timeout and A drops the
  // connection.
  gate->stall_ms = 1500;
  std::unique_ptr<Client> b = Client::Connect({.socket_path = socket()}).value();
  ShmKvCache b_cache = ShmKvCache::Create(SmallLayout(), 4).value();
  const CacheId b_id = b->RegisterKvCache(b_cache).value();
  std::future<Result<OpResult>> b_store = std::async(std::launch::async, [&] {
    return b->Store(b_id, b->ComputeKeys(b_id, Tokens(4, 4)).value(), std::vector<uint32_t>{0});
  });
  while (!gate->stalling) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Result<LookupResult> timed_out = a->Lookup(id, keys);
  ASSERT_FALSE(timed_out.has_value());
  EXPECT_EQ(timed_out.error().code(), StatusCode::kDeadlineExceeded) << timed_out.error();
  Result<OpResult> lost = a->Wait(op);
  ASSERT_FALSE(lost.has_value());
  EXPECT_EQ(lost.error().code(), StatusCode::kUnavailable) << lost.error();

  // A may reuse blocks 8-15 now. The daemon's load starts only now.
  std::memset(cache.block(8).data(), 0x77, cache.block(8).size());
  gated->Release();
  while (gate->loads_done.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::vector<uint8_t> reused(cache.block(8).size(), 0x77), untouched(cache.block(9).size(), 0xee);
  EXPECT_TRUE(std::ranges::equal(cache.block(8), reused)) << "the load wrote a block the client had reused";
  for (uint32_t i = 9; i < 16; ++i) {
    EXPECT_TRUE(std::ranges::equal(cache.block(i), untouched)) << "the lost load wrote block " << i;
  }
  EXPECT_TRUE(b_store.get().has_value());
  server->Stop();
  EXPECT_TRUE(ran.get().ok());
  loop_.join();
}

}  // namespace
}  // namespace kvtier
