// The words of BlockCache's contract that its callers use (handlers,
// metrics, KV events, tests): where a block is present, what a store or a
// load answers, what a tenant's share and the node's counters hold, the
// filters and progress of operator walks. Declared apart from the class so
// that a reader finds BlockCache's methods in block_cache.h (its sides are
// in block_cache_*.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/device_backend.h"
#include "common/key128.h"
#include "common/latency_histogram.h"
#include "common/op_fence.h"
#include "common/status.h"
#include "tiers/block_index.h"

namespace kvtier {

// Where TierListener says a block is: a tier of this node (the first three
// are Tier's), or the remote tier: the cluster holds a copy that this node
// put there (a whole batch answered OK) or read from it.
enum class Presence : uint8_t { kHbm = 0, kHost = 1, kDisk = 2, kRemote = 3 };
inline Presence PresenceOf(Tier t) { return static_cast<Presence>(t); }
const char* PresenceName(Presence p);  // "hbm", "host", "disk", "remote"

// Told, on the event loop, as a block becomes present somewhere (servable
// from there) and as it leaves: what KV events publish. A block may be
// present in several places at once (a host block that still has its disk
// record and was put to the cluster). Remote presence ends when this node
// forgets the block (the cluster may have let it go before: a miss then).
// Blocks present before the listener was set are not announced:
// BlockCache::ForEachPresent gives them (a snapshot).
class TierListener {
 public:
  virtual void OnBlockPresent(const StoredKey& key, TenantId owner, uint32_t ns, Presence where) = 0;
  virtual void OnBlockGone(const StoredKey& key, TenantId owner, uint32_t ns, Presence where) = 0;
  // What to keep with the block's disk record as it is written (at most
  // RecordHeader::kMaxAnnotationBytes; empty: nothing): a restart gives it
  // back in DiskRecord::header.annotation.
  virtual std::string DiskAnnotation(const StoredKey& key, TenantId owner) = 0;

 protected:
  ~TierListener() = default;
};

struct TierWatermarks {
  double high = 0.90;
  double low = 0.80;
};

struct TenantQuota {
  // Per tier; unset = only the tier's capacity.
  std::optional<uint64_t> bytes[kNumTiers];
};

// Where engine blocks are copied from or to.
struct EngineTarget {
  std::shared_ptr<const KvCacheLayout> layout;
  std::shared_ptr<ClientMapping> mapping;
  // An event of the mapping (cuda), or -1. Loads record it after their copy;
  // stores wait for the engine's record of it before theirs (CopyBatch).
  int32_t event = -1;
  // How its namespace's blocks are stored below host (issue 18): kNone;
  // kLossless; or kFp8 (LOSSY, fp16 and bf16 only), whose blocks form a
  // namespace of their own (CodedFingerprint). REQUIRES: CheckCodec passes
  // for the layout's dtype (the daemon checks it at registration).
  CodecParams codec = {.kind = CodecKind::kNone, .dtype = DType::kBf16, .group_elems = 0};
  // The op's fence (common/op_fence.h): its copies touch the engine's memory
  // only while the client has not cancelled it. Empty: none.
  OpFence fence = {};
  // A load's copies layer by layer, each layer reported through the fence
  // (CopyBatch::by_layer).
  bool by_layer = false;
  // A store by layer's: the layers the engine has written so far
  // (CopyBatch::gate). REQUIRES: the backend GatesStoreLayers.
  std::shared_ptr<LayerGate> gate = nullptr;
};

// What a store's engine said of its blocks (issue 19, docs/policy.md).
struct StoreHint {
  RetentionHint retention;
  bool last_partial = false;  // the last key's block covers part of a block's tokens
};

struct OpOutcome {
  Status status = Status::Ok();
  uint32_t blocks = 0;   // blocks loaded or newly stored
  uint32_t already = 0;  // Store: keys already present or in flight
  // A load's: the slowest tier its blocks were read from (kDisk where one
  // came from disk; kHbm only where every block was in hbm).
  Tier source = Tier::kHost;
};
using OpDone = std::function<void(OpOutcome)>;

struct CacheLookup {
  uint32_t hits = 0;        // leading keys present and ready
  std::vector<Tier> tiers;  // tier of each hit
};

// What callers' requests did and what happened to their blocks: kept per
// tenant (TenantShare); the node's figures are the tenants' sums.
struct RequestCounters {
  uint64_t lookups = 0;
  uint64_t lookup_keys = 0;
  uint64_t hits[kNumTiers] = {};
  uint64_t misses = 0;
  uint64_t stores = 0;            // blocks newly stored
  uint64_t already_stored = 0;
  uint64_t store_rejected = 0;    // blocks refused with kResourceExhausted
  uint64_t stores_discarded = 0;  // copies finished after their client died
  uint64_t loads = 0;             // blocks loaded into engines
  uint64_t evictions[kNumTiers] = {};  // blocks dropped from a tier
  uint64_t bytes_engine_to_cache = 0;
  uint64_t bytes_cache_to_engine = 0;

