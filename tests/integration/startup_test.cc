// kvtierd's start-up end to end: the shipped example config starts once its
// paths exist; a start-up that fails removes what it created but never a
// warm cache; a disk tier larger than its file system is refused before it
// fills it (on a loop-mounted ext4, as root).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/disk_helpers.h"
#include "tests/integration/loop_fs.h"
#include "tests/programs.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

constexpr uint64_t kMiB = 1ull << 20;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs kvtierd with `args` (no shell: brackets stay literal) to its exit.
RunResult RunKvtierd(std::vector<std::string> args) {
  args.insert(args.begin(), testing::ProgramPath("kvtierd"));
  RunResult run;
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return run;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  std::array<char, 4096> buf{};
  for (ssize_t n; (n = ::read(out[0], buf.data(), buf.size())) > 0;) {
    run.output.append(buf.data(), n);
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/kvtier-startup-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A TCP port on 127.0.0.1 that is taken (listened on) while the fd lives.
UniqueFd TakePort(uint16_t* port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (!fd || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd.get(), 1) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return UniqueFd();
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

std::vector<std::string> WithSet(const std::vector<std::string>& sets) {
  std::vector<std::string> args = {"--foreground"};
  for (const std::string& s : sets) {
    args.push_back("--set");
    args.push_back(s);
  }
  return args;
}

std::vector<BlockKey> StoreSome(DiskSession& s, uint64_t seed) {
  const std::vector<BlockKey> keys = s.client->ComputeKeys(s.id, Prompt(seed, 8)).value();
  EXPECT_EQ(StoreAck(s, keys).size(), keys.size());
  return keys;
}

const std::string kExample = std::string(KVTIER_SOURCE_DIR) + "/config/kvtier.example.yaml";

// The example operators copy: --check-config passes, and kvtierd really
// starts on it once its paths are temporary directories and its sizes fit
// this machine (the same keys, --set over the file). device.backend stays
// `auto`: host here (no GPU, or a build without CUDA), cuda on a GPU machine.
TEST(StartupTest, TheExampleConfigChecksAndStartsAndServes) {
  const RunResult check = RunKvtierd({"--config", kExample, "--check-config"});
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_THAT(check.output, HasSubstr("configuration OK"));

  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string d = dir.path();
  Result<DaemonProcess> daemon = DaemonProcess::Start(
      {"socket.path=" + d + "/run/kvtierd.sock", "state_dir=" + d + "/lib",
       "tiers.disk.paths=[" + d + "/nvme0/kvtier, " + d + "/nvme1/kvtier]", "tiers.hbm.bytes=16MiB",
       "tiers.host.bytes=64MiB", "tiers.disk.bytes=128MiB", "metrics.listen=127.0.0.1:0",
       // DaemonProcess turns these off by default; the example has them on.
       "tiers.disk.enabled=true", "metrics.enabled=true"},
      kExample);
  ASSERT_TRUE(daemon.has_value()) << daemon.error();
  EXPECT_THAT(daemon->Log(), HasSubstr("4 tenant(s)"));
  // The batch tenant of the example, by its token.
  Result<std::unique_ptr<Client>> client = Client::Connect(
      {.socket_path = daemon->socket_path(), .token = "replace-me-with-openssl-rand-hex-32"});
  ASSERT_TRUE(client.has_value()) << client.error() << "\n" << daemon->Log();
  DiskSession s;
  s.client = std::move(*client);
  s.cache = std::make_unique<ShmKvCache>(ShmKvCache::Create(SmallLayout(), 256).value());
  s.id = s.client->RegisterKvCache(*s.cache).value();
  const std::vector<BlockKey> keys = StoreSome(s, 1);
  for (const BlockKey& k : keys) EXPECT_EQ(LoadOne(s, k), 1);
  EXPECT_EQ(s.client->Stats().value().scope, "tenant batch");
  s = {};
  const int status = daemon->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << daemon->Log();
}

// Options for a daemon with a small disk tier under `d`.
std::vector<std::string> DiskUnder(const std::string& d) {
  std::vector<std::string> sets = DiskSets("auto");
  for (const std::string& s :
       {"socket.path=" + d + "/run/kvtierd.sock", "state_dir=" + d + "/state",
        "tiers.disk.paths=[" + d + "/nvme0/kvtier, " + d + "/nvme1/kvtier]",
        std::string("tiers.disk.bytes=8MiB"), std::string("metrics.enabled=false")}) {
    sets.push_back(s);
  }
  return sets;
}

// Metrics start after the disk tier: a taken metrics port fails start-up
// after the segment files and the index were made. Those go again.
TEST(StartupTest, AFailedStartRemovesTheFilesItCreated) {
  TempDir dir;
  const std::string d = dir.path();
  uint16_t port = 0;
  const UniqueFd taken = TakePort(&port);
  ASSERT_TRUE(taken.valid());
  std::vector<std::string> sets = DiskUnder(d);
  sets.push_back("metrics.enabled=true");
  sets.push_back("metrics.listen=127.0.0.1:" + std::to_string(port));
  const RunResult r = RunKvtierd(WithSet(sets));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("metrics.listen"));
  EXPECT_FALSE(fs::exists(d + "/nvme0")) << r.output;
  EXPECT_FALSE(fs::exists(d + "/nvme1")) << r.output;
  EXPECT_FALSE(fs::exists(d + "/state/disk-index")) << r.output;
  EXPECT_FALSE(fs::exists(d + "/run")) << r.output;
}

// ...but a warm cache, its segment files and index, outlives a failed start.
TEST(StartupTest, AFailedStartKeepsAWarmCache) {
  TempDir dir;
  const std::string d = dir.path();
  const std::vector<std::string> sets = DiskUnder(d);
  std::vector<BlockKey> keys;
  {
    Result<DaemonProcess> daemon = DaemonProcess::Start(sets);
    ASSERT_TRUE(daemon.has_value()) << daemon.error();
    DiskSession s = Open(*daemon);
    ASSERT_NE(s.client, nullptr);
    keys = StoreSome(s, 2);
    s = {};
    daemon->Stop();  // writes the host tier to disk
  }
  const std::string segment = d + "/nvme0/kvtier/segment-0.kvt";
  struct stat before {};
  ASSERT_EQ(::stat(segment.c_str(), &before), 0);

  uint16_t port = 0;
  const UniqueFd taken = TakePort(&port);
  ASSERT_TRUE(taken.valid());
  std::vector<std::string> failing = sets;
  failing.push_back("metrics.enabled=true");
  failing.push_back("metrics.listen=127.0.0.1:" + std::to_string(port));
  const RunResult r = RunKvtierd(WithSet(failing));
  ASSERT_EQ(r.exit_code, 1) << r.output;
  struct stat after {};
  ASSERT_EQ(::stat(segment.c_str(), &after), 0) << r.output;
  EXPECT_EQ(after.st_ino, before.st_ino);
  EXPECT_EQ(after.st_size, before.st_size);
  EXPECT_TRUE(fs::exists(d + "/state/disk-index/CURRENT")) << r.output;

  Result<DaemonProcess> daemon = DaemonProcess::Start(sets);
  ASSERT_TRUE(daemon.has_value()) << daemon.error();
  DiskSession s = Open(*daemon);
  ASSERT_NE(s.client, nullptr);
  for (const BlockKey& k : keys) EXPECT_EQ(LoadOne(s, k), 1) << daemon->Log();
}

// The example's 3TiB per path on a file system of 256 MiB: refused before
// anything is preallocated, naming the key, the path, the size and the free
// space; nothing left behind. A tier that fits starts, and restarts when the
// file system has filled up meanwhile (its file holds its space already).
TEST(StartupTest, ADiskTierLargerThanItsFileSystemIsRefusedWithoutFillingIt) {
  TempDir dir;
  Result<std::unique_ptr<LoopFileSystem>> loop = LoopFileSystem::Mount(dir.path(), 256 * kMiB);
  if (!loop) GTEST_SKIP() << "no loop-mounted ext4 here: " << loop.error();
  const std::string mnt = (*loop)->mount_point();
  const uint64_t available = (*loop)->AvailableBytes();
  std::vector<std::string> sets = {"socket.path=" + dir.path() + "/kvtierd.sock",
                                   "state_dir=" + mnt + "/state",
                                   "tiers.disk.paths=[" + mnt + "/kvtier]",
                                   "tiers.disk.region_bytes=1MiB",
                                   "tiers.host.bytes=16MiB",
                                   "metrics.enabled=false"};
  {
    std::vector<std::string> too_large = sets;
    too_large.push_back("tiers.disk.bytes=1GiB");
    const RunResult r = RunKvtierd(WithSet(too_large));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    // Not filled, and nothing left but ext4's own lost+found.
    EXPECT_GE((*loop)->AvailableBytes() + 64 * 1024, available);
    std::vector<std::string> left;
    for (const fs::directory_entry& e : fs::directory_iterator(mnt)) {
      left.push_back(e.path().filename());
    }
    EXPECT_THAT(left, ::testing::ElementsAre("lost+found"));
    EXPECT_THAT(r.output,
                HasSubstr("tiers.disk.bytes: 1GiB per path: " + mnt + "/kvtier/segment-0.kvt"));
    EXPECT_THAT(r.output, HasSubstr("cannot preallocate 1073741824 bytes"));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("file system has ([0-9]+) bytes")))
        << r.output;
    const uint64_t said = std::stoull(m[1]);
    EXPECT_NEAR(static_cast<double>(said), static_cast<double>(available), 1.0 * kMiB) << r.output;
  }

  std::vector<std::string> fits = DiskSets("auto");
  fits.insert(fits.end(), sets.begin(), sets.end());
  fits.push_back("tiers.disk.bytes=64MiB");
  Result<DaemonProcess> daemon = DaemonProcess::Start(fits);
  ASSERT_TRUE(daemon.has_value()) << daemon.error();
  std::vector<BlockKey> keys;
  {
    DiskSession s = Open(*daemon);
    ASSERT_NE(s.client, nullptr);
    keys = StoreSome(s, 3);
  }
  ASSERT_EQ(daemon->Stop(), 0) << daemon->Log();
  EXPECT_LE((*loop)->AvailableBytes() + 64 * kMiB, available);
  // Fill the file system to 8 MiB of free space: far less than the tier.
  {
    UniqueFd filler(::open((mnt + "/filler").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(filler.valid());
    ASSERT_EQ(
        ::fallocate(filler.get(), 0, 0, static_cast<off_t>((*loop)->AvailableBytes() - 8 * kMiB)),
        0)
        << std::strerror(errno);
  }
  ASSERT_TRUE(daemon->Restart().ok()) << daemon->Log();
  DiskSession s = Open(*daemon);
  ASSERT_NE(s.client, nullptr);
  for (const BlockKey& k : keys) EXPECT_EQ(LoadOne(s, k), 1) << daemon->Log();
  s = {};
  daemon->Stop();
}

// Anonymous memory of kvtierd's resident set, from /proc/PID/status; 0 if
// it cannot be read.
uint64_t RssAnonBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("RssAnon:"))
      return std::stoull(line.substr(8)) * 1024;  // "RssAnon:  123 kB"
  }
  return 0;
}

