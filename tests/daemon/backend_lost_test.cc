// A device backend that can copy no more (a GPU whose CUDA context a sticky
// error lost, issue 31 item 8), seen from the daemon: the in-process Server
// stops on its own, writes its host blocks to disk, and Run() returns the
// backend's error (kvtierd then exits non-zero, and its supervisor starts a
// new process, which finds the blocks on disk). The fake at the backend seam
// (STYLE.md) is a HostBackend that loses its device when told, as
// CudaBackend does on a sticky error (tests/gpu/cuda_backend_gpu_test.cc
// makes a real one on a GPU).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>

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
#include "config/config_loader.h"
#include "daemon/server.h"
#include "tiers/host_backend.h"

namespace kvtier {
namespace {

Status LostStatus() {
  return Status(StatusCode::kUnavailable, "the GPU's CUDA context is lost (test): kvtierd must be restarted");
}

// A HostBackend until `lost` is set; then health() says so and every batch
// fails with it, copying nothing, on the inner backend's thread.
class LosingBackend final : public DeviceBackend {
 public:
  LosingBackend(std::unique_ptr<DeviceBackend> inner, std::shared_ptr<std::atomic<bool>> lost)
      : inner_(std::move(inner)), lost_(std::move(lost)) {}
  std::string_view name() const override { return inner_->name(); }
  std::string Describe() const override { return "losing " + inner_->Describe(); }
  Result<std::unique_ptr<Arena>> AllocateDeviceArena(int device, uint64_t size_bytes) override {
    return inner_->AllocateDeviceArena(device, size_bytes);
  }
  Result<std::unique_ptr<Arena>> AllocateHostArena(uint64_t size_bytes) override {
    return inner_->AllocateHostArena(size_bytes);
  }
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override {
    if (lost_->load()) return Err(LostStatus());
    return inner_->MapClientMemory(std::move(regions), std::move(events));
  }
  bool Submit(CopyBatch batch, CopyDone done) override {
    if (!lost_->load()) return inner_->Submit(std::move(batch), std::move(done));
    inner_->Submit(CopyBatch{.direction = CopyDirection::kSlotToSlot, .priority = batch.priority},
                   [done = std::move(done)](CopyResult) { done(CopyResult{.status = LostStatus()}); });
    return false;
  }
  uint64_t live_mappings() const override { return inner_->live_mappings(); }
  Status health() const override { return lost_->load() ? LostStatus() : Status::Ok(); }

 private:
  std::unique_ptr<DeviceBackend> inner_;
  std::shared_ptr<std::atomic<bool>> lost_;
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

class BackendLostTest : public ::testing::Test {
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

TEST_F(BackendLostTest, TheDaemonStopsWritesHostBlocksToDiskAndReportsTheError) {
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

}  // namespace
}  // namespace kvtier
