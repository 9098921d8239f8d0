// CachePolicy: BlockCache's tenants, quotas and the eviction policy's
// inputs (block_cache_policy.h).
#include "tiers/block_cache_policy.h"

#include <algorithm>
#include <vector>

namespace kvtier {

void CachePolicy::ArrivedTogether(std::span<BlockEntry* const> filling, uint32_t parent_depth,
                                 uint32_t request_blocks) {
  const EvictionOrder::Arrival arrival{
      .prefix_hits = parent_depth, .request_blocks = request_blocks, .partial_tail = false};
  std::vector<BlockEntry*> in_tier;
  for (Tier t : {Tier::kHbm, Tier::kHost}) {
    in_tier.clear();
    for (BlockEntry* e : filling) {
      if (e->tier == t) in_tier.push_back(e);
    }
    if (!in_tier.empty()) cache_.index_.order(t).ArrivedTogether(in_tier, arrival);
  }
}

bool CachePolicy::HintBlock(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms) {
  // Bytes hinted to be kept: the tier's share, and of it the owner's: its
  // quota's share where it has a quota of the tier, else an even part of
  // the tier among the tenants.
  const uint64_t capacity = cache_.Usage(e->tier).capacity_bytes;
  const double share = std::clamp(cache_.options_.hint_share, 0.0, 1.0);
  const uint64_t tenants = std::max<uint64_t>(1, named_tenants_);
  const std::optional<uint64_t> quota = QuotaOf(e->owner, e->tier);
  const uint64_t owner_room = quota ? std::min(*quota, capacity) : capacity / tenants;
  return cache_.index_.Hint(e, hint, now_ms,
                     {.tier_bytes = static_cast<uint64_t>(share * static_cast<double>(capacity)),
                      .owner_bytes = static_cast<uint64_t>(share * static_cast<double>(owner_room))});
}

uint32_t CachePolicy::Hint(std::span<const StoredKey> keys, const RetentionHint& hint, uint32_t* refused) {
  const uint32_t now = cache_.NowMs();
  uint32_t took = 0, kept_none = 0;
  if (hint.engine_dropped) {
    // Only blocks held for their engine take it.
    for (const StoredKey& k : keys) {
      BlockEntry* e = cache_.index_.Find(k);
      if (e == nullptr || !EvictionOrder::EngineHeld(e)) continue;
      ++took;
      cache_.index_.Hint(e, hint, now);
    }
    cache_.counters_.engine_dropped += took;
    if (refused != nullptr) *refused = 0;
    return took;
  }
  for (const StoredKey& k : keys) {
    BlockEntry* e = cache_.index_.Find(k);
    if (e == nullptr) continue;
    ++took;
    kept_none += HintBlock(e, hint, now) ? 0 : 1;
  }
  cache_.counters_.hinted += took;
  cache_.counters_.hints_refused += kept_none;
  if (refused != nullptr) *refused = kept_none;
  return took;
}

void CachePolicy::SetQuota(TenantId tenant, const TenantQuota& quota) {
  if (quotas_.size() <= tenant) quotas_.resize(tenant + 1);
  quotas_[tenant] = quota;
  // Without a disk quota its record log is not kept (nor needed).
  if (!quota.bytes[static_cast<size_t>(Tier::kDisk)] && tenant < quota_state_.size()) {
    quota_state_[tenant].disk_log = DiskWriteLog();
  }
}

void CachePolicy::SetTenantName(TenantId tenant, std::string name) {
  if (tenant_names_.size() <= tenant) tenant_names_.resize(tenant + 1);
  tenant_names_[tenant] = std::move(name);
  named_tenants_ = static_cast<uint64_t>(std::count_if(tenant_names_.begin(), tenant_names_.end(),
                                                       [](const std::string& n) { return !n.empty(); }));
}

bool CachePolicy::QuotaAllows(TenantId tenant, Tier t, uint64_t bytes) const {
  const std::optional<uint64_t> q = QuotaOf(tenant, t);
  if (!q) return true;
  uint64_t used = cache_.TenantUsedBytes(tenant, t);
  // Host blocks being written out to disk are leaving (block_cache.h,
  // "Quotas"); blocks being read up from disk have as good as arrived.
  if (t == Tier::kHost && tenant < quota_state_.size()) {
    used += quota_state_[tenant].host_bytes_arriving;
    used -= quota_state_[tenant].host_bytes_leaving;
  }
  return used + bytes <= *q;
}

const std::string& CachePolicy::NameOf(TenantId owner) const {
  static const std::string kNone;
  return owner < tenant_names_.size() ? tenant_names_[owner] : kNone;
}

std::optional<TenantId> CachePolicy::TenantNamed(const std::string& name) const {
  auto it = std::find(tenant_names_.begin(), tenant_names_.end(), name);
  if (it == tenant_names_.end()) return std::nullopt;
  return static_cast<TenantId>(it - tenant_names_.begin());
}

std::optional<uint64_t> CachePolicy::QuotaOf(TenantId tenant, Tier t) const {
  return tenant < quotas_.size() ? quotas_[tenant].bytes[static_cast<size_t>(t)] : std::nullopt;
}

void CachePolicy::HostLeaving(TenantId tenant, uint64_t bytes, bool more) {
  uint64_t& leaving = QuotaStateOf(tenant).host_bytes_leaving;
  leaving = more ? leaving + bytes : leaving - bytes;
}

void CachePolicy::HostArriving(TenantId tenant, uint64_t bytes, bool more) {
  uint64_t& arriving = QuotaStateOf(tenant).host_bytes_arriving;
  arriving = more ? arriving + bytes : arriving - bytes;
}

CachePolicy::QuotaState& CachePolicy::QuotaStateOf(TenantId tenant) {
  if (quota_state_.size() <= tenant) quota_state_.resize(size_t{tenant} + 1);
  return quota_state_[tenant];
}

namespace {

// Disk quota (block_cache.h, "Quotas"): entries of a tenant's DiskWriteLog
// looked at per write (or return to disk) to bring it back within its
// quota, and entries compacted per record logged.
constexpr uint32_t kDiskQuotaStepsPerWrite = 64;
constexpr uint32_t kDiskLogCompactSteps = 4;

}  // namespace

bool CachePolicy::IsCurrentRecord(const DiskWriteLog::Record& r) {
  if (DiskOnlyBlock* b = cache_.disk_only_.Find(r.key); b != nullptr) {
    return DiskWriteLog::Where(b->device, b->offset_bytes()) == r.where;
  }
  const BlockEntry* e = cache_.index_.Find(r.key);
  return e != nullptr && e->on_disk &&
         DiskWriteLog::Where(e->disk.device, e->disk.offset) == r.where;
}

void CachePolicy::LogDiskRecord(TenantId owner, const StoredKey& key, const DiskLocation& where) {
  if (!QuotaOf(owner, Tier::kDisk)) return;
  DiskWriteLog& log = QuotaStateOf(owner).disk_log;
  log.Push(DiskWriteLog::Record{key, DiskWriteLog::Where(where.device, where.offset)});
  // Its live entries are records of its blocks: at most the blocks it holds.
  const TenantShare& share = cache_.Counted(owner);
  log.Compact([this](const DiskWriteLog::Record& r) { return IsCurrentRecord(r); },
              share.blocks[0] + share.blocks[1] + share.blocks[2], kDiskLogCompactSteps);
}

void CachePolicy::DiskGrew(TenantId owner, const StoredKey& newest) {
  EnforceDiskQuota(owner, kDiskQuotaStepsPerWrite, &newest);
}

void CachePolicy::EnforceDiskQuotas(uint32_t max_steps) {
  for (size_t t = 0; t < quota_state_.size(); ++t) {
    EnforceDiskQuota(static_cast<TenantId>(t), max_steps, nullptr);
  }
}

void CachePolicy::EnforceDiskQuota(TenantId owner, uint32_t max_steps, const StoredKey* newest) {
  const std::optional<uint64_t> quota = QuotaOf(owner, Tier::kDisk);
  if (!quota || owner >= quota_state_.size()) return;
  DiskWriteLog& log = quota_state_[owner].disk_log;
  for (uint32_t step = 0; step < max_steps && cache_.TenantUsedBytes(owner, Tier::kDisk) > *quota;
       ++step) {
    const DiskWriteLog::Record* oldest = log.Oldest();
    if (oldest == nullptr) break;  // what is left predates its quota: reclaims take it
    const DiskWriteLog::Record r = *oldest;
    if (newest != nullptr && r.key == *newest) break;  // all that is left is what just came
    log.PopOldest();
    if (!IsCurrentRecord(r)) continue;  // gone, or written again elsewhere
    DiskOnlyBlock* b = cache_.disk_only_.Find(r.key);
    if (b == nullptr) {
      log.Push(r);  // in memory (hit since) or busy (read, leased, carried): another round
      continue;
    }
    ++cache_.counters_.disk_quota_evictions;
    cache_.DropDiskOnly(b);
  }
}

}  // namespace kvtier
