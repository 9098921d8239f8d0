// KvEventSource: turns the cache's presence changes (TierListener) into KV
// events for KV-aware routers (docs/kv-events.md), published through a
// KvEventPublisher.
//
// Routers need the engine's view of a block (its hash, parent, token ids,
// block size, LoRA name), which only a client knows: a Store may carry it
// (Remember), and it is kept with the block while the block is present
// somewhere, bounded by max_metadata_bytes, and written into the block's disk
// record (DiskAnnotation) so that a restart publishes it again (Adopt, then
// Snapshot). A block of a tenant that does not publish, or stored without
// metadata, is never announced.
//
// Owned by the Server; every call on the event loop (thread-compatible); the
// publisher's thread does the encoding and the sending.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/key128.h"
#include "daemon/kv_event_publisher.h"
#include "daemon/kv_events.h"
#include "tiers/block_cache.h"
#include "tiers/disk/disk_tier.h"

namespace kvtier {

// A Store's metadata, as the protocol gives it (sizes already checked with
// ipc::CheckBlockEventSizes).
struct StoreEventFields {
  uint32_t hash_bytes = 0;
  std::span<const uint8_t> engine_hashes;  // hash_bytes per key
  std::span<const uint8_t> parent_hash;    // empty: a sequence start
  std::span<const uint32_t> token_ids;     // block_size per key, or empty
  uint32_t block_size = 0;
  std::string_view lora_name;
};

struct KvEventSourceCounters {
  uint64_t blocks_tracked = 0;       // blocks with metadata now
  uint64_t metadata_bytes = 0;       // their memory, as counted against the bound
  uint64_t metadata_refused = 0;     // blocks not tracked: the bound was reached
  uint64_t clears_published = 0;     // AllBlocksCleared sent
};

class KvEventSource final : public TierListener {
 public:
  // Per tenant id: whether its blocks are published, and under which topic.
  struct TenantTopic {
    bool publish = false;
    std::string topic;
  };
  KvEventSource(std::unique_ptr<KvEventPublisher> publisher, std::vector<TenantTopic> tenants,
                uint64_t max_metadata_bytes);

  bool Publishes(TenantId owner) const { return owner < tenants_.size() && tenants_[owner].publish; }

  // Keeps `fields` for `keys` (one store's blocks, in chain order) until the
  // blocks are gone, or until Release when they never became present. A key
  // already tracked keeps what it has.
  void Remember(std::span<const StoredKey> keys, const StoreEventFields& fields);
  // The store that named `keys` is over.
  void Release(std::span<const StoredKey> keys);

  // After a restart, before BlockCache::AdoptDiskRecords: the metadata kept
  // in the records' annotations.
  void Adopt(const std::vector<DiskRecord>& records);
  // After a restart: an AllBlocksCleared on every topic, then what the cache
  // holds. Metadata of blocks it does not hold is dropped. Walks the cache.
  void Snapshot(BlockCache& cache);
  // After an evict of every tier and namespace of `owners` (nullopt: all):
  // an AllBlocksCleared on each of their topics that holds nothing now (the
  // removals went out one by one already; this resynchronises a consumer
  // that missed some).
  void AfterEvictAll(const std::optional<std::vector<TenantId>>& owners);

  // TierListener.
  void OnBlockPresent(const StoredKey& key, TenantId owner, uint32_t ns, Presence where) override;
  void OnBlockGone(const StoredKey& key, TenantId owner, uint32_t ns, Presence where) override;
  std::string DiskAnnotation(const StoredKey& key, TenantId owner) override;

  KvEventSourceCounters counters() const { return counters_; }
  KvEventPublisherCounters publisher_counters() const { return publisher_->counters(); }

 private:
  struct BlockMeta {
    EngineBlockHash hash;
    std::optional<EngineBlockHash> parent;
    std::vector<uint32_t> tokens;
    std::string lora;
    uint32_t block_size = 0;
    uint8_t places = 0;    // a bit per Presence
    uint32_t pending = 0;  // stores in flight that named it
  };
  // A map node (key, value, next pointer and cached hash); BytesOf adds
  // what its vectors and strings hold outside it.
  static constexpr uint64_t kNodeBytes = sizeof(StoredKey) + sizeof(BlockMeta) + 2 * sizeof(void*);
  static uint64_t BytesOf(const BlockMeta& m);
  void Track(const StoredKey& key, BlockMeta meta);
  void Untrack(std::unordered_map<StoredKey, BlockMeta, Key128Hash>::iterator it);
  void PublishStored(TenantId owner, const BlockMeta& m, Presence where);
  void Publish(const std::string& topic, KvEvent event);
  void PublishCleared(const std::string& topic);

  std::unique_ptr<KvEventPublisher> publisher_;
  std::vector<TenantTopic> tenants_;
  std::vector<uint64_t> present_;  // per tenant: (block, place) pairs announced
  const uint64_t max_metadata_bytes_;
  std::unordered_map<StoredKey, BlockMeta, Key128Hash> blocks_;
  KvEventSourceCounters counters_;
  bool snapshotting_ = false;  // in Snapshot: events wait for room instead of dropping
};

// The annotation format (docs/disk-format.md), exposed for tests.
std::string EncodeBlockAnnotation(const EngineBlockHash& hash, const std::optional<EngineBlockHash>& parent,
                                  std::span<const uint32_t> tokens, uint32_t block_size, std::string_view lora);
struct DecodedBlockAnnotation {
  EngineBlockHash hash;
  std::optional<EngineBlockHash> parent;
  std::vector<uint32_t> tokens;
  uint32_t block_size = 0;
  std::string lora;
};
// nullopt when `bytes` is not a valid annotation.
std::optional<DecodedBlockAnnotation> DecodeBlockAnnotation(std::string_view bytes);

}  // namespace kvtier
