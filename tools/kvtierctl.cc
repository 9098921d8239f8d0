// kvtierctl: operate a running kvtierd over its socket.
//
//   kvtierctl --socket PATH [--token T] status  [--json]     backend, metrics address, tiers in one glance
//   kvtierctl --socket PATH [--token T] stats   [--json]
//   kvtierctl --socket PATH [--token T] tenants [--json]     (admin)
//   kvtierctl --socket PATH [--token T] namespaces [--tenant NAME|*] [--json]
//   kvtierctl --socket PATH [--token T] evict [--tenant NAME|*] [--namespace FP] [--tier hbm|host|disk] [--json]
//   kvtierctl --socket PATH [--token T] flush   [--json]     (admin: host -> disk)
//   kvtierctl --socket PATH [--token T] verify  [--json]     (admin: read back every disk record, with progress)
//   kvtierctl --socket PATH [--token T] version [--json]     this kvtierctl's version and the daemon's
//
// Exit codes: 0 success; 1 the daemon refused or failed; 2 usage; 3 the
// daemon is unavailable.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "kvtier/client.h"

namespace {

using kvtier::BlockTier;

// For printf's %s.
const char* TierName(BlockTier t) { return kvtier::BlockTierName(t).data(); }

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
    std::printf("{\"scope\": %s, \"tiers\": [", JsonString(s.scope).c_str());
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
  std::printf("scope %s\n", s.scope.c_str());
  std::printf("%-6s %16s %16s %10s\n", "tier", "capacity_bytes", "used_bytes", "blocks");
  for (const auto& t : s.tiers) {
    std::printf("%-6s %16lu %16lu %10lu\n", TierName(t.tier), t.capacity_bytes, t.used_bytes, t.blocks);
  }
  std::printf("sessions %lu  leases %lu  mappings %lu  inflight_ops %lu\n", s.sessions, s.leases, s.mappings,
              s.inflight_ops);
  for (const auto& [name, value] : s.counters) std::printf("%-24s %lu\n", name.c_str(), value);
}

// The remote tier's line of `status`, when the daemon has one (node scope).
std::optional<std::string> RemoteSummary(const kvtier::DaemonStats& s, bool json) {
  const bool has = std::any_of(s.counters.begin(), s.counters.end(),
                               [](const auto& c) { return c.first == "remote_round_trips"; });
  if (!has) return std::nullopt;
  const bool open = s.Counter("remote_breaker_open") != 0;
  char line[512];
  std::snprintf(line, sizeof(line),
                json ? "{\"breaker_open\": %s, \"hits\": %lu, \"misses\": %lu, \"stores\": %lu, \"promotions\": "
                       "%lu, \"corrupt\": %lu, \"unavailable\": %lu, \"refused_breaker\": %lu, \"round_trips\": %lu, "
                       "\"topology_refreshes\": %lu, \"redirects\": %lu}"
                     : "breaker %s; %lu hit(s), %lu miss(es), %lu store(s), %lu promoted; %lu corrupt, %lu "
                       "unavailable, %lu refused by the breaker; %lu round trip(s), %lu topology refresh(es), %lu "
                       "redirect(s)",
                json ? (open ? "true" : "false") : (open ? "OPEN (every remote call a miss)" : "closed"),
                s.Counter("remote_hits"), s.Counter("remote_misses"), s.Counter("remote_stores"),
                s.Counter("remote_promotions"), s.Counter("remote_corrupt"), s.Counter("remote_errors_unavailable"),
                s.Counter("remote_refused_breaker"), s.Counter("remote_round_trips"),
                s.Counter("remote_topology_refreshes"), s.Counter("remote_redirects"));
  return std::string(line);
}

// The disk index's line of `status`, when the daemon has a disk tier (node
// scope): whether it takes writes.
std::optional<std::string> DiskIndexSummary(const kvtier::DaemonStats& s, bool json) {
  const bool has = std::any_of(s.counters.begin(), s.counters.end(),
                               [](const auto& c) { return c.first == "disk_index_stopped"; });
  if (!has) return std::nullopt;
  const bool stopped = s.Counter("disk_index_stopped") != 0;
  char line[256];
  std::snprintf(line, sizeof(line),
                json ? "{\"stopped\": %s, \"errors\": %lu, \"recoveries\": %lu}"
                     : "%s; %lu write error(s), %lu recovery(ies)",
                json ? (stopped ? "true" : "false")
                     : (stopped ? "STOPPED (its writes fail: no block reaches the disk until it recovers)"
                                : "writable"),
                s.Counter("disk_index_errors"), s.Counter("disk_index_recoveries"));
  return std::string(line);
}