  void Add(const RequestCounters& o);
};

// Counters since start; read on the owner thread.
struct CacheCounters : RequestCounters {
  uint64_t promotions = 0;      // host -> hbm
  uint64_t demotions = 0;       // hbm -> host
  uint64_t disk_promotions = 0; // disk -> host
  uint64_t disk_demotions = 0;  // host -> disk
  uint64_t disk_read_failures = 0;   // records that failed their checks or I/O: dropped, never served
  uint64_t disk_write_failures = 0;
  uint64_t disk_not_admitted = 0;    // demotions dropped by the admission policy
  uint64_t disk_admitted_on_return = 0;  // reuse gate: written as stored again after they were let go
  uint64_t disk_returns = 0;         // host blocks still on disk sent back without a write
  uint64_t disk_hits_not_promoted =
      0;  // blocks read from disk for a load, not hot enough to stay in host
  uint64_t disk_over_budget = 0;     // demotions dropped because the write budget was spent
  uint64_t disk_reinsertions =
      0;  // hot blocks carried forward (read up to host) by a region's reclaim
  uint64_t disk_reinsertions_dropped =
      0;  // hot blocks a reclaim dropped: carry budget spent, or no host room
  uint64_t disk_writes_given_up = 0;  // blocks whose disk writes kept failing: no more tries
  uint64_t disk_write_backoffs = 0;   // pauses of write-back after a failed write
  // Reads from disk that found host without free room or a clean block:
  // they waited for host's blocks leaving, or (none leaving) missed.
  uint64_t disk_reads_waited_for_room = 0;
  uint64_t disk_reads_without_room = 0;
  // Loads' reads (disk or cluster) that their owner's host quota had no
  // room for: served from free host room (reads_past_quota), and sent back
  // below host once the load was over (reads_not_kept).
  uint64_t reads_past_quota = 0;
  uint64_t reads_not_kept = 0;
  // Reads that found their block's record gone before they could start: a
  // region's reclaim took it while the read waited for host room (a load
  // holding a block does not keep its record).
  uint64_t disk_reads_record_gone = 0;
  // Dirty host blocks let go of unwritten because write-back had not reached
  // them (the disk fell behind: a slow or contended device), the coldest
  // first: room for a store, or a demotion that could not wait.
  uint64_t disk_writes_missed = 0;
  uint64_t prefix_fallbacks = 0;  // evictions that had to take a block with cached children
  // Blocks victim scans looked at, and the times the background scans
  // (hbm's demotion, host's write-back) used their budget between two
  // pumps and left the rest to a later turn of the loop (issue 32).
  uint64_t victim_scan_blocks = 0;
  uint64_t scan_budget_deferrals = 0;
  // Loads that came up short of the keys they named (issue 32: an engine
  // loads what its lookup found, and recomputes the rest): the first key
  // missing was gone (evicted since the lookup, a race with other clients'
  // stores), or present but not servable (being stored, or dropped from
  // disk), or a block on disk could not be read up to host (a failed read,
  // or no host room).
  uint64_t loads_short_gone = 0;
  uint64_t loads_short_not_ready = 0;
  uint64_t loads_short_disk = 0;
  // The engine's retention hints (issue 19): blocks hinted (by a store or
  // Hint), those of them hinted to be kept past the tier's hint_share (kept
  // as unhinted), and partial tail blocks stores marked (never admitted).
  uint64_t hinted = 0;
  uint64_t hints_refused = 0;
  uint64_t partial_not_admitted = 0;
  // Exclusive caching (issue 47): blocks stored or loaded while their engine
  // keeps a copy (evicted first), and blocks whose engine let go of its copy since
  // (back among the policy's, the only copy).
  uint64_t engine_held = 0;
  uint64_t engine_dropped = 0;
  uint64_t extents_reclaimed = 0;  // slot extents emptied for another block size
  // Slots (blocks) looked at to empty extents for another block size: a few
  // extents' worth per try, however many blocks the tier holds.
  uint64_t extent_slots_examined = 0;
  // A tenant's oldest disk blocks forgotten to keep it within its disk quota
  // (also counted in its disk evictions).
  uint64_t disk_quota_evictions = 0;
  // Compression (issue 18), of blocks whose store asked for a codec:
  uint64_t codec_encoded = 0;       // encoded for a host slot, a disk record or a remote value
  // kept raw: saved under 1/64, a NaN or Inf (fp8), or (host) no smaller slot
  uint64_t codec_not_worth_it = 0;
  uint64_t codec_pool_busy = 0;     // kept raw: the codec pool's queue (or staging) was full
  uint64_t codec_decoded = 0;       // packed records read back and decoded
  uint64_t codec_decode_failures = 0;  // packed records that did not decode: dropped, never served
  uint64_t codec_raw_bytes = 0;     // of the blocks encoded: their own bytes,
  uint64_t codec_stored_bytes = 0;  // and what the codec made of them
  uint64_t codec_host_coded = 0;    // host blocks moved into a slot of their coded size
  uint64_t codec_host_no_room = 0;  // encoded for host, but no slot of that size: kept raw
  uint64_t bytes_hbm_to_host = 0;
  uint64_t bytes_host_to_hbm = 0;
  uint64_t bytes_host_to_disk = 0;
  uint64_t bytes_disk_to_host = 0;
  uint64_t remote_promotions = 0;  // blocks fetched from the remote tier into host
  uint64_t remote_writes = 0;      // blocks put to the remote tier
  // Puts of blocks that did not reach the cluster: tried again after a
  // pause that doubles per failed batch in a row (remote_write_backoffs).
  uint64_t remote_write_failures = 0;
  uint64_t remote_write_backoffs = 0;
  // Blocks the cluster refused (too large, out of memory, no permission):
  // never put again.
  uint64_t remote_writes_refused = 0;
  // Write-through (write: store) puts waiting to be tried again, given up
  // because too many waited.
  uint64_t remote_retries_dropped = 0;
  // Host blocks dropped before the kOnDemote write-back put them (host full,
  // a tenant's quota or a size change needed their slots at once).
  uint64_t remote_demotions_missed = 0;
  // From the disk tier's Read/Append to its answer (durable, for a write).
  LatencyHistogram disk_read_latency;
  LatencyHistogram disk_write_latency;
};

// One tenant's share (Stats for a tenant that is no admin): what it holds,
// what its own calls did and what happened to its own blocks (evictions are
// of its blocks), and the leases its loads and stores hold now.
struct TenantShare : RequestCounters {
  uint64_t used_bytes[kNumTiers] = {};  // of committed and filling blocks
  uint64_t blocks[kNumTiers] = {};
  uint64_t leases = 0;  // held now by its loads and stores
};

struct TierUsage {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t blocks = 0;
};

// Which blocks an Evict drops (nullopt = any).
struct EvictFilter {
  std::optional<std::vector<TenantId>> owners;
  std::optional<LayoutFingerprint> layout;
  std::optional<Tier> tier;
};

// A disk verification's progress (BlockCache::VerifyDisk).
struct VerifyProgress {
  uint64_t total = 0;    // records to check
  uint64_t checked = 0;  // read back and checked so far
  uint64_t bad = 0;      // failed their checks (or their read): dropped
  uint64_t skipped = 0;  // gone or moved before their turn
  bool done = false;
};

}  // namespace kvtier
