// BlockCache's memory tiers and data path: stores, loads, lookups,
// promotion and demotion between hbm and host, eviction, quotas (its disk,
// codec, remote, verify and policy sides live in block_cache_*.cc). Past 800
// lines on purpose: a store's and a load's steps, and the leases and slots
// they share, read best side by side.
#include "tiers/block_cache.h"

#include <algorithm>
#include <utility>

#include "common/check.h"

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
  if (!o.clock) cache->options_.clock = [] { return std::chrono::steady_clock::now(); };
  cache->budget_tokens_ = static_cast<double>(o.disk_write_budget_bytes_per_day);
  cache->budget_refilled_ = cache->options_.clock();
  cache->created_ = cache->budget_refilled_;
  cache->tier(Tier::kHbm)->marks = o.hbm_watermarks;
  cache->tier(Tier::kHost)->marks = o.host_watermarks;
  return cache;
}

BlockCache::BlockCache(Options options)
    : options_(std::move(options)),
      index_(options_.policy),
      gate_(options_.disk_gate_sample_every),
      namespaces_(std::max(1u, options_.max_namespaces), std::max(1u, options_.max_namespaces_per_tenant)),
      self_(std::make_shared<BlockCache*>(this)) {}

BlockCache::~BlockCache() {
  // Copies in flight write into the arenas freed below.
  KVTIER_CHECK_MSG(inflight_copies_ == 0, "BlockCache destroyed with copies in flight");
}

void BlockCache::SetQuota(TenantId tenant, const TenantQuota& quota) {
  if (quotas_.size() <= tenant) quotas_.resize(tenant + 1);
  quotas_[tenant] = quota;
  // Without a disk quota its record log is not kept (nor needed).
  if (!quota.bytes[static_cast<size_t>(Tier::kDisk)] && tenant < quota_state_.size()) {
    quota_state_[tenant].disk_log = DiskWriteLog();
  }
}

void BlockCache::SetWatermarks(TierWatermarks hbm, TierWatermarks host) {
  tier(Tier::kHbm)->marks = hbm;
  tier(Tier::kHost)->marks = host;
  MaybeDemote();
}

void BlockCache::SetTenantName(TenantId tenant, std::string name) {
  if (tenant_names_.size() <= tenant) tenant_names_.resize(tenant + 1);
  tenant_names_[tenant] = std::move(name);
  named_tenants_ = static_cast<uint64_t>(std::count_if(tenant_names_.begin(), tenant_names_.end(),
                                                       [](const std::string& n) { return !n.empty(); }));
}

bool BlockCache::QuotaAllows(TenantId tenant, Tier t, uint64_t bytes) const {
  if (tenant >= quotas_.size()) return true;
  const std::optional<uint64_t>& q = quotas_[tenant].bytes[static_cast<size_t>(t)];
  if (!q) return true;
  uint64_t used = TenantUsedBytes(tenant, t);
  // Host blocks being written out to disk are leaving (block_cache.h, "Quotas").
  if (t == Tier::kHost && tenant < quota_state_.size())
    used -= quota_state_[tenant].host_bytes_leaving;
  return used + bytes <= *q;
}

BlockCache::QuotaState& BlockCache::QuotaStateOf(TenantId tenant) {
  if (quota_state_.size() <= tenant) quota_state_.resize(size_t{tenant} + 1);
  return quota_state_[tenant];
}

bool BlockCache::MakeHostQuotaRoom(TenantId tenant, uint64_t bytes) {
  while (!QuotaAllows(tenant, Tier::kHost, bytes)) {
    BlockEntry* own = PickVictim(Tier::kHost, 0, tenant);
    if (own == nullptr) return false;
    if (options_.disk == nullptr) {
      Drop(own);
    } else {
      DemoteFromHost(own);
    }
  }
  return true;
}

uint64_t BlockCache::TenantUsedBytes(TenantId tenant, Tier t) const {
  return tenant < tenant_shares_.size() ? tenant_shares_[tenant].used_bytes[static_cast<size_t>(t)]
                                        : 0;
}

uint64_t BlockCache::TenantBlocks(TenantId tenant) const {
  const TenantShare s = ShareOf(tenant);
  return s.blocks[0] + s.blocks[1] + s.blocks[2];
}

TenantShare BlockCache::ShareOf(TenantId tenant) const {
  return tenant < tenant_shares_.size() ? tenant_shares_[tenant] : TenantShare{};
}

