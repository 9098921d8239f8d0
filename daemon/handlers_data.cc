// The data path's requests: Hint, Lookup and Prefetch (answered from the
// index, the remote tier asked for what missed locally), Load and Store (ops
// queued to the cache and the device backend, answered when started or when
// done), and Wait, Poll and Cancel of those ops.
#include <algorithm>

#include "common/chain_hash.h"
#include "daemon/server.h"
#include "daemon/wire_tier.h"

namespace kvtier {

namespace w = wire;
using flatbuffers::FlatBufferBuilder;

namespace {

constexpr size_t kMaxWaitersPerOp = 8;

}  // namespace

Result<std::vector<StoredKey>> Server::StoredKeys(const Session& s, const SessionNamespace& ns,
                                                  const flatbuffers::Vector<const w::Key*>* keys) {
  const size_t n = keys == nullptr ? 0 : keys->size();
  if (n > options_.config.limits.max_keys_per_request) {
    return Err(InvalidArgument(std::to_string(n) + " keys exceed limits.max_keys_per_request (" +
                               std::to_string(options_.config.limits.max_keys_per_request) + ")"));
  }
  std::vector<StoredKey> out;
  out.reserve(n);
  const LayoutFingerprint& fp = ns.fingerprint;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(DeriveStoredKey(s.tenant->salt, fp,
                                  ipc::FromWire<BlockKey>(*keys->Get(static_cast<flatbuffers::uoffset_t>(i)))));
  }
  return out;
}

namespace {
Result<const SessionNamespace*> FindNamespace(const Session& s, uint32_t ns_id) {
  auto it = s.namespaces.find(ns_id);
  if (it == s.namespaces.end()) {
    return Err(Status(StatusCode::kNotFound, "namespace " + std::to_string(ns_id) + " is not registered"));
  }
  return &it->second;
}
}  // namespace

std::vector<uint8_t> Server::HandleHint(Session& s, uint64_t id, const w::Hint& m) {
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  if (Status bad = ipc::CheckRetentionHint(m.priority(), m.next_use_ms()); !bad.ok()) {
    return ipc::ErrorMessage(id, bad);
  }
  const RetentionHint hint{.priority = m.priority(),
                           .next_use_ms = m.next_use_ms(),
                           .session_over = m.session_over(),
                           .engine_dropped = m.engine_dropped()};
  uint32_t refused = 0;
  const uint32_t hinted = cache_->Hint(*keys, hint, &refused);
  FlatBufferBuilder b(64);
  return ipc::FinishMessage(b, id, w::CreateHintReply(b, hinted, refused));
}

LoadRates& Server::RatesOf(const Session& s, const SessionNamespace& ns) {
  const RatesKey key{s.tenant->id, ns.fingerprint};
  if (auto it = load_rates_.find(key); it != load_rates_.end()) return it->second;
  // The tenant's entries are contiguous (the key's first part): counted only
  // when a new layout comes, at most the limit.
  const auto first = load_rates_.lower_bound(RatesKey{s.tenant->id, LayoutFingerprint{}});
  size_t held = 0;
  for (auto it = first; it != load_rates_.end() && it->first.first == s.tenant->id; ++it) ++held;
  if (held >= std::max<uint32_t>(options_.config.limits.max_namespaces_per_tenant, 1)) load_rates_.erase(first);
  return load_rates_[key];
}

void Server::CountRecomputed(LoadSource source, uint32_t blocks, uint32_t block_tokens) {
  recomputed_tokens_[static_cast<size_t>(source)] += uint64_t{blocks} * block_tokens;
}