void PrintStatus(const kvtier::DaemonStats& s, const std::string& socket, bool json) {
  uint64_t used = 0;
  uint64_t capacity = 0;
  for (const auto& t : s.tiers) {
    used += t.used_bytes;
    capacity += t.capacity_bytes;
  }
  if (json) {
    std::printf("{\"socket\": %s, \"scope\": %s, \"backend\": %s, \"metrics\": %s, \"sessions\": %lu, "
                "\"leases\": %lu, \"mappings\": %lu, \"inflight_ops\": %lu, \"used_bytes\": %lu, "
                "\"capacity_bytes\": %lu, \"disk_index\": %s, \"remote\": %s}\n",
                JsonString(socket).c_str(), JsonString(s.scope).c_str(), JsonString(s.backend).c_str(),
                JsonString(s.metrics).c_str(), s.sessions,
                s.leases, s.mappings, s.inflight_ops, used, capacity, DiskIndexSummary(s, true).value_or("null").c_str(),
                RemoteSummary(s, true).value_or("null").c_str());
    return;
  }
  std::printf("kvtierd   up, on %s\n", socket.c_str());
  std::printf("scope     %s\n", s.scope.c_str());
  std::printf("backend   %s\n", s.backend.c_str());
  std::printf("metrics   %s\n", s.metrics.empty() ? "off" : ("http://" + s.metrics + "/metrics").c_str());
  std::printf("clients   %lu session(s), %lu cache(s) mapped, %lu op(s) in flight, %lu block(s) leased\n", s.sessions,
              s.mappings, s.inflight_ops, s.leases);
  for (const auto& t : s.tiers) {
    if (t.capacity_bytes == 0) continue;
    std::printf("%-9s %5.1f%% of %lu bytes, %lu block(s)\n", TierName(t.tier),
                100.0 * static_cast<double>(t.used_bytes) / static_cast<double>(t.capacity_bytes), t.capacity_bytes,
                t.blocks);
  }
  if (std::optional<std::string> index = DiskIndexSummary(s, false)) std::printf("disk idx  %s\n", index->c_str());
  if (std::optional<std::string> remote = RemoteSummary(s, false)) std::printf("remote    %s\n", remote->c_str());
}

void PrintNamespaces(const std::vector<kvtier::NamespaceStats>& list, bool json) {
  if (json) std::printf("[");
  else std::printf("%-32s %10s %16s %16s %16s  %s\n", "namespace", "blocks", "hbm_bytes", "host_bytes", "disk_bytes", "layout");
  for (size_t i = 0; i < list.size(); ++i) {
    const kvtier::NamespaceStats& n = list[i];
    if (json) {
      std::printf("%s{\"namespace\": \"%s\", \"layout\": %s, \"blocks\": %lu, \"used_bytes\": {\"hbm\": %lu, "
                  "\"host\": %lu, \"disk\": %lu}}",
                  i ? ", " : "", n.fingerprint.ToHex().c_str(), JsonString(n.description).c_str(), n.blocks,
                  n.used_bytes[0], n.used_bytes[1], n.used_bytes[2]);
    } else {
      std::printf("%-32s %10lu %16lu %16lu %16lu  %s\n", n.fingerprint.ToHex().c_str(), n.blocks, n.used_bytes[0],
                  n.used_bytes[1], n.used_bytes[2],
                  n.description.empty() ? "(not registered since kvtierd started)" : n.description.c_str());
    }
  }
  if (json) std::printf("]\n");
}

