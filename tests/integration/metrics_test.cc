// /metrics of a real kvtierd: scraped over HTTP before and after real client
// traffic (stores, lookups, loads, demotion to disk), the kvtier_* values move
// as the traffic says they must, and promtool (Debian's prometheus package,
// installed by tools/setup-deps.sh) accepts the page.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "common/block_pattern.h"
#include "common/unique_fd.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

// GET /metrics from "host:port" (IPv4), body only; empty on failure.
std::string Scrape(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  if (::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) != 1) return "";
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) return "";
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (::write(fd.get(), request.data(), request.size()) != static_cast<ssize_t>(request.size())) return "";
  std::string response;
  char buf[8192];
  ssize_t n = 0;
  while ((n = ::read(fd.get(), buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || response.find(" 200 ") == std::string::npos || body == std::string::npos) {
    return "";
  }
  return response.substr(body + 4);
}

// "name{labels}" -> value, for every sample line of a page.
std::map<std::string, double> Samples(const std::string& page) {
  std::map<std::string, double> out;
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

// promtool's verdict on a page: "" when it is accepted, else its output.
std::string PromtoolProblems(const std::string& page, const std::string& dir) {
  const std::string file = dir + "/metrics.txt";
  std::ofstream(file) << page;
  const std::string cmd = "promtool check metrics < " + file + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "cannot run promtool";
  std::string out;
  char buf[4096];
  while (::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = ::pclose(p);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127) return "promtool is not installed (tools/setup-deps.sh installs it)";
  return status == 0 ? "" : "promtool failed:\n" + out;
}

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "kvtier/metrics", .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16, .block_tokens = 16})
      .value();
}