void Server::ObserveLoad(const RatesKey& key, LoadSource source, uint64_t bytes,
                         std::chrono::steady_clock::time_point start) {
  auto it = load_rates_.find(key);
  if (it == load_rates_.end()) return;
  it->second.Observe(source, bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

namespace {

LoadSource SourceOf(Tier t) {
  switch (t) {
    case Tier::kHbm: return LoadSource::kHbm;
    case Tier::kHost: return LoadSource::kHost;
    case Tier::kDisk: return LoadSource::kDisk;
  }
  return LoadSource::kHost;
}

}  // namespace

uint32_t Server::ChooseLocalHits(const Session& s, const SessionNamespace& ns, float prefill_tokens_per_s,
                                 std::span<const Tier> tiers) {
  if (prefill_tokens_per_s <= 0 || tiers.empty()) return static_cast<uint32_t>(tiers.size());
  std::vector<LoadSource> sources;
  sources.reserve(tiers.size());
  for (Tier t : tiers) sources.push_back(SourceOf(t));
  const Layout& layout = ns.layout->layout();
  const LoadRates::Choice c = RatesOf(s, ns).Choose(sources, layout.block_bytes(), layout.spec().block_tokens,
                                                   prefill_tokens_per_s, std::chrono::steady_clock::now());
  for (size_t i = 0; i < kNumLoadSources; ++i) {
    CountRecomputed(static_cast<LoadSource>(i), c.recomputed[i], layout.spec().block_tokens);
  }
  return c.load;
}

bool Server::RemoteWorthAsking(const Session& s, const SessionNamespace& ns, float prefill_tokens_per_s,
                               uint32_t tail) {
  const Layout& layout = ns.layout->layout();
  return prefill_tokens_per_s <= 0 ||
         RatesOf(s, ns).WorthLoading(LoadSource::kRemote, tail, layout.block_bytes(), layout.spec().block_tokens,
                                     prefill_tokens_per_s, std::chrono::steady_clock::now());
}

std::vector<uint8_t> Server::HandleLookup(Session& s, uint64_t id, const w::Lookup& m) {
  const auto start = std::chrono::steady_clock::now();
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  CacheLookup r = cache_->Lookup(s.tenant->id, *keys);
  const uint32_t found = r.hits;
  r.hits = ChooseLocalHits(s, **ns, m.prefill_tokens_per_s(), r.tiers);
  r.tiers.resize(r.hits);
  // Remote hits (asked only after every local one) are reported when
  // loading them is worth it, else counted as recomputed.
  auto reply = [id, local = r, recompute = found - r.hits](uint32_t remote_hits, uint32_t remote_recompute) {
    std::vector<w::Tier> tiers;
    for (Tier t : local.tiers) tiers.push_back(TierToWire(t));
    tiers.insert(tiers.end(), remote_hits, w::Tier::Remote);
    FlatBufferBuilder b(64 + tiers.size());
    const auto body = w::CreateLookupReplyDirect(b, local.hits + remote_hits, &tiers, recompute + remote_recompute);
    return ipc::FinishMessage(b, id, body);
  };
  if (remote_ == nullptr || found == keys->size() || r.hits < found) {
    lookup_latency_.RecordSince(start);
    return reply(0, 0);
  }
  // The tail that missed locally goes to the remote tier (one pipelined
  // batch, a round trip per node); the reply follows its answer. A remote
  // tier that is slow or down only makes this a local answer: timeouts and
  // its breaker end the wait.
  const bool worth =
      RemoteWorthAsking(s, **ns, m.prefill_tokens_per_s(), static_cast<uint32_t>(keys->size() - r.hits));
  const uint32_t block_tokens = (*ns)->layout->layout().spec().block_tokens;
  std::vector<StoredKey> tail(keys->begin() + r.hits, keys->end());
  remote_->Exists(std::move(tail), [this, session = s.id, start, reply, worth, block_tokens](Result<uint32_t> remote) {
    const uint32_t hits = remote ? *remote : 0;
    if (!worth) CountRecomputed(LoadSource::kRemote, hits, block_tokens);
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return;  // the client is gone
    lookup_latency_.RecordSince(start);
    Send(*it->second, worth ? reply(hits, 0) : reply(0, hits));
  });
  return {};
}

std::vector<uint8_t> Server::HandlePrefetch(Session& s, uint64_t id, const w::Prefetch& m) {
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  const float prefill = m.prefill_tokens_per_s();
  uint32_t found = 0;
  const std::pair<uint32_t, uint32_t> prefetched =
      cache_->Prefetch(s.tenant->id, *keys, [&](std::span<const Tier> tiers) {
        found = static_cast<uint32_t>(tiers.size());
        return ChooseLocalHits(s, **ns, prefill, tiers);
      });
  const uint32_t resident = prefetched.first;
  auto reply = [id, queued = prefetched.second](uint32_t present, uint32_t recompute) {
    FlatBufferBuilder b(64);
    return ipc::FinishMessage(b, id, w::CreatePrefetchReply(b, present, queued, recompute));
  };
  if (resident < found) return reply(resident, found - resident);
  if (remote_ == nullptr || resident == keys->size()) return reply(resident, 0);
  const uint32_t block_tokens = (*ns)->layout->layout().spec().block_tokens;
  if (!RemoteWorthAsking(s, **ns, prefill, static_cast<uint32_t>(keys->size() - resident))) {
    // Not fetched: the remote hits are only counted, as left to compute.
    std::vector<StoredKey> tail(keys->begin() + resident, keys->end());
    remote_->Exists(std::move(tail), [this, session = s.id, reply, resident, block_tokens](Result<uint32_t> remote) {
      const uint32_t hits = remote ? *remote : 0;
      CountRecomputed(LoadSource::kRemote, hits, block_tokens);
      auto it = sessions_.find(session);
      if (it != sessions_.end()) Send(*it->second, reply(resident, hits));
    });
    return {};
  }
  // The tail no local tier holds is fetched from the remote tier into host
  // (a later load then finds it local); the reply counts it once it is there,
  // and the fetch is a timing of the remote tier (its rates kept from now on,
  // also for a prefetch that gave no prefill rate).
  RatesOf(s, **ns);
  std::optional<uint32_t> local = cache_->FetchFromRemote(
      s.tenant->id, (*ns)->layout->layout(), (*ns)->codec, *keys,
      [this, session = s.id, reply, key = RatesKey{s.tenant->id, (*ns)->fingerprint},
       block_bytes = (*ns)->layout->layout().block_bytes(),
       start = std::chrono::steady_clock::now()](uint32_t n, uint32_t fetched) {
        // A fetch from the remote tier: a timing of its loads.
        if (fetched > 0) ObserveLoad(key, LoadSource::kRemote, fetched * block_bytes, start);
        auto it = sessions_.find(session);
        if (it != sessions_.end()) Send(*it->second, reply(n, 0));
      });
  return local ? reply(*local, 0) : std::vector<uint8_t>{};
}

std::vector<uint8_t> Server::HandleLoadOrStore(Session& s, uint64_t id, bool load, const w::Load* l,
                                               const w::Store* st) {
  const uint32_t ns_id = load ? l->namespace_id() : st->namespace_id();
  const auto* wire_keys = load ? l->keys() : st->keys();
  const auto* block_ids = load ? l->block_ids() : st->block_ids();
  const bool wait = load ? l->wait() : st->wait();
  Result<const SessionNamespace*> ns = FindNamespace(s, ns_id);
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, wire_keys);
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  const size_t n_ids = block_ids == nullptr ? 0 : block_ids->size();
  if (n_ids != keys->size()) {
    return ipc::ErrorMessage(id, InvalidArgument(std::to_string(keys->size()) + " keys but " +
                                                 std::to_string(n_ids) + " block ids"));
  }
  std::vector<uint32_t> ids(n_ids);
  const uint32_t num_blocks = (*ns)->layout->num_blocks();
  for (size_t i = 0; i < n_ids; ++i) {
    ids[i] = block_ids->Get(static_cast<flatbuffers::uoffset_t>(i));
    if (ids[i] >= num_blocks) {
      return ipc::ErrorMessage(id, Status(StatusCode::kOutOfRange,
                                          "block id " + std::to_string(ids[i]) + " at " + std::to_string(i) +
                                              " is not below num_blocks " + std::to_string(num_blocks)));
    }
  }
  if (load) {
    // Two keys loaded into one engine block would race on its bytes.
    std::vector<uint32_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      return ipc::ErrorMessage(id, InvalidArgument("a Load names the same engine block twice"));
    }
  }
  if (s.ops.full()) {
    return ipc::ErrorMessage(
        id, Status(StatusCode::kResourceExhausted,
                   "limits.max_inflight_ops_per_session ops are running: wait for one first"));
  }
  const int32_t event = load ? l->event() : st->event();
  if (event < -1 || (event >= 0 && static_cast<uint32_t>(event) >= (*ns)->mapping->num_events())) {
    return ipc::ErrorMessage(id, InvalidArgument("event " + std::to_string(event) + " is not one of the " +
                                                 std::to_string((*ns)->mapping->num_events()) +
                                                 " CUDA events this cache registered"));
  }
  const int32_t completion_slot = load ? -1 : st->completion_slot();
  if (completion_slot != -1 && ((*ns)->completions == nullptr || completion_slot < 0 ||
                                static_cast<uint32_t>(completion_slot) >= CompletionPage::kSlots)) {
    return ipc::ErrorMessage(id, InvalidArgument("completion_slot " + std::to_string(completion_slot) +
                                                 " needs a completion page and a slot below " +
                                                 std::to_string(CompletionPage::kSlots)));
  }
  const int32_t fence_slot = load ? l->fence_slot() : st->fence_slot();
  const uint64_t fence_generation = load ? l->fence_generation() : st->fence_generation();
  if (fence_slot != -1 && ((*ns)->fences == nullptr || fence_slot < 0 ||
                           static_cast<uint32_t>(fence_slot) >= FencePage::kSlots || fence_generation == 0 ||
                           fence_generation > FencePage::kGenerationMask)) {
    return ipc::ErrorMessage(id, InvalidArgument("fence_slot " + std::to_string(fence_slot) +
                                                 " needs a fence page, a slot below " +
                                                 std::to_string(FencePage::kSlots) +
                                                 " and a generation of 1 to 2^48 - 1"));
  }
  const bool by_layer = load && l->by_layer();
  if (by_layer && (fence_slot < 0 || !(*ns)->fences->has_progress())) {
    return ipc::ErrorMessage(id, InvalidArgument("a load by layer needs a fence slot in a fence page of " +
                                                 std::to_string(FencePage::kBytes) +
                                                 " bytes (its layer progress words)"));
  }
  const bool store_by_layer = !load && st->by_layer();
  if (store_by_layer && !backend_->GatesStoreLayers()) {
    return ipc::ErrorMessage(id, Status(StatusCode::kUnimplemented,
                                        std::string("the ") + std::string(backend_->name()) +
                                            " device backend copies stores whole (Welcome.layer_stores)"));
  }
  StoreHint hint;
  if (!load) {
    hint = StoreHint{.retention = {.priority = st->priority(),
                                   .next_use_ms = st->next_use_ms(),
                                   .session_over = false,
                                   .engine_holds = st->engine_holds()},
                     .last_partial = st->last_partial()};
    if (Status bad = ipc::CheckRetentionHint(st->priority(), st->next_use_ms()); !bad.ok()) {
      return ipc::ErrorMessage(id, bad);
    }
  }
  // A store's KV-event metadata: checked whatever is done with it, kept
  // when this tenant's blocks are published.
  std::optional<StoreEventFields> event_fields;
  if (!load && st->engine_hashes() != nullptr) {
    const auto* hashes = st->engine_hashes();
    const auto* parent = st->parent_engine_hash();
    const auto* tokens = st->token_ids();
    const std::string_view lora = st->lora_name() != nullptr ? st->lora_name()->string_view() : "";
    if (Status bad = ipc::CheckBlockEventSizes({.keys = keys->size(),
                                                 .hash_bytes = st->hash_bytes(),
                                                 .hashes = hashes->size(),
                                                 .parent = parent != nullptr ? parent->size() : 0,
                                                 .tokens = tokens != nullptr ? tokens->size() : 0,
                                                 .block_size = st->block_size(),
                                                 .lora_name = lora.size()});
        !bad.ok()) {
      return ipc::ErrorMessage(id, bad);
    }
    if (events_ != nullptr && events_->Publishes(s.tenant->id)) {
      event_fields = StoreEventFields{
          .hash_bytes = st->hash_bytes(),
          .engine_hashes = {hashes->data(), hashes->size()},
          .parent_hash = parent != nullptr ? std::span<const uint8_t>(parent->data(), parent->size())
                                           : std::span<const uint8_t>(),
          .token_ids = tokens != nullptr ? std::span<const uint32_t>(tokens->data(), tokens->size())
                                         : std::span<const uint32_t>(),
          .block_size = st->block_size(),
          .lora_name = lora};
    }
  }
  // What the op holds in kvtierd while it runs, from the tenant's share of
  // the node's memory: given back when its completion is let go.
  Result<std::shared_ptr<NodeCharge>> held =
      NodeCharge::Take(node_, &NodeBudgets::memory, s.tenant->id, s.tenant->config.name,
                       keys->size() * NodeBudgets::kOpBytesPerKey);
  if (!held) return ipc::ErrorMessage(id, held.error());
  const std::pair<uint64_t, SessionOp*> started = s.ops.Start();
  const uint64_t op = started.first;
  SessionOp& o = *started.second;
  o.load = load;
  if (by_layer) ++loads_by_layer_;
  if (store_by_layer) {
    ++stores_by_layer_;
    o.gate = std::make_shared<LayerGate>((*ns)->layout->layout().spec().num_layers);
    o.gate_deadline = gate_deadlines_.emplace(
        o.started + std::chrono::milliseconds(options_.config.limits.store_layers_timeout_ms), PendingGate{s.id, op});
  }
  if (wait) o.waiters.push_back(OpWaiter{.request = id, .deadline = std::nullopt});
  if (completion_slot >= 0) {
    o.completions = (*ns)->completions;
    o.completion_slot = static_cast<uint32_t>(completion_slot);
    o.completion_value = st->completion_value();
  }
  EngineTarget target{(*ns)->layout, (*ns)->mapping, event, (*ns)->codec,
                      fence_slot < 0 ? OpFence()
                                     : OpFence((*ns)->fences, static_cast<uint32_t>(fence_slot), fence_generation),
                      by_layer, o.gate};
  // A load by layer tells its client it is over through its progress word
  // too (whether or not the session is still here), with every layer once
  // it is done: a backend that copies it whole reports nothing before.
  // A load's timing, of the tier it read from (load or recompute): from
  // this request to its copies' end; a fetch from the remote tier is timed
  // apart, as the remote tier's.
  if (load) RatesOf(s, **ns);  // kept from now on (within the tenant's bound)
  const RatesKey rates{s.tenant->id, (*ns)->fingerprint};
  const uint64_t block_bytes = (*ns)->layout->layout().block_bytes();
  auto fetched = std::make_shared<bool>(false);  // the load waited for a fetch: timed as the remote tier's
  OpDone done = [this, session = s.id, op, held = std::move(*held),
                 progress = by_layer ? target.fence : OpFence(),
                 layers = (*ns)->layout->layout().spec().num_layers, load, rates, block_bytes, fetched,
                 start = std::chrono::steady_clock::now()](OpOutcome outcome) {
    progress.Progress(outcome.status.ok() ? layers : 0, /*over=*/true);
    if (load && outcome.status.ok() && !*fetched) {
      ObserveLoad(rates, SourceOf(outcome.source), outcome.blocks * block_bytes, start);
    }
    OnOpDone(session, op, std::move(outcome));
  };
  uint32_t queued = 0;  // blocks whose copies were queued just now
  if (load) {
    // Blocks after the local prefix that the remote tier holds are fetched
    // into host first (a remote hit is promoted); the load starts then.
    std::optional<uint32_t> local;
    if (remote_ != nullptr) {
      local = cache_->FetchFromRemote(
          s.tenant->id, (*ns)->layout->layout(), (*ns)->codec, *keys,
          [this, tenant = s.tenant->id, keys = *keys, ids, target, alive = s.alive, done, rates, block_bytes,
           start = std::chrono::steady_clock::now(), fetched, held = l->engine_holds()](uint32_t, uint32_t brought) {
            if (brought > 0) ObserveLoad(rates, LoadSource::kRemote, brought * block_bytes, start);
            *fetched = brought > 0;
            cache_->Load(tenant, keys, ids, target, alive, done, held);
          });
    }
    if (remote_ == nullptr || local.has_value()) {
      queued = cache_->Load(s.tenant->id, *keys, ids, std::move(target), s.alive, std::move(done), l->engine_holds());
    }
  } else {
    std::optional<StoredKey> parent;
    if (st->parent() != nullptr) {
      parent = DeriveStoredKey(s.tenant->salt, (*ns)->fingerprint,
                               ipc::FromWire<BlockKey>(*st->parent()));
    }
    if (event_fields) {
      // Kept until the blocks are gone; a store that placed none lets go.
      events_->Remember(*keys, *event_fields);
      done = [this, keys = *keys, done = std::move(done)](OpOutcome outcome) {
        events_->Release(keys);
        done(std::move(outcome));
      };
    }
    queued = cache_->Store(s.tenant->id, *keys, ids, parent, std::move(target), s.alive, std::move(done), hint);
  }
  if (wait) return {};
  FlatBufferBuilder b(64);
  // Only a load records its event (a store waits for the engine's record).
  const bool recorded = load && event >= 0 && queued > 0;
  return ipc::FinishMessage(b, id, w::CreateOpStarted(b, op, recorded, recorded ? queued : 0));
}