// Starts a verification and reports progress until it is done. Exit 1 when
// a record was bad (it was dropped, never served).
int Verify(kvtier::Client& client, bool json) {
  kvtier::Result<kvtier::VerifyStatus> v = client.VerifyDisk(/*start=*/true);
  uint64_t last_printed = UINT64_MAX;
  while (v && !v->done) {
    if (!json && v->checked != last_printed) {
      std::fprintf(stderr, "\rverify: %lu / %lu records checked, %lu bad", v->checked, v->total, v->bad);
      last_printed = v->checked;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    v = client.VerifyDisk(/*start=*/false);
  }
  if (!v) return Fail(v.error());
  if (json) {
    std::printf("{\"total\": %lu, \"checked\": %lu, \"bad\": %lu, \"skipped\": %lu}\n", v->total, v->checked,
                v->bad, v->skipped);
  } else {
    std::fprintf(stderr, "\r");
    std::printf("verify: %lu record(s) checked, %lu bad (dropped), %lu skipped (left the disk tier meanwhile)\n",
                v->checked, v->bad, v->skipped);
  }
  return v->bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtierctl: inspect and operate kvtierd", "kvtierctl"};
  std::string socket = kvtier::ClientDefaultSocket();  // $KVTIER_SOCKET, else where a daemon listens
  std::string token;
  bool json = false;
  app.add_option("-s,--socket", socket, "kvtierd's socket")->capture_default_str();
  app.add_option("--token", token, "token of the tenant to act as (default: identified by uid)");
  app.add_flag("--json", json, "machine-readable output");
  app.require_subcommand(1);
  app.fallthrough();  // `kvtierctl stats --json` as well as `kvtierctl --json stats`
  CLI::App* status = app.add_subcommand("status", "is it up: backend, metrics address, clients, tier fill");
  CLI::App* stats = app.add_subcommand("stats", "tier usage, sessions, leases, mappings and counters");
  CLI::App* namespaces = app.add_subcommand("namespaces", "layouts with blocks, and their usage per tier");
  CLI::App* verify = app.add_subcommand("verify", "read back and check every disk record (admin)");
  std::string namespaces_tenant;
  namespaces->add_option("--tenant", namespaces_tenant, "whose blocks (admin; * = all; default: yours)");
  CLI::App* tenants = app.add_subcommand("tenants", "per-tenant usage (admin)");
  CLI::App* evict = app.add_subcommand("evict", "drop unleased blocks");
  CLI::App* flush = app.add_subcommand("flush", "write every host block to the disk tier (admin)");
  CLI::App* version = app.add_subcommand("version", "this kvtierctl's version, and the daemon's");
  std::string evict_tenant;
  std::string evict_tier;
  evict->add_option("--tenant", evict_tenant, "tenant whose blocks to drop (admin; * = all; default: yours)");
  evict->add_option("--tier", evict_tier, "only this tier")->check(CLI::IsMember({"hbm", "host", "disk"}));
  std::string evict_namespace;
  evict->add_option("--namespace", evict_namespace, "only this namespace (its fingerprint, from `namespaces`)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  kvtier::Result<std::unique_ptr<kvtier::Client>> client =
      kvtier::Client::Connect({.socket_path = socket, .token = token, .client_name = "kvtierctl"});
  if (version->parsed()) {
    // Its own version first: a daemon that cannot be reached is an error
    // after it.
    if (json) {
      std::printf("{\"kvtierctl\": %s, \"kvtierd\": %s}\n", JsonString(kvtier::Client::release()).c_str(),
                  JsonString(client ? (*client)->daemon_release() : "").c_str());
    } else {
      std::printf("kvtierctl %s\n", kvtier::Client::release());
      if (client) std::printf("kvtierd   %s (%s)\n", (*client)->daemon_release().c_str(), socket.c_str());
    }
    std::fflush(stdout);
    return client ? 0 : Fail(client.error());
  }
  if (!client) return Fail(client.error());

  if (status->parsed() || stats->parsed()) {
    kvtier::Result<kvtier::DaemonStats> s = (*client)->Stats();
    if (!s) return Fail(s.error());
    if (status->parsed()) PrintStatus(*s, socket, json);
    else PrintStats(*s, json);
  } else if (namespaces->parsed()) {
    kvtier::Result<std::vector<kvtier::NamespaceStats>> list = (*client)->ListNamespaces(namespaces_tenant);
    if (!list) return Fail(list.error());
    PrintNamespaces(*list, json);
  } else if (verify->parsed()) {
    return Verify(**client, json);
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
    if (!evict_tier.empty()) tier = kvtier::ParseBlockTier(evict_tier).value();  // CLI11 checked it
    std::optional<kvtier::LayoutFingerprint> ns;
    if (!evict_namespace.empty()) {
      kvtier::Result<kvtier::LayoutFingerprint> fp = kvtier::LayoutFingerprint::FromHex(evict_namespace);
      if (!fp) {
        std::fprintf(stderr, "kvtierctl: --namespace: %s\n", fp.error().ToString().c_str());
        return 2;
      }
      ns = *fp;
    }
    kvtier::Result<uint64_t> n = (*client)->Evict(evict_tenant, tier, ns);
    if (!n) return Fail(n.error());
    if (json) std::printf("{\"evicted\": %lu}\n", *n);
    else std::printf("evicted %lu block(s)\n", *n);
  }
  return 0;
}