// tiers.host.prefault (the default): the host tier's memory is kvtierd's
// within seconds of the start, before any store, and the log says so; with
// prefault off it is faulted only as stores use it.
TEST(StartupTest, TheHostTierIsFaultedInAtStartUnlessPrefaultIsOff) {
  constexpr uint64_t kTier = 512 * kMiB;
  Result<DaemonProcess> eager = DaemonProcess::Start({"tiers.host.bytes=512MiB"});
  ASSERT_TRUE(eager.has_value()) << eager.error();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (RssAnonBytes(eager->pid()) < kTier && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(RssAnonBytes(eager->pid()), kTier) << eager->Log();
  while (eager->Log().find("host tier: 536870912 bytes faulted in") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_THAT(eager->Log(), HasSubstr("host tier: 536870912 bytes faulted in"));
  EXPECT_EQ(eager->Stop(), 0) << eager->Log();

  Result<DaemonProcess> lazy =
      DaemonProcess::Start({"tiers.host.bytes=512MiB", "tiers.host.prefault=false"});
  ASSERT_TRUE(lazy.has_value()) << lazy.error();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(RssAnonBytes(lazy->pid()), kTier / 2) << lazy->Log();
  EXPECT_THAT(lazy->Log(), Not(HasSubstr("faulted in")));
}

}  // namespace
}  // namespace kvtier::testing
