#include "config/config_loader.h"

#include "common/default_socket.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvtier {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class ConfigLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-config-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::string WriteSalt(const std::string& name, size_t n = 256) {
    std::string bytes(n, '\0');
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 5);
    return WriteFile(name, bytes);
  }
  Result<Config> LoadYaml(const std::string& yaml, std::vector<std::string> overrides = {}) {
    return LoadConfig(ConfigSource{.file = WriteFile("kvtier.yaml", yaml), .overrides = std::move(overrides)});
  }
  // The error message of a load that must fail.
  std::string ErrorOf(const std::string& yaml, std::vector<std::string> overrides = {}) {
    Result<Config> c = LoadYaml(yaml, std::move(overrides));
    EXPECT_FALSE(c.has_value()) << "expected an error for:\n" << yaml;
    if (c) return "";
    EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
    return c.error().message();
  }
  std::string File() const { return dir_ + "/kvtier.yaml"; }

  std::string dir_;
};

TEST_F(ConfigLoaderTest, BuiltInDefaults) {
  Result<Config> c = LoadConfig(ConfigSource{});
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->socket.path, DaemonDefaultSocket());  // common/default_socket.h
  EXPECT_EQ(c->socket.mode, 0660u);
  EXPECT_EQ(c->device.backend, DeviceBackendKind::kAuto);
  ASSERT_EQ(c->tenants.size(), 1u);
  EXPECT_EQ(c->tenants[0].name, "local");
  EXPECT_EQ(c->tenants[0].uid, ::getuid());
  EXPECT_TRUE(c->tenants[0].admin);  // a single-tenant node
  EXPECT_FALSE(c->tiers.hbm.enabled);
  EXPECT_EQ(c->tiers.host.bytes, 2ull << 30);
  EXPECT_TRUE(c->tiers.host.prefault);
  EXPECT_TRUE(c->tiers.disk.enabled);
  EXPECT_EQ(c->tiers.disk.paths, std::vector<std::string>{"./var/kvtier/disk"});
  EXPECT_EQ(c->tiers.disk.region_bytes, 64ull << 20);
  EXPECT_EQ(c->tiers.disk.queue_depth, 64u);
  EXPECT_DOUBLE_EQ(c->policy.watermarks.host.high, 0.90);
  EXPECT_FALSE(c->policy.disk_admission.write_budget_bytes_per_day.has_value());
  EXPECT_EQ(c->metrics.listen, "127.0.0.1:9464");
  EXPECT_EQ(c->log.level, LogLevel::kInfo);
  // An empty file is the defaults too.
  EXPECT_TRUE(LoadYaml("").has_value());
  EXPECT_TRUE(LoadYaml("# only a comment\n").has_value());
}

TEST_F(ConfigLoaderTest, ExampleConfigLoads) {
  Result<Config> c =
      LoadConfig(ConfigSource{.file = std::string(KVTIER_SOURCE_DIR) + "/config/kvtier.example.yaml"});
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->socket.path, "/run/kvtier/kvtierd.sock");
  ASSERT_EQ(c->tenants.size(), 4u);
  EXPECT_EQ(c->tenants[0].sharing_group, "chat");
  EXPECT_EQ(c->tenants[0].SaltScope(), c->tenants[1].SaltScope());
  EXPECT_NE(c->tenants[0].SaltScope(), c->tenants[2].SaltScope());
  EXPECT_EQ(c->tenants[0].quotas.hbm_bytes, 32ull << 30);
  EXPECT_FALSE(c->tenants[1].quotas.hbm_bytes.has_value());
  EXPECT_TRUE(c->tenants[2].token.has_value());
  EXPECT_TRUE(c->tenants[3].admin);
  EXPECT_EQ(c->tiers.hbm.devices, std::vector<uint32_t>{0});  // one kvtierd per GPU
  EXPECT_EQ(c->tiers.disk.paths.size(), 2u);
  EXPECT_EQ(c->tiers.disk.bytes, 3ull << 40);
  EXPECT_DOUBLE_EQ(c->policy.watermarks.disk.low, 0.90);
  EXPECT_EQ(c->policy.disk_admission.min_hits, 1u);
  EXPECT_EQ(c->policy.disk_admission.write_budget_bytes_per_day, 20'000'000'000'000ull);
  EXPECT_EQ(c->log.format, LogFormat::kJson);
}

