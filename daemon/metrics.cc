#include "daemon/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <netdb.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <exception>
#include <thread>

#include "common/unique_fd.h"

namespace kvtier {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

// Builds families one metric at a time.
class Families {
 public:
  // A family with its first metric; later calls with the same name add to it.
  void Add(const std::string& name, const std::string& help, MetricType type, Labels labels, double value) {
    ClientMetric m;
    m.label = std::move(labels);
    switch (type) {
      case MetricType::Counter: m.counter.value = value; break;
      case MetricType::Gauge: m.gauge.value = value; break;
      default: m.untyped.value = value; break;
    }
    Family(name, help, type).metric.push_back(std::move(m));
  }
  void Counter(const std::string& name, const std::string& help, double value, Labels labels = {}) {
    Add(name, help, MetricType::Counter, std::move(labels), value);
  }
  void Gauge(const std::string& name, const std::string& help, double value, Labels labels = {}) {
    Add(name, help, MetricType::Gauge, std::move(labels), value);
  }
  void Histogram(const std::string& name, const std::string& help, const LatencyHistogram& h) {
    ClientMetric m;
    m.histogram.sample_count = h.count();
    m.histogram.sample_sum = h.sum_seconds();
    uint64_t cumulative = 0;
    for (size_t i = 0; i < LatencyHistogram::kBoundsSeconds.size(); ++i) {
      cumulative += h.bucket(i);
      m.histogram.bucket.push_back({cumulative, LatencyHistogram::kBoundsSeconds[i]});
    }
    m.histogram.bucket.push_back({h.count(), std::numeric_limits<double>::infinity()});
    Family(name, help, MetricType::Histogram).metric.push_back(std::move(m));
  }
  std::vector<MetricFamily> Take() { return std::move(families_); }

 private:
  MetricFamily& Family(const std::string& name, const std::string& help, MetricType type) {
    for (MetricFamily& f : families_) {
      if (f.name == name) return f;
    }
    families_.push_back(MetricFamily{name, help, type, {}});
    return families_.back();
  }
  std::vector<MetricFamily> families_;
};

Labels L(std::initializer_list<std::pair<const char*, std::string>> kv) {
  Labels out;
  for (const auto& [k, v] : kv) out.push_back({k, v});
  return out;
}

}  // namespace