TenantShare& BlockCache::Counted(TenantId tenant) {
  if (tenant_shares_.size() <= tenant) tenant_shares_.resize(size_t{tenant} + 1);
  return tenant_shares_[tenant];
}

void BlockCache::CountEviction(Tier t, TenantId owner) { ++Counted(owner).evictions[static_cast<size_t>(t)]; }

void RequestCounters::Add(const RequestCounters& o) {
  lookups += o.lookups;
  lookup_keys += o.lookup_keys;
  misses += o.misses;
  stores += o.stores;
  already_stored += o.already_stored;
  store_rejected += o.store_rejected;
  stores_discarded += o.stores_discarded;
  loads += o.loads;
  bytes_engine_to_cache += o.bytes_engine_to_cache;
  bytes_cache_to_engine += o.bytes_cache_to_engine;
  for (size_t t = 0; t < kNumTiers; ++t) {
    hits[t] += o.hits[t];
    evictions[t] += o.evictions[t];
  }
}

CacheCounters BlockCache::counters() const {
  CacheCounters c = counters_;
  for (const TenantShare& share : tenant_shares_) c.Add(share);
  return c;
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

void BlockCache::Charge(BlockEntry* e, int sign) { Charge(e->tier, e->owner, e->ns, ChargedBytes(e), sign); }

LayoutFingerprint BlockCache::NamespaceOf(const Layout& layout, const CodecParams& codec) {
  return CodedFingerprint(layout.fingerprint(), codec);
}

NamespaceFormat BlockCache::FormatFor(const Layout& layout, const CodecParams& codec) {
  // A layout's own namespace holds raw and lossless blocks alike.
  if (codec.kind == CodecKind::kFp8) return {layout.block_bytes(), codec};
  return {layout.block_bytes(), {.kind = CodecKind::kLossless, .dtype = layout.spec().dtype, .group_elems = 0}};
}

void BlockCache::Charge(const DiskOnlyBlock& b, int sign) {
  Charge(Tier::kDisk, b.owner, b.ns, b.block_bytes, sign);
}

void BlockCache::Charge(Tier tier_id, TenantId owner, uint32_t ns, uint64_t bytes, int sign) {
  namespaces_.Charge(ns, owner, tier_id, bytes, sign);
  const size_t t = static_cast<size_t>(tier_id);
  TenantShare& mine = Counted(owner);
  if (sign > 0) {
    tiers_[t]->blocks += 1;
    tiers_[t]->used_bytes += bytes;
    mine.used_bytes[t] += bytes;
    mine.blocks[t] += 1;
  } else {
    tiers_[t]->blocks -= 1;
    tiers_[t]->used_bytes -= bytes;
    mine.used_bytes[t] -= bytes;
    mine.blocks[t] -= 1;
  }
}

BlockEntry* BlockCache::InsertFilling(const StoredKey& key, const StoredKey* parent, Tier t, uint8_t* slot,
                                      uint64_t bytes, uint32_t ns, TenantId tenant, uint64_t coded_bytes) {
  BlockEntry* e = index_.Insert(key, t, parent);
  e->slot = slot;
  tier(t)->pool->SetOwner(slot, e);
  e->block_bytes = static_cast<uint32_t>(bytes);
  e->coded_bytes = static_cast<uint32_t>(coded_bytes);
  e->ns = ns;
  e->owner = tenant;
  e->state = EntryState::kFilling;
  Lease(e, tenant);
  Charge(e, +1);
  return e;
}

void BlockCache::MakeReady(BlockEntry* e) {
  e->state = EntryState::kReady;
  if (e->tier != Tier::kDisk) Tell(true, e, e->tier);  // a disk entry is present by its record
}

void BlockCache::MoveToTier(BlockEntry* e, Tier to) {
  const Tier from = e->tier;
  index_.ChangeTier(e, to);
  if (e->state != EntryState::kReady || from == to) return;
  // Present in the new tier first: a consumer never sees the block held
  // nowhere in between (nor does the listener drop what it keeps of it).
  if (to != Tier::kDisk) Tell(true, e, to);
  if (from != Tier::kDisk) Tell(false, e, from);
}

void BlockCache::SetOnDisk(BlockEntry* e, bool on_disk) {
  if (e->on_disk == on_disk) return;
  e->on_disk = on_disk;
  if (e->state == EntryState::kReady) Tell(on_disk, e, Tier::kDisk);
}

void BlockCache::SetRemotePresent(BlockEntry* e, bool present) {
  if (e->remote_present == present) return;
  e->remote_present = present;
  Tell(present, e, Presence::kRemote);
}

void BlockCache::Erase(BlockEntry* e) {
  SetRemotePresent(e, false);
  index_.Erase(e);
}

void BlockCache::ForEachPresent(const std::function<void(const StoredKey&, TenantId, uint32_t, Presence)>& fn) {
  index_.ForEach([&](const BlockEntry* e) {
    if (e->remote_present) fn(e->key, e->owner, e->ns, Presence::kRemote);
    if (e->state != EntryState::kReady) return;
    if (e->tier != Tier::kDisk) fn(e->key, e->owner, e->ns, PresenceOf(e->tier));
    if (e->on_disk) fn(e->key, e->owner, e->ns, Presence::kDisk);
  });
  disk_only_.ForEach([&](const DiskOnlyBlock& b) { fn(b.key, b.owner, b.ns, Presence::kDisk); });
}

void BlockCache::Lease(BlockEntry* e, TenantId tenant) {
  index_.AddLease(e);
  ++Counted(tenant).leases;
}

void BlockCache::Unlease(BlockEntry* e, TenantId tenant) {
  --Counted(tenant).leases;
  index_.ReleaseLease(e);
  if (e->leases == 0 && e->retired_slot != nullptr) {
    tier(e->retired_tier)->pool->Free(e->retired_slot, e->retired_bytes);
    e->retired_slot = nullptr;
  }
  if (e->leases == 0) Dematerialize(e);  // a load that could not read it up
}

void BlockCache::Drop(BlockEntry* e) {
  KVTIER_CHECK(e->leases == 0 && !e->moving && e->retired_slot == nullptr);
  if (e->state == EntryState::kReady) {
    CountEviction(e->tier, e->owner);
    if (e->tier != Tier::kDisk) Tell(false, e, e->tier);
    if (e->on_disk) Tell(false, e, Tier::kDisk);
  }
  if (!e->on_disk && WantsRemotePut(e, Options::RemoteWrite::kOnDemote)) {
    ++counters_.remote_demotions_missed;
  }
  Charge(e, -1);
  if (e->on_disk) options_.disk->Forget(e->key, e->disk);
  if (e->tier != Tier::kDisk) tier(e->tier)->pool->Free(e->slot, SlotBytes(e));
  Erase(e);
}

void BlockCache::RetireSlot(BlockEntry* e, Tier from, uint8_t* old, uint64_t old_bytes) {
  if (e->leases == 0) {
    tier(from)->pool->Free(old, old_bytes);
    return;
  }
  // Loads that leased the block before still read the old slot.
  KVTIER_CHECK(e->retired_slot == nullptr);
  e->retired_slot = old;
  e->retired_tier = from;
  e->retired_bytes = static_cast<uint32_t>(old_bytes);
}


void BlockCache::DropDiskOnly(DiskOnlyBlock* b, bool forget) {
  if (forget) {
    options_.disk->Forget(b->key, options_.disk->LocationOf(RecordRefOf(*b)));
  }
  CountEviction(Tier::kDisk, b->owner);
  Charge(*b, -1);
  CountPresent(Presence::kDisk, false);
  if (options_.listener != nullptr) options_.listener->OnBlockGone(b->key, b->owner, b->ns, Presence::kDisk);
  disk_only_.Erase(b);
}

namespace {

// Children of a block looked at, at most, to see whether they all leave.
constexpr int kLeavingChildrenChecked = 8;

// Whether every child of `e` in tier `t` or above is on its way below `t`
// (a demotion in flight): then `e` is as good as a leaf of `t` for another
// demotion (PickVictim's moves_down). False past kLeavingChildrenChecked
// children.
bool ChildrenLeaving(const BlockEntry* e, Tier t) {
  int seen = 0;
  for (const BlockEntry* c = e->first_child; c != nullptr; c = c->next_sibling) {
    if (c->tier > t) continue;  // below t: no child of t's
    if (c->tier != t || !c->leaving || ++seen > kLeavingChildrenChecked) return false;
  }
  return true;
}

}  // namespace

BlockEntry* BlockCache::PickVictim(Tier t, uint64_t block_bytes, std::optional<TenantId> owner, bool clean_only,
                                   bool moves_down) {
  bool last_resort = false;
  index_.order(t).Expire(NowMs());
  BlockEntry* victim = index_.order(t).PickVictim(
      options_.eviction_scan_limit,
      [&](const BlockEntry* e) {
        ++counters_.victim_scan_blocks;
        if (e->leases != 0 || e->state != EntryState::kReady || e->moving) return Candidate::kSkip;
        if (block_bytes != 0 && SlotPool::StrideFor(SlotBytes(e)) != SlotPool::StrideFor(block_bytes)) {
          return Candidate::kSkip;
        }
        if (owner && e->owner != *owner) return Candidate::kSkip;
        if (clean_only && !(options_.disk != nullptr ? e->on_disk : e->on_remote)) return Candidate::kSkip;
        if (options_.prefix_aware && BlockIndex::HasChildrenAtOrAbove(e, t) && !(moves_down && ChildrenLeaving(e, t))) {
          return Candidate::kLastResort;
        }
        return Candidate::kEvict;
      },
      &last_resort);
  if (last_resort) ++counters_.prefix_fallbacks;
  return victim;
}

uint8_t* BlockCache::AllocateSlot(Tier t, uint64_t bytes, Room room) {
  TierState* s = tier(t);
  if (!s->pool) return nullptr;
  // Blocks the tier below holds (disk, or else the cluster, however they
  // were put there) can go for nothing; an extent of another size is emptied
  // without loss only where host writes back to disk.
  const bool has_clean = t == Tier::kHost && (options_.disk != nullptr || options_.remote != nullptr);
  const bool may_empty_extents =
      room == Room::kAny || (t == Tier::kHost && options_.disk != nullptr) || (room == Room::kCleanOnly && has_clean);
  // Without a disk to write them to, an extent is emptied for kCleanOnly
  // only when every block in it is held below host.
  const bool extents_clean_only = room != Room::kAny;
  while (true) {
    if (uint8_t* slot = s->pool->Allocate(bytes); slot != nullptr) return slot;
    if (room == Room::kNothing) return nullptr;
    // Sizes share a tier by recency, not by who came first: when the
    // coldest block is of another size, the extent it lives in is emptied
    // for this size (without this, a second model's blocks would find
    // every extent taken by the first's).
    if (may_empty_extents && s->pool->sizes_in_use() > (s->pool->holds(bytes) ? 1u : 0u)) {
      const BlockEntry* coldest = PickVictim(t, 0, std::nullopt);
      if (coldest != nullptr &&
          SlotPool::StrideFor(SlotBytes(coldest)) != SlotPool::StrideFor(bytes)) {
        // Draining: refused until its blocks have left (this size's own
        // blocks are hotter than the coldest). Busy: this size's own
        // coldest may still go below.
        const ExtentReclaim r = EmptyExtent(t, bytes, coldest->slot, extents_clean_only);
        if (r == ExtentReclaim::kRoom) continue;
        if (r == ExtentReclaim::kDraining) return nullptr;
      }
    }
    // A block the tier below holds (disk, or else the cluster) costs
    // nothing to let go; a dirty one would be lost, so it goes only when no
    // clean one can.
    BlockEntry* victim =
        has_clean ? PickVictim(t, bytes, std::nullopt, /*clean_only=*/true) : nullptr;
    if (victim == nullptr && room == Room::kAny) victim = PickVictim(t, bytes, std::nullopt);
    if (victim == nullptr) {
      // No block of this size can go now (all leased or moving: a store's
      // own, blocks being coded; or all dirty): an extent of another size,
      // whatever the coldest is, before giving up.
      if (may_empty_extents && s->pool->sizes_in_use() > (s->pool->holds(bytes) ? 1u : 0u) &&
          EmptyExtent(t, bytes, nullptr, extents_clean_only) == ExtentReclaim::kRoom) {
        continue;
      }
      return nullptr;
    }
    if (BackToDisk(victim)) continue;
    if (t == Tier::kHost && options_.disk != nullptr && !victim->on_disk) ++counters_.disk_writes_missed;
    Drop(victim);
  }
}

// Extents one EmptyExtent looks at, at most.
constexpr size_t kExtentCandidates = 4;

BlockCache::ExtentReclaim BlockCache::EmptyExtent(Tier t, uint64_t bytes, const uint8_t* coldest, bool clean_only) {
  SlotPool& pool = *tier(t)->pool;
  const bool write_back = t == Tier::kHost && options_.disk != nullptr;
  const bool keep_dirty = clean_only && !write_back;
  for (const std::span<uint8_t> extent : pool.ExtentsToReclaim(bytes, coldest, kExtentCandidates)) {
    // Its blocks, found through the slots' owners: each must be settled
    // to go now (a lease, a copy in flight, a retired slot or a move's
    // destination keeps the extent this time).
    std::vector<BlockEntry*> blocks;
    bool busy = false;
    pool.ForEachSlotInUse(extent.data(), [&](uint8_t* slot, void* owner) {
      ++counters_.extent_slots_examined;
      auto* e = static_cast<BlockEntry*>(owner);
      busy = e == nullptr || e->slot != slot || e->tier != t || e->leases != 0 || e->moving ||
             e->state != EntryState::kReady || e->retired_slot != nullptr || (keep_dirty && !e->on_remote);
      if (!busy) blocks.push_back(e);
      return !busy;
    });
    // One drain at a time: one under way (listed first) is waited for while
    // its blocks leave; any other extent that cannot go now is skipped.
    const bool draining = pool.draining(extent.data());
    if (busy) {
      if (draining) return ExtentReclaim::kDraining;
      continue;
    }
    // Everything here can go: clean blocks back to disk, dirty ones written
    // back (they leave once written; one that cannot start now waits for
    // the next try) or, without a disk tier, dropped.
    for (BlockEntry* e : blocks) {
      if (!write_back) {
        Drop(e);
      } else if (!BackToDisk(e)) {
        DemoteFromHost(e, /*may_drop=*/false);
      }
    }
    if (!draining) ++counters_.extents_reclaimed;
    if (pool.CanAllocate(bytes)) return ExtentReclaim::kRoom;
    if (!draining) pool.Drain(extent.data());
    return ExtentReclaim::kDraining;
  }
  return ExtentReclaim::kBusy;
}

void BlockCache::Touch(BlockEntry* e) { index_.Touch(e); }

std::string BlockCache::NoRoomReason() const {
  return "no block of this size can be evicted now (" + std::to_string(index_.total_leases()) +
         " leases held, " + std::to_string(disk_writes_in_flight_) +
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
                          std::weak_ptr<void> /*owner*/, OpDone done) {
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
  for (auto it = leased.rbegin(); it != leased.rend(); ++it) Touch(*it);
  std::vector<uint32_t> ids(block_ids.begin(), block_ids.begin() + static_cast<ptrdiff_t>(leased.size()));
  if (on_disk.empty()) {
    const auto n = static_cast<uint32_t>(leased.size());
    return CopyToEngine(tenant, std::move(leased), std::move(ids), std::move(target),
                        std::move(done))
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
    PromoteFromDisk(e, [this, p, tenant](bool) {
      if (--p->waiting > 0) return;
      // Blocks still on disk failed their read; the prefix ends before the first.
      size_t good = 0;
      while (good < p->leased.size() && p->leased[good]->tier != Tier::kDisk) ++good;
      if (good < p->leased.size()) ++counters_.loads_short_disk;
      for (size_t i = good; i < p->leased.size(); ++i) Unlease(p->leased[i], tenant);
      p->leased.resize(good);
      p->ids.resize(good);
      // Too late for the event: the engine learned from OpStarted that it
      // was not recorded, and waits for the op instead.
      p->target.event = -1;
      CopyToEngine(tenant, std::move(p->leased), std::move(p->ids), std::move(p->target),
                   std::move(p->done));
    });
  }
  return 0;
}

bool BlockCache::CopyToEngine(TenantId tenant, std::vector<BlockEntry*> leased,
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
                  .fence = target.fence};
  // Coded host blocks are decoded on their way (DecodesOnLoad): all of one
  // namespace, the target's.
  for (size_t i = 0; i < leased.size(); ++i) {
    const BlockEntry* e = leased[i];
    batch.blocks.push_back(BlockCopy{block_ids[i], e->slot, e->coded_bytes});
    if (e->coded_bytes != 0) batch.codec = namespaces_.FormatOf(e->ns).codec;
  }
  const uint64_t bytes = target.layout->layout().block_bytes() * leased.size();
  return SubmitCopy(std::move(batch), [this, tenant, leased = std::move(leased), bytes,
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
      done(OpOutcome{.status = Status::Ok(), .blocks = static_cast<uint32_t>(leased.size())});
    } else {
      done(OpOutcome{.status = result.status});
    }
  });
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
  if (!QuotaAllows(e->owner, Tier::kHbm, e->block_bytes)) return false;
  uint8_t* dst = AllocateSlot(Tier::kHbm, e->block_bytes, Room::kNothing);
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
  const uint64_t coded = CodedOnStore(*ns, bytes);
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
                  .fence = target.fence};
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
    if (QuotaAllows(tenant, Tier::kHbm, bytes)) {
      slot = AllocateSlot(Tier::kHbm, bytes, Room::kNothing);
    }
    const uint64_t host_bytes = coded != 0 ? coded : bytes;
    if (slot == nullptr) {
      t = Tier::kHost;
      if (MakeHostQuotaRoom(tenant, host_bytes)) {
        slot = AllocateSlot(Tier::kHost, host_bytes, Room::kAny);
      }
    }
    if (slot == nullptr) {
      const bool quota = !QuotaAllows(tenant, Tier::kHost, host_bytes);
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
    if (options_.disk_admit_learned) filled->disk_gate = gate_.TagFor(request_blocks);
    if (hinted) {
      ++counters_.hinted;
      if (!HintBlock(filled, hint, now)) ++counters_.hints_refused;
    }
    job->block_ids.push_back(block_ids[i]);
    batch.blocks.push_back(BlockCopy{block_ids[i], slot, static_cast<uint32_t>(slot_coded)});
  }
  Counted(tenant).already_stored += job->already;
  ArrivedTogether(job->filling, parent_depth, request_blocks);
  if (job->filling.empty()) {
    options_.post([job] { job->done(OpOutcome{.status = job->status, .blocks = 0, .already = job->already}); });
    return 0;
  }
  const auto n = static_cast<uint32_t>(job->filling.size());
  job->target = std::move(target);
  const bool queued = SubmitCopy(std::move(batch), [this, job](CopyResult result) { FinishStore(job, std::move(result)); });
  return queued ? n : 0;
}

