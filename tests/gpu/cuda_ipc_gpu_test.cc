// CUDA IPC between real processes: a real kvtierd on the cuda backend and
// gpu_client engine processes (tests/gpu/gpu_client.cc) that register KV
// caches in GPU memory. Blocks stored by one process load, byte-exact, into
// another, ordered on the engine's stream through IPC events (or, for a load
// by layer, layer by layer through its progress words); a client killed
// while it holds IPC mappings leaves none behind; fp8 blocks coded in the
// host tier are decoded by the load's kernel.
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/client.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"
#include "tests/programs.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;

constexpr uint32_t kBlocks = 128;  // 256 KiB each: 32 MiB per load, long enough to race

pid_t StartClient(const std::string& mode, const std::string& socket, uint64_t seed, const std::string& token = "") {
  const std::string binary = testing::ProgramPath("gpu_client");
  const std::string seed_arg = std::to_string(seed);
  const std::string blocks_arg = std::to_string(kBlocks);
  // exec at once: a forked child must not touch the parent's CUDA state.
  return testing::ForkChild([&] {
    ::execl(binary.c_str(), binary.c_str(), mode.c_str(), socket.c_str(), seed_arg.c_str(), blocks_arg.c_str(),
            token.empty() ? static_cast<char*>(nullptr) : token.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
}

int RunClient(const std::string& mode, const std::string& socket, uint64_t seed, const std::string& token = "") {
  return testing::WaitChild(StartClient(mode, socket, seed, token));
}

class CudaIpcGpuTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    KVTIER_SKIP_WITHOUT_GPU();
    // With the hbm tier, loads copy device to device; without it, from the
    // pinned host tier straight into the engine's GPU memory.
    const bool hbm = GetParam();
    Result<DaemonProcess> d = DaemonProcess::Start({"device.backend=cuda", "tiers.hbm.enabled=" + std::string(hbm ? "true" : "false"),
                                                    "tiers.hbm.bytes=256MiB", "tiers.host.bytes=256MiB",
                                                    "tiers.disk.enabled=false"});
    ASSERT_TRUE(d.has_value()) << d.error();
    daemon_.emplace(std::move(*d));
    Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = daemon_->socket_path()});
    ASSERT_TRUE(c.has_value()) << c.error();
    admin_ = std::move(*c);
  }

  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<Client> admin_;
};

TEST_P(CudaIpcGpuTest, BlocksStoredByOneProcessLoadIntoAnother) {
  Result<DaemonStats> before = admin_->Stats();
  ASSERT_TRUE(before.has_value()) << before.error();
  EXPECT_NE(before->backend.find("cuda"), std::string::npos) << before->backend;

  ASSERT_EQ(RunClient("store", daemon_->socket_path(), 1), 0) << daemon_->Log();
  ASSERT_EQ(RunClient("load", daemon_->socket_path(), 1), 0) << daemon_->Log();

  const DaemonStats after = testing::StatsWhen(*admin_, [](const DaemonStats& s) { return s.mappings == 0; });
  EXPECT_EQ(after.mappings, 0u) << "the clients exited; their IPC mappings must be closed";
  EXPECT_EQ(after.leases, 0u);
  EXPECT_EQ(after.Counter("stores"), kBlocks);
  EXPECT_EQ(after.Counter("loads"), kBlocks);
}

// A load by layer waited for on the engine's stream, on the GPU, layer by
// layer (Client::StreamWaitLayers): each layer read back right after its
// wait holds every block's bytes.
TEST_P(CudaIpcGpuTest, ALoadByLayerIsWaitedForOnTheEnginesStreamLayerByLayer) {
  ASSERT_EQ(RunClient("store", daemon_->socket_path(), 3), 0) << daemon_->Log();
  ASSERT_EQ(RunClient("load-layers", daemon_->socket_path(), 3), 0) << daemon_->Log();
  const DaemonStats after = testing::StatsWhen(*admin_, [](const DaemonStats& s) { return s.mappings == 0; });
  EXPECT_EQ(after.Counter("loads_by_layer"), 1u);
  EXPECT_EQ(after.Counter("loads"), kBlocks);
}