TEST_F(ConfigLoaderTest, HbmDevicesMatterOnlyWithTheHbmTier) {
  // Off, the hbm tier's devices do not matter.
  const Result<Config> c = LoadYaml("tiers:\n  hbm:\n    devices: [0, 1]\n");
  EXPECT_TRUE(c.has_value()) << c.error();
}

TEST_F(ConfigLoaderTest, RemoteTierSettings) {
  Result<Config> c = LoadYaml(
      "tiers:\n  remote:\n    enabled: true\n    seeds: [10.0.0.1:7000, 'redis-2:7001', '[fe80::1]:7002']\n"
      "    key_prefix: 'fleet-a:'\n    timeout_ms: 250\n    max_value_bytes: 8MiB\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_TRUE(c->tiers.remote.enabled);
  EXPECT_EQ(c->tiers.remote.seeds.size(), 3u);
  EXPECT_EQ(c->tiers.remote.key_prefix, "fleet-a:");
  EXPECT_EQ(c->tiers.remote.timeout_ms, 250u);
  EXPECT_EQ(c->tiers.remote.max_value_bytes, 8ull << 20);
  EXPECT_EQ(c->tiers.remote.write, RemoteWritePolicy::kOnStore);
  c = LoadYaml("tiers:\n  remote:\n    write: demote\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tiers.remote.write, RemoteWritePolicy::kOnDemote);
  c = LoadYaml("tiers:\n  remote:\n    write: through\n");
  ASSERT_FALSE(c.has_value());
  EXPECT_THAT(c.error().message(), HasSubstr("tiers.remote.write"));

  c = LoadYaml("tiers:\n  remote:\n    enabled: true\n");
  ASSERT_FALSE(c.has_value());
  EXPECT_THAT(c.error().message(), HasSubstr("tiers.remote.seeds: the remote tier is enabled but has no seed nodes"));
  for (const char* bad : {"nohost", "host:0", "host:70000", ":7000", "host:12x"}) {
    c = LoadYaml("tiers:\n  remote:\n    seeds: ['" + std::string(bad) + "']\n");
    ASSERT_FALSE(c.has_value()) << bad;
    EXPECT_THAT(c.error().message(), HasSubstr("expected host:port")) << bad;
  }
  c = LoadYaml("tiers:\n  remote:\n    max_value_bytes: 1KiB\n");
  ASSERT_FALSE(c.has_value());
  EXPECT_THAT(c.error().message(), HasSubstr("tiers.remote.max_value_bytes"));
}

TEST_F(ConfigLoaderTest, EventsAreOffByDefaultOnLoopbackAndCheckedWhenSet) {
  Result<Config> c = LoadYaml("");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_FALSE(c->events.enabled);
  EXPECT_EQ(c->events.endpoint, "tcp://127.0.0.1:5557");
  EXPECT_FALSE(c->tenants.at(0).publish_events);

  c = LoadYaml(
      "events:\n  enabled: true\n  endpoint: ipc:///run/kvtier/events\n  replay_endpoint: 'tcp://[::1]:5558'\n"
      "  topic: 'kv@{node}@{model}/{tenant}'\n  encoding: positional\n  hash: bytes\n  dp_rank: 3\n"
      "tenants:\n  - {name: a, uid: 1, publish_events: true, model: llama}\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->events.encoding, EventEncoding::kPositional);
  EXPECT_TRUE(c->events.hashes_as_bytes);
  EXPECT_EQ(c->events.dp_rank, 3);
  EXPECT_TRUE(c->tenants[0].publish_events);
  EXPECT_EQ(c->tenants[0].model, "llama");

  const std::pair<const char*, const char*> bad[] = {
      {"events:\n  endpoint: 'udp://x:1'\n", "events.endpoint: expected tcp://host:port or ipc://path"},
      {"events:\n  endpoint: 'tcp://nohost'\n", "events.endpoint: expected host:port"},
      {"events:\n  topic: 'kv@{pod}'\n", "events.topic: '{pod}' is not one of {node}, {model}, {tenant}"},
      {"events:\n  encoding: json\n", "events.encoding"},
      {"events:\n  hash: sha\n", "events.hash"},
      {"events:\n  endpoint: 'ipc:///a'\n  replay_endpoint: 'ipc:///a'\n", "events.replay_endpoint: must differ"},
      {"events:\n  cadence_ms: 0\n", "events.cadence_ms"},
  };
  for (const auto& [yaml, message] : bad) {
    c = LoadYaml(yaml);
    ASSERT_FALSE(c.has_value()) << yaml;
    EXPECT_THAT(c.error().message(), HasSubstr(message)) << yaml;
  }
}

TEST_F(ConfigLoaderTest, CodecsAreNoneAndLosslessByDefaultAndFp8OnlyWhereListed) {
  Result<Config> c = LoadYaml("");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tenants.at(0).codecs, (std::vector<CodecKind>{CodecKind::kNone, CodecKind::kLossless}));
  EXPECT_EQ(c->tiers.compression.threads, 2u);
  c = LoadYaml("tiers:\n  compression: {threads: 0, max_queued: 8, staging_bytes: 64MiB}\n"
               "tenants:\n  - {name: a, uid: 1, codecs: [fp8]}\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tenants[0].codecs, std::vector<CodecKind>{CodecKind::kFp8});
  EXPECT_EQ(c->tiers.compression.threads, 0u);
  EXPECT_EQ(c->tiers.compression.max_queued, 8u);
  EXPECT_EQ(c->tiers.compression.staging_bytes, 64ull << 20);
  const std::pair<const char*, const char*> bad[] = {
      {"tenants:\n  - {name: a, uid: 1, codecs: [lossless, zstd]}\n", "expected one of none, lossless, fp8"},
      {"tenants:\n  - {name: a, uid: 1, codecs: fp8}\n", "tenants[0].codecs"},
      {"tiers:\n  compression: {max_queued: 0}\n", "tiers.compression.max_queued"},
      {"tiers:\n  compression: {threads: 1000}\n", "tiers.compression.threads"},
      {"tiers:\n  compression: {staging_bytes: 4KiB}\n", "tiers.compression.staging_bytes: must be at least 1MiB"},
  };
  for (const auto& [yaml, message] : bad) {
    c = LoadYaml(yaml);
    ASSERT_FALSE(c.has_value()) << yaml;
    EXPECT_THAT(c.error().message(), HasSubstr(message)) << yaml;
  }
}

#if !KVTIER_HAVE_CUDA
TEST_F(ConfigLoaderTest, CudaBackendNeedsACudaBuild) {
  const Result<Config> c = LoadYaml("", {"device.backend=cuda"});
  ASSERT_FALSE(c.has_value());
  EXPECT_THAT(c.error().message(), HasSubstr("--set device.backend=cuda: device.backend: cuda, but this kvtierd "
                                             "was built without the CUDA toolkit"));
}
#endif

TEST_F(ConfigLoaderTest, EveryKeyIsDocumented) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/docs/config.md");
  std::stringstream doc;
  doc << in.rdbuf();
  const std::vector<std::string> keys = KnownConfigKeys();
  EXPECT_GT(keys.size(), 40u);
  for (const std::string& key : keys) {
    EXPECT_THAT(doc.str(), HasSubstr("| `" + key + "` |")) << "docs/config.md does not document " << key;
  }
}

TEST_F(ConfigLoaderTest, UserNamesResolve) {
  Result<Config> c = LoadYaml("tenants:\n  - name: r\n    uid: root\n    gid: root\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tenants[0].uid, 0u);
  EXPECT_EQ(c->tenants[0].gid, 0u);
}

TEST_F(ConfigLoaderTest, TokenAndSaltFiles) {
  const std::string token = WriteFile("token", "0123456789abcdef0123\n");
  const std::string salt = WriteSalt("a.salt");
  Result<Config> c = LoadYaml("tenants:\n  - name: a\n    token_file: " + token + "\n    salt_file: " + salt +
                              "\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tenants[0].token, "0123456789abcdef0123");
  EXPECT_EQ(c->tenants[0].salt_file, salt);
}

TEST_F(ConfigLoaderTest, SetOverridesFileAndLaterSetWins) {
  Result<Config> c =
      LoadYaml("tiers:\n  host:\n    bytes: 1GiB\n",
               {"tiers.host.bytes=3GiB", "tiers.disk.paths=[/a, /b]", "tiers.host.bytes=5GiB",
                "log.level=debug", "tiers.hbm.enabled=true", "tiers.host.prefault=false"});
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->tiers.host.bytes, 5ull << 30);
  EXPECT_FALSE(c->tiers.host.prefault);
  EXPECT_EQ(c->tiers.disk.paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(c->log.level, LogLevel::kDebug);
  EXPECT_TRUE(c->tiers.hbm.enabled);
  // Without a file.
  Result<Config> d = LoadConfig(ConfigSource{.overrides = {"tenants=[{name: a, uid: 1000}, {name: b, token: "
                                                           "abcdefghijklmnopq}]"}});
  ASSERT_TRUE(d.has_value()) << d.error();
  EXPECT_EQ(d->tenants.size(), 2u);
}

TEST_F(ConfigLoaderTest, UnknownKeysNameTheKeyAndLine) {
  const std::string e = ErrorOf("socket:\n  path: /tmp/k.sock\ntiers:\n  host:\n    byts: 1GiB\n");
  EXPECT_THAT(e,
              HasSubstr(File() + ":5: tiers.host.byts: unknown key (known here: bytes, prefault)"));
  EXPECT_THAT(ErrorOf("colour: blue\n"), HasSubstr(File() + ":1: colour: unknown key"));
  EXPECT_THAT(ErrorOf("", {"tiers.host.byts=1"}),
              HasSubstr("--set tiers.host.byts=1: tiers.host.byts: unknown key"));
}

TEST_F(ConfigLoaderTest, NegativeSizeFromSetNamesTheKey) {
  EXPECT_THAT(ErrorOf("", {"tiers.host.bytes=-5"}),
              HasSubstr("--set tiers.host.bytes=-5: tiers.host.bytes: '-5' is not a size (negative)"));
}

TEST_F(ConfigLoaderTest, ReportsEveryErrorAtOnce) {
  const std::string e = ErrorOf("tiers:\n  host:\n    bytes: 0\n  disk:\n    queue_depth: 0\nlog:\n  level: loud\n");
  EXPECT_THAT(e, HasSubstr(":3: tiers.host.bytes: must be a positive size"));
  EXPECT_THAT(e, HasSubstr(":5: tiers.disk.queue_depth: must be from 1 to 4096"));
  EXPECT_THAT(e, HasSubstr(":7: log.level: expected one of trace, debug, info, warn, error, critical, off"));
}

// Paths past 16 TiB (a 30.72 TB NVMe drive) load, up to the 2 PiB the disk
// tier addresses; one byte more is refused (ConfigValidationTest).
TEST_F(ConfigLoaderTest, DiskPathsLargerThan16TiBLoad) {
  for (const auto& [set, bytes] :
       {std::pair<std::string, uint64_t>{"30720GB", 30720ull * 1000 * 1000 * 1000},
        {"2048TiB", 2048ull << 40}}) {
    Result<Config> c = LoadYaml("", {"tiers.disk.bytes=" + set, "tiers.disk.region_bytes=1GiB"});
    ASSERT_TRUE(c.has_value()) << set << ": " << c.error();
    EXPECT_EQ(c->tiers.disk.bytes, bytes);
  }
}

struct BadCase {
  std::string name;
  std::string yaml;
  std::vector<std::string> overrides;
  std::string expected;  // substring of the error
};

class ConfigValidationTest : public ConfigLoaderTest, public ::testing::WithParamInterface<BadCase> {};

TEST_P(ConfigValidationTest, RejectsWithAMessageNamingTheKey) {
  const BadCase& c = GetParam();
  EXPECT_THAT(ErrorOf(c.yaml, c.overrides), HasSubstr(c.expected));
}

std::string CaseName(const ::testing::TestParamInfo<BadCase>& param_info) { return param_info.param.name; }

const std::string kSocketTooLong = std::string(120, 'x');

INSTANTIATE_TEST_SUITE_P(
    All, ConfigValidationTest,
    ::testing::Values(
        BadCase{"DuplicateKey", "log:\n  level: info\n  level: debug\n", {}, ":3: log.level: given more than once"},
        BadCase{"NoValue", "socket:\n  path:\n", {}, ":2: socket.path: has no value"},
        BadCase{"MapForScalar", "tiers:\n  host:\n    bytes: {a: 1}\n", {}, "tiers.host.bytes: expected a value, got a map"},
        BadCase{"ScalarForMap", "tiers: 5\n", {}, ":1: tiers: expected a map of keys, got '5'"},
        BadCase{"TopLevelList", "- a\n- b\n", {}, "(top level): expected a map of keys, got a list"},
        BadCase{"BadBool", "", {"tiers.disk.enabled=maybe"}, "tiers.disk.enabled: expected true or false, got 'maybe'"},
        BadCase{"ZeroSize", "tiers:\n  hbm:\n    bytes: 0GiB\n", {}, ":3: tiers.hbm.bytes: must be a positive size"},
        BadCase{"FractionalSize", "", {"tiers.host.bytes=1.5GiB"}, "tiers.host.bytes: '1.5GiB' is not a size"},
        BadCase{"UnknownUnit", "", {"tiers.host.bytes=3 parsecs"}, "tiers.host.bytes: '3 parsecs' is not a size (unknown unit 'parsecs')"},
        BadCase{"WatermarkOrder", "policy:\n  watermarks:\n    host: {high: 0.5, low: 0.6}\n", {}, ":3: policy.watermarks.host.low: must be below policy.watermarks.host.high (0.5)"},
        BadCase{"WatermarkRange", "", {"policy.watermarks.disk.high=1.5"}, "policy.watermarks.disk.high: expected a fraction in (0, 1], got '1.5'"},
        BadCase{"WatermarkZero", "", {"policy.watermarks.hbm.low=0"}, "policy.watermarks.hbm.low: expected a fraction in (0, 1]"},
        BadCase{"ModeNotOctal", "socket:\n  mode: 0999\n", {}, ":2: socket.mode: expected an octal mode such as 0660, got '0999'"},
        BadCase{"ModeOwnerCannotWrite", "", {"socket.mode=0440"}, "socket.mode: the owner needs read and write"},
        BadCase{"SocketPathTooLong", "socket:\n  path: /tmp/" + kSocketTooLong + "\n", {}, "socket.path: is 125 bytes; a unix socket path must be under 108"},
        BadCase{"NoTenants", "tenants: []\n", {}, ":1: tenants: at least one tenant is required"},
        BadCase{"TenantsNotAList", "tenants: {name: a}\n", {}, "tenants: expected a list of tenants, got a map"},
        BadCase{"TenantWithoutIdentity", "tenants:\n  - name: a\n", {}, "tenants[0]: needs uid, gid, token or token_file"},
        BadCase{"TenantWithoutName", "tenants:\n  - uid: 5\n", {}, "tenants[0].name: is required"},
        BadCase{"TenantBadName", "tenants:\n  - name: ../etc\n    uid: 5\n", {}, ":2: tenants[0].name: '../etc' must be 1-64 of"},
        BadCase{"TenantUnknownKey", "tenants:\n  - name: a\n    uid: 5\n    colour: red\n", {}, ":4: tenants[0].colour: unknown key"},
        BadCase{"DuplicateTenantNames", "tenants:\n  - {name: a, uid: 5}\n  - {name: a, uid: 6}\n", {}, "tenants[1].name: 'a' is also the name of tenants[0]"},
        BadCase{"DuplicateUid", "tenants:\n  - {name: a, uid: 5}\n  - {name: b, uid: 5}\n", {}, ":3: tenants[1].uid: the same uid/gid already identifies tenants[0]"},
        BadCase{"DuplicateToken", "tenants:\n  - {name: a, token: abcdefghijklmnopq}\n  - {name: b, token: abcdefghijklmnopq}\n", {}, "tenants[1].token: the same token already identifies tenants[0]"},
        BadCase{"ShortToken", "tenants:\n  - {name: a, token: short}\n", {}, "tenants[0].token: a token must be at least 16 bytes"},
        BadCase{"UnknownUser", "tenants:\n  - {name: a, uid: no-such-user-kvtier}\n", {}, "tenants[0].uid: no user named 'no-such-user-kvtier'"},
        BadCase{"UnknownGroup", "tenants:\n  - {name: a, gid: no-such-group-kvtier}\n", {}, "tenants[0].gid: no group named 'no-such-group-kvtier'"},
        BadCase{"MissingTokenFile", "tenants:\n  - {name: a, token_file: /nonexistent/kvtier.token}\n", {}, "tenants[0].token_file: cannot read token file '/nonexistent/kvtier.token'"},
        BadCase{"MissingSaltFile", "tenants:\n  - {name: a, uid: 5, salt_file: /nonexistent/a.salt}\n", {}, "tenants[0].salt_file: opening secret file /nonexistent/a.salt"},
        BadCase{"QuotaZero", "tenants:\n  - {name: a, uid: 5, quotas: {host: 0}}\n", {}, "tenants[0].quotas.host: must be a positive size"},
        BadCase{"QuotaUnknownTier", "tenants:\n  - {name: a, uid: 5, quotas: {ssd: 1GiB}}\n", {}, "tenants[0].quotas.ssd: unknown key (known here: hbm, host, disk)"},
        BadCase{"DiskWithoutPaths", "", {"tiers.disk.paths=[]"}, "tiers.disk.paths: the disk tier is enabled but has no paths"},
        BadCase{"DiskDuplicatePaths", "", {"tiers.disk.paths=[/a, /a]"}, "tiers.disk.paths: lists a path twice"},
        BadCase{"DiskPathsNotAList", "", {"tiers.disk.paths=/a"}, "tiers.disk.paths: expected a list such as [a, b], got '/a'"},
        BadCase{"RegionUnaligned", "", {"tiers.disk.region_bytes=1000000"}, "tiers.disk.region_bytes: must be a multiple of 4KiB and at least 1MiB"},
        BadCase{"DiskSmallerThanTwoRegions", "", {"tiers.disk.bytes=100MiB"}, "tiers.disk.bytes: must hold at least two regions of 64MiB, got 100MiB"},
        BadCase{"DiskPathLargerThanSupported", "", {"tiers.disk.bytes=2049TiB"}, "tiers.disk.bytes: is 2049TiB per path; the disk tier supports at most 2048TiB (2 PiB)"},
        BadCase{"RegionLargerThanSupported", "", {"tiers.disk.bytes=100TiB", "tiers.disk.region_bytes=16TiB"}, "tiers.disk.region_bytes: must be below 16TiB, got 16TiB"},
        BadCase{"HbmDuplicateDevice", "", {"tiers.hbm.devices=[0, 1, 0]"}, "tiers.hbm.devices: lists a device twice"},
        BadCase{"HbmTwoDevices", "", {"tiers.hbm.enabled=true", "tiers.hbm.devices=[0, 1]"}, "--set tiers.hbm.devices=[0, 1]: tiers.hbm.devices: lists 2 devices, but one kvtierd serves the hbm tier of one GPU"},
        BadCase{"DiskBytesUnaligned", "tiers:\n  disk:\n    bytes: 100GB\n", {}, ":3: tiers.disk.bytes: must be a multiple of 4KiB (e.g. in MiB or GiB), got 100GB (100000000000 bytes)"},
        BadCase{"RegionTooLarge", "", {"tiers.disk.region_bytes=16TiB", "tiers.disk.bytes=32TiB"}, "tiers.disk.region_bytes: must be below 16TiB, got 16TiB"},
        BadCase{"HbmBadDevice", "", {"tiers.hbm.devices=[0, -1]"}, "tiers.hbm.devices: item 1: expected a whole number from 0 to 1023, got '-1'"},
        BadCase{"IoEngine", "", {"tiers.disk.io_engine=spdk"}, "tiers.disk.io_engine: expected one of auto, io_uring, threadpool, got 'spdk'"},
        BadCase{"Eviction", "", {"policy.eviction=random"}, "policy.eviction: expected one of lru, s3fifo, classes, got 'random'"},
        BadCase{"HintShare", "", {"policy.hints.max_share=0"}, "policy.hints.max_share: expected a fraction in (0, 1], got '0'"},
        BadCase{"WriteBudget", "", {"policy.disk_admission.write_budget_per_day=lots"}, "policy.disk_admission.write_budget_per_day: 'lots' is not a size"},
        BadCase{"MetricsListen", "", {"metrics.listen=localhost"}, "metrics.listen: expected host:port"},
        BadCase{"MetricsPort", "", {"metrics.listen=127.0.0.1:70000"}, "metrics.listen: expected host:port"},
        BadCase{"LimitZero", "", {"limits.max_keys_per_request=0"}, "limits.max_keys_per_request: must be from 1 to 1048576, got 0"},
        BadCase{"LogFormat", "", {"log.format=xml"}, "log.format: expected one of text, json, got 'xml'"},
        BadCase{"Backend", "", {"device.backend=rocm"}, "device.backend: expected one of auto, host, cuda, got 'rocm'"},
        BadCase{"SetWithoutValue", "", {"tiers.host.bytes="}, "--set tiers.host.bytes=: tiers.host.bytes: has no value"},
        BadCase{"SetWithoutEquals", "", {"tiers.host.bytes"}, "--set tiers.host.bytes: expected KEY=VALUE"},
        BadCase{"SetBadKey", "", {"tenants[0].uid=5"}, "is not a dotted key such as tiers.host.bytes"},
        BadCase{"SetBadYaml", "", {"tiers.disk.paths=[/a"}, "tiers.disk.paths: the value is not valid YAML"},
        BadCase{"SetThroughScalar", "socket:\n  path: /tmp/k.sock\n", {"socket.path.x=1"}, "--set socket.path.x=1: socket.path is not a map"},
        BadCase{"SetBelowALeaf", "", {"socket.path.x=1"}, "--set socket.path.x=1: socket.path: expected a value, got a map"},
        BadCase{"InvalidYaml", "socket:\n  path: [unclosed\n", {}, "not valid YAML"}),
    CaseName);

TEST_F(ConfigLoaderTest, SaltFilesAndSharingGroups) {
  const std::string a = WriteSalt("a.salt");
  const std::string b = WriteSalt("b.salt");
  const std::string tiny = WriteSalt("tiny.salt", 64);
  // One group, one file: fine.
  EXPECT_TRUE(LoadYaml("tenants:\n  - {name: x, uid: 1, sharing_group: g, salt_file: " + a +
                       "}\n  - {name: y, uid: 2, sharing_group: g, salt_file: " + a + "}\n")
                  .has_value());
  EXPECT_THAT(ErrorOf("tenants:\n  - {name: x, uid: 1, sharing_group: g, salt_file: " + a +
                      "}\n  - {name: y, uid: 2, sharing_group: g, salt_file: " + b + "}\n"),
              HasSubstr("tenants[1].salt_file: tenants of sharing group 'g' must all name the same salt_file"));
  EXPECT_THAT(ErrorOf("tenants:\n  - {name: x, uid: 1, salt_file: " + a + "}\n  - {name: y, uid: 2, salt_file: " +
                      a + "}\n"),
              HasSubstr("tenants[1].salt_file: '" + a + "' is also the salt of tenants[0]"));
  EXPECT_THAT(ErrorOf("tenants:\n  - {name: x, uid: 1, salt_file: " + tiny + "}\n"),
              HasSubstr("tenants[0].salt_file: secret file " + tiny + ": secret is 64 bytes"));
  // A tenant and a group of the same name get different default salt files.
  Result<Config> c = LoadYaml("tenants:\n  - {name: g, uid: 1}\n  - {name: y, uid: 2, sharing_group: g}\n");
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_NE(c->tenants[0].SaltScope(), c->tenants[1].SaltScope());
}

TEST_F(ConfigLoaderTest, TokenAndTokenFileTogetherIsAnError) {
  const std::string token = WriteFile("token", "0123456789abcdef0123\n");
  EXPECT_THAT(ErrorOf("tenants:\n  - {name: a, token: abcdefghijklmnopq, token_file: " + token + "}\n"),
              HasSubstr("tenants[0].token_file: give token or token_file, not both"));
}

TEST_F(ConfigLoaderTest, MissingFileIsNotFound) {
  Result<Config> c = LoadConfig(ConfigSource{.file = dir_ + "/nope.yaml"});
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kNotFound);
  EXPECT_THAT(c.error().message(), HasSubstr(dir_ + "/nope.yaml"));
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

class ConfigPrivacyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-config-privacy-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path;
  }
  std::string dir_;
};

TEST_F(ConfigPrivacyTest, SocketGroupMustNameAGroup) {
  const std::string file = Write("kvtier.yaml", "socket:\n  group: root\n", 0600);
  Result<Config> c = LoadConfig(ConfigSource{.file = file});
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ(c->socket.group, std::optional<uint32_t>(0));
  Result<Config> none = LoadConfig(ConfigSource{.overrides = {"socket.group=kvtier-no-such-group"}});
  ASSERT_FALSE(none.has_value());
  EXPECT_THAT(none.error().message(), ::testing::HasSubstr("socket.group: no group named 'kvtier-no-such-group'"));
  EXPECT_EQ(LoadConfig(ConfigSource{.overrides = {"socket.group=1234"}})->socket.group, std::optional<uint32_t>(1234));
  EXPECT_FALSE(LoadConfig(ConfigSource{})->socket.group.has_value());  // the daemon's own
}

TEST_F(ConfigPrivacyTest, InlineTokensInAFileOthersCanReadAreAWarning) {
  const std::string tenants =
      "tenants:\n  - name: a\n    uid: 0\n    admin: true\n  - name: b\n    token: "
      "0123456789abcdef0123456789abcdef\n";
  const std::string shared = Write("shared.yaml", tenants, 0640);
  ConfigSource source{.file = shared};
  Result<Config> c = LoadConfig(source);
  ASSERT_TRUE(c.has_value()) << c.error();
  std::optional<std::string> warning = TokenExposure(*c, source);
  ASSERT_TRUE(warning.has_value());
  EXPECT_THAT(*warning, ::testing::HasSubstr("mode 0640"));
  EXPECT_THAT(*warning, ::testing::HasSubstr("token_file"));

  const std::string own = Write("own.yaml", tenants, 0600);  // its owner's alone
  ConfigSource own_source{.file = own};
  EXPECT_FALSE(TokenExposure(*LoadConfig(own_source), own_source).has_value());

  // A token in a token_file: the config may be readable by kvtierd's group.
  const std::string token = Write("b.token", "0123456789abcdef0123456789abcdef\n", 0600);
  const std::string by_file = Write(
      "by-file.yaml", "tenants:\n  - name: a\n    uid: 0\n    admin: true\n  - name: b\n    token_file: " + token + "\n",
      0640);
  ConfigSource file_source{.file = by_file};
  Result<Config> f = LoadConfig(file_source);
  ASSERT_TRUE(f.has_value()) << f.error();
  EXPECT_FALSE(TokenExposure(*f, file_source).has_value());
}

}  // namespace
}  // namespace kvtier
