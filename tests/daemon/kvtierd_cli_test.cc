// Runs the real kvtierd binary's --check-config path.
#include <sys/wait.h>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/version.h"
#include "ipc/wire.h"
#include "tests/programs.h"
#include "tiers/disk/disk_tier.h"

namespace {

using ::testing::HasSubstr;

struct CmdResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

CmdResult Kvtierd(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + kvtier::testing::ProgramPath("kvtierd") + " " + args + " 2>&1";
  CmdResult run;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return run;
  std::array<char, 4096> buf{};
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) run.output.append(buf.data(), n);
  const int status = ::pclose(p);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

const std::string kExample = std::string(KVTIER_SOURCE_DIR) + "/config/kvtier.example.yaml";

TEST(KvtierdCliTest, ExampleConfigChecksOk) {
  const CmdResult r = Kvtierd("--config " + kExample + " --check-config");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("configuration OK"));
  EXPECT_THAT(r.output, HasSubstr("chat-prod"));
  // Secrets are never printed.
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("replace-me-with-openssl-rand-hex-32")));
}

TEST(KvtierdCliTest, DefaultsCheckOk) {
  const CmdResult r = Kvtierd("--check-config");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// --check-config says how the node's limits are shared: 24 tenants of 4,096
// maps each are past a node of 20,000 maps, so each is guaranteed a share
// and the rest is lent.
TEST(KvtierdCliTest, CheckConfigPrintsTheNodesBudgetsAndTheirShares) {
  std::string tenants = "tenants=[";
  for (int i = 0; i < 24; ++i) {
    tenants += (i ? ", {name: t" : "{name: t") + std::to_string(i) + ", uid: " + std::to_string(1000 + i) + "}";
  }
  const CmdResult r = Kvtierd("--set '" + tenants + "]' --set limits.node_max_map_count=20000 --check-config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("node budgets"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("vm.max_map_count 20000 maps: [0-9]+ maps kept for kvtierd, [0-9]+ "
                                                 "maps for 24 tenants .limits.max_mappings_per_tenant 4096 maps "
                                                 "each, 98304 maps in all: past it, so each is guaranteed"));
  EXPECT_THAT(r.output, HasSubstr("RLIMIT_NOFILE"));
  EXPECT_THAT(r.output, HasSubstr("memory ("));
}

TEST(KvtierdCliTest, NegativeSizeExitsTwoNamingTheKey) {
  const CmdResult r = Kvtierd("--config " + kExample + " --set tiers.host.bytes=-5 --check-config");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tiers.host.bytes"));
}

TEST(KvtierdCliTest, UnknownKeyExitsTwoNamingKeyAndLine) {
  char path[] = "/tmp/kvtier-cli-XXXXXX.yaml";
  const int fd = ::mkstemps(path, 5);
  ASSERT_GE(fd, 0);
  const std::string yaml = "socket:\n  path: /tmp/x.sock\nmetrics:\n  listen: 127.0.0.1:9464\n  colour: red\n";
  ASSERT_EQ(::write(fd, yaml.data(), yaml.size()), static_cast<ssize_t>(yaml.size()));
  ::close(fd);
  const CmdResult r = Kvtierd(std::string("--config ") + path + " --check-config");
  ::unlink(path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr(std::string(path) + ":5: metrics.colour: unknown key"));
}

// What start-up refuses from the config alone, --check-config refuses too,
// with the same words; and start-up refuses it as a config error (exit 2),
// before it creates anything.
struct StartupRule {
  const char* name;
  std::string sets;
  std::string error;
};

class StartupRuleTest : public ::testing::TestWithParam<StartupRule> {};

TEST_P(StartupRuleTest, CheckConfigAndStartUpRefuseIt) {
  const CmdResult check =
      Kvtierd("--config " + kExample + " " + GetParam().sets + " --check-config");
  EXPECT_EQ(check.exit_code, 2) << check.output;
  EXPECT_THAT(check.output, HasSubstr(GetParam().error));
  // The example, scaled to this machine, in a temporary directory.
  char dir[] = "/tmp/kvtier-cli-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string d = dir;
  const std::string here = " --set socket.path=" + d + "/kvtierd.sock --set state_dir=" + d +
                           "/state --set 'tiers.disk.paths=[" + d +
                           "/disk]' --set tiers.host.bytes=64MiB" +
                           " --set tiers.hbm.bytes=16MiB --set metrics.enabled=false ";
  const CmdResult start =
      Kvtierd("--config " + kExample + here + GetParam().sets + " --foreground", "timeout 30 ");
  EXPECT_EQ(start.exit_code, 2) << start.output;
  EXPECT_THAT(start.output, HasSubstr(GetParam().error));
  std::error_code ec;
  EXPECT_TRUE(std::filesystem::is_empty(d, ec)) << "start-up created files before refusing";
  std::filesystem::remove_all(d, ec);
}