std::vector<MetricFamily> ToFamilies(const MetricsSnapshot& s) {
  Families f;
  const CacheCounters& c = s.cache;
  f.Gauge("kvtier_build_info", "kvtierd's device backend (value 1).", 1, L({{"backend", s.backend}}));
  for (const MetricsSnapshot::TierRow& t : s.tiers) {
    f.Gauge("kvtier_tier_capacity_bytes", "Bytes a tier can hold.", static_cast<double>(t.usage.capacity_bytes),
            L({{"tier", t.tier}}));
    f.Gauge("kvtier_tier_used_bytes", "Bytes of blocks in a tier.", static_cast<double>(t.usage.used_bytes),
            L({{"tier", t.tier}}));
    f.Gauge("kvtier_tier_blocks", "Blocks in a tier.", static_cast<double>(t.usage.blocks), L({{"tier", t.tier}}));
  }
  f.Counter("kvtier_lookups_total", "Lookup and prefetch requests.",
            static_cast<double>(c.lookups));
  f.Counter("kvtier_lookup_keys_total", "Keys asked about by lookups and prefetches.",
            static_cast<double>(c.lookup_keys));
  const char* tiers[] = {"hbm", "host", "disk"};
  for (size_t t = 0; t < 3; ++t) {
    f.Counter("kvtier_hits_total",
              "Keys found by lookups and prefetches, by the tier that held them.",
              static_cast<double>(c.hits[t]), L({{"tier", tiers[t]}}));
  }
  f.Counter("kvtier_misses_total",
            "Keys of lookups and prefetches not found (after the first miss of a prompt).",
            static_cast<double>(c.misses));
  f.Counter("kvtier_stores_total", "Blocks newly stored.", static_cast<double>(c.stores));
  f.Counter("kvtier_stores_already_total", "Blocks a store found present or in flight.",
            static_cast<double>(c.already_stored));
  f.Counter("kvtier_stores_rejected_total", "Blocks refused by stores for lack of room.",
            static_cast<double>(c.store_rejected));
  f.Counter("kvtier_stores_discarded_total", "Stored blocks dropped because their client died first.",
            static_cast<double>(c.stores_discarded));
  f.Counter("kvtier_loads_total", "Blocks loaded into engines.", static_cast<double>(c.loads));
  for (const auto& [reason, n] : {std::pair{"gone", c.loads_short_gone}, std::pair{"not_ready", c.loads_short_not_ready},
                                  std::pair{"disk", c.loads_short_disk}}) {
    f.Counter("kvtier_loads_short_total",
              "Loads that came up short of the keys they named, by why: the first missing key gone (evicted "
              "since the lookup), present but not servable yet, or on disk and not readable into host.",
              static_cast<double>(n), L({{"reason", reason}}));
  }
  for (size_t t = 0; t < 3; ++t) {
    f.Counter("kvtier_evictions_total", "Blocks dropped from a tier.", static_cast<double>(c.evictions[t]),
              L({{"tier", tiers[t]}}));
  }
  f.Counter("kvtier_extents_reclaimed_total", "Slot extents emptied for blocks of another size.",
            static_cast<double>(c.extents_reclaimed));
  f.Counter("kvtier_extent_slots_examined_total",
            "Slots looked at to empty extents for another block size (bounded per call).",
            static_cast<double>(c.extent_slots_examined));
  f.Counter("kvtier_disk_quota_evictions_total",
            "Disk blocks a tenant's own newer writes evicted to keep it within its disk quota.",
            static_cast<double>(c.disk_quota_evictions));
  const std::string help_moves = "Blocks moved between tiers, by source and destination.";
  f.Counter("kvtier_moves_total", help_moves, static_cast<double>(c.demotions), L({{"from", "hbm"}, {"to", "host"}}));
  f.Counter("kvtier_moves_total", help_moves, static_cast<double>(c.promotions), L({{"from", "host"}, {"to", "hbm"}}));
  f.Counter("kvtier_moves_total", help_moves, static_cast<double>(c.disk_demotions),
            L({{"from", "host"}, {"to", "disk"}}));
  f.Counter("kvtier_moves_total", help_moves, static_cast<double>(c.disk_promotions),
            L({{"from", "disk"}, {"to", "host"}}));
  const std::string help_bytes = "Bytes copied, by direction.";
  const std::pair<const char*, uint64_t> bytes[] = {
      {"engine_to_cache", c.bytes_engine_to_cache}, {"cache_to_engine", c.bytes_cache_to_engine},
      {"hbm_to_host", c.bytes_hbm_to_host},         {"host_to_hbm", c.bytes_host_to_hbm},
      {"host_to_disk", c.bytes_host_to_disk},       {"disk_to_host", c.bytes_disk_to_host}};
  for (const auto& [direction, value] : bytes) {
    f.Counter("kvtier_bytes_moved_total", help_bytes, static_cast<double>(value), L({{"direction", direction}}));
  }
  f.Histogram("kvtier_loop_turn_duration_seconds",
              "Time the event loop spent on one turn (every event ready at once, then its upkeep): a request "
              "arriving meanwhile waits for the rest of it.",
              s.loop_turns);
  f.Histogram("kvtier_lookup_duration_seconds", "Time to answer a lookup, in the daemon.", s.lookup_latency);
  f.Histogram("kvtier_load_duration_seconds", "Time from a load's request to its completion.", s.load_latency);
  f.Histogram("kvtier_store_duration_seconds", "Time from a store's request to its completion.", s.store_latency);
  f.Histogram("kvtier_disk_read_duration_seconds", "Time to read and check one block from disk.",
              c.disk_read_latency);
  f.Histogram("kvtier_disk_write_duration_seconds", "Time to write one block to disk until it is durable.",
              c.disk_write_latency);
  f.Counter("kvtier_disk_io_errors_total", "Disk reads and writes that failed.", static_cast<double>(s.disk.io_errors));
  if (s.disk_io) {
    const IoEngineStats& io = *s.disk_io;
    for (const auto& [op, n] : {std::pair{"read", io.reads}, {"write", io.writes}, {"sync", io.syncs}}) {
      f.Counter("kvtier_disk_io_operations_total",
                "Operations the disk tier's I/O threads started (a write cut into chunks counts each).",
                static_cast<double>(n), L({{"op", op}}));
    }
    for (const auto& [op, n] : {std::pair{"read", io.read_bytes}, {"write", io.write_bytes}}) {
      f.Counter("kvtier_disk_io_bytes_total", "Bytes the disk tier's I/O threads read and wrote.",
                static_cast<double>(n), L({{"op", op}}));
    }
    f.Counter("kvtier_disk_io_depth_sum_total",
              "Operations in flight on their thread as each started, summed: over "
              "kvtier_disk_io_operations_total, the mean depth the device saw.",
              static_cast<double>(io.depth_sum));
    f.Counter("kvtier_disk_io_idle_seconds_total",
              "Time the disk tier's I/O threads waited for work or completions, all threads.",
              static_cast<double>(io.idle_ns) / 1e9);
    f.Counter("kvtier_disk_io_thread_seconds_total", "The disk tier's I/O threads' lifetime, all threads.",
              static_cast<double>(io.thread_ns) / 1e9);
  }
  f.Counter("kvtier_checksum_failures_total", "Disk records that failed their checks on read (never served).",
            static_cast<double>(s.disk.checksum_failures));
  f.Counter("kvtier_disk_write_failures_total", "Blocks that could not be written to disk.",
            static_cast<double>(c.disk_write_failures));
  f.Counter("kvtier_disk_not_admitted_total", "Demotions to disk refused by the admission policy.",
            static_cast<double>(c.disk_not_admitted + c.disk_over_budget));
  f.Counter("kvtier_disk_regions_reclaimed_total", "Disk regions reclaimed.",
            static_cast<double>(s.disk.regions_reclaimed));
  f.Counter(
      "kvtier_disk_records_carried_total",
      "Blocks hit since they were written, read out of a region being reclaimed and written again.",
      static_cast<double>(s.disk.records_carried));
  f.Counter("kvtier_disk_hot_blocks_dropped_total",
            "Blocks hit since they were written that a reclaim dropped (carry budget or write "
            "budget spent).",
            static_cast<double>(c.disk_reinsertions_dropped));
  f.Counter("kvtier_victim_scan_blocks_total",
            "Blocks the eviction and write-back scans looked at (a rate far above evictions' means scans walk "
            "past blocks that cannot go).",
            static_cast<double>(c.victim_scan_blocks));
  f.Counter("kvtier_scan_budget_deferrals_total",
            "Times the background scans (hbm demotion, host write-back) used their budget and went on at a "
            "later turn of the event loop.",
            static_cast<double>(c.scan_budget_deferrals));
  f.Counter("kvtier_disk_writes_missed_total",
            "Dirty host blocks let go of unwritten, coldest first, because write-back had not reached them "
            "(the disk fell behind).",
            static_cast<double>(c.disk_writes_missed));
  f.Counter("kvtier_disk_reads_record_gone_total",
            "Disk reads whose record a reclaim took while they waited for host room (their loads come up short).",
            static_cast<double>(c.disk_reads_record_gone));
  f.Counter("kvtier_disk_reclaim_failures_total", "Reclaims whose index deletes failed (retried).",
            static_cast<double>(s.disk.reclaim_failures));
  f.Counter("kvtier_disk_index_errors_total", "Disk index writes that failed.",
            static_cast<double>(s.disk.index_errors));
  f.Counter("kvtier_disk_index_recoveries_total", "Times the disk index took writes again after writes failed.",
            static_cast<double>(s.disk.index_recoveries));
  f.Gauge("kvtier_disk_index_stopped",
          "1 while the disk index refuses writes (its volume full, say): no block reaches the disk until it "
          "recovers, by itself once the volume has room.",
          s.disk_index_stopped ? 1.0 : 0.0);
  f.Counter("kvtier_disk_writes_given_up_total",
            "Blocks whose disk writes kept failing (or can never fit): not tried again.",
            static_cast<double>(c.disk_writes_given_up));
  const std::string help_codec =
      "Encodes of blocks whose store asked for a codec (for a host slot, a disk record or a remote value), by "
      "outcome: encoded, or kept raw (not_worth_it; pool_busy; host_no_room: no host slot of the coded size).";
  const std::pair<const char*, uint64_t> coded[] = {{"encoded", c.codec_encoded},
                                                    {"not_worth_it", c.codec_not_worth_it},
                                                    {"pool_busy", c.codec_pool_busy},
                                                    {"host_no_room", c.codec_host_no_room}};
  for (const auto& [outcome, value] : coded) {
    f.Counter("kvtier_codec_writes_total", help_codec, static_cast<double>(value), L({{"outcome", outcome}}));
  }
  f.Counter("kvtier_hinted_blocks_total", "Blocks given an engine's retention hint (by a store or a hint request).",
            static_cast<double>(c.hinted));
  f.Counter("kvtier_engine_held_blocks_total",
            "Blocks stored or loaded while their engine keeps a copy in its own cache (Store and Load engine_holds): "
            "evicted first.",
            static_cast<double>(c.engine_held));
  f.Counter("kvtier_engine_dropped_blocks_total",
            "Blocks whose engine let go of its own copy (Hint.engine_dropped): kvtier's is the only one since.",
            static_cast<double>(c.engine_dropped));
  f.Counter("kvtier_hints_refused_total",
            "Blocks hinted to be kept past the tier's policy.hints.max_share: kept as unhinted.",
            static_cast<double>(c.hints_refused));
  f.Counter("kvtier_partial_blocks_not_admitted_total", "Partial tail blocks a store marked: never admitted.",
            static_cast<double>(c.partial_not_admitted));
  f.Counter("kvtier_codec_host_coded_total", "Host blocks moved into a host slot of their coded size.",
            static_cast<double>(c.codec_host_coded));
  f.Counter("kvtier_codec_decoded_total", "Packed disk records decoded on their way back to host.",
            static_cast<double>(c.codec_decoded));
  f.Counter("kvtier_codec_decode_failures_total", "Packed disk records that did not decode (never served).",
            static_cast<double>(c.codec_decode_failures));
  const std::string help_codec_bytes =
      "Blocks encoded (host slots, disk, remote): their own bytes (raw) and the codec's (stored).";
  f.Counter("kvtier_codec_bytes_total", help_codec_bytes, static_cast<double>(c.codec_raw_bytes),
            L({{"form", "raw"}}));
  f.Counter("kvtier_codec_bytes_total", help_codec_bytes, static_cast<double>(c.codec_stored_bytes),
            L({{"form", "stored"}}));
  if (s.remote) {
    const RemoteCounters& r = *s.remote;
    f.Counter("kvtier_remote_hits_total", "Blocks fetched from the remote tier and served (each checked).",
              static_cast<double>(r.hits));
    f.Counter("kvtier_remote_misses_total", "Blocks asked of the remote tier and not fetched.",
              static_cast<double>(r.misses));
    f.Counter("kvtier_remote_stores_total", "Blocks stored in the remote tier.", static_cast<double>(r.stores));
    const std::string help_remote_bytes = "Value bytes moved to and from the remote tier.";
    f.Counter("kvtier_remote_bytes_total", help_remote_bytes, static_cast<double>(r.bytes_read),
              L({{"direction", "read"}}));
    f.Counter("kvtier_remote_bytes_total", help_remote_bytes, static_cast<double>(r.bytes_written),
              L({{"direction", "written"}}));
    const std::string help_errors = "Remote tier failures, by kind (each a miss).";
    const std::pair<const char*, uint64_t> errors[] = {{"corrupt", r.corrupt},
                                                        {"unavailable", r.errors_unavailable},
                                                        {"rejected", r.errors_rejected},
                                                        {"busy", r.refused_busy},
                                                        {"breaker_open", r.refused_breaker}};
    for (const auto& [kind, value] : errors) {
      f.Counter("kvtier_remote_errors_total", help_errors, static_cast<double>(value), L({{"kind", kind}}));
    }
    f.Counter("kvtier_remote_topology_refreshes_total", "Slot maps read again from the cluster (CLUSTER SLOTS).",
              static_cast<double>(r.topology_refreshes));
    f.Counter("kvtier_remote_redirects_total", "MOVED and ASK redirections followed.",
              static_cast<double>(r.redirects));
    f.Counter("kvtier_remote_breaker_opened_total", "Times the remote tier's circuit breaker opened.",
              static_cast<double>(r.breaker_opened));
    f.Gauge("kvtier_remote_breaker_open", "1 while the remote tier's circuit breaker is open.",
            r.breaker_open ? 1.0 : 0.0);
    f.Histogram("kvtier_remote_batch_duration_seconds", "Time of one remote batch (a round trip per node).",
                r.batch_latency);
    f.Counter("kvtier_moves_total", help_moves, static_cast<double>(c.remote_promotions),
              L({{"from", "remote"}, {"to", "host"}}));
    f.Counter("kvtier_remote_demotions_missed_total",
              "Host blocks that left before the remote write-back (write: demote) could put them.",
              static_cast<double>(c.remote_demotions_missed));
  }
  if (s.events) {
    const KvEventPublisherCounters& p = s.events->publisher;
    const KvEventSourceCounters& e = s.events->source;
    f.Counter("kvtier_kv_events_published_total", "KV events sent to subscribers (in batches).",
              static_cast<double>(p.events_published));
    f.Counter("kvtier_kv_events_dropped_total", "KV events dropped: the publisher's queue was full.",
              static_cast<double>(p.events_dropped));
    f.Counter("kvtier_kv_event_batches_total", "KV event batches sent.", static_cast<double>(p.batches_published));
    f.Counter("kvtier_kv_event_replays_served_total", "Replay requests answered.",
              static_cast<double>(p.replays_served));
    f.Counter("kvtier_kv_event_replay_batches_total", "Batches sent again by replays.",
              static_cast<double>(p.replay_batches));
    f.Counter("kvtier_kv_event_replays_refused_total",
              "Replay requests refused unanswered: malformed, or more waiting than the publisher serves at once.",
              static_cast<double>(p.replays_refused));
    f.Counter("kvtier_kv_events_clears_total", "AllBlocksCleared events sent (restarts, evict-all).",
              static_cast<double>(e.clears_published));
    f.Gauge("kvtier_kv_event_blocks_tracked", "Blocks whose metadata KV events keep.",
            static_cast<double>(e.blocks_tracked));
    f.Gauge("kvtier_kv_event_metadata_bytes", "Memory that metadata takes (bounded by events.max_metadata_bytes).",
            static_cast<double>(e.metadata_bytes));
    f.Counter("kvtier_kv_event_metadata_refused_total",
              "Blocks not announced: their metadata would have passed events.max_metadata_bytes.",
              static_cast<double>(e.metadata_refused));
  }
  f.Gauge("kvtier_disk_free_regions",
          "Disk regions free to write (reclaim keeps some ahead of need).",
          static_cast<double>(s.disk_free_regions));
  f.Gauge("kvtier_disk_writes_pending", "Disk writes in flight or waiting in line.",
          static_cast<double>(s.disk_writes_pending));
  f.Gauge("kvtier_namespaces", "Layouts (namespaces) holding blocks.", static_cast<double>(s.namespaces));
  f.Gauge("kvtier_evicts_pending", "Evict calls still walking the cache in steps.",
          static_cast<double>(s.evicts_pending));
  f.Gauge("kvtier_timed_waits_pending", "Waits with a deadline that are not answered yet.",
          static_cast<double>(s.timed_waits_pending));
  f.Gauge("kvtier_sessions", "Connected clients.", static_cast<double>(s.sessions));
  f.Gauge("kvtier_leases", "Blocks pinned by loads and stores in flight.", static_cast<double>(s.leases));
  f.Gauge("kvtier_client_mappings", "Engine KV caches mapped into the daemon.", static_cast<double>(s.mappings));
  f.Gauge("kvtier_inflight_ops", "Loads and stores not finished.", static_cast<double>(s.inflight_ops));
  f.Counter("kvtier_sessions_refused_total", "Connections refused (unknown peer, limits).",
            static_cast<double>(s.sessions_refused));
  f.Counter("kvtier_messages_rejected_total", "Malformed or oversized messages.",
            static_cast<double>(s.messages_rejected));
  for (const NodeBudgetFigures& b : s.node_budgets) {
    const auto limit = L({{"limit", b.limit}});
    f.Gauge("kvtier_node_budget", "What the node allows kvtierd (vm.max_map_count, RLIMIT_NOFILE, memory bytes).",
            static_cast<double>(b.node), limit);
    f.Gauge("kvtier_node_budget_reserved", "Of the node's budget, what kvtierd keeps for itself.",
            static_cast<double>(b.reserve), limit);
    f.Gauge("kvtier_node_budget_share", "Of the node's budget, what each named tenant is guaranteed.",
            static_cast<double>(b.share), limit);
    f.Gauge("kvtier_node_budget_used", "Of the node's budget, what the tenants hold (maps, sessions, bytes).",
            static_cast<double>(b.used), limit);
    f.Counter("kvtier_node_budget_refusals_total",
              "Registrations and sessions refused because the node's budget was held or guaranteed to others.",
              static_cast<double>(b.refusals), limit);
  }
  f.Counter("kvtier_loop_slow_turns_total",
            "Turns of the event loop that took 10 ms or more (kvtierd logs the largest parts of one a second).",
            static_cast<double>(s.loop_slow_turns));
  f.Counter("kvtier_loop_posted_deferred_total",
            "Turns of the event loop whose background work (completions, write-back) ran past its 2 ms slice and "
            "went on after the requests waiting.",
            static_cast<double>(s.loop_posted_deferred));
  f.Counter("kvtier_ops_cancelled_total", "Loads and stores whose copies their client cancelled (a fence).",
            static_cast<double>(s.ops_cancelled));
  for (size_t i = 0; i < s.recomputed_tokens.size(); ++i) {
    f.Counter("kvtier_tokens_recomputed_by_choice_total",
              "Tokens of hits that lookups left out for the engine to compute, as loading them from this tier was "
              "expected to take longer (prefill_tokens_per_s; docs/policy.md \"Load or recompute\").",
              static_cast<double>(s.recomputed_tokens[i]), L({{"tier", LoadSourceName(static_cast<LoadSource>(i))}}));
  }
  f.Counter("kvtier_loads_by_layer_total",
            "Loads copied layer by layer, each layer reported to the engine once in place (Load.by_layer).",
            static_cast<double>(s.loads_by_layer));
  f.Counter("kvtier_stores_by_layer_total",
            "Stores copied layer by layer, each layer as soon as the engine wrote it (Store.by_layer).",
            static_cast<double>(s.stores_by_layer));
  for (const MetricsSnapshot::TenantRow& t : s.tenants) {
    const TenantShare& ts = t.share;
    for (size_t i = 0; i < 3; ++i) {
      f.Gauge("kvtier_tenant_used_bytes", "Bytes a tenant holds, by tier.",
              static_cast<double>(ts.used_bytes[i]), L({{"tenant", t.name}, {"tier", tiers[i]}}));
    }
    f.Gauge("kvtier_tenant_blocks", "Blocks a tenant holds.",
            static_cast<double>(ts.blocks[0] + ts.blocks[1] + ts.blocks[2]),
            L({{"tenant", t.name}}));
    f.Gauge("kvtier_tenant_sessions", "A tenant's connected clients.", static_cast<double>(t.sessions),
            L({{"tenant", t.name}}));
    f.Counter("kvtier_tenant_lookups_total", "A tenant's lookup requests.",
              static_cast<double>(ts.lookups), L({{"tenant", t.name}}));
    f.Counter("kvtier_tenant_hits_total", "Keys a tenant's lookups found.",
              static_cast<double>(ts.hits[0] + ts.hits[1] + ts.hits[2]), L({{"tenant", t.name}}));
    f.Counter("kvtier_tenant_misses_total", "Keys a tenant's lookups did not find.",
              static_cast<double>(ts.misses), L({{"tenant", t.name}}));
    f.Counter("kvtier_tenant_stores_total", "Blocks a tenant stored.",
              static_cast<double>(ts.stores), L({{"tenant", t.name}}));
    f.Counter("kvtier_tenant_loads_total", "Blocks loaded into a tenant's engines.",
              static_cast<double>(ts.loads), L({{"tenant", t.name}}));
    for (size_t i = 0; i < 3; ++i) {
      f.Counter("kvtier_tenant_evictions_total", "A tenant's blocks dropped from a tier.",
                static_cast<double>(ts.evictions[i]), L({{"tenant", t.name}, {"tier", tiers[i]}}));
    }
  }
  return f.Take();
}