TEST(MetricsTest, ValuesMoveWithTrafficAndPromtoolAcceptsThePage) {
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"metrics.enabled=true", "metrics.listen=127.0.0.1:0", "tiers.hbm.enabled=true",
       "tiers.hbm.bytes=1MiB", "tiers.host.bytes=2MiB", "tiers.disk.enabled=true",
       "tiers.disk.bytes=64MiB", "tiers.disk.region_bytes=4MiB",
       // Blocks loaded from disk stay in host at once, so every tier shows some.
       "policy.disk_promotion_min_hits=0",
       // KV events on, so their families are on the page too.
       "events.enabled=true", "events.endpoint=ipc:///tmp/kvtier-metrics-events-" + std::to_string(::getpid()),
       "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true, publish_events: true}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d->socket_path(), .client_name = "metrics"});
  ASSERT_TRUE(c.has_value()) << c.error();
  Client& client = **c;
  const std::string address = client.Stats().value().metrics;
  ASSERT_FALSE(address.empty()) << d->Log();

  const std::string before_page = Scrape(address);
  ASSERT_FALSE(before_page.empty()) << "no /metrics at " << address;
  EXPECT_EQ(PromtoolProblems(before_page, d->dir()), "");
  const std::map<std::string, double> before = Samples(before_page);
  EXPECT_EQ(before.at("kvtier_stores_total"), 0);
  EXPECT_EQ(before.at("kvtier_sessions"), 1);
  EXPECT_EQ(before.at("kvtier_tier_capacity_bytes{tier=\"hbm\"}"), 1 << 20);

  // 96 blocks of 16 KiB: more than hbm holds, so the rest goes to host, and
  // a flush moves those to disk; the loads bring some back to host.
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 128);
  ASSERT_TRUE(cache.has_value()) << cache.error();
  const CacheId id = client.RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = client.ComputeKeys(id, PseudoTokens(7, 96 * 16)).value();
  std::vector<uint32_t> ids(keys.size());
  for (uint32_t i = 0; i < ids.size(); ++i) {
    ids[i] = i;
    FillFromKey(keys[i], cache->block(i));
  }
  std::vector<uint8_t> engine_hashes(keys.size() * 16);
  for (size_t i = 0; i < keys.size(); ++i) std::copy_n(keys[i].bytes.begin(), 16, engine_hashes.begin() + i * 16);
  const BlockEventInfo events{.hash_bytes = 16, .engine_hashes = engine_hashes, .parent_hash = {}, .token_ids = {},
                              .block_size = 16, .lora_name = {}};
  ASSERT_EQ(client.Store(id, keys, ids, std::nullopt, &events).value().blocks, keys.size());
  const uint64_t flushed = client.Flush().value();
  ASSERT_GT(flushed, 0u);
  const DaemonStats settled =
      StatsWhen(client, [flushed](const DaemonStats& s) { return s.Counter("disk_demotions") >= flushed; });
  ASSERT_EQ(settled.Counter("disk_demotions"), flushed) << d->Log();
  const uint32_t hits = client.Lookup(id, keys).value().hits;
  EXPECT_EQ(hits, keys.size());
  std::vector<uint32_t> into(8);
  for (uint32_t i = 0; i < 8; ++i) into[i] = 100 + i;
  // The chain's last blocks: hbm demoted the chain's tail first (its tail is
  // coldest), so these went to host, and the flush moved them to disk.
  ASSERT_EQ(client.Load(id, std::span(keys).last(8), into).value().blocks, 8u);

  // Events go out on the publisher's cadence: the start's clear marker, each
  // block stored, each written to disk.
  const uint64_t min_events = 1 + 96 + flushed;
  StatsWhen(client, [&](const DaemonStats& s) { return s.Counter("events_published") >= min_events; });
  const std::string after_page = Scrape(address);
  ASSERT_FALSE(after_page.empty());
  EXPECT_EQ(PromtoolProblems(after_page, d->dir()), "");
  const std::map<std::string, double> after = Samples(after_page);
  const double block = 16 << 10;
  EXPECT_EQ(after.at("kvtier_stores_total"), 96);
  EXPECT_EQ(after.at("kvtier_lookups_total"), 1);
  EXPECT_EQ(after.at("kvtier_hits_total{tier=\"hbm\"}") + after.at("kvtier_hits_total{tier=\"host\"}") +
                after.at("kvtier_hits_total{tier=\"disk\"}"),
            96);
  EXPECT_EQ(after.at("kvtier_loads_total"), 8);
  EXPECT_EQ(after.at("kvtier_bytes_moved_total{direction=\"engine_to_cache\"}"), 96 * block);
  EXPECT_EQ(after.at("kvtier_bytes_moved_total{direction=\"cache_to_engine\"}"), 8 * block);
  EXPECT_GT(after.at("kvtier_bytes_moved_total{direction=\"host_to_disk\"}"), 0);
  EXPECT_GT(after.at("kvtier_moves_total{from=\"host\",to=\"disk\"}"), 0);
  EXPECT_GT(after.at("kvtier_tier_used_bytes{tier=\"disk\"}"), 0);
  // The disk tier's reclaim and write-back figures: free regions kept ahead
  // of need (16 regions, one open), nothing failed, nothing left in line.
  EXPECT_GT(after.at("kvtier_disk_free_regions"), 0);
  EXPECT_EQ(after.at("kvtier_disk_writes_pending"), 0);
  EXPECT_EQ(after.at("kvtier_disk_records_carried_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_hot_blocks_dropped_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_reclaim_failures_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_index_errors_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_index_stopped"), 0);
  EXPECT_EQ(after.at("kvtier_disk_index_recoveries_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_writes_given_up_total"), 0);
  // The I/O threads: the flush's writes and a sync at least, the loads'
  // reads, each at depth 1 or more, and idle no longer than they lived.
  EXPECT_GE(after.at("kvtier_disk_io_operations_total{op=\"write\"}"), static_cast<double>(flushed));
  EXPECT_GE(after.at("kvtier_disk_io_operations_total{op=\"sync\"}"), 1);
  EXPECT_GE(after.at("kvtier_disk_io_operations_total{op=\"read\"}"), 1);
  EXPECT_GE(after.at("kvtier_disk_io_bytes_total{op=\"write\"}"), static_cast<double>(flushed) * block);
  EXPECT_GE(after.at("kvtier_disk_io_depth_sum_total"),
            after.at("kvtier_disk_io_operations_total{op=\"read\"}") +
                after.at("kvtier_disk_io_operations_total{op=\"write\"}") +
                after.at("kvtier_disk_io_operations_total{op=\"sync\"}"));
  EXPECT_LE(after.at("kvtier_disk_io_idle_seconds_total"), after.at("kvtier_disk_io_thread_seconds_total"));
  EXPECT_GT(after.at("kvtier_disk_io_thread_seconds_total"), 0);
  EXPECT_GT(after.at("kvtier_tier_blocks{tier=\"host\"}"), 0);
  EXPECT_EQ(after.at("kvtier_lookup_duration_seconds_count"), 1);
  // Every request is a turn of the loop at least.
  EXPECT_GE(after.at("kvtier_loop_turn_duration_seconds_count"), 4);
  EXPECT_GE(after.at("kvtier_loop_slow_turns_total"), 0);
  EXPECT_EQ(after.at("kvtier_store_duration_seconds_count"), 1);
  EXPECT_EQ(after.at("kvtier_load_duration_seconds_count"), 1);
  EXPECT_EQ(after.at("kvtier_loads_short_total{reason=\"gone\"}"), 0);
  EXPECT_EQ(after.at("kvtier_loads_short_total{reason=\"disk\"}"), 0);
  EXPECT_GT(after.at("kvtier_disk_write_duration_seconds_count"), 0);
  EXPECT_GT(after.at("kvtier_store_duration_seconds_sum"), 0);
  EXPECT_EQ(after.at("kvtier_tenant_hits_total{tenant=\"local\"}"), 96);
  EXPECT_EQ(after.at("kvtier_tenant_lookups_total{tenant=\"local\"}"), 1);
  EXPECT_EQ(after.at("kvtier_tenant_misses_total{tenant=\"local\"}"), 0);
  EXPECT_EQ(after.at("kvtier_tenant_stores_total{tenant=\"local\"}"), 96);
  EXPECT_EQ(after.at("kvtier_tenant_loads_total{tenant=\"local\"}"), 8);
  EXPECT_EQ(after.at("kvtier_tenant_evictions_total{tenant=\"local\",tier=\"host\"}"), 0);
  EXPECT_EQ(after.at("kvtier_extents_reclaimed_total"), 0);
  EXPECT_EQ(after.at("kvtier_extent_slots_examined_total"), 0);
  EXPECT_EQ(after.at("kvtier_disk_quota_evictions_total"), 0);
  EXPECT_EQ(after.at("kvtier_namespaces"), 1);
  EXPECT_EQ(after.at("kvtier_evicts_pending"), 0);
  EXPECT_EQ(after.at("kvtier_timed_waits_pending"), 0);
  EXPECT_GT(after.at("kvtier_tenant_used_bytes{tenant=\"local\",tier=\"disk\"}"), 0);
  EXPECT_EQ(after.at("kvtier_client_mappings"), 1);
  EXPECT_EQ(after.at("kvtier_leases"), 0);
  EXPECT_THAT(after_page, HasSubstr("kvtier_build_info{backend=\"host"));
  EXPECT_GE(after.at("kvtier_kv_events_published_total"), min_events);
  EXPECT_EQ(after.at("kvtier_kv_events_dropped_total"), 0);
  EXPECT_EQ(after.at("kvtier_kv_event_blocks_tracked"), 96);
  EXPECT_GT(after.at("kvtier_kv_event_metadata_bytes"), 96 * 100);
  EXPECT_EQ(after.at("kvtier_kv_event_metadata_refused_total"), 0);
  EXPECT_EQ(after.at("kvtier_kv_events_clears_total"), 1);

  // Every series the Grafana dashboard queries is one the daemon exports.
  std::ifstream dashboard(std::string(KVTIER_SOURCE_DIR) + "/tools/grafana-dashboard.json");
  ASSERT_TRUE(dashboard.good());
  const std::string json((std::istreambuf_iterator<char>(dashboard)), std::istreambuf_iterator<char>());
  const std::regex name("kvtier_[a-z_]+");
  int queried = 0;
  for (auto it = std::sregex_iterator(json.begin(), json.end(), name); it != std::sregex_iterator(); ++it) {
    ++queried;
    EXPECT_THAT(after_page, HasSubstr("\n" + it->str())) << "the dashboard queries " << it->str();
  }
  EXPECT_GT(queried, 20);
}

TEST(MetricsTest, AnAddressInUseStopsStartUp) {
  // Hold a port, then ask the daemon for it.
  UniqueFd held(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(held.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(held.get(), 1), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::getsockname(held.get(), reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::string port = std::to_string(ntohs(sa.sin_port));
  Result<DaemonProcess> d = DaemonProcess::Start({"metrics.enabled=true", "metrics.listen=127.0.0.1:" + port});
  ASSERT_FALSE(d.has_value());
  EXPECT_THAT(d.error().message(), HasSubstr("metrics.listen"));
}

}  // namespace
}  // namespace kvtier::testing
