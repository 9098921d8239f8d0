// NamespaceTable: BlockCache's namespaces (one per KV-cache layout
// fingerprint), each a small integer id, with what every namespace and every
// tenant's part of it holds, kept as blocks come and go.
//
// Ids are 16 bits (a block only on disk keeps its id in 16 bits) and are
// reused: an id whose namespace holds no block, and that nothing pins, goes
// back to the free list the next time an id is needed. So a node that has
// seen millions of layouts over its life holds ids only for the ones with
// blocks now. Two bounds keep a tenant from taking the id space from the
// others: at most `max_namespaces` ids live on the node, and a tenant holds
// blocks in at most `max_per_tenant` namespaces; past either, Admit says no
// with the bound's name.
//
// Usage is kept per namespace and per (tenant, namespace) at every Charge, so
// listing a tenant's namespaces costs O(its namespaces), never a walk of the
// cache.
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/key128.h"
#include "common/status.h"
#include "kernels/codec.h"
#include "tiers/block_index.h"

namespace kvtier {

// What a namespace's packed (compressed) disk records hold (issue 18): the
// blocks' own size and the codec that wrote them: lossless for a layout's
// own namespace, fp8 for its fp8 namespace (CodedFingerprint).
struct NamespaceFormat {
  uint64_t block_bytes = 0;  // 0: not known yet
  CodecParams codec;

  friend bool operator==(const NamespaceFormat&, const NamespaceFormat&) = default;
};

// Blocks and bytes of one namespace (layout), per tier.
struct NamespaceUsage {
  LayoutFingerprint fingerprint;
  std::string description;  // the layout, as its last store described it ("" after a restart)
  uint64_t blocks = 0;
  uint64_t used_bytes[kNumTiers] = {};
};

class NamespaceTable {
 public:
  // The most ids a 16-bit field can name.
  static constexpr uint32_t kMaxIds = UINT16_MAX + 1;

  // max_namespaces <= kMaxIds; both > 0.
  NamespaceTable(uint32_t max_namespaces, uint32_t max_per_tenant);
  NamespaceTable(const NamespaceTable&) = delete;
  NamespaceTable& operator=(const NamespaceTable&) = delete;

  // The id of `fingerprint`, created when it has none. A new id holds no
  // block: it is reused unless a block is charged to it (or it is pinned)
  // before the next new id is made. kResourceExhausted when max_namespaces
  // ids hold blocks. `describe` names the layout in listings; it is called
  // only while the namespace has no description yet (null: none known).
  Result<uint32_t> IdFor(const LayoutFingerprint& fingerprint,
                         const std::function<std::string()>& describe = nullptr);
  std::optional<uint32_t> Find(const LayoutFingerprint& fingerprint) const;
  // REQUIRES: `id` names a namespace (IdFor returned it, and it holds blocks
  // or pins, or no new id was made since).
  const LayoutFingerprint& FingerprintOf(uint32_t id) const;
  // Whether `tenant` may add blocks to namespace `id`: it holds some there
  // already, or holds blocks in fewer than max_per_tenant namespaces. The
  // error names limits.max_namespaces_per_tenant.
  Status Admit(TenantId tenant, uint32_t id) const;

  // A block of `bytes` of `owner` in namespace `id` enters (sign +1) or
  // leaves (-1) tier `t`.
  void Charge(uint32_t id, TenantId owner, Tier t, uint64_t bytes, int sign);
  // Records the format of namespace `id`'s blocks: known from its stores
  // and from the records adopted after a restart. False (nothing changes)
  // when it has another one already: a record that disagrees is not its.
  bool SetFormat(uint32_t id, const NamespaceFormat& format);
  // Zero block_bytes while no store or record told it.
  const NamespaceFormat& FormatOf(uint32_t id) const;

  // A pinned id is not reused while it holds no block (e.g. an Evict that
  // filters by it runs across turns of the loop).
  void Pin(uint32_t id);
  void Unpin(uint32_t id);

  // Namespaces with blocks: of `owner`, O(its namespaces), or every one.
  std::vector<NamespaceUsage> Usage(std::optional<TenantId> owner) const;
  // Ids with blocks or pins now.
  uint32_t live() const { return live_; }
  // Namespaces `tenant` holds blocks in.
  uint32_t TenantNamespaces(TenantId tenant) const;

 private:
  struct Counts {
    uint64_t blocks = 0;
    uint64_t bytes[kNumTiers] = {};
    void Add(Tier t, uint64_t n, int sign);
  };
  struct Namespace {
    LayoutFingerprint fingerprint;
    std::string description;
    NamespaceFormat format;
    Counts total;
    uint32_t pins = 0;
    bool in_use = false;  // the id names `fingerprint`
    bool counted = false; // counted in live_
  };
  struct TenantPart {
    Counts counts;
    size_t index = 0;  // in its tenant's list (tenant_ids_)
  };
  static uint64_t PartKey(TenantId tenant, uint32_t id) { return (uint64_t{tenant} << 16) | id; }
  // Gives back the ids that hold nothing any more.
  void Reclaim();
  void UpdateLive(uint32_t id);

  const uint32_t max_namespaces_;
  const uint32_t max_per_tenant_;
  std::vector<Namespace> by_id_;
  std::unordered_map<LayoutFingerprint, uint32_t, Key128Hash> ids_;
  std::vector<uint32_t> free_ids_;
  std::vector<uint32_t> maybe_empty_;  // ids that held nothing at some point since the last Reclaim
  uint32_t live_ = 0;
  std::unordered_map<uint64_t, TenantPart> parts_;     // by PartKey
  std::vector<std::vector<uint16_t>> tenant_ids_;      // by tenant: the ids it has blocks in
};

}  // namespace kvtier
