// BlockCache's core: the data path (stores, loads, lookups, prefetches,
// moves between hbm and host) and the background pump; the calls it hands
// to its sides. Its entries, presence and accounting are in
// block_cache_entries.cc; its sides in block_cache_*.{h,cc}.
#include "tiers/block_cache.h"

#include <algorithm>
#include <utility>

#include "common/check.h"
#include "tiers/block_cache_codec.h"
#include "tiers/block_cache_disk.h"
#include "tiers/block_cache_policy.h"
#include "tiers/block_cache_remote.h"
#include "tiers/block_cache_room.h"
#include "tiers/block_cache_walks.h"

namespace kvtier {

const char* PresenceName(Presence p) { return p == Presence::kRemote ? "remote" : TierName(static_cast<Tier>(p)); }

Result<std::unique_ptr<BlockCache>> BlockCache::Create(Options options) {
  if (options.backend == nullptr || !options.post) {
    return Err(InvalidArgument("BlockCache: backend and post are required"));
  }
  if (options.host_bytes == 0) return Err(InvalidArgument("BlockCache: host tier size is 0"));
  std::unique_ptr<BlockCache> cache(new BlockCache(std::move(options)));
  const Options& o = cache->options_;
  KVTIER_ASSIGN_OR_RETURN(cache->arenas_[static_cast<size_t>(Tier::kHost)],
                          o.backend->AllocateHostArena(o.host_bytes));
  if (o.hbm_bytes > 0) {
    KVTIER_ASSIGN_OR_RETURN(cache->arenas_[static_cast<size_t>(Tier::kHbm)],
                            o.backend->AllocateDeviceArena(o.hbm_device, o.hbm_bytes));
  }
  for (size_t t = 0; t < kNumTiers; ++t) {
    cache->tiers_[t] = std::make_unique<TierState>();
    if (const Arena* a = cache->arenas_[t].get(); a != nullptr) {
      // Extents of at most 1/64 of the tier, so that one block size cannot
      // take a small tier whole before a second namespace arrives.
      const uint64_t extent =
          std::clamp<uint64_t>(a->size_bytes() / 64, SlotPool::kSlotAlignBytes, SlotPool::kDefaultExtentBytes);
      cache->tiers_[t]->pool = std::make_unique<SlotPool>(a->data(), a->size_bytes(), extent);
    }
  }
  cache->tier(Tier::kHbm)->marks = o.hbm_watermarks;
  cache->tier(Tier::kHost)->marks = o.host_watermarks;
  return cache;
}

BlockCache::BlockCache(Options options)
    : options_(std::move(options)),
      index_(options_.policy),
      namespaces_(std::max(1u, options_.max_namespaces), std::max(1u, options_.max_namespaces_per_tenant)),
      self_(std::make_shared<BlockCache*>(this)) {
  if (!options_.clock) options_.clock = [] { return std::chrono::steady_clock::now(); };
  created_ = options_.clock();
  // A clean-only victim scan takes marked blocks among as many coldest as
  // any scan looks at.
  for (size_t t = 0; t < kNumTiers; ++t) index_.order(static_cast<Tier>(t)).SetWindow(options_.eviction_scan_limit);
  room_ = std::make_unique<RoomGate>(*this);
  policy_ = std::make_unique<CachePolicy>(*this);
  codec_ = std::make_unique<CacheCodec>(*this);
  remote_ = std::make_unique<CacheRemote>(*this);
  disk_ = std::make_unique<CacheDisk>(*this);  // its write budget starts full, at created_
  walks_ = std::make_unique<CacheWalks>(*this);
}

BlockCache::~BlockCache() {
  // Copies in flight write into the arenas freed below.
  KVTIER_CHECK_MSG(inflight_copies_ == 0, "BlockCache destroyed with copies in flight");
}

void BlockCache::SetWatermarks(TierWatermarks hbm, TierWatermarks host) {
  tier(Tier::kHbm)->marks = hbm;
  tier(Tier::kHost)->marks = host;
  MaybeDemote();
}

std::span<uint8_t> BlockCache::host_arena() const {
  const Arena* a = arenas_[static_cast<size_t>(Tier::kHost)].get();
  return {a->data(), a->size_bytes()};
}

TierUsage BlockCache::Usage(Tier t) const {
  const TierState* s = tier(t);
  if (t == Tier::kDisk) {
    if (options_.disk == nullptr) return {};
    return TierUsage{options_.disk->capacity_bytes(), s->used_bytes, s->blocks};
  }
  if (s == nullptr || !s->pool) return {};
  return TierUsage{s->pool->capacity_bytes(), s->used_bytes, s->blocks};
}

bool BlockCache::AboveHigh(Tier t) const {
  const TierState* s = tier(t);
  return s->pool && static_cast<double>(s->pool->used_bytes()) >
                        s->marks.high * static_cast<double>(s->pool->capacity_bytes());
}

bool BlockCache::AboveLow(Tier t) const {
  const TierState* s = tier(t);
  return s->pool && static_cast<double>(s->pool->used_bytes() - s->moving_out_bytes) >
                        s->marks.low * static_cast<double>(s->pool->capacity_bytes());
}

std::string BlockCache::NoRoomReason() const {
  return "no block of this size can be evicted now (" + std::to_string(index_.total_leases()) +
         " leases held, " + std::to_string(disk_->writes_in_flight()) +
         " blocks being written to disk), and blocks of other sizes hold the rest of the tier";
}

bool BlockCache::SubmitCopy(CopyBatch batch, std::function<void(CopyResult)> on_done) {
  ++inflight_copies_;
  return options_.backend->Submit(
      std::move(batch), [post = options_.post, self = std::weak_ptr<BlockCache*>(self_),
                         on_done = std::move(on_done)](CopyResult result) mutable {
        post([self, on_done = std::move(on_done), result = std::move(result)]() mutable {
          std::shared_ptr<BlockCache*> cache = self.lock();
          if (!cache) return;
          --(*cache)->inflight_copies_;
          on_done(std::move(result));
        });
      });
}

CacheLookup BlockCache::Lookup(TenantId tenant, std::span<const StoredKey> keys) {
  index_.Prefetch(keys);  // the prompt's misses overlap instead of queueing
  CacheLookup r;
  std::vector<BlockEntry*> hit;  // to touch; blocks only on disk have no LRU place
  for (const StoredKey& key : keys) {
    if (BlockEntry* e = index_.Find(key); e != nullptr) {
      if (!Servable(e)) break;
      hit.push_back(e);
      r.tiers.push_back(e->tier);
      if (e->hits < DiskOnlyBlock::kMaxHits) ++e->hits;
    } else if (DiskOnlyBlock* b = disk_only_.Find(key); b != nullptr) {
      r.tiers.push_back(Tier::kDisk);
      if (b->hits < DiskOnlyBlock::kMaxHits) ++b->hits;
    } else {
      break;
    }
  }
  r.hits = static_cast<uint32_t>(r.tiers.size());
  CountLookup(tenant, r.tiers, keys.size());
  // Deepest first, so a chain's head ends up hottest and its tail is evicted first.
  for (auto it = hit.rbegin(); it != hit.rend(); ++it) Touch(*it);
  return r;
}

uint32_t BlockCache::Load(TenantId tenant, std::span<const StoredKey> keys,
                          std::span<const uint32_t> block_ids, EngineTarget target,
                          std::weak_ptr<void> /*owner*/, OpDone done, bool engine_holds) {
  KVTIER_CHECK(keys.size() == block_ids.size());
  std::vector<BlockEntry*> leased;
  std::vector<BlockEntry*> on_disk;
  for (size_t i = 0; i < keys.size(); ++i) {
    BlockEntry* e = index_.Find(keys[i]);
    if (e == nullptr) e = Materialize(keys[i]);
    if (e == nullptr || !Servable(e)) {
      ++(e == nullptr ? counters_.loads_short_gone : counters_.loads_short_not_ready);
      break;
    }
    Lease(e, tenant);
    if (e->hits < DiskOnlyBlock::kMaxHits) ++e->hits;
    leased.push_back(e);
    if (e->tier == Tier::kDisk) on_disk.push_back(e);
  }
  for (auto it = leased.rbegin(); it != leased.rend(); ++it) {
    if (!engine_holds) {
      Touch(*it);
    } else if (index_.TouchHeld(*it)) {
      ++counters_.engine_held;
    }
  }
  std::vector<uint32_t> ids(block_ids.begin(), block_ids.begin() + static_cast<ptrdiff_t>(leased.size()));
  if (on_disk.empty()) {
    const auto n = static_cast<uint32_t>(leased.size());
    const bool all_hbm = std::ranges::all_of(leased, [](const BlockEntry* e) { return e->tier == Tier::kHbm; });
    return CopyToEngine(tenant, all_hbm && n > 0 ? Tier::kHbm : Tier::kHost, std::move(leased), std::move(ids),
                        std::move(target), std::move(done))
               ? n
               : 0;
  }
  // Bring the disk blocks up to host first (sharing reads with other loads),
  // then copy the prefix that made it: a block that failed its checks is
  // dropped and ends the prefix there.
  struct Pending {
    std::vector<BlockEntry*> leased;
    std::vector<uint32_t> ids;
    EngineTarget target;
    OpDone done;
    size_t waiting = 0;
  };
  auto p = std::make_shared<Pending>(Pending{std::move(leased), std::move(ids), std::move(target), std::move(done),
                                             on_disk.size()});
  for (BlockEntry* e : on_disk) {
    disk_->PromoteFromDisk(e, [this, p, tenant](bool) {
      if (--p->waiting > 0) return;
      // Blocks still on disk failed their read; the prefix ends before the first.
      size_t good = 0;
      while (good < p->leased.size() && p->leased[good]->tier != Tier::kDisk) ++good;
      if (good < p->leased.size()) ++counters_.loads_short_disk;
      for (size_t i = good; i < p->leased.size(); ++i) {
        const StoredKey key = p->leased[i]->key;
        Unlease(p->leased[i], tenant);
        // Read up, but past the prefix: not kept past its owner's quota.
        if (BlockEntry* read = index_.Find(key); read != nullptr) LeaveHostPastQuota(read);
      }
      p->leased.resize(good);
      p->ids.resize(good);
      // Too late for the event: the engine learned from OpStarted that it
      // was not recorded, and waits for the op instead.
      p->target.event = -1;
      CopyToEngine(tenant, Tier::kDisk, std::move(p->leased), std::move(p->ids), std::move(p->target),
                   std::move(p->done));
    });
  }
  return 0;
}

bool BlockCache::CopyToEngine(TenantId tenant, Tier source, std::vector<BlockEntry*> leased,
                              std::vector<uint32_t> block_ids, EngineTarget target, OpDone done) {
  if (leased.empty()) {
    options_.post([done = std::move(done)] { done(OpOutcome{}); });
    return false;
  }
  CopyBatch batch{.direction = CopyDirection::kSlotToEngine,
                  .priority = CopyPriority::kLoad,
                  .flow = tenant,
                  .layout = target.layout,
                  .mapping = target.mapping,
                  .signal_event = target.event,
                  .fence = target.fence,
                  .by_layer = target.by_layer};
  // Coded host blocks are decoded on their way (DecodesOnLoad): all of one
  // namespace, the target's.
  for (size_t i = 0; i < leased.size(); ++i) {
    const BlockEntry* e = leased[i];
    batch.blocks.push_back(BlockCopy{block_ids[i], e->slot, e->coded_bytes});
    if (e->coded_bytes != 0) batch.codec = namespaces_.FormatOf(e->ns).codec;
  }
  const uint64_t bytes = target.layout->layout().block_bytes() * leased.size();
  return SubmitCopy(std::move(batch), [this, tenant, source, leased = std::move(leased), bytes,
                                       done = std::move(done)](CopyResult result) {
    std::vector<BlockEntry*> promote;
    for (BlockEntry* e : leased) {
      const StoredKey key = e->key;
      Unlease(e, tenant);
      // The last lease of a block whose disk write finished meanwhile frees
      // its retired host slot, and the block may go back to the disk-only
      // table: the entry is gone then.
      e = index_.Find(key);
      if (e == nullptr) continue;
      if (LeaveHostPastQuota(e)) continue;
      // A block not hot yet goes back to disk (where its record still is);
      // a hot one stays, and may move up to hbm.
      if (e->tier == Tier::kHost && e->on_disk && e->hits < options_.disk_promotion_min_hits &&
          BackToDisk(e)) {
        ++counters_.disk_hits_not_promoted;
        continue;
      }
      if (e->tier == Tier::kHost) promote.push_back(e);
    }
    if (result.status.ok()) {
      TenantShare& mine = Counted(tenant);
      mine.loads += leased.size();
      mine.bytes_cache_to_engine += bytes;
      // Promote what was read from host, if hbm has room without evicting.
      for (BlockEntry* e : promote) MaybePromote(e);
      done(OpOutcome{.status = Status::Ok(), .blocks = static_cast<uint32_t>(leased.size()), .source = source});
    } else {
      done(OpOutcome{.status = result.status});
    }
  });
}

bool BlockCache::LeaveHostPastQuota(BlockEntry* e) {
  if (e->tier != Tier::kHost || policy_->QuotaAllows(e->owner, Tier::kHost, 0) || !LeaveHostHeldBelow(e)) {
    return false;
  }
  ++counters_.reads_not_kept;
  return true;
}

bool BlockCache::MaybePromote(BlockEntry* e) {
  TierState* hbm = tier(Tier::kHbm);
  // hbm holds blocks as they are: a coded one stays in host.
  if (!hbm->pool || e->tier != Tier::kHost || e->moving || e->state != EntryState::kReady ||
      e->coded_bytes != 0) {
    return false;
  }
  // A load that leased the block before its last move still reads the old
  // slot; an entry keeps one retired slot, so the block stays put until that
  // lease is released (FinishMove would otherwise have two to keep).
  if (e->retired_slot != nullptr) return false;
  const uint64_t stride = SlotPool::StrideFor(e->block_bytes);
  if (static_cast<double>(hbm->pool->used_bytes() + stride) >
      hbm->marks.high * static_cast<double>(hbm->pool->capacity_bytes())) {
    return false;
  }
  if (!policy_->QuotaAllows(e->owner, Tier::kHbm, e->block_bytes)) return false;
  uint8_t* dst = room_->ForPromotion(e->block_bytes);
  if (dst == nullptr) return false;
  StartMove(e, Tier::kHbm, dst);
  return true;
}

uint32_t BlockCache::Store(TenantId tenant, std::span<const StoredKey> keys,
                       std::span<const uint32_t> block_ids, std::optional<StoredKey> parent,
                       EngineTarget target, std::weak_ptr<void> owner, OpDone done, const StoreHint& store_hint) {
  KVTIER_CHECK(keys.size() == block_ids.size());
  if (store_hint.last_partial && !keys.empty()) {
    // Engines that store only full blocks never send one; one that marks
    // it gets it refused here, as it is almost never reused.
    keys = keys.first(keys.size() - 1);
    block_ids = block_ids.first(block_ids.size() - 1);
    ++counters_.partial_not_admitted;
  }
  const RetentionHint& hint = store_hint.retention;
  const bool hinted = hint.priority != 0 || hint.next_use_ms != 0 || hint.session_over;
  // The engine keeps a copy, and no hint says otherwise: evicted first.
  const bool held = hint.engine_holds && !hinted;
  const uint32_t now = hinted ? NowMs() : 0;
  const Layout& layout = target.layout->layout();
  // A new layout takes a namespace id while ids and the tenant's bound last.
  Result<uint32_t> ns = namespaces_.IdFor(NamespaceOf(layout, target.codec), [&] { return layout.ToString(); });
  Status admitted = ns ? namespaces_.Admit(tenant, *ns) : ns.error();
  // The first store tells a namespace its format (a restart's records may
  // have told it before: the same, since the fingerprint fixes both).
  if (admitted.ok()) namespaces_.SetFormat(*ns, FormatFor(layout, target.codec));
  if (!admitted.ok()) {
    Counted(tenant).store_rejected += keys.size();
    options_.post([done = std::move(done), admitted] { done(OpOutcome{.status = admitted}); });
    return 0;
  }
  const uint64_t bytes = layout.block_bytes();
  // Host blocks the backend codes on the copy's way go straight into slots
  // of their coded size.
  const uint64_t coded = codec_->CodedOnStore(*ns, bytes);
  auto job = std::make_shared<StoreJob>(
      StoreJob{.tenant = tenant, .bytes = bytes, .owner = std::move(owner), .done = std::move(done)});
  CopyBatch batch{.direction = CopyDirection::kEngineToSlot,
                  .priority = CopyPriority::kStore,
                  .flow = tenant,
                  .layout = target.layout,
                  .mapping = target.mapping,
                  .checksum_destination = true,
                  .wait_event = target.event,
                  .codec = target.codec,
                  .fence = target.fence,
                  .gate = std::move(target.gate)};  // the backend's alone: the job's target keeps none
  const StoredKey* prev = parent ? &*parent : nullptr;
  // Where the chain stands: the parent's depth when the index has it.
  const BlockEntry* parent_entry = parent ? index_.Find(*parent) : nullptr;
  const uint32_t parent_depth = parent_entry != nullptr ? parent_entry->depth : 0;
  const auto request_blocks = static_cast<uint32_t>(std::min<uint64_t>(parent_depth + keys.size(), UINT32_MAX));
  for (size_t i = 0; i < keys.size(); prev = &keys[i], ++i) {
    if (index_.Find(keys[i]) != nullptr || disk_only_.Find(keys[i]) != nullptr) {
      ++job->already;  // present (in memory or only on disk), or its copy is in flight
      continue;
    }
    // hbm first when it has a free slot; otherwise host, evicting its coldest
    // unleased blocks (the tenant's own first when its quota is the limit:
    // demoted to disk when there is one, see "Quotas" in block_cache.h).
    uint8_t* slot = nullptr;
    Tier t = Tier::kHbm;
    if (policy_->QuotaAllows(tenant, Tier::kHbm, bytes)) {
      slot = room_->ForStore(Tier::kHbm, bytes);
    }
    const uint64_t host_bytes = coded != 0 ? coded : bytes;
    if (slot == nullptr) {
      t = Tier::kHost;
      if (room_->HostQuotaRoom(tenant, host_bytes)) {
        slot = room_->ForStore(Tier::kHost, host_bytes);
      }
    }
    if (slot == nullptr) {
      const bool quota = !policy_->QuotaAllows(tenant, Tier::kHost, host_bytes);
      const bool draining = tier(Tier::kHost)->pool->draining();
      job->status = Status(StatusCode::kResourceExhausted,
                           "no room for block " + std::to_string(i) + " of the store: " +
                               (quota      ? "the tenant's host quota is full of leased or moving blocks"
                                : draining ? "an extent of another block size is being emptied for this "
                                             "size (its blocks are being written to disk); retry shortly"
                                           : NoRoomReason()));
      Counted(tenant).store_rejected += keys.size() - i;
      break;
    }
    const uint64_t slot_coded = t == Tier::kHost ? coded : 0;
    job->filling.push_back(InsertFilling(keys[i], prev, t, slot, bytes, *ns, tenant, slot_coded));
    BlockEntry* filled = job->filling.back();
    filled->compress = target.codec.kind != CodecKind::kNone;
    filled->depth = static_cast<uint16_t>(std::min<uint64_t>(parent_depth + i + 1, UINT16_MAX));
    if (options_.disk_admit_learned) filled->disk_gate = disk_->GateTag(request_blocks);
    if (hinted) {
      ++counters_.hinted;
      if (!policy_->HintBlock(filled, hint, now)) ++counters_.hints_refused;
    } else if (held) {
      ++counters_.engine_held;
      index_.Hint(filled, hint, now);
    }
    job->block_ids.push_back(block_ids[i]);
    batch.blocks.push_back(BlockCopy{block_ids[i], slot, static_cast<uint32_t>(slot_coded)});
  }
  Counted(tenant).already_stored += job->already;
  policy_->ArrivedTogether(job->filling, parent_depth, request_blocks);
  if (job->filling.empty()) {
    options_.post([job] { job->done(OpOutcome{.status = job->status, .blocks = 0, .already = job->already}); });
    return 0;
  }
  const auto n = static_cast<uint32_t>(job->filling.size());
  job->target = std::move(target);
  const bool queued = SubmitCopy(std::move(batch), [this, job](CopyResult result) { FinishStore(job, std::move(result)); });
  return queued ? n : 0;
}

void BlockCache::FinishStore(const std::shared_ptr<StoreJob>& job, CopyResult result) {
  const bool commit = result.status.ok() && !job->owner.expired();
  if (commit && !result.not_coded.empty() && RegatherRaw(job, std::move(result))) return;
  job->target = EngineTarget{};  // the client's memory is let go of before it is answered
  for (size_t i = 0; i < job->filling.size(); ++i) {
    BlockEntry* e = job->filling[i];
    Unlease(e, job->tenant);
    if (commit) {
      MakeReady(e);
      // Only host memory is checksummed by the copy (DeviceBackend); an hbm
      // block gets its checksum when it moves to host.
      e->checksum = result.checksums[i];
      e->has_checksum = e->tier == Tier::kHost;
      if (e->coded_bytes != 0) {  // coded by the copy
        codec_->CountEncoded(e->block_bytes, e->coded_bytes);
        ++counters_.codec_host_coded;
      }
      codec_->MaybeCompact(e);
      if (options_.disk_write_through && options_.disk != nullptr && e->tier == Tier::kHost) {
        disk_->QueueDiskWrite(e->key, /*keep_in_memory=*/true);
      }
      remote_->PutOnStore(e);
    } else {
      Drop(e);
    }
  }
  TenantShare& mine = Counted(job->tenant);
  if (commit) {
    mine.stores += job->filling.size();
    mine.bytes_engine_to_cache += job->bytes * job->filling.size();
  } else if (result.status.ok()) {
    mine.stores_discarded += job->filling.size();
  }
  job->done(OpOutcome{.status = result.status.ok() ? job->status : result.status,
                      .blocks = commit ? static_cast<uint32_t>(job->filling.size()) : 0,
                      .already = job->already});
  MaybeDemote();
}

bool BlockCache::RegatherRaw(const std::shared_ptr<StoreJob>& job, CopyResult result) {
  // The engine keeps its blocks until the store is answered: those the codec
  // did not code (fp8: a NaN or an Inf) are gathered again as they are, into
  // raw host slots, and never retried by the pool. One without room is not
  // stored (a store that finds no room stops there too).
  CopyBatch again{.direction = CopyDirection::kEngineToSlot,
                  .priority = CopyPriority::kStore,
                  .flow = job->tenant,
                  .layout = job->target.layout,
                  .mapping = job->target.mapping,
                  .checksum_destination = true,
                  .fence = job->target.fence};
  std::vector<size_t> regathered;
  for (uint32_t i : result.not_coded) {
    BlockEntry* e = job->filling.at(i);
    KVTIER_CHECK(e->tier == Tier::kHost && e->coded_bytes != 0);
    ++counters_.codec_not_worth_it;
    uint8_t* raw = room_->ForStore(Tier::kHost, e->block_bytes);
    if (raw == nullptr) {
      ++Counted(job->tenant).store_rejected;
      job->status = Status(StatusCode::kResourceExhausted, "no room for a block the codec did not code");
      Unlease(e, job->tenant);
      Drop(e);
      job->filling[i] = nullptr;
      continue;
    }
    Charge(e, -1);
    tier(Tier::kHost)->pool->Free(e->slot, e->coded_bytes);
    e->slot = raw;
    e->coded_bytes = 0;
    e->compress = false;
    tier(Tier::kHost)->pool->SetOwner(raw, e);
    Charge(e, +1);
    again.blocks.push_back(BlockCopy{job->block_ids[i], e->slot});
    regathered.push_back(i);
  }
  // The blocks stored so far, with their checksums, then those gathered again.
  std::vector<BlockEntry*> kept;
  std::vector<uint64_t> checksums;
  for (size_t i = 0; i < job->filling.size(); ++i) {
    if (job->filling[i] == nullptr || std::ranges::find(regathered, i) != regathered.end()) continue;
    kept.push_back(job->filling[i]);
    checksums.push_back(result.checksums.at(i));
  }
  for (size_t i : regathered) kept.push_back(job->filling[i]);
  job->filling = std::move(kept);
  job->block_ids.clear();  // no further round
  if (again.blocks.empty()) {
    FinishStore(job, CopyResult{.status = Status::Ok(), .checksums = std::move(checksums)});
    return true;
  }
  SubmitCopy(std::move(again), [this, job, checksums = std::move(checksums)](CopyResult raw) mutable {
    if (raw.status.ok()) {
      checksums.insert(checksums.end(), raw.checksums.begin(), raw.checksums.end());
      raw.checksums = std::move(checksums);
    }
    KVTIER_CHECK(raw.not_coded.empty());
    FinishStore(job, std::move(raw));
  });
  return true;
}

std::pair<uint32_t, uint32_t> BlockCache::Prefetch(
    TenantId tenant, std::span<const StoredKey> keys, const std::function<uint32_t(std::span<const Tier>)>& choose) {
  // The leading present keys, counted as a lookup (engines such as vLLM's
  // connector ask only through prefetches) and touched deepest first (as
  // Lookup does) before anything moves.
  std::vector<Tier> tiers;
  while (tiers.size() < keys.size()) {
    const StoredKey& key = keys[tiers.size()];
    const BlockEntry* e = index_.Find(key);
    if (e == nullptr ? disk_only_.Find(key) == nullptr : !Servable(e)) break;
    tiers.push_back(e == nullptr ? Tier::kDisk : e->tier);
  }
  CountLookup(tenant, tiers, keys.size());
  const size_t present = choose ? std::min<size_t>(choose(tiers), tiers.size()) : tiers.size();
  for (size_t i = present; i-- > 0;) {
    if (BlockEntry* e = index_.Find(keys[i]); e != nullptr) Touch(e);
  }
  // Then start the moves, finding each entry again: a promotion may take a
  // host slot from a colder block, which may be one of these.
  uint32_t queued = 0;
  for (size_t i = 0; i < present; ++i) {
    BlockEntry* e = index_.Find(keys[i]);
    if (e == nullptr) e = Materialize(keys[i]);
    if (e == nullptr || !Servable(e)) continue;
    if (e->tier == Tier::kDisk) {
      if (!e->moving) {
        disk_->PromoteFromDisk(e, nullptr);
        ++queued;
      }
    } else if (MaybePromote(e)) {
      ++queued;
    }
  }
  return {static_cast<uint32_t>(present), queued};
}

void BlockCache::StartMove(BlockEntry* e, Tier to, uint8_t* dst) {
  KVTIER_CHECK(e->coded_bytes == 0);  // hbm and its moves hold blocks as they are
  e->moving = true;
  e->leaving = to > e->tier;
  index_.Park(e);
  const uint64_t stride = SlotPool::StrideFor(e->block_bytes);
  tier(e->tier)->moving_out_bytes += stride;
  CopyBatch batch{.direction = CopyDirection::kSlotToSlot,
                  .priority = CopyPriority::kBackground,
                  .flow = e->owner,
                  .slot_copies = {SlotCopy{e->slot, dst, e->block_bytes}},
                  .checksum_destination = to == Tier::kHost};
  SubmitCopy(std::move(batch), [this, key = e->key, from = e->tier, to, dst, stride](CopyResult r) {
    tier(from)->moving_out_bytes -= stride;
    FinishMove(key, to, dst, std::move(r));
  });
}

void BlockCache::FinishMove(const StoredKey& key, Tier to, uint8_t* dst, CopyResult result) {
  // Moving entries are never dropped, so the entry is still there.
  BlockEntry* e = index_.Find(key);
  KVTIER_CHECK(e != nullptr && e->moving);
  e->moving = false;
  e->leaving = false;
  if (!result.status.ok()) {
    index_.Unpark(e, /*hot=*/true);
    tier(to)->pool->Free(dst, e->block_bytes);
    disk_->RetryReadsWaitingForRoom();  // no room came of it
    return;
  }
  const Tier from = e->tier;
  uint8_t* old = e->slot;
  Charge(e, -1);
  MoveToTier(e, to);
  index_.Unpark(e, /*hot=*/true);
  e->slot = dst;
  tier(to)->pool->SetOwner(dst, e);
  Charge(e, +1);
  RetireSlot(e, from, old, e->block_bytes);
  if (to == Tier::kHost) {
    e->checksum = result.checksums.at(0);
    e->has_checksum = true;
    ++counters_.demotions;
    counters_.bytes_hbm_to_host += e->block_bytes;
    codec_->MaybeCompact(e);
    remote_->PutOnStore(e);
  } else {
    ++counters_.promotions;
    counters_.bytes_host_to_hbm += e->block_bytes;
  }
  MaybeDemote();
}

void BlockCache::MaybeDemote() {
  // hbm above its high watermark: demote its coldest blocks to host until it
  // is below the low one (also when a demotion that used its scan budget
  // goes on).
  if (tier(Tier::kHbm)->pool && (AboveHigh(Tier::kHbm) || std::exchange(hbm_demotion_deferred_, false))) {
    while (AboveLow(Tier::kHbm)) {
      if (!ScanBudgetLeft()) {
        hbm_demotion_deferred_ = true;  // the rest on a later turn
        break;
      }
      BlockEntry* v = PickBackgroundVictim(Tier::kHbm);
      if (v == nullptr) break;
      // The owner's host quota is full: with a disk tier its host coldest
      // make room there; else (or when nothing of it can go) this block goes.
      if (options_.disk != nullptr ? !room_->HostQuotaRoom(v->owner, v->block_bytes)
                                   : !policy_->QuotaAllows(v->owner, Tier::kHost, v->block_bytes)) {
        Drop(v);
        continue;
      }
      // With a disk tier, host blocks are on their way there: wait for room
      // rather than drop them (RoomGate::ForDemotion).
      uint8_t* dst = room_->ForDemotion(v->block_bytes);
      if (dst == nullptr) break;  // host is full or leased; try again after the next op
      StartMove(v, Tier::kHost, dst);
    }
  }
  disk_->PumpDiskWrites();
  remote_->FlushRemotePuts();
  disk_->RetryReadsWaitingForRoom();
}

uint32_t BlockCache::LeadingLocal(std::span<const StoredKey> keys) {
  uint32_t n = 0;
  for (const StoredKey& key : keys) {
    const BlockEntry* e = index_.Find(key);
    if (e != nullptr ? !Servable(e) : disk_only_.Find(key) == nullptr) break;
    ++n;
  }
  return n;
}

// --- Calls handed to the sides.

void BlockCache::SetQuota(TenantId tenant, const TenantQuota& quota) { policy_->SetQuota(tenant, quota); }

void BlockCache::SetTenantName(TenantId tenant, std::string name) {
  policy_->SetTenantName(tenant, std::move(name));
}

uint32_t BlockCache::Hint(std::span<const StoredKey> keys, const RetentionHint& hint, uint32_t* refused) {
  return policy_->Hint(keys, hint, refused);
}

uint64_t BlockCache::AdoptDiskRecords(std::vector<DiskRecord> records) {
  return disk_->AdoptDiskRecords(std::move(records));
}

ReclaimAnswer BlockCache::ReclaimFromDisk(const StoredKey& key, const DiskLocation& where, bool may_carry) {
  return disk_->ReclaimFromDisk(key, where, may_carry);
}

void BlockCache::FinishRelocation(const StoredKey& key, Result<DiskLocation> now) {
  disk_->FinishRelocation(key, std::move(now));
}

uint64_t BlockCache::FlushToDisk() { return disk_->FlushToDisk(); }

void BlockCache::CancelFlush() { disk_->CancelFlush(); }

uint64_t BlockCache::pending_disk_writes() const { return disk_->pending_disk_writes(); }

std::optional<uint32_t> BlockCache::FetchFromRemote(TenantId tenant, const Layout& layout, const CodecParams& codec,
                                                    std::span<const StoredKey> keys, FetchDone done) {
  return remote_->FetchFromRemote(tenant, layout, codec, keys, std::move(done));
}

void BlockCache::Evict(EvictFilter filter, std::function<void(uint64_t)> done) {
  walks_->Evict(std::move(filter), std::move(done));
}

size_t BlockCache::pending_evicts() const { return walks_->pending_evicts(); }

std::shared_ptr<const VerifyProgress> BlockCache::VerifyDisk(uint32_t max_inflight) {
  return walks_->VerifyDisk(max_inflight);
}

void BlockCache::CancelVerify() { walks_->CancelVerify(); }


BlockEntry* BlockCache::PickBackgroundVictim(Tier t) {
  const uint64_t before = counters_.victim_scan_blocks;
  BlockEntry* v = room_->PickVictim(t, 0, std::nullopt, /*clean_only=*/false, /*moves_down=*/t == Tier::kHbm);
  background_scanned_ += counters_.victim_scan_blocks - before;
  return v;
}

bool BlockCache::ScanBudgetLeft() {
  if (background_scanned_ - scan_base_ < std::max<uint32_t>(1, options_.background_scan_budget)) return true;
  if (!pump_posted_) ++counters_.scan_budget_deferrals;
  SchedulePump();
  return false;
}

void BlockCache::SchedulePump() {
  if (pump_posted_) return;
  pump_posted_ = true;
  options_.post([self = std::weak_ptr<BlockCache*>(self_)] {
    auto cache = self.lock();
    if (!cache) return;
    (*cache)->pump_posted_ = false;
    (*cache)->scan_base_ = (*cache)->background_scanned_;  // a new budget
    (*cache)->MaybeDemote();  // hbm's demotion, write-back, and what they queued
  });
}

uint32_t BlockCache::NowMs() const {
  return static_cast<uint32_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.clock() - created_).count());
}
}  // namespace kvtier