uint64_t BlockCache::CodedOnStore(uint32_t ns, uint64_t bytes) const {
  const NamespaceFormat& format = namespaces_.FormatOf(ns);
  if (format.block_bytes != bytes || !KeepsCoded(ns) || !options_.backend->EncodesOnStore(format.codec.kind)) {
    return 0;
  }
  const uint64_t n = BlockCodec::MaxEncodedBytes(format.codec, bytes);
  return SlotPool::StrideFor(n) < SlotPool::StrideFor(bytes) ? n : 0;
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
        CountEncoded(e->block_bytes, e->coded_bytes);
        ++counters_.codec_host_coded;
      }
      MaybeCompact(e);
      if (options_.disk_write_through && options_.disk != nullptr && e->tier == Tier::kHost) {
        QueueDiskWrite(e->key, /*keep_in_memory=*/true);
      }
      PutOnStore(e);
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
    uint8_t* raw = AllocateSlot(Tier::kHost, e->block_bytes, Room::kAny);
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

void BlockCache::CountLookup(TenantId tenant, std::span<const Tier> hit_tiers, size_t num_keys) {
  TenantShare& mine = Counted(tenant);
  for (Tier t : hit_tiers) ++mine.hits[static_cast<size_t>(t)];
  ++mine.lookups;
  mine.lookup_keys += num_keys;
  mine.misses += num_keys - hit_tiers.size();
}

std::pair<uint32_t, uint32_t> BlockCache::Prefetch(TenantId tenant,
                                                   std::span<const StoredKey> keys) {
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
  const size_t present = tiers.size();
  CountLookup(tenant, tiers, keys.size());
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
        PromoteFromDisk(e, nullptr);
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
    RetryReadsWaitingForRoom();  // no room came of it
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
    MaybeCompact(e);
    PutOnStore(e);
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
      if (options_.disk != nullptr ? !MakeHostQuotaRoom(v->owner, v->block_bytes)
                                   : !QuotaAllows(v->owner, Tier::kHost, v->block_bytes)) {
        Drop(v);
        continue;
      }
      // With a disk tier, host blocks are on their way there: wait for room
      // rather than drop them.
      const Room room = options_.disk == nullptr ? Room::kAny : Room::kNothing;
      uint8_t* dst = AllocateSlot(Tier::kHost, v->block_bytes, room);
      if (dst == nullptr) break;  // host is full or leased; try again after the next op
      StartMove(v, Tier::kHost, dst);
    }
  }
  PumpDiskWrites();
  FlushRemotePuts();
  RetryReadsWaitingForRoom();
}

}  // namespace kvtier
