// The operator's requests: Stats (scoped to the caller's tenant unless it is
// an admin), Evict, ListNamespaces, VerifyDisk and ListTenants (bulk calls,
// rate-limited for tenants that are no admin), and the metrics snapshot the
// Prometheus thread takes from the loop.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>

#include "common/version.h"
#include "daemon/server.h"
#include "daemon/wire_tier.h"

namespace kvtier {

namespace w = wire;
using flatbuffers::FlatBufferBuilder;

namespace {

// The counters a tenant's share and the node's have in common.
std::vector<std::pair<const char*, uint64_t>> RequestCounterList(const RequestCounters& c) {
  return {
      {"lookups", c.lookups},
      {"lookup_keys", c.lookup_keys},
      {"hits_hbm", c.hits[0]},
      {"hits_host", c.hits[1]},
      {"hits_disk", c.hits[2]},
      {"misses", c.misses},
      {"stores", c.stores},
      {"already_stored", c.already_stored},
      {"store_rejected", c.store_rejected},
      {"stores_discarded", c.stores_discarded},
      {"loads", c.loads},
      {"evictions_hbm", c.evictions[0]},
      {"evictions_host", c.evictions[1]},
      {"evictions_disk", c.evictions[2]},
      {"bytes_engine_to_cache", c.bytes_engine_to_cache},
      {"bytes_cache_to_engine", c.bytes_cache_to_engine},
  };
}

// Samples of `h` above `bound_s`, one of its bucket bounds.
uint64_t TurnsOver(const LatencyHistogram& h, double bound_s) {
  uint64_t n = 0;
  for (size_t i = LatencyHistogram::kBoundsSeconds.size() + 1; i-- > 0;) {
    if (i < LatencyHistogram::kBoundsSeconds.size() && LatencyHistogram::kBoundsSeconds[i] <= bound_s) break;
    n += h.bucket(i);
  }
  return n;
}

}  // namespace

std::vector<uint8_t> Server::HandleStats(Session& s, uint64_t id) {
  // An admin sees the node. Any other tenant sees only its own share: its
  // blocks, sessions and traffic, so Stats tells it nothing of its
  // co-tenants' blocks or activity (docs/security.md).
  const Tenant* only = s.tenant->config.admin ? nullptr : s.tenant;
  std::vector<std::pair<const char*, uint64_t>> counters;
  TierUsage usage[kNumTiers];
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk})
    usage[static_cast<size_t>(t)] = cache_->Usage(t);
  uint64_t sessions = 0, leases = 0, mappings = 0, inflight = 0;
  for (const auto& [sid, session] : sessions_) {
    if (only != nullptr && session->tenant != only) continue;
    ++sessions;
    inflight += session->ops.in_flight();
    mappings += session->namespaces.size();
  }
  if (only != nullptr) {
    const TenantQuota quota = TenantRegistry::QuotaOf(only->config);
    for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
      TierUsage& u = usage[static_cast<size_t>(t)];
      if (const std::optional<uint64_t>& q = quota.bytes[static_cast<size_t>(t)]; q) {
        u.capacity_bytes = std::min(u.capacity_bytes, *q);
      }
    }
    const TenantShare c = cache_->ShareOf(only->id);
    for (size_t t = 0; t < kNumTiers; ++t) {
      usage[t].used_bytes = c.used_bytes[t];
      usage[t].blocks = c.blocks[t];
    }
    leases = c.leases;
    counters = RequestCounterList(c);
  } else {
    const CacheCounters c = cache_->counters();
    const IoEngineStats io = io_engine_ ? io_engine_->stats() : IoEngineStats{};
    leases = cache_->leases();
    // Every live mapping, including dead clients' that wait for their copies.
    mappings = backend_->live_mappings();
    counters = RequestCounterList(c);
    counters.insert(counters.end(),
                    {
                        {"promotions", c.promotions},
                        {"demotions", c.demotions},
                        {"prefix_fallbacks", c.prefix_fallbacks},
                        {"victim_scan_blocks", c.victim_scan_blocks},
                        {"scan_budget_deferrals", c.scan_budget_deferrals},
                        {"extents_reclaimed", c.extents_reclaimed},
                        {"extent_slots_examined", c.extent_slots_examined},
                        {"disk_quota_evictions", c.disk_quota_evictions},
                        {"bytes_hbm_to_host", c.bytes_hbm_to_host},
                        {"bytes_host_to_hbm", c.bytes_host_to_hbm},
                        {"disk_promotions", c.disk_promotions},
                        {"disk_demotions", c.disk_demotions},
                        {"disk_returns", c.disk_returns},
                        {"disk_hits_not_promoted", c.disk_hits_not_promoted},
                        {"loads_short_gone", c.loads_short_gone},
                        {"loads_short_not_ready", c.loads_short_not_ready},
                        {"loads_short_disk", c.loads_short_disk},
                        {"disk_read_failures", c.disk_read_failures},
                        {"disk_write_failures", c.disk_write_failures},
                        {"disk_not_admitted", c.disk_not_admitted},
                        {"disk_admitted_on_return", c.disk_admitted_on_return},
                        {"disk_over_budget", c.disk_over_budget},
                        {"disk_reinsertions", c.disk_reinsertions},
                        {"disk_reinsertions_dropped", c.disk_reinsertions_dropped},
                        {"disk_writes_given_up", c.disk_writes_given_up},
                        {"disk_write_backoffs", c.disk_write_backoffs},
                        {"disk_reads_waited_for_room", c.disk_reads_waited_for_room},
                        {"disk_reads_without_room", c.disk_reads_without_room},
                        {"reads_past_quota", c.reads_past_quota},
                        {"reads_not_kept", c.reads_not_kept},
                        {"disk_reads_record_gone", c.disk_reads_record_gone},
                        {"disk_writes_missed", c.disk_writes_missed},
                        {"bytes_host_to_disk", c.bytes_host_to_disk},
                        {"bytes_disk_to_host", c.bytes_disk_to_host},
                        {"disk_io_errors", disk_ ? disk_->counters().io_errors : 0},
                        {"disk_checksum_failures", disk_ ? disk_->counters().checksum_failures : 0},
                        {"disk_regions_reclaimed", disk_ ? disk_->counters().regions_reclaimed : 0},
                        {"disk_recovered_records", disk_ ? disk_->counters().recovered_records : 0},
                        {"disk_group_commits", disk_ ? disk_->counters().group_commits : 0},
                        {"disk_records_reclaimed", disk_ ? disk_->counters().records_reclaimed : 0},
                        {"disk_records_carried", disk_ ? disk_->counters().records_carried : 0},
                        {"disk_reclaim_failures", disk_ ? disk_->counters().reclaim_failures : 0},
                        {"disk_appends_waited", disk_ ? disk_->counters().appends_waited : 0},
                        {"disk_index_errors", disk_ ? disk_->counters().index_errors : 0},
                        {"disk_index_recoveries", disk_ ? disk_->counters().index_recoveries : 0},
                        {"disk_index_stopped", disk_ && disk_->index_stopped() ? 1u : 0u},
                        {"disk_free_regions", disk_ ? disk_->free_regions() : 0},
                        // The I/O threads (IoEngineStats): what the device
                        // was asked, the depth it saw, the threads' idle time.
                        {"disk_io_reads", io.reads},
                        {"disk_io_writes", io.writes},
                        {"disk_io_syncs", io.syncs},
                        {"disk_io_read_bytes", io.read_bytes},
                        {"disk_io_write_bytes", io.write_bytes},
                        {"disk_io_depth_sum", io.depth_sum},
                        {"disk_io_idle_us", io.idle_ns / 1000},
                        {"disk_io_thread_us", io.thread_ns / 1000},
                        {"loop_turns", loop_turns_.count()},
                        {"loop_turns_over_1ms", TurnsOver(loop_turns_, 1e-3)},
                        {"loop_turns_over_5ms", TurnsOver(loop_turns_, 5e-3)},
                        {"loop_turns_over_10ms", TurnsOver(loop_turns_, 1e-2)},
                        {"loop_turns_over_25ms", TurnsOver(loop_turns_, 2.5e-2)},
                        {"loop_posted_deferred", posted_deferred_},
                        {"disk_region_bytes", disk_ ? disk_->region_bytes() : 0},
                        {"disk_record_bytes", disk_ ? disk_->used_bytes() : 0},
                        {"disk_filled_bytes", disk_ ? disk_->filled_bytes() : 0},
                        {"disk_writes_pending", cache_->pending_disk_writes()},
                        {"hinted", c.hinted},
                        {"hints_refused", c.hints_refused},
                        {"engine_held", c.engine_held},
                        {"engine_dropped", c.engine_dropped},
                        {"partial_not_admitted", c.partial_not_admitted},
                        {"codec_encoded", c.codec_encoded},
                        {"codec_not_worth_it", c.codec_not_worth_it},
                        {"codec_pool_busy", c.codec_pool_busy},
                        {"codec_host_coded", c.codec_host_coded},
                        {"codec_host_no_room", c.codec_host_no_room},
                        {"codec_decoded", c.codec_decoded},
                        {"codec_decode_failures", c.codec_decode_failures},
                        {"codec_raw_bytes", c.codec_raw_bytes},
                        {"codec_stored_bytes", c.codec_stored_bytes},
                        {"namespaces", cache_->live_namespaces()},
                        {"evicts_pending", cache_->pending_evicts()},
                        {"timed_waits_pending", wait_deadlines_.size()},
                        {"blocks_present_hbm", cache_->present_blocks(Presence::kHbm)},
                        {"blocks_present_host", cache_->present_blocks(Presence::kHost)},
                        {"blocks_present_disk", cache_->present_blocks(Presence::kDisk)},
                        {"blocks_present_remote", cache_->present_blocks(Presence::kRemote)},
                        {"sessions_refused", sessions_refused_},
                        {"messages_rejected", messages_rejected_},
                        {"ops_cancelled", ops_cancelled_},
                        {"loads_by_layer", loads_by_layer_},
                        {"stores_by_layer", stores_by_layer_},
                        {"stores_by_layer_expired", stores_by_layer_expired_},
                        {"recomputed_tokens_hbm", recomputed_tokens_[0]},
                        {"recomputed_tokens_host", recomputed_tokens_[1]},
                        {"recomputed_tokens_disk", recomputed_tokens_[2]},
                        {"recomputed_tokens_remote", recomputed_tokens_[3]},
                        {"load_rates_layouts", load_rates_.size()},
                    });
    const NodeBudgetFigures node_maps = node_->maps.figures(), node_sessions = node_->sessions.figures(),
                            node_memory = node_->memory.figures();
    counters.insert(counters.end(), {
                                        {"node_maps_share", node_maps.share},
                                        {"node_maps_used", node_maps.used},
                                        {"node_maps_refused", node_maps.refusals},
                                        {"node_sessions_share", node_sessions.share},
                                        {"node_sessions_used", node_sessions.used},
                                        {"node_sessions_refused", node_sessions.refusals},
                                        {"node_memory_share", node_memory.share},
                                        {"node_memory_used", node_memory.used},
                                        {"node_memory_refused", node_memory.refusals},
                                        {"node_budget_warnings",
                                         node_maps.warnings + node_sessions.warnings + node_memory.warnings},
                                    });
    if (events_ != nullptr) {
      const KvEventPublisherCounters p = events_->publisher_counters();
      const KvEventSourceCounters e = events_->counters();
      counters.insert(counters.end(), {
                                          {"events_published", p.events_published},
                                          {"events_dropped", p.events_dropped},
                                          {"events_batches", p.batches_published},
                                          {"events_replays_served", p.replays_served},
                                          {"events_replay_batches", p.replay_batches},
                                          {"events_replays_refused", p.replays_refused},
                                          {"events_clears", e.clears_published},
                                          {"events_blocks_tracked", e.blocks_tracked},
                                          {"events_metadata_bytes", e.metadata_bytes},
                                          {"events_metadata_refused", e.metadata_refused},
                                      });
    }
    if (remote_ != nullptr) {
      const RemoteCounters r = remote_->counters();
      counters.insert(counters.end(),
                      {
                          {"remote_hits", r.hits},
                          {"remote_misses", r.misses},
                          {"remote_exists_keys", r.exists_keys},
                          {"remote_stores", r.stores},
                          {"remote_bytes_read", r.bytes_read},
                          {"remote_bytes_written", r.bytes_written},
                          {"remote_corrupt", r.corrupt},
                          {"remote_errors_unavailable", r.errors_unavailable},
                          {"remote_errors_rejected", r.errors_rejected},
                          {"remote_refused_busy", r.refused_busy},
                          {"remote_refused_breaker", r.refused_breaker},
                          {"remote_topology_refreshes", r.topology_refreshes},
                          {"remote_redirects", r.redirects},
                          {"remote_round_trips", r.round_trips},
                          {"remote_breaker_opened", r.breaker_opened},
                          {"remote_breaker_open", r.breaker_open ? 1u : 0u},
                          {"remote_promotions", c.remote_promotions},
                          {"remote_writes", c.remote_writes},
                          {"remote_write_failures", c.remote_write_failures},
                          {"remote_write_backoffs", c.remote_write_backoffs},
                          {"remote_writes_refused", c.remote_writes_refused},
                          {"remote_retries_dropped", c.remote_retries_dropped},
                          {"remote_demotions_missed", c.remote_demotions_missed},
                      });
    }
  }
  FlatBufferBuilder b(2048);
  std::vector<flatbuffers::Offset<w::TierStats>> tiers;
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
    const TierUsage& u = usage[static_cast<size_t>(t)];
    tiers.push_back(w::CreateTierStats(b, TierToWire(t), u.capacity_bytes, u.used_bytes, u.blocks));
  }
  std::vector<flatbuffers::Offset<w::Counter>> cs;
  for (const auto& [name, value] : counters) cs.push_back(w::CreateCounterDirect(b, name, value));
  const std::string backend = backend_->Describe();
  const std::string metrics = metrics_ ? metrics_->address() : "";
  const std::string scope = only != nullptr ? "tenant " + only->config.name : "node";
  const auto body = w::CreateStatsReplyDirect(b, &tiers, sessions, leases, mappings, inflight, &cs,
                                              backend.c_str(), metrics.c_str(), scope.c_str(), kVersion);
  return ipc::FinishMessage(b, id, body);
}

