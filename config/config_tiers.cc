// The tiers: section: hbm, host, disk, the remote tier and compression.
#include "config/config_sections.h"

#include <algorithm>
#include <charconv>
#include <set>
#include <string>

#include "common/disk_limits.h"
#include "config/size.h"

namespace kvtier::config_yaml {
namespace {

// "host:port" with a port of 1..65535 (the host as Redis writes it: a name,
// IPv4, or IPv6 bare or in brackets).
ParseResult ParseSeed(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const size_t colon = out->rfind(':');
  uint32_t port = 0;
  const char* end = out->data() + out->size();
  const auto [ptr, ec] =
      colon == std::string::npos ? std::from_chars(end, end, port) : std::from_chars(out->data() + colon + 1, end, port);
  if (colon == std::string::npos || colon == 0 || ec != std::errc() || ptr != end || port == 0 || port > 65535) {
    return "expected host:port (a port of 1-65535), got '" + *out + "'";
  }
  return {};
}

void ReadRemote(Context* ctx, const YAML::Node& node, Config::Tiers::Remote* remote) {
  MapReader h(ctx, node, "tiers.remote");
  h.Read("enabled", &remote->enabled, ParseBoolNode);
  h.Read("seeds", &remote->seeds, [](const YAML::Node& n, std::vector<std::string>* out) {
    return ParseList(n, out, ParseSeed);
  });
  h.Read("user", &remote->user, ParseNonEmpty);
  h.Read("password_file", &remote->password_file, ParseNonEmpty);
  h.Read("key_prefix", &remote->key_prefix, ParseNonEmpty);
  h.Read("write", &remote->write, [](const YAML::Node& n, RemoteWritePolicy* v) {
    return ParseEnum<RemoteWritePolicy>(
        n, {{"store", RemoteWritePolicy::kOnStore}, {"demote", RemoteWritePolicy::kOnDemote}}, v);
  });
  h.Read("connect_timeout_ms", &remote->connect_timeout_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 60000, v); });
  h.Read("timeout_ms", &remote->timeout_ms, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 60000, v); });
  h.Read("io_threads", &remote->io_threads, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 64, v); });
  h.Read("max_inflight_batches", &remote->max_inflight_batches,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 65536, v); });
  h.Read("max_value_bytes", &remote->max_value_bytes, ParseSizeNode);
  h.Read("breaker_failures", &remote->breaker_failures,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1000, v); });
  h.Read("breaker_cooldown_ms", &remote->breaker_cooldown_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 3600000, v); });
  h.Finish();
  if (remote->enabled && remote->seeds.empty()) {
    ctx->ErrorAt("tiers.remote.seeds", "the remote tier is enabled but has no seed nodes (host:port)");
  }
  if (remote->max_value_bytes < (1u << 12) || remote->max_value_bytes > (512ull << 20)) {
    ctx->ErrorAt("tiers.remote.max_value_bytes", "must be between 4KiB and 512MiB (Redis' largest value)");
  }
}

}  // namespace

void ReadTiers(Context* ctx, const YAML::Node& node, Config::Tiers* tiers) {
  MapReader r(ctx, node, "tiers");
  ReadRemote(ctx, r.Take("remote"), &tiers->remote);
  {
    MapReader h(ctx, r.Take("hbm"), "tiers.hbm");
    h.Read("enabled", &tiers->hbm.enabled, ParseBoolNode);
    h.Read("devices", &tiers->hbm.devices, [](const YAML::Node& n, std::vector<uint32_t>* out) {
      return ParseList(n, out, [](const YAML::Node& item, uint32_t* v) { return ParseU32(item, 0, 1023, v); });
    });
    h.Read("bytes", &tiers->hbm.bytes, ParseSizeNode);
    h.Finish();
    std::vector<uint32_t> sorted = tiers->hbm.devices;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      ctx->ErrorAt("tiers.hbm.devices", "lists a device twice");
    }
  }
  {
    MapReader h(ctx, r.Take("host"), "tiers.host");
    h.Read("bytes", &tiers->host.bytes, ParseSizeNode);
    h.Read("prefault", &tiers->host.prefault, ParseBoolNode);
    h.Finish();
  }
  {
    Config::Tiers::Disk& d = tiers->disk;
    MapReader h(ctx, r.Take("disk"), "tiers.disk");
    h.Read("enabled", &d.enabled, ParseBoolNode);
    h.Read("paths", &d.paths, [](const YAML::Node& n, std::vector<std::string>* out) {
      return ParseList(n, out, ParseNonEmpty);
    });
    h.Read("bytes", &d.bytes, ParseSizeNode);
    h.Read("direct_io", &d.direct_io, ParseBoolNode);
    h.Read("queue_depth", &d.queue_depth,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 4096, v); });
    h.Read("region_bytes", &d.region_bytes, ParseSizeNode);
    h.Read("io_engine", &d.io_engine, [](const YAML::Node& n, IoEngineKind* v) {
      return ParseEnum<IoEngineKind>(n, {{"auto", IoEngineKind::kAuto},
                                         {"io_uring", IoEngineKind::kIoUring},
                                         {"threadpool", IoEngineKind::kThreadPool}}, v);
    });
    h.Read("io_threads", &d.io_threads,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 64, v); });
    h.Read("stop_flush_seconds", &d.stop_flush_seconds,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 3600, v); });
    h.Finish();
    if (d.enabled) {
      if (d.paths.empty()) ctx->ErrorAt("tiers.disk.paths", "the disk tier is enabled but has no paths");
      std::set<std::string> unique(d.paths.begin(), d.paths.end());
      if (unique.size() != d.paths.size()) ctx->ErrorAt("tiers.disk.paths", "lists a path twice");
    }
    constexpr uint64_t kAlign = 4096;
    constexpr uint64_t kMinRegion = 1ull << 20;
    if (d.bytes > kMaxDiskPathBytes) {
      ctx->ErrorAt("tiers.disk.bytes", "is " + FormatSize(d.bytes) +
                                           " per path; the disk tier supports at most " +
                                           FormatSize(kMaxDiskPathBytes) + " (2 PiB)");
    }
    if (d.region_bytes % kAlign != 0 || d.region_bytes < kMinRegion) {
      ctx->ErrorAt("tiers.disk.region_bytes", "must be a multiple of 4KiB and at least 1MiB, got " +
                                                  FormatSize(d.region_bytes));
    } else if (d.region_bytes > kMaxDiskRegionBytes) {
      ctx->ErrorAt("tiers.disk.region_bytes",
                   "must be below 16TiB, got " + FormatSize(d.region_bytes));
    } else if (d.bytes / d.region_bytes < 2) {
      ctx->ErrorAt("tiers.disk.bytes", "must hold at least two regions of " +
                                           FormatSize(d.region_bytes) + ", got " + FormatSize(d.bytes));
    }
  }
  {
    Config::Tiers::Compression& c = tiers->compression;
    MapReader h(ctx, r.Take("compression"), "tiers.compression");
    h.Read("threads", &c.threads, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 256, v); });
    h.Read("max_queued", &c.max_queued, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
    h.Read("staging_bytes", &c.staging_bytes, ParseSizeNode);
    h.Finish();
    if (c.staging_bytes < (1ull << 20)) {
      ctx->ErrorAt("tiers.compression.staging_bytes", "must be at least 1MiB, got " + FormatSize(c.staging_bytes));
    }
  }
  r.Finish();
}

}  // namespace kvtier::config_yaml