void Server::OnOpDone(uint64_t session_id, uint64_t op_id, OpOutcome outcome) {
  if (outcome.status.code() == StatusCode::kCancelled) ++ops_cancelled_;
  auto sit = sessions_.find(session_id);
  if (sit == sessions_.end()) return;  // the client is gone; nothing to tell
  Session& s = *sit->second;
  SessionOp* o = s.ops.Finish(op_id, std::move(outcome));
  if (o == nullptr) return;
  if (o->gate_deadline) gate_deadlines_.erase(*std::exchange(o->gate_deadline, std::nullopt));
  (o->load ? load_latency_ : store_latency_).RecordSince(o->started);
  // Over, whether it succeeded or not: an engine stream waiting for the value
  // must never hang on a failed store.
  if (o->completions) o->completions->Write(o->completion_slot, o->completion_value);
  if (o->waiters.empty()) return;  // kept for a later Wait or Poll (SessionOps bounds how many)
  for (const OpWaiter& w : o->waiters) {
    if (w.deadline) wait_deadlines_.erase(*w.deadline);
    Send(s, OpResultMessage(w.request, op_id, *o));
  }
  s.ops.Take(op_id);
}

std::vector<uint8_t> Server::OpResultMessage(uint64_t id, uint64_t op, const SessionOp& o) {
  FlatBufferBuilder b(128);
  const auto message = b.CreateString(o.outcome.status.message());
  const auto body = w::CreateOpResult(b, op, o.done, ipc::CodeToWire(o.outcome.status.code()), message,
                                      o.outcome.blocks, o.outcome.already);
  return ipc::FinishMessage(b, id, body);
}

