// kvtierctl: operate a running kvtierd over its socket.
//
//   kvtierctl --socket PATH [--token T] stats   [--json]
//   kvtierctl --socket PATH [--token T] tenants [--json]     (admin)
//   kvtierctl --socket PATH [--token T] evict [--tenant NAME|*] [--tier hbm|host|disk] [--json]
//   kvtierctl --socket PATH [--token T] flush   [--json]     (admin: host -> disk)
//
// Exit codes: 0 success; 1 the daemon refused or failed; 2 usage; 3 the
// daemon is unavailable.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "kvtier/client.h"

namespace {

using kvtier::BlockTier;

const char* TierName(BlockTier t) {
  switch (t) {
    case BlockTier::kHbm: return "hbm";
    case BlockTier::kHost: return "host";
    case BlockTier::kDisk: return "disk";
  }
  return "?";
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

int Fail(const kvtier::Status& s) {
  std::fprintf(stderr, "kvtierctl: %s\n", s.ToString().c_str());
  return s.code() == kvtier::StatusCode::kUnavailable ? 3 : 1;
}

void PrintStats(const kvtier::DaemonStats& s, bool json) {
  if (json) {
    std::printf("{\"tiers\": [");
    for (size_t i = 0; i < s.tiers.size(); ++i) {
      const auto& t = s.tiers[i];
      std::printf("%s{\"tier\": \"%s\", \"capacity_bytes\": %lu, \"used_bytes\": %lu, \"blocks\": %lu}",
                  i ? ", " : "", TierName(t.tier), t.capacity_bytes, t.used_bytes, t.blocks);
    }
    std::printf("], \"sessions\": %lu, \"leases\": %lu, \"mappings\": %lu, \"inflight_ops\": %lu, \"counters\": {",
                s.sessions, s.leases, s.mappings, s.inflight_ops);
    for (size_t i = 0; i < s.counters.size(); ++i) {
      std::printf("%s%s: %lu", i ? ", " : "", JsonString(s.counters[i].first).c_str(), s.counters[i].second);
    }
    std::printf("}}\n");
    return;
  }
  std::printf("%-6s %16s %16s %10s\n", "tier", "capacity_bytes", "used_bytes", "blocks");
  for (const auto& t : s.tiers) {
    std::printf("%-6s %16lu %16lu %10lu\n", TierName(t.tier), t.capacity_bytes, t.used_bytes, t.blocks);
  }
  std::printf("sessions %lu  leases %lu  mappings %lu  inflight_ops %lu\n", s.sessions, s.leases, s.mappings,
              s.inflight_ops);
  for (const auto& [name, value] : s.counters) std::printf("%-24s %lu\n", name.c_str(), value);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtierctl: inspect and operate kvtierd", "kvtierctl"};
  std::string socket = "/run/kvtier/kvtierd.sock";
  std::string token;
  bool json = false;
  app.add_option("-s,--socket", socket, "kvtierd's socket")->capture_default_str();
  app.add_option("--token", token, "token of the tenant to act as (default: identified by uid)");
  app.add_flag("--json", json, "machine-readable output");
  app.require_subcommand(1);
  app.fallthrough();  // `kvtierctl stats --json` as well as `kvtierctl --json stats`
  CLI::App* stats = app.add_subcommand("stats", "tier usage, sessions, leases, mappings and counters");
  CLI::App* tenants = app.add_subcommand("tenants", "per-tenant usage (admin)");
  CLI::App* evict = app.add_subcommand("evict", "drop unleased blocks");
  CLI::App* flush = app.add_subcommand("flush", "write every host block to the disk tier (admin)");
  std::string evict_tenant;
  std::string evict_tier;
  evict->add_option("--tenant", evict_tenant, "tenant whose blocks to drop (admin; * = all; default: yours)");
  evict->add_option("--tier", evict_tier, "only this tier")->check(CLI::IsMember({"hbm", "host", "disk"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  kvtier::Result<std::unique_ptr<kvtier::Client>> client =
      kvtier::Client::Connect({.socket_path = socket, .token = token, .client_name = "kvtierctl"});
  if (!client) return Fail(client.error());

  if (stats->parsed()) {
    kvtier::Result<kvtier::DaemonStats> s = (*client)->Stats();
    if (!s) return Fail(s.error());
    PrintStats(*s, json);
  } else if (tenants->parsed()) {
    kvtier::Result<std::vector<kvtier::TenantStats>> list = (*client)->ListTenants();
    if (!list) return Fail(list.error());
    if (json) std::printf("[");
    else std::printf("%-24s %8s %16s %16s %16s %10s\n", "tenant", "sessions", "hbm_bytes", "host_bytes", "disk_bytes", "blocks");
    for (size_t i = 0; i < list->size(); ++i) {
      const kvtier::TenantStats& t = (*list)[i];
      if (json) {
        std::printf("%s{\"name\": %s, \"sessions\": %lu, \"used_bytes\": {\"hbm\": %lu, \"host\": %lu, \"disk\": %lu}, \"blocks\": %lu}",
                    i ? ", " : "", JsonString(t.name).c_str(), t.sessions, t.used_bytes[0], t.used_bytes[1],
                    t.used_bytes[2], t.blocks);
      } else {
        std::printf("%-24s %8lu %16lu %16lu %16lu %10lu\n", t.name.c_str(), t.sessions, t.used_bytes[0],
                    t.used_bytes[1], t.used_bytes[2], t.blocks);
      }
    }
    if (json) std::printf("]\n");
  } else if (flush->parsed()) {
    kvtier::Result<uint64_t> n = (*client)->Flush();
    if (!n) return Fail(n.error());
    if (json) std::printf("{\"flushed\": %lu}\n", *n);
    else std::printf("writing %lu block(s) to disk\n", *n);
  } else if (evict->parsed()) {
    std::optional<BlockTier> tier;
    if (evict_tier == "hbm") tier = BlockTier::kHbm;
    if (evict_tier == "host") tier = BlockTier::kHost;
    if (evict_tier == "disk") tier = BlockTier::kDisk;
    kvtier::Result<uint64_t> n = (*client)->Evict(evict_tenant, tier);
    if (!n) return Fail(n.error());
    if (json) std::printf("{\"evicted\": %lu}\n", *n);
    else std::printf("evicted %lu block(s)\n", *n);
  }
  return 0;
}