std::vector<StartupRule> StartupRules() {
  std::vector<StartupRule> rules = {
      {"TwoHbmDevices", "--set 'tiers.hbm.devices=[0, 1]'",
       "--set tiers.hbm.devices=[0, 1]: tiers.hbm.devices: lists 2 devices, but one kvtierd "
       "serves"},
      {"DecimalDiskSize", "--set tiers.disk.bytes=100GB",
       "tiers.disk.bytes: must be a multiple of 4KiB (e.g. in MiB or GiB), got 100GB"},
      {"HugeRegions", "--set tiers.disk.region_bytes=16TiB --set tiers.disk.bytes=32TiB",
       "tiers.disk.region_bytes: must be below 16TiB, got 16TiB"},
      {"NodeLimitAboveTheNode", "--set limits.node_max_map_count=4294967295",
       "limits.node_max_map_count (4294967295) is above the node's vm.max_map_count"},
      {"NamespacesPastTheNodesLayouts",
       "--set 'tenants=[{name: a, uid: 1001}, {name: b, uid: 1002}, {name: c, uid: 1003}]' "
       "--set limits.max_namespaces_per_tenant=30000",
       "limits.max_namespaces_per_tenant: 30000 layouts a tenant for 3 tenants add up to 90000, past the 65536 "
       "layouts a node holds: set it to at most 21845"}};
#if !KVTIER_HAVE_CUDA
  rules.push_back({"CudaWithoutToolkit", "--set device.backend=cuda",
                   "device.backend: cuda, but this kvtierd was built without the CUDA toolkit"});
#endif
  return rules;
}

std::string RuleName(const ::testing::TestParamInfo<StartupRule>& rule) { return rule.param.name; }

INSTANTIATE_TEST_SUITE_P(Rules, StartupRuleTest, ::testing::ValuesIn(StartupRules()), RuleName);

TEST(KvtierdCliTest, TwoHbmDevicesAreRefusedAtTheirLine) {
  char path[] = "/tmp/kvtier-cli-XXXXXX.yaml";
  const int fd = ::mkstemps(path, 5);
  ASSERT_GE(fd, 0);
  const std::string yaml = "tiers:\n  hbm:\n    enabled: true\n    devices: [0, 1]\n";
  ASSERT_EQ(::write(fd, yaml.data(), yaml.size()), static_cast<ssize_t>(yaml.size()));
  ::close(fd);
  const CmdResult r = Kvtierd(std::string("--config ") + path + " --check-config");
  ::unlink(path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr(std::string(path) + ":4: tiers.hbm.devices: lists 2 devices"));
  // Off, the hbm tier's devices do not matter.
  EXPECT_EQ(Kvtierd("--set tiers.hbm.enabled=false --set 'tiers.hbm.devices=[0, 1]' --check-config")
                .exit_code,
            0);
}

// One version string (issue 33): CMake's project(VERSION), with the
// protocol and the disk format this kvtierd speaks and reads.
TEST(KvtierdCliTest, VersionSaysTheReleaseTheProtocolAndTheDiskFormat) {
  const CmdResult r = Kvtierd("--version");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.output, std::string("kvtierd ") + kvtier::kVersion + " (protocol " +
                          std::to_string(kvtier::ipc::kProtocolVersion) + ", disk format " +
                          std::to_string(kvtier::DiskTier::kFormatVersion) + ")\n");
}

TEST(KvtierdCliTest, BadCommandLineExitsTwo) {
  EXPECT_EQ(Kvtierd("--no-such-flag").exit_code, 2);
  EXPECT_EQ(Kvtierd("--config /nonexistent/kvtier.yaml --check-config").exit_code, 2);
}

}  // namespace
