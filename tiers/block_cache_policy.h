// CachePolicy: BlockCache's tenants and the eviction policy's inputs
// (issues 19 and 34, docs/policy.md): quotas, tenant names, what a store
// tells its tier's order of the request, and the engine's retention hints.
//
// It owns the quotas, the tenants' names, what each quota needs per tenant
// (host bytes being written out; the line of disk records) and nothing
// else. Its promises:
//   - QuotaAllows counts a tenant's host blocks being written out to disk
//     as leaving (block_cache.h, "Quotas"): HostLeaving must be told of
//     each write-back as it starts and ends, and of nothing else. It counts
//     the reads from disk into host under way for the tenant as arrived:
//     HostArriving is told of each as it starts and ends.
//   - A tenant over its disk quota forgets its own oldest disk-only records
//     only, at most kDiskQuotaStepsPerWrite per record it gains; a record
//     whose block is in memory or busy goes to the back of the line.
//   - Hints keep at most the tier's hint_share, and of it the owner's part.
//
// Who may call: BlockCache's core and sides, on the owner thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tiers/block_cache.h"
#include "tiers/disk_write_log.h"

namespace kvtier {

class CachePolicy {
 public:
  explicit CachePolicy(BlockCache& cache) : cache_(cache) {}
  CachePolicy(const CachePolicy&) = delete;
  CachePolicy& operator=(const CachePolicy&) = delete;

  void SetQuota(TenantId tenant, const TenantQuota& quota);
  void SetTenantName(TenantId tenant, std::string name);
  // The name written into `owner`'s disk records; empty when it has none.
  const std::string& NameOf(TenantId owner) const;
  // The tenant a disk record's owner name maps back to (a restart).
  std::optional<TenantId> TenantNamed(const std::string& name) const;

  // `tenant`'s quota of tier `t`; nullopt: only the tier's capacity.
  std::optional<uint64_t> QuotaOf(TenantId tenant, Tier t) const;
  bool QuotaAllows(TenantId tenant, Tier t, uint64_t bytes) const;
  // `tenant`'s host blocks being written out to disk: `bytes` more (a
  // write-back started) or fewer (it ended).
  void HostLeaving(TenantId tenant, uint64_t bytes, bool more);
  // `tenant`'s blocks being read from disk into host slots: `bytes` more (a
  // read started) or fewer (it ended, its block charged to host or not).
  void HostArriving(TenantId tenant, uint64_t bytes, bool more);

  // The disk quota: its line of records; forgetting the oldest while over.
  void LogDiskRecord(TenantId owner, const StoredKey& key, const DiskLocation& where);
  // `owner`'s disk bytes grew by `newest`'s record: bounded steps back
  // within its quota (never forgetting `newest`'s).
  void DiskGrew(TenantId owner, const StoredKey& newest);
  // Once over every tenant's line (records adopted at a restart).
  void EnforceDiskQuotas(uint32_t max_steps);

  // The policy learns what it can of a store's request (s3fifo, classes:
  // EvictionOrder::ArrivedTogether): the blocks before it (its parent's
  // depth) and the request's length with them. O(blocks stored).
  void ArrivedTogether(std::span<BlockEntry* const> filling, uint32_t parent_depth, uint32_t request_blocks);
  // index_.Hint, within the tier's hint_share and the owner's part of it
  // (in bytes).
  bool HintBlock(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms);
  uint32_t Hint(std::span<const StoredKey> keys, const RetentionHint& hint, uint32_t* refused);

 private:
  // What the quotas need per tenant (by TenantId, created on first use).
  struct QuotaState {
    uint64_t host_bytes_leaving = 0;   // its host blocks being written out to disk
    uint64_t host_bytes_arriving = 0;  // its blocks being read from disk into host
    DiskWriteLog disk_log;            // its disk records, while it has a disk quota
  };
  QuotaState& QuotaStateOf(TenantId tenant);
  // Looks at most `max_steps` entries; never forgets `newest`'s record.
  void EnforceDiskQuota(TenantId owner, uint32_t max_steps, const StoredKey* newest);
  bool IsCurrentRecord(const DiskWriteLog::Record& r);

  BlockCache& cache_;
  std::vector<TenantQuota> quotas_;
  std::vector<QuotaState> quota_state_;
  std::vector<std::string> tenant_names_;
  uint64_t named_tenants_ = 0;  // of tenant_names_: the tenants a hint share is split among
};

}  // namespace kvtier
