// kvtierctl, the real binary, against a real kvtierd with a disk tier:
// status, stats, namespaces, evict by namespace and tier, flush, and verify,
// which finds a record corrupted on disk, drops it and never serves it.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/disk_helpers.h"
#include "tests/integration/stats_when.h"
#include "tests/programs.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

struct CtlRun {
  int exit_code = -1;
  std::string out;  // stdout
};

// Runs kvtierctl with `args` against the daemon; stderr is left to the log.
CtlRun Ctl(const DaemonProcess& d, const std::string& args) {
  const std::string cmd = testing::ProgramPath("kvtierctl") + " --socket " + d.socket_path() + " " +
                          args + " 2>/dev/null";
  CtlRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (::fgets(buf, sizeof(buf), p) != nullptr) r.out += buf;
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Flips bytes all over the data written to the disk tier's segment files.
int CorruptSegments(const std::string& dir) {
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir + "/disk")) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    ++files;
    for (off_t off = 100; off < (1 << 20); off += 1024) {
      uint8_t byte = 0;
      if (::pread(fd, &byte, 1, off) != 1) break;
      byte ^= 0x5a;
      if (::pwrite(fd, &byte, 1, off) != 1) break;
    }
    ::fsync(fd);
    ::close(fd);
  }
  return files;
}

// One version string (issue 33): kvtierctl's own, and the daemon's from its
// Welcome; a daemon that cannot be reached still leaves kvtierctl's.
TEST(KvtierctlTest, VersionSaysItsOwnAndTheDaemons) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  const std::string release = Client::release();
  EXPECT_FALSE(release.empty());
  CtlRun v = Ctl(*d, "version");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_EQ(v.out, "kvtierctl " + release + "\nkvtierd   " + release + " (" + d->socket_path() + ")\n");
  v = Ctl(*d, "version --json");
  EXPECT_EQ(v.out, "{\"kvtierctl\": \"" + release + "\", \"kvtierd\": \"" + release + "\"}\n");
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d->socket_path()});
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ((*c)->daemon_release(), release);
  EXPECT_EQ((*c)->Stats().value().release, release);
  const std::string socket = d->socket_path();
  d->Stop();
  FILE* p = ::popen((testing::ProgramPath("kvtierctl") + " --socket " + socket + " version 2>/dev/null").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[256] = {};
  std::string out;
  while (::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = ::pclose(p);
  EXPECT_EQ(WEXITSTATUS(status), 3) << "no daemon: unavailable";
  EXPECT_EQ(out, "kvtierctl " + release + "\n");
}

TEST(KvtierctlTest, InspectsEvictsFlushesAndVerifies) {
  std::vector<std::string> sets = DiskSets("io_uring");
  sets.push_back("metrics.enabled=true");
  sets.push_back("metrics.listen=127.0.0.1:0");
  Result<DaemonProcess> d = DaemonProcess::Start(sets);
  ASSERT_TRUE(d.has_value()) << d.error();
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);

  CtlRun status = Ctl(*d, "status");
  EXPECT_EQ(status.exit_code, 0);
  EXPECT_THAT(status.out, HasSubstr("backend   host"));
  EXPECT_THAT(status.out, HasSubstr("metrics   http://127.0.0.1:"));
  EXPECT_THAT(status.out, HasSubstr("scope     node"));
  EXPECT_THAT(status.out, HasSubstr("disk idx  writable; 0 write error(s), 0 recovery(ies)"));
  status = Ctl(*d, "status --json");
  EXPECT_THAT(status.out, HasSubstr("\"disk_index\": {\"stopped\": false, \"errors\": 0, \"recoveries\": 0}"));
  EXPECT_THAT(status.out, HasSubstr("\"sessions\": 2"));  // the test and kvtierctl
  EXPECT_THAT(status.out, HasSubstr("\"scope\": \"node\""));

  const std::vector<BlockKey> keys = s.client->ComputeKeys(s.id, Prompt(3, 32)).value();
  ASSERT_EQ(StoreAck(s, keys).size(), keys.size());

  const LayoutFingerprint fp = SmallLayout().fingerprint();
  CtlRun ns = Ctl(*d, "namespaces --json");
  EXPECT_EQ(ns.exit_code, 0);
  EXPECT_THAT(ns.out, HasSubstr("\"namespace\": \"" + fp.ToHex() + "\""));
  EXPECT_THAT(ns.out, HasSubstr("\"blocks\": 32"));
  EXPECT_THAT(ns.out, HasSubstr("model=kvtier/disk-it"));
  EXPECT_THAT(Ctl(*d, "namespaces").out, HasSubstr(fp.ToHex()));

  // Flush moves the host blocks to disk.
  CtlRun flush = Ctl(*d, "flush --json");
  ASSERT_EQ(flush.exit_code, 0);
  const uint64_t flushed = std::stoull(flush.out.substr(flush.out.find(':') + 1));
  ASSERT_EQ(flushed, 32u);
  StatsWhen(*s.client, [&](const DaemonStats& st) { return st.Counter("disk_demotions") >= flushed; });
  EXPECT_THAT(Ctl(*d, "namespaces --json").out,
              HasSubstr("\"used_bytes\": {\"hbm\": 0, \"host\": 0, \"disk\": " + std::to_string(32 * 16384) + "}"));
  EXPECT_EQ(s.client->Lookup(s.id, keys).value().hits, 32u);
  // Another namespace, or one that is not hex, evicts nothing.
  EXPECT_THAT(Ctl(*d, "evict --namespace 000102030405060708090a0b0c0d0e0f").out, HasSubstr("evicted 0 block(s)"));
  EXPECT_EQ(Ctl(*d, "evict --namespace nothex").exit_code, 2);

  CtlRun verify = Ctl(*d, "verify --json");
  EXPECT_EQ(verify.exit_code, 0) << verify.out;
  EXPECT_THAT(verify.out, HasSubstr("\"total\": 32, \"checked\": 32, \"bad\": 0"));

  // Damage what is on disk: verify finds it, drops it, and it is never served.
  ASSERT_GT(CorruptSegments(d->dir()), 0);
  verify = Ctl(*d, "verify --json");
  EXPECT_EQ(verify.exit_code, 1) << verify.out;
  EXPECT_THAT(verify.out, ::testing::Not(HasSubstr("\"bad\": 0")));
  const uint32_t hits = s.client->Lookup(s.id, keys).value().hits;
  EXPECT_LT(hits, 32u);
  std::vector<uint32_t> ids(hits);
  for (uint32_t i = 0; i < hits; ++i) ids[i] = 100 + i;
  const OpResult loaded = s.client->Load(s.id, std::span(keys).first(hits), ids).value();
  for (uint32_t i = 0; i < loaded.blocks; ++i) EXPECT_TRUE(MatchesKey(keys[i], s.cache->block(100 + i)));

  // Evict what is left of the namespace, by fingerprint.
  CtlRun evict = Ctl(*d, "evict --namespace " + fp.ToHex());
  EXPECT_EQ(evict.exit_code, 0);
  EXPECT_THAT(evict.out, HasSubstr("evicted "));
  EXPECT_EQ(Ctl(*d, "namespaces --json").out, "[]\n");

  // An unknown tenant is refused.
  EXPECT_EQ(Ctl(*d, "namespaces --tenant nobody").exit_code, 1);
}

}  // namespace
}  // namespace kvtier::testing