TEST_P(CudaIpcGpuTest, KilledClientLeavesNoMappings) {
  const pid_t holder = StartClient("hold", daemon_->socket_path(), 2);
  const DaemonStats held = testing::StatsWhen(*admin_, [](const DaemonStats& s) { return s.Counter("loads") > 0; });
  ASSERT_GE(held.mappings, 1u) << daemon_->Log();
  ASSERT_GT(held.Counter("loads"), 0u) << "the holder never got to its load loop";

  ASSERT_EQ(::kill(holder, SIGKILL), 0);
  EXPECT_EQ(testing::WaitChild(holder), 128 + SIGKILL);
  const DaemonStats after =
      testing::StatsWhen(*admin_, [](const DaemonStats& s) { return s.mappings == 0 && s.sessions == 1 && s.leases == 0; });
  EXPECT_EQ(after.mappings, 0u) << "a dead client's GPU memory is still mapped";
  EXPECT_EQ(after.sessions, 1u);
  EXPECT_EQ(after.leases, 0u);

  // The daemon still serves: another process loads what the dead one stored.
  EXPECT_EQ(RunClient("load", daemon_->socket_path(), 2), 0) << daemon_->Log();
}

// fp8 (issue 18): a store's kernel quantizes the blocks straight into host
// slots of their coded size (the one with a NaN is stored as it is), and a
// load's dequantizes them straight into the engine's pages: exactly the CPU
// codec's bytes, with no CPU pass on the way.
TEST(CudaIpcFp8GpuTest, CodedHostBlocksDecodeOnTheGpuIntoAnotherProcess) {
  KVTIER_SKIP_WITHOUT_GPU();
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"device.backend=cuda", "tiers.hbm.enabled=false", "tiers.host.bytes=256MiB", "tiers.disk.enabled=false",
       "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true, codecs: [none, fp8]}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> admin = Client::Connect({.socket_path = d->socket_path()});
  ASSERT_TRUE(admin.has_value()) << admin.error();

  ASSERT_EQ(RunClient("store-fp8", d->socket_path(), 3), 0) << d->Log();
  const DaemonStats coded = (*admin)->Stats().value();
  EXPECT_EQ(coded.Counter("codec_host_coded"), kBlocks - 1) << "coded by the store's kernel\n" << d->Log();
  EXPECT_EQ(coded.Counter("codec_encoded"), kBlocks - 1);
  ASSERT_EQ(RunClient("load-fp8", d->socket_path(), 3), 0) << d->Log();

  const DaemonStats after = testing::StatsWhen(**admin, [](const DaemonStats& s) { return s.mappings == 0; });
  EXPECT_EQ(after.Counter("loads"), kBlocks);
  EXPECT_EQ(after.Counter("codec_decoded"), 0u) << "the CPU decoded what the GPU should have";
  EXPECT_EQ(after.Counter("codec_decode_failures"), 0u);
  EXPECT_EQ(after.mappings, 0u);
}

// Issue 31, item 13: an IPC handle's bytes are no right to its memory. A
// second tenant presenting the handle of memory the first registered (the
// same bytes) is refused, and the first tenant's registration still works.
TEST(CudaIpcTenantsGpuTest, AnotherTenantCannotRegisterMemoryByItsHandle) {
  KVTIER_SKIP_WITHOUT_GPU();
  const std::string token(32, 'm');
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"device.backend=cuda", "tiers.hbm.enabled=false", "tiers.host.bytes=256MiB", "tiers.disk.enabled=false",
       "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true}, {name: mallory, token: " +
           token + "}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  // gpu_client checks the refusal (kPermissionDenied) and the owner's store
  // and load after it.
  ASSERT_EQ(RunClient("steal", d->socket_path(), 4, token), 0) << d->Log();
}

INSTANTIATE_TEST_SUITE_P(Tiers, CudaIpcGpuTest, ::testing::Values(true, false),
                         [](const auto& param_info) { return param_info.param ? std::string("Hbm") : std::string("HostOnly"); });

}  // namespace
}  // namespace kvtier