Result<std::optional<TenantId>> Server::TargetTenant(const Session& s, const flatbuffers::String* name,
                                                     std::string_view what) {
  // "" = the caller's own blocks; another tenant's name, or "*" for every
  // tenant, only for an admin.
  const std::string_view target = name != nullptr ? name->string_view() : "";
  if (target.empty() || target == s.tenant->config.name) return std::optional<TenantId>(s.tenant->id);
  if (!s.tenant->config.admin) {
    return Err(Status(StatusCode::kPermissionDenied,
                      "only an admin tenant may " + std::string(what) + " another tenant's blocks"));
  }
  if (target == "*") return std::optional<TenantId>();
  Tenant* other = tenants_->FindByName(target);
  if (other == nullptr) return Err(Status(StatusCode::kNotFound, "no such tenant"));
  return std::optional<TenantId>(other->id);
}

Status Server::TakeBulkCall(Tenant& t, std::string_view what) {
  if (t.config.admin) return Status::Ok();
  const double rate = options_.config.limits.bulk_calls_per_second;
  const auto now = std::chrono::steady_clock::now();
  if (t.bulk_tokens < 0) {
    t.bulk_tokens = rate;
  } else {
    const double elapsed = std::chrono::duration<double>(now - t.bulk_refilled).count();
    t.bulk_tokens = std::min(rate, t.bulk_tokens + elapsed * rate);
  }
  t.bulk_refilled = now;
  if (t.bulk_tokens < 1) {
    return Status(StatusCode::kResourceExhausted,
                  std::string(what) + ": limits.bulk_calls_per_second (" +
                      std::to_string(options_.config.limits.bulk_calls_per_second) +
                      ") reached for this tenant; retry later");
  }
  t.bulk_tokens -= 1;
  return Status::Ok();
}