class MetricsExporter::Collector final : public prometheus::Collectable {
 public:
  explicit Collector(SnapshotFn snapshot) : snapshot_(std::move(snapshot)) {}
  std::vector<MetricFamily> Collect() const override {
    std::optional<MetricsSnapshot> s = snapshot_();
    if (!s) return {};
    return ToFamilies(*s);
  }

 private:
  SnapshotFn snapshot_;
};

Result<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& listen, SnapshotFn snapshot) {
  std::unique_ptr<MetricsExporter> e(new MetricsExporter());
  try {
    // One HTTP thread: scrapes are rare, and each waits for the event loop.
    e->exposer_ = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& ex) {
    return Err(Status(StatusCode::kUnavailable, "metrics.listen " + listen + ": cannot listen (" + ex.what() + ")"));
  }
  e->collector_ = std::make_shared<Collector>(std::move(snapshot));
  e->exposer_->RegisterCollectable(e->collector_);
  const std::vector<int> ports = e->exposer_->GetListeningPorts();
  const std::string host = listen.substr(0, listen.rfind(':'));
  e->address_ = host + ":" + (ports.empty() ? listen.substr(listen.rfind(':') + 1) : std::to_string(ports.front()));
  return e;
}

namespace {

// Opens a TCP connection to `address` ("host:port", as MetricsExporter
// reports it; a wildcard host means this machine) and closes it at once,
// sending nothing; failures are ignored.
void Knock(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return;
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), address.substr(colon + 1).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.valid() && (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS)) break;
  }
  ::freeaddrinfo(found);
}

}  // namespace

MetricsExporter::~MetricsExporter() {
  // Stop serving before the collector (and the loop it asks) goes away. The
  // HTTP server's listening thread sees the stop only when its poll of the
  // listening socket returns, up to a second or two later (kvtierd took 1.3 s
  // to exit after a client's visit, 0.07 s with metrics off): connections
  // opened and closed meanwhile wake it at once.
  std::atomic<bool> stopped = false;
  std::thread knocker([&] {
    while (!stopped.load(std::memory_order_acquire)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      Knock(address_);
    }
  });
  exposer_.reset();
  stopped.store(true, std::memory_order_release);
  knocker.join();
}

}  // namespace kvtier
