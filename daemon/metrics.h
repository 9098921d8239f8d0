// Prometheus metrics (DESIGN.md, "Observability"): the daemon's figures as
// kvtier_* families on metrics.listen (/metrics).
//
// The figures live on the event loop (BlockCache, tenants, sessions), which
// takes no locks. So a scrape does not read them in place: the exporter's
// HTTP thread asks the loop for a MetricsSnapshot (a plain copy, made by
// Server between two requests) and renders that. Only this file and
// metrics.cc include prometheus-cpp.
//
// MetricsExporter is created and destroyed by the Server; its snapshot
// function is called on the exporter's own threads. ToFamilies is pure.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/kv_event_source.h"
#include "daemon/load_rates.h"
#include "daemon/node_budget.h"
#include "common/latency_histogram.h"
#include "common/status.h"
#include "tiers/block_cache.h"
#include "tiers/remote/remote_tier.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk/io_engine.h"

namespace prometheus {
class Exposer;
struct MetricFamily;
}  // namespace prometheus

namespace kvtier {

// Everything /metrics shows, copied on the event loop.
struct MetricsSnapshot {
  struct TierRow {
    std::string tier;  // hbm, host, disk
    TierUsage usage;
  };
  struct TenantRow {
    std::string name;
    uint64_t sessions = 0;
    TenantShare share;
  };
  std::string backend;
  std::vector<TierRow> tiers;
  CacheCounters cache;
  DiskCounters disk;
  std::optional<RemoteCounters> remote;  // with a remote tier
  struct Events {
    KvEventPublisherCounters publisher;
    KvEventSourceCounters source;
  };
  std::optional<Events> events;  // with KV events on
  std::optional<IoEngineStats> disk_io;  // with a disk tier: its I/O threads
  uint64_t disk_free_regions = 0;
  bool disk_index_stopped = false;   // the last index write failed
  uint64_t disk_writes_pending = 0;
  uint64_t namespaces = 0;           // layouts holding blocks
  uint64_t evicts_pending = 0;       // Evict calls still walking
  uint64_t timed_waits_pending = 0;  // Waits with a deadline not answered yet
  uint64_t sessions = 0;
  uint64_t leases = 0;
  uint64_t mappings = 0;
  uint64_t inflight_ops = 0;
  uint64_t sessions_refused = 0;
  uint64_t messages_rejected = 0;
  uint64_t ops_cancelled = 0;  // Loads and Stores whose client cancelled their copies
  uint64_t loads_by_layer = 0;  // Loads copied layer by layer (Load.by_layer)
  uint64_t stores_by_layer = 0;  // Stores copied as the engine wrote each layer (Store.by_layer)
  // Tokens of hits left to compute as cheaper than loading, by LoadSource.
  std::array<uint64_t, kNumLoadSources> recomputed_tokens = {};
  LatencyHistogram loop_turns;       // the event loop's turns
  uint64_t loop_slow_turns = 0;      // past Server::kSlowTurn
  uint64_t loop_posted_deferred = 0;  // posted work past its slice (Server::RunPosted)
  LatencyHistogram lookup_latency;  // request handling
  LatencyHistogram load_latency;    // op start to completion
  LatencyHistogram store_latency;
  std::vector<TenantRow> tenants;
  std::vector<NodeBudgetFigures> node_budgets;
};

// The kvtier_* families for one snapshot.
std::vector<prometheus::MetricFamily> ToFamilies(const MetricsSnapshot& s);

class MetricsExporter {
 public:
  // Returns nullopt when no snapshot could be had in time (the loop is busy
  // or stopping): the scrape then gets no kvtier_* families.
  using SnapshotFn = std::function<std::optional<MetricsSnapshot>()>;

  // Listens on `listen` ("host:port"; port 0 picks one). Errors: kUnavailable
  // when the address cannot be bound (in use, no such interface).
  static Result<std::unique_ptr<MetricsExporter>> Start(const std::string& listen, SnapshotFn snapshot);
  ~MetricsExporter();

  // "127.0.0.1:9464": where it really listens (the port, if 0 was asked).
  const std::string& address() const { return address_; }

 private:
  class Collector;
  MetricsExporter() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<Collector> collector_;
  std::string address_;
};

}  // namespace kvtier