std::vector<uint8_t> Server::HandleEvict(Session& s, uint64_t id, const w::Evict& m) {
  Result<std::optional<TenantId>> target = TargetTenant(s, m.tenant(), "evict");
  if (!target) return ipc::ErrorMessage(id, target.error());
  EvictFilter filter;
  if (*target) filter.owners = std::vector<TenantId>{**target};
  if (m.fingerprint() != nullptr) filter.layout = ipc::FromWire<LayoutFingerprint>(*m.fingerprint());
  switch (m.tier()) {
    case w::Tier::None: break;
    case w::Tier::Hbm: filter.tier = Tier::kHbm; break;
    case w::Tier::Host: filter.tier = Tier::kHost; break;
    case w::Tier::Disk: filter.tier = Tier::kDisk; break;
    case w::Tier::Remote:
      return ipc::ErrorMessage(id, InvalidArgument("evict: the remote tier is the cluster's to evict (maxmemory)"));
    default:
      return ipc::ErrorMessage(id, InvalidArgument("unknown tier " + std::to_string(static_cast<int>(m.tier()))));
  }
  Tenant& caller = *s.tenant;
  if (!caller.config.admin && caller.evicting) {
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted,
                                        "evict: one of this tenant's evicts is still running; retry later"));
  }
  if (Status st = TakeBulkCall(caller, "evict"); !st.ok()) return ipc::ErrorMessage(id, st);
  // The walk runs in the background; the reply goes out when it is done (to
  // the session, if it is still there).
  if (!caller.config.admin) caller.evicting = true;
  // Everything of its tenants: KV events may end it with AllBlocksCleared.
  std::optional<std::optional<std::vector<TenantId>>> evict_all;
  if (!filter.tier && !filter.layout) evict_all = filter.owners;
  cache_->Evict(std::move(filter), [this, session = s.id, id, tenant = &caller, evict_all](uint64_t evicted) {
    tenant->evicting = false;  // tenants live as long as the server
    if (events_ != nullptr && evict_all) events_->AfterEvictAll(*evict_all);
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return;
    spdlog::info("session {}: evicted {} block(s)", session, evicted);
    FlatBufferBuilder b(64);
    Send(*it->second, ipc::FinishMessage(b, id, w::CreateEvictReply(b, evicted)));
  });
  return {};
}