std::vector<uint8_t> Server::HandleStoreLayers(Session& s, uint64_t id, const w::StoreLayers& m) {
  Result<SessionOp*> found = s.ops.Find(m.op());
  // Over already (a store whose blocks were all present, or one that
  // failed): the layers have nothing left to open.
  if (!found || (*found)->done) return {};
  if ((*found)->gate == nullptr) {
    return ipc::ErrorMessage(id, InvalidArgument("op " + std::to_string(m.op()) + " is not a store by layer"));
  }
  (*found)->gate->Open(m.layers());
  return {};
}

std::vector<uint8_t> Server::HandleWaitOrPoll(Session& s, uint64_t id, uint64_t op,
                                              std::optional<uint32_t> timeout_ms) {
  Result<SessionOp*> found = s.ops.Find(op);
  if (!found) return ipc::ErrorMessage(id, found.error());
  SessionOp& o = **found;
  if (o.done) {
    std::vector<uint8_t> reply = OpResultMessage(id, op, o);
    s.ops.Take(op);
    return reply;
  }
  if (!timeout_ms) return OpResultMessage(id, op, o);  // Poll: not done yet
  if (o.waiters.size() >= kMaxWaitersPerOp) {
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted,
                                        "too many Waits on op " + std::to_string(op)));
  }
  OpWaiter& w = o.waiters.emplace_back(OpWaiter{.request = id, .deadline = std::nullopt});
  if (*timeout_ms > 0) {
    w.deadline = wait_deadlines_.emplace(
        std::chrono::steady_clock::now() + std::chrono::milliseconds(*timeout_ms),
        PendingWait{s.id, op, id});
  }
  return {};
}

}  // namespace kvtier