std::vector<uint8_t> Server::HandleListNamespaces(Session& s, uint64_t id, const w::ListNamespaces& m) {
  Result<std::optional<TenantId>> target = TargetTenant(s, m.tenant(), "list");
  if (!target) return ipc::ErrorMessage(id, target.error());
  if (Status st = TakeBulkCall(*s.tenant, "namespaces"); !st.ok()) return ipc::ErrorMessage(id, st);
  FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<w::NamespaceInfo>> list;
  for (const NamespaceUsage& u : cache_->UsageByNamespace(*target)) {
    const w::Key fp = ipc::ToWire(u.fingerprint);
    const std::vector<uint64_t> used(std::begin(u.used_bytes), std::end(u.used_bytes));
    list.push_back(w::CreateNamespaceInfoDirect(b, &fp, u.description.c_str(), u.blocks, &used));
  }
  return ipc::FinishMessage(b, id, w::CreateNamespaceListDirect(b, &list));
}

std::vector<uint8_t> Server::HandleVerify(Session& s, uint64_t id, const w::VerifyDisk& m) {
  if (!s.tenant->config.admin) {
    return ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "verify is an admin call"));
  }
  if (!disk_) return ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition, "verify: there is no disk tier"));
  if (m.start() || !verify_progress_) {
    verify_progress_ = cache_->VerifyDisk();
    spdlog::info("session {}: verifying {} disk record(s)", s.id, verify_progress_->total);
  }
  const VerifyProgress& p = *verify_progress_;
  FlatBufferBuilder b(64);
  return ipc::FinishMessage(b, id, w::CreateVerifyDiskProgress(b, p.total, p.checked, p.bad, p.skipped, p.done));
}

std::vector<uint8_t> Server::HandleListTenants(Session& s, uint64_t id) {
  if (!s.tenant->config.admin) {
    return ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "ListTenants is an admin call"));
  }
  FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<w::TenantInfo>> list;
  for (const auto& t : tenants_->tenants()) {
    std::vector<uint64_t> used;
    for (Tier tier : {Tier::kHbm, Tier::kHost, Tier::kDisk}) used.push_back(cache_->TenantUsedBytes(t->id, tier));
    list.push_back(w::CreateTenantInfoDirect(b, t->config.name.c_str(), t->sessions, &used,
                                             cache_->TenantBlocks(t->id)));
  }
  return ipc::FinishMessage(b, id, w::CreateTenantListDirect(b, &list));
}

MetricsSnapshot Server::Snapshot() const {
  MetricsSnapshot m;
  m.backend = backend_->Describe();
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
    m.tiers.push_back({std::string(TierName(t)), cache_->Usage(t)});
  }
  m.cache = cache_->counters();
  if (disk_) {
    m.disk = disk_->counters();
    if (io_engine_) m.disk_io = io_engine_->stats();
    m.disk_free_regions = disk_->free_regions();
    m.disk_index_stopped = disk_->index_stopped();
  }
  if (events_ != nullptr) m.events = MetricsSnapshot::Events{events_->publisher_counters(), events_->counters()};
  if (remote_ != nullptr) {
    m.remote = remote_->counters();
  }
  m.disk_writes_pending = cache_->pending_disk_writes();
  m.namespaces = cache_->live_namespaces();
  m.evicts_pending = cache_->pending_evicts();
  m.timed_waits_pending = wait_deadlines_.size();
  m.sessions = sessions_.size();
  m.leases = cache_->leases();
  m.mappings = backend_->live_mappings();
  for (const auto& [sid, session] : sessions_) m.inflight_ops += session->ops.in_flight();
  m.sessions_refused = sessions_refused_;
  m.messages_rejected = messages_rejected_;
  m.ops_cancelled = ops_cancelled_;
  m.loads_by_layer = loads_by_layer_;
  m.stores_by_layer = stores_by_layer_;
  m.recomputed_tokens = recomputed_tokens_;
  m.lookup_latency = lookup_latency_;
  m.loop_turns = loop_turns_;
  m.loop_slow_turns = slow_turns_;
  m.loop_posted_deferred = posted_deferred_;
  m.load_latency = load_latency_;
  m.store_latency = store_latency_;
  for (const NodeBudget* b : node_->all()) m.node_budgets.push_back(b->figures());
  for (const auto& t : tenants_->tenants()) {
    MetricsSnapshot::TenantRow row{
        .name = t->config.name, .sessions = t->sessions, .share = cache_->ShareOf(t->id)};
    m.tenants.push_back(std::move(row));
  }
  return m;
}

std::optional<MetricsSnapshot> Server::SnapshotFromLoop() {
  // Shared: a reply that comes after the wait gave up must not write into a
  // promise that is gone.
  auto promise = std::make_shared<std::promise<MetricsSnapshot>>();
  std::future<MetricsSnapshot> result = promise->get_future();
  Post([this, promise] { promise->set_value(Snapshot()); }, "metrics snapshot");
  if (result.wait_for(std::chrono::seconds(2)) != std::future_status::ready) return std::nullopt;
  return result.get();
}

}  // namespace kvtier
