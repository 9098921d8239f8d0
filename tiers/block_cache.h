// BlockCache: kvtier's index and tiers. It maps stored keys to blocks in the
// hbm and host pools and on disk, leases blocks for loads and stores, moves
// them between tiers (demotion hbm -> host -> disk between watermarks,
// promotion disk -> host -> hbm on load and prefetch) and evicts by
// prefix-aware LRU. A block on disk is read into a host slot before it is
// loaded; two loads of it share that one read. Past 800 lines: the class's
// contract and the state of all its sides (disk, remote, codec, policy,
// verify) are declared here, until issue 34 gives each side an object of its
// own.
//
// Rules (DESIGN.md, "Rules learned from the peers' bug trackers"):
//   - Lookup never pins; Load and Store hold leases until their copy is done.
//   - A stored block is visible only after its copy completed; a key that is
//     present or in flight is "already stored" and not copied again.
//   - A store that cannot fit without evicting leased blocks fails at once
//     with kResourceExhausted.
//   - An op whose owner is gone when its copy completes commits nothing:
//     a dead client's stores are discarded, and its leases released.
//
// Quotas (TenantQuota) never bypass the disk tier:
//   - host: a tenant at its host quota makes room by demoting its own
//     coldest host blocks as the tier itself would: a clean one goes back to
//     disk, a dirty one is written back (dropped only without a disk tier,
//     or when admission, the write budget or the writes in flight say no).
//     A store does not wait for those writes: a block being written out
//     counts as leaving, so the quota is checked against the tenant's host
//     bytes minus its bytes being written out. A tenant thus holds at most
//     its quota plus its writes in flight (disk_max_writes_in_flight blocks
//     in all), and its quota once they complete. hbm blocks demoted for a
//     tenant at its host quota make room the same way.
//   - disk: a tenant at its disk quota keeps writing; each of its disk
//     writes is followed by forgetting its oldest disk records (a per-tenant
//     DiskWriteLog in write order, stale entries skipped) until its disk
//     bytes are within the quota again, at most kDiskQuotaStepsPerWrite
//     entries per write. A record whose block is in memory or busy (read,
//     leased, carried) goes to the back of the line instead. Only records
//     written (or adopted) while the tenant has a disk quota are in its
//     line: older ones leave as the disk's regions are reclaimed.
//
// Threading: owned by one thread (the daemon's event loop): every method
// must be called there. Copies run on the backend's threads; their
// completions come back through Options::post, which must run the closure on
// the owner thread. Thread-compatible.
//
// Past 800 lines on purpose: this header is the contract of every caller
// (handlers, tests, the benches), and its options and counters document
// each knob and figure where they are declared.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/device_backend.h"
#include "common/key128.h"
#include "common/latency_histogram.h"
#include "common/op_fence.h"
#include "common/status.h"
#include "tiers/block_index.h"
#include "tiers/disk_gate.h"
#include "tiers/ghost_filter.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk_only_index.h"
#include "tiers/disk_write_log.h"
#include "tiers/namespace_table.h"
#include "tiers/remote/put_outcome.h"
#include "tiers/slot_pool.h"

namespace kvtier {

class CodecPool;
class RemoteTier;

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

class BlockCache {
 public:
  using Post = std::function<void(std::function<void()>)>;

  struct Options {
    DeviceBackend* backend = nullptr;  // REQUIRED; must outlive the cache
    Post post;                         // REQUIRED; runs a closure on the owner thread
    uint64_t hbm_bytes = 0;            // 0: no hbm tier
    int hbm_device = 0;                // the device whose memory holds it
    uint64_t host_bytes = 0;           // > 0
    TierWatermarks hbm_watermarks;
    TierWatermarks host_watermarks;
    bool prefix_aware = true;
    // Each tier's eviction order (tiers/eviction_order.h).
    PolicyKind policy = PolicyKind::kLru;
    // The most of a tier the engine's hints may keep (priority +1 and
    // next_use: EvictionOrder::Hint's keep_limit).
    double hint_share = 0.5;
    // Most blocks one eviction looks at, in its tier's order, for a block
    // without cached children before taking the first unleased one.
    uint32_t eviction_scan_limit = 1024;
    // Most blocks the background scans (hbm's demotion, host's write-back)
    // look at between two posted pumps (SchedulePump); the rest is done at
    // a later turn of the loop. A pump's scans then take about 3 ms at most.
    // Too small a budget starves write-back: on the trace replay with every
    // tier full, 8,192 let host fill with dirty blocks (0.90-0.93x LRU's
    // hit rate), 16,384 gave 0.97-0.98x, 32,768 to 131,072 0.985-0.99x.
    uint32_t background_scan_budget = 65536;
    // The disk tier (borrowed; must outlive the cache), or null. With it,
    // blocks leaving the host tier are written there instead of dropped.
    DiskTier* disk = nullptr;
    // Disk admission: a block is written to disk only after this many hits,
    // and only while the write budget (bytes per day, 0 = unlimited) has
    // room: a token bucket that holds a day's budget and refills evenly, so
    // KV offload cannot wear the flash out faster than the operator allows.
    uint32_t disk_min_hits = 0;
    // The NVMe gate (issue 19): a block is written only once it has shown
    // reuse, as well: a hit since its store, or a store again after host let
    // it go unwritten. What host let go of unwritten is remembered in a ghost
    // filter of about a byte per key, for the last 4x host's blocks of them
    // (tiers/ghost_filter.h; a few % of false positives are admitted).
    bool disk_admit_on_reuse = false;
    // The learned NVMe gate (tiers/disk_gate.h): a block that showed no
    // reuse is also written when its request's class is hit on disk at
    // least as often as all are, as learned from samples (one block in
    // disk_gate_sample_every of each class, always written).
    bool disk_admit_learned = false;
    uint32_t disk_gate_sample_every = 32;
    // A block a load read from disk stays in host only with this many hits
    // since it was written (0: always); else it goes back to the disk tier
    // once loaded, no write needed (its record serves the next hit), since
    // a host copy of a block on disk takes room in both tiers.
    uint32_t disk_promotion_min_hits = 0;
    uint64_t disk_write_budget_bytes_per_day = 0;
    // Write-through: every block stored into the host tier is also written to
    // disk at once (kept in memory, clean), so a restart finds it warm.
    // Admission and the budget do not apply to these writes.
    bool disk_write_through = false;
    // Disk writes in flight at most (write-back, write-through and flush
    // together); more wait in line, so completions never rescan a crowd.
    uint32_t disk_max_writes_in_flight = 1024;
    // Namespaces (layouts) that may hold blocks at once, on the node (at
    // most NamespaceTable::kMaxIds) and per tenant; a store of a new layout
    // past either is refused (limits.max_namespaces_per_tenant).
    uint32_t max_namespaces = NamespaceTable::kMaxIds;
    uint32_t max_namespaces_per_tenant = 256;
    // The remote tier (borrowed; must outlive the cache), or null. Loads may
    // fetch the blocks no local tier holds from it (FetchFromRemote). Blocks
    // are put there, each at most once and leased until its put ends:
    //  - kOnStore: as they reach host memory (a store into host, or an hbm
    //    block demoted to host);
    //  - kOnDemote: as they leave host memory (written back to disk or
    //    dropped). Host then keeps below its watermarks also without a disk
    //    tier, and a block leaves only once its put has ended.
    RemoteTier* remote = nullptr;
    // Told of every block's arrival in and departure from each tier
    // (borrowed; must outlive the cache), or null.
    TierListener* listener = nullptr;
    // The codec pool (borrowed; must outlive the cache), or null. With it,
    // blocks whose store asked for a codec are encoded on the pool (kept raw
    // when its queue is full or staging is spent): into host slots of their
    // coded size where the backend decodes them on load (KeepsCoded), and
    // on their way to disk (packed) or the remote tier otherwise; packed
    // records are read back coded, or decoded on the pool. Without it they
    // are kept raw, and packed records found at a restart are forgotten.
    CodecPool* codecs = nullptr;
    // Encoded blocks waiting for their host slot, disk write or remote put
    // at most (staging buffers).
    uint64_t codec_staging_bytes = 256ull << 20;
    enum class RemoteWrite { kOnStore, kOnDemote };
    RemoteWrite remote_write = RemoteWrite::kOnStore;
    // The clock the budget uses (the seam tests drive); steady_clock if unset.
    std::function<std::chrono::steady_clock::time_point()> clock = nullptr;
  };

  static Result<std::unique_ptr<BlockCache>> Create(Options options);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Tenants are small integers chosen by the caller (< 65536); their names
  // are written into disk records and map them back after a restart.
  void SetQuota(TenantId tenant, const TenantQuota& quota);
  void SetTenantName(TenantId tenant, std::string name);

  // After a restart: adopts the disk tier's recovered records as disk-resident
  // blocks (oldest coldest). Records of tenants no longer configured are
  // forgotten. Returns how many were adopted.
  uint64_t AdoptDiskRecords(std::vector<DiskRecord> records);

  // DiskTier's reclaim callback (DiskTier::ReclaimFn): forgets the block
  // whose current record is `where` (a copy in memory stays, dirty), or has
  // it carried forward when it was hit since it was written and
  // `may_carry` and the write budget allow. A carried block is moving until
  // FinishRelocation; loads of it meanwhile wait for that.
  ReclaimAnswer ReclaimFromDisk(const StoredKey& key, const DiskLocation& where, bool may_carry);
  // DiskTier's relocated callback (DiskTier::RelocatedFn).
  void FinishRelocation(const StoredKey& key, Result<DiskLocation> now);
  void SetWatermarks(TierWatermarks hbm, TierWatermarks host);

  // Counted for `tenant`, who asked.
  CacheLookup Lookup(TenantId tenant, std::span<const StoredKey> keys);

  // Loads the leading present blocks of `keys` into engine blocks
  // `block_ids` (same length). `done` runs on the owner thread with the
  // number of blocks loaded (a missing key ends the prefix; that is not an
  // error). Blocks read from host are then promoted to hbm when there is room.
  // Returns how many blocks' copies were queued, with target.event recorded
  // after them, before returning: all the hits when none had to be read from
  // disk first, else 0.
  uint32_t Load(TenantId tenant, std::span<const StoredKey> keys, std::span<const uint32_t> block_ids,
            EngineTarget target, std::weak_ptr<void> owner, OpDone done);

  // Stores engine blocks under `keys`; `parent` is the key before keys[0]
  // (for prefix-aware eviction). Keys already present or in flight are
  // skipped. Blocks that do not fit are refused: the op then completes with
  // kResourceExhausted after the blocks before them are stored. `done` runs
  // on the owner thread; if `owner` has expired by then, the copies are
  // discarded instead of committed. The copies wait for the engine's record
  // of target.event. Returns how many blocks' copies were started.
  // `hint`: the engine's retention hint for the new blocks (the ones
  // already present keep theirs), and whether the last key's block is a
  // partial one (never admitted: neither stored nor counted as already).
  uint32_t Store(TenantId tenant, std::span<const StoredKey> keys, std::span<const uint32_t> block_ids,
             std::optional<StoredKey> parent, EngineTarget target, std::weak_ptr<void> owner,
             OpDone done, const StoreHint& hint = {});

  // The engine's retention hint (EvictionOrder::Hint) for the blocks of
  // `keys` that are cached in a local tier, replacing theirs. Returns how
  // many took it; *refused (may be null): how many were hinted to be kept
  // but the tier's hint_share was spent. O(keys).
  uint32_t Hint(std::span<const StoredKey> keys, const RetentionHint& hint, uint32_t* refused = nullptr);
  // The orders' clock: milliseconds of options.clock since the cache was
  // created (wraps after 49 days; the orders compare with wrap).
  uint32_t NowMs() const;

  // Starts promoting the leading host-resident blocks of `keys` to hbm.
  // Returns how many of the leading keys are present, and how many moves
  // were queued. Counted as a lookup (lookups, hits per tier, misses).
  std::pair<uint32_t, uint32_t> Prefetch(TenantId tenant, std::span<const StoredKey> keys);

  // Leading keys some local tier holds (servable now), without counting a
  // lookup.
  uint32_t LeadingLocal(std::span<const StoredKey> keys);
  // The remote tier's part of a load: fetches the blocks of `keys` after the
  // leading local ones into host slots (as many as fit) and commits those the
  // remote tier had, as host blocks of `tenant` (a remote hit is promoted).
  // Returns the leading local count when there is nothing to fetch (no
  // remote tier, every key local, no host room); else nullopt, and `done`
  // runs on the owner thread with the leading keys held locally then.
  std::optional<uint32_t> FetchFromRemote(TenantId tenant, const Layout& layout, const CodecParams& codec,
                                          std::span<const StoredKey> keys,
                                          std::function<void(uint32_t)> done);

  // Queues a write to disk of every host block that has no disk record
  // (kvtierctl flush, and at stop), at most disk_max_writes_in_flight at a
  // time. Returns how many were queued; 0 without a disk tier. O(blocks in
  // memory) once, to list them.
  uint64_t FlushToDisk();
  // Drops the writes still waiting in line (a stop past its deadline);
  // writes in flight finish.
  void CancelFlush();
  // Disk writes in flight or waiting in line.
  uint64_t pending_disk_writes() const { return disk_writes_in_flight_ + disk_write_queue_.size(); }

  // Drops unleased, settled blocks matching `filter`. With tier = host, a
  // block that also has its disk record stays on disk. Runs in the
  // background, a bounded step per turn of the loop (memory blocks a chunk
  // of the index at a time, disk blocks a region at a time), one Evict at a
  // time in the order asked; `done` gets how many blocks went. A block that
  // is leased, moving, or stored after the walk passed its place stays.
  void Evict(EvictFilter filter, std::function<void(uint64_t)> done);
  // Evicts waiting or running.
  size_t pending_evicts() const { return evicts_.size(); }

  // Per namespace with blocks, of `owner` (O(its namespaces)), or of every
  // tenant (O(namespaces)).
  std::vector<NamespaceUsage> UsageByNamespace(std::optional<TenantId> owner) const {
    return namespaces_.Usage(owner);
  }

  // Reads back every record on disk, at most `max_inflight` at a time, and
  // checks it as a load would (header, key, XXH3): a record that fails is
  // dropped, as a load would drop it, and counted. Nothing is served from
  // these reads. It walks the disk a region at a time (bounded work per
  // step). Progress is updated on the owner thread; one verification at a
  // time (a second call returns the running one's progress).
  std::shared_ptr<const VerifyProgress> VerifyDisk(uint32_t max_inflight = 8);
  // Stops a running verification: no more reads start (those in flight
  // finish), and its progress says done.
  void CancelVerify();

  // The namespace id of a fingerprint that has blocks stored (or did, and
  // its id was not reused yet), without creating one.
  std::optional<uint32_t> FindNamespaceId(const LayoutFingerprint& fingerprint) const {
    return namespaces_.Find(fingerprint);
  }
  // Namespaces holding blocks now.
  uint32_t live_namespaces() const { return namespaces_.live(); }
  // Every block present somewhere, once per place it is present in (as
  // TierListener counts presence). Walks the whole cache: for snapshots and
  // tests, not for the request path.
  void ForEachPresent(const std::function<void(const StoredKey&, TenantId, uint32_t ns, Presence)>& fn);
  // How many blocks are present in `where` (as ForEachPresent counts them:
  // a host block that keeps its disk record is present in both).
  uint64_t present_blocks(Presence where) const { return present_[static_cast<size_t>(where)]; }

  TierUsage Usage(Tier tier) const;
  // The host tier's memory, e.g. for registering it with io_uring as fixed
  // buffers (disk reads and writes go straight to and from its slots).
  std::span<uint8_t> host_arena() const;
  uint64_t TenantUsedBytes(TenantId tenant, Tier tier) const;
  uint64_t TenantBlocks(TenantId tenant) const;
  TenantShare ShareOf(TenantId tenant) const;
  uint64_t leases() const { return index_.total_leases(); }
  uint64_t inflight_copies() const { return inflight_copies_; }
  // The node's counters: its own, and the sums of the tenants' shares.
  CacheCounters counters() const;

 private:
  // The policy learns what it can of a store's request (s3fifo, classes:
  // EvictionOrder::ArrivedTogether): the blocks before it (its parent's
  // depth) and the request's length with them. O(blocks stored).
  void ArrivedTogether(std::span<BlockEntry* const> filling, uint32_t parent_depth, uint32_t request_blocks);
  // index_.Hint, within the tier's hint_share and the owner's part of it
  // (in bytes).
  bool HintBlock(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms);
  struct TierState {
    std::unique_ptr<SlotPool> pool;  // null: tier disabled (and always for disk)
    TierWatermarks marks;
    uint64_t blocks = 0;
    uint64_t used_bytes = 0;         // block bytes of committed and filling entries
    uint64_t moving_out_bytes = 0;   // slot bytes of moves out of this tier in flight
  };

  explicit BlockCache(Options options);

  TierState* tier(Tier t) { return tiers_[static_cast<size_t>(t)].get(); }
  const TierState* tier(Tier t) const { return tiers_[static_cast<size_t>(t)].get(); }
  bool QuotaAllows(TenantId tenant, Tier t, uint64_t bytes) const;
  // What AllocateSlot may let go of to make room.
  enum class Room : uint8_t {
    kNothing,    // free room only
    kCleanOnly,  // also host blocks the tier below holds (a disk record or remote copy)
    kAny,        // also, when no clean one can go, the coldest block: lost
  };
  // A slot in tier `t` for a block of `bytes`, letting unleased blocks of
  // that tier go (prefix-aware LRU) as `room` allows; nullptr when
  // impossible. When the coldest block is of another size, an extent of that
  // size is emptied instead (EmptyExtent: dirty host blocks are written, not
  // dropped, where a disk tier is); nullptr while one drains to disk.
  uint8_t* AllocateSlot(Tier t, uint64_t bytes, Room room);
  // The eviction victim in tier `t` with the given block size (0 = any).
  // With clean_only, only blocks the tier below host holds: their disk
  // record, or without a disk tier, their remote copy. `moves_down`: the
  // victim is demoted from hbm to host, not dropped, so a parent whose
  // children in hbm are all moving down already goes as a leaf would
  // (ChildrenLeaving): nothing is orphaned, and the scan need not walk past
  // the parents of the blocks being demoted (issue 32: those scans held the
  // event loop for milliseconds a turn). Host's write-back keeps strict
  // prefix order: written back early, a parent's record is reclaimed
  // before its children's, and the replay hit 2 points less.
  BlockEntry* PickVictim(Tier t, uint64_t block_bytes, std::optional<TenantId> owner, bool clean_only = false,
                         bool moves_down = false);
  void Drop(BlockEntry* e);
  // Drops a block that lives only on disk (counted as a disk eviction); its
  // record is forgotten unless `forget` is false (a reclaim deletes it).
  void DropDiskOnly(DiskOnlyBlock* b, bool forget = true);
  // Empties an extent of another size for `bytes`. Candidates (at most
  // kExtentCandidates, from SlotPool::ExtentsToReclaim): an extent already
  // draining, the one holding the `coldest` block's slot, then those with
  // the fewest slots in use; their blocks are found through the pool's slot
  // owners (no LRU walk: bounded by the candidates' slots). An extent with
  // a block that cannot go now (leased, filling, moving, a retired slot or a
  // move's destination) is skipped. The chosen one's blocks go: clean ones
  // back to disk; dirty ones, with a disk tier, written back (the extent
  // drains: SlotPool::Drain) — without one, dropped.
  enum class ExtentReclaim : uint8_t {
    kRoom,      // `bytes` fits now
    kDraining,  // an extent is being emptied for it: try again shortly
    kBusy,      // no candidate could go now
  };
  // `clean_only` (without a disk tier): an extent holding a block the
  // cluster does not is not emptied.
  ExtentReclaim EmptyExtent(Tier t, uint64_t bytes, const uint8_t* coldest, bool clean_only = false);
  // A host block that still has its disk record goes back to the disk tier,
  // no write needed. Returns whether it did.
  bool BackToDisk(BlockEntry* e);
  void Touch(BlockEntry* e);
  void Charge(BlockEntry* e, int sign);
  // The only ways a block's presence changes (each tells the listener):
  // ready to serve from its tier; moved to another tier (index and
  // presence); its disk record gained or lost.
  void MakeReady(BlockEntry* e);
  void MoveToTier(BlockEntry* e, Tier to);
  void SetOnDisk(BlockEntry* e, bool on_disk);
  // The cluster holds it (a put answered, or a read from it) or this node
  // forgets that it does.
  void SetRemotePresent(BlockEntry* e, bool present);
  // Takes `e` out of the index, ending its remote presence first.
  void Erase(BlockEntry* e);
  void Tell(bool present, const BlockEntry* e, Presence where) {
    CountPresent(where, present);
    if (options_.listener == nullptr) return;
    if (present) {
      options_.listener->OnBlockPresent(e->key, e->owner, e->ns, where);
    } else {
      options_.listener->OnBlockGone(e->key, e->owner, e->ns, where);
    }
  }
  void Tell(bool present, const BlockEntry* e, Tier t) { Tell(present, e, PresenceOf(t)); }
  void CountPresent(Presence where, bool present) {
    uint64_t& n = present_[static_cast<size_t>(where)];
    n = present ? n + 1 : n - 1;
  }
  void Charge(const DiskOnlyBlock& b, int sign);
  void Charge(Tier t, TenantId owner, uint32_t ns, uint64_t bytes, int sign);
  // `tenant`'s share, created on first use.
  TenantShare& Counted(TenantId tenant);
  // One lookup of `num_keys` keys whose leading hits were in `hit_tiers`.
  void CountLookup(TenantId tenant, std::span<const Tier> hit_tiers, size_t num_keys);
  void CountEviction(Tier t, TenantId owner);
  // A new entry for `key` (child of `parent`) whose bytes are on their way
  // into `slot` of tier `t`: filling, leased for `tenant`, charged.
  // `coded_bytes`: the slot is of that size, for the block coded by its copy.
  BlockEntry* InsertFilling(const StoredKey& key, const StoredKey* parent, Tier t, uint8_t* slot, uint64_t bytes,
                            uint32_t ns, TenantId tenant, uint64_t coded_bytes = 0);
  // A store on its way: its blocks (filling, leased, in copy order), their
  // engine blocks, and what to answer.
  struct StoreJob {
    TenantId tenant = 0;
    uint64_t bytes = 0;  // per block
    std::weak_ptr<void> owner = {};
    OpDone done = {};
    std::vector<BlockEntry*> filling = {};
    std::vector<uint32_t> block_ids = {};  // filling's engine blocks
    EngineTarget target = {};
    Status status = Status::Ok();  // why the store stopped before its last key, if it did
    uint32_t already = 0;
  };
  // A store's copy is done: its blocks are ready (or dropped), and it is
  // answered; blocks the copy did not code go through RegatherRaw first.
  void FinishStore(const std::shared_ptr<StoreJob>& job, CopyResult result);
  // Gathers a store's blocks that its copy did not code again as they are,
  // into raw host slots, then FinishStore. Returns true (it took over).
  bool RegatherRaw(const std::shared_ptr<StoreJob>& job, CopyResult result);
  // The coded size of namespace `ns`'s host slots when the backend codes its
  // stores on the way (EncodesOnStore) and that takes a smaller slot; else 0.
  uint64_t CodedOnStore(uint32_t ns, uint64_t bytes) const;
  // A lease for `tenant`'s load or store (counted as its leases). Releasing
  // the last one frees a retired slot.
  void Lease(BlockEntry* e, TenantId tenant);
  void Unlease(BlockEntry* e, TenantId tenant);
  // A block only on disk is kept in disk_only_ (40 bytes), and becomes a
  // BlockEntry while it is read, leased or in memory.
  BlockEntry* Materialize(const StoredKey& key);
  void Dematerialize(BlockEntry* e);
  // Whether lookups, loads and prefetches may find `e`: it is ready and,
  // when its tier is disk, its record is still there or a read (or carry)
  // of it is in flight. A disk block whose record went with a reclaim while
  // a load held it stays only for that load (it may still read a retired
  // host slot) and is a miss for everyone else until its last lease erases
  // it: a read of its old location would find whatever the region holds now.
  static bool Servable(const BlockEntry* e) {
    return e->state == EntryState::kReady && (e->tier != Tier::kDisk || e->on_disk || e->moving);
  }
  // Whether host blocks are put to the remote tier as they leave host.
  bool RemoteWriteBack() const {
    return options_.remote != nullptr && options_.remote_write == Options::RemoteWrite::kOnDemote;
  }
  // Whether `policy` wants host block `e` put to the remote tier (it is
  // not there, nor on its way, nor refused); and whether it is put now
  // (puts are not pausing after a failure).
  bool WantsRemotePut(const BlockEntry* e, Options::RemoteWrite policy) const;
  bool PutsToRemote(const BlockEntry* e, Options::RemoteWrite policy) const;
  // Write-through (write: store): puts host block `e` now, or once the
  // pause after a failed put is over (RetryRemotePut, remote_retries_).
  void PutOnStore(BlockEntry* e);
  void RetryRemotePut(const StoredKey& key);
  // Queues a put of host block `e` to the remote tier: leased for its owner
  // until the put ends, and on_remote once it landed. A block
  // `leaving` host counts as moving out of it meanwhile (write-back stops
  // at the low watermark without waiting for the put).
  void QueueRemotePut(BlockEntry* e, bool leaving);
  // Starts the queued puts, one batch per namespace (after each
  // PumpDiskWrites, and in MaybeDemote), and write-through retries once a
  // pause is over.
  void FlushRemotePuts();
  // Whether remote puts pause after a failure.
  bool RemoteBackingOff() const;
  // Whether puts hold less than their share of host (kRemotePutShareOfHost).
  bool RemotePutRoom() const;
  // A put's end: each block on_remote where it landed, refused for good,
  // or to try again after a pause.
  void FinishRemotePut(const std::vector<std::pair<BlockEntry*, bool>>& batch,
                       const std::vector<RemotePutOutcome>& outcomes);
  // A put's blocks that asked for a codec are encoded on the codec pool
  // first, then sent (SendRemotePut); false (nothing started) when there is
  // nothing to encode, or the pool or staging is full (counted).
  struct RemoteEncoding;
  bool StartRemoteEncode(uint32_t ns, const std::vector<std::pair<BlockEntry*, bool>>& batch);
  void SendRemotePut(uint32_t ns, std::vector<std::pair<BlockEntry*, bool>> batch,
                     std::shared_ptr<RemoteEncoding> encoding);
  // Returns DeviceBackend::Submit's answer: whether the copies (and their
  // signal event) were queued.
  bool SubmitCopy(CopyBatch batch, std::function<void(CopyResult)> on_done);
  // Background work after anything changed: demote hbm above its watermark,
  // and keep disk writes going (PumpDiskWrites).
  void MaybeDemote();
  // Starts queued disk writes, then write-back of host above its high
  // watermark down to its low one, while fewer than
  // disk_max_writes_in_flight are in flight and write-back is not backing
  // off after a failure. Bounded work per call (it posts itself to go on).
  void PumpDiskWrites();
  // Puts a write of `key` in line (write-through, flush).
  void QueueDiskWrite(const StoredKey& key, bool keep_in_memory);
  // MaybeDemote (and so PumpDiskWrites) on a later turn of the loop (once,
  // however often asked).
  void SchedulePump();
  // Moves `e` to `dst` in tier `to` in the background.
  void StartMove(BlockEntry* e, Tier to, uint8_t* dst);
  // host -> disk (write-back) and disk -> host (before a load, or prefetch).
  // keep_in_memory: write-through, the block stays where it is and becomes
  // clean; otherwise it moves to the disk tier.
  // `budgeted`: bytes taken from the write budget, given back if it fails.
  void StartDiskWrite(BlockEntry* e, bool keep_in_memory, uint64_t budgeted = 0);
  // `payload_bytes`: the record's (a codec's output when where->packed).
  void FinishDiskWrite(const StoredKey& key, uint64_t stride, bool keep_in_memory, uint64_t budgeted,
                       uint64_t payload_bytes, Result<DiskLocation> where);
  // The header of a disk record of what `e`'s slot holds.
  RecordHeader DiskHeader(const BlockEntry* e);
  // The header of a disk record of `e` with this payload: its checksum, and
  // whether it is coded by its namespace's codec (a coded host slot, or a
  // packed record being carried forward).
  RecordHeader RecordHeaderOf(const BlockEntry* e, uint64_t payload_bytes, uint64_t checksum, bool coded);
  // Where the disk-only block's record is, for DiskTier::LocationOf.
  static DiskTier::RecordRef RecordRefOf(const DiskOnlyBlock& b);
  // Encodes `e` on the codec pool and appends it packed, or raw when the
  // codec saves too little; `done` as Append's, with the payload's bytes.
  // False (nothing started) when the pool or staging is full.
  using DiskWriteDone = std::function<void(uint64_t payload_bytes, Result<DiskLocation>)>;
  bool StartPackedWrite(BlockEntry* e, const CodecParams& codec, DiskWriteDone done);
  // A block written coded (to disk or the remote tier), in the counters.
  void CountEncoded(uint64_t raw_bytes, uint64_t stored_bytes);
  // Decodes a packed record read into `staging` into host slot `dst` on the
  // codec pool, then FinishDiskRead.
  void DecodeDiskRead(BlockEntry* e, std::shared_ptr<uint8_t> staging, uint8_t* dst);
  // What `e`'s memory slot holds (and was allocated for): its coded bytes
  // or the block.
  static uint64_t SlotBytes(const BlockEntry* e) { return e->coded_bytes != 0 ? e->coded_bytes : e->block_bytes; }
  // The bytes `e` is charged in its tier: its record's payload on disk.
  static uint64_t ChargedBytes(const BlockEntry* e) {
    return e->tier == Tier::kDisk ? e->disk_payload_bytes : SlotBytes(e);
  }
  // Gives up `e`'s memory slot (the block left its tier): freed now, or kept
  // as its retired slot until the loads that leased it let go.
  void RetireSlot(BlockEntry* e, Tier from, uint8_t* old, uint64_t old_bytes);
  // Coded host blocks (issue 18, docs/compression.md): whether namespace
  // `ns`'s blocks are kept coded in host (a codec pool, and a backend that
  // decodes them on load).
  bool KeepsCoded(uint32_t ns) const;
  // Encodes ready host block `e` (stored raw, its store asked for a codec)
  // on the codec pool and moves it into a host slot of its coded size; kept
  // raw when the pool is busy, the codec saves too little or no slot of
  // that size can be had (each counted). A block being compacted is moving.
  void MaybeCompact(BlockEntry* e);
  void FinishHostEncode(const StoredKey& key, std::shared_ptr<uint8_t> staging, std::optional<size_t> n);
  void FinishCompaction(const StoredKey& key, uint8_t* dst, uint64_t coded_bytes, CopyResult result);
  // Ends `e`'s compaction (it stays raw, or went coded): the disk write
  // asked for meanwhile goes in line.
  void EndCompaction(BlockEntry* e);
  // Starts compactions that waited for their share of the tier.
  void CompactDeferred();
  // A staging buffer of `bytes` (4 KiB aligned) counted against
  // codec_staging_bytes until its last holder lets go; null when that is
  // spent.
  std::shared_ptr<uint8_t> TakeStaging(uint64_t bytes);
  // Whether host block `e` is ready to be written to disk: only in memory,
  // settled, checksummed, and not given up on.
  static bool DirtyInHost(const BlockEntry* e);
  // The namespace of `layout`'s blocks stored under `codec`, and the codec
  // its packed records use.
  static LayoutFingerprint NamespaceOf(const Layout& layout, const CodecParams& codec);
  static NamespaceFormat FormatFor(const Layout& layout, const CodecParams& codec);
  // The host slot `e`'s disk read needs: the record's payload, kept coded
  // (KeepsCoded), or the block.
  uint64_t ReadSlotBytes(const BlockEntry* e) const;
  // Starts reading `e` into a host slot; `then(ok)` runs when it is in host
  // (false: the read failed and the block was dropped, or host had no room
  // for it). Reads of one block are shared.
  void PromoteFromDisk(BlockEntry* e, std::function<void(bool)> then);
  // The read of `e` for its disk_waiters_: it starts now, waits in
  // reads_waiting_for_room_ while host room is coming, or fails (its
  // waiters miss it).
  void ReadIntoHost(BlockEntry* e);
  // A host slot for `e`'s read: free room or a clean block's, never a dirty
  // block's (AllocateSlot, Room::kCleanOnly); nullptr without its record.
  uint8_t* SlotForDiskRead(const BlockEntry* e);
  // Whether a read of `e` that found no slot should wait: it has its record
  // and host blocks are leaving (MaybeDemote runs as each has left).
  bool HostRoomIsComing(const BlockEntry* e) const;
  // Starts the reads waiting for room that now find it, in order; those that
  // cannot wait any longer fail. Called by MaybeDemote.
  void RetryReadsWaitingForRoom();
  // Ends a read that cannot start (counted in disk_reads_without_room when
  // the record is there): its waiters miss the block (posted), and an entry
  // nobody holds goes back to the disk-only table.
  void FailDiskRead(BlockEntry* e);
  // Reads `e` (on disk, not moving) into host slot `dst`.
  void StartDiskRead(BlockEntry* e, uint8_t* dst);
  // Whether a failed disk read says nothing of its record (cancelled at a
  // stop, EAGAIN, ENOMEM): the record is kept.
  static bool TransientReadError(const Status& st);
  // `coded_bytes`: the slot holds the record's payload as it was coded.
  void FinishDiskRead(const StoredKey& key, uint8_t* dst, Status status, uint64_t checksum,
                      uint64_t coded_bytes = 0);
  // Loads `leased` (all resident in memory tiers) into the engine. Returns
  // whether copies were queued (with target.event).
  bool CopyToEngine(TenantId tenant, std::vector<BlockEntry*> leased,
                    std::vector<uint32_t> block_ids, EngineTarget target, OpDone done);
  // Starts a host -> hbm move of `e` if hbm has a free slot below its high
  // watermark and the owner's quota allows; returns whether it started.
  bool MaybePromote(BlockEntry* e);
  void FinishMove(const StoredKey& key, Tier to, uint8_t* dst, CopyResult result);
  bool AboveHigh(Tier t) const;
  // Takes `bytes` from the disk write budget; false when it is spent.
  bool TakeWriteBudget(uint64_t bytes);
  void RefundWriteBudget(uint64_t bytes);
  // Why a store found no slot: what holds the blocks that could go.
  std::string NoRoomReason() const;
  // Host-quota room for `bytes` of `tenant`, demoting its own coldest host
  // blocks (DemoteFromHost; dropped without a disk tier). False when its
  // quota is still full (of leased, moving or filling blocks).
  bool MakeHostQuotaRoom(TenantId tenant, uint64_t bytes);
  // Sends unleased, settled host block `v` on its way down: back to disk when
  // it still has its record, else written back; dropped when admission or
  // the write budget says no. When no write may start now (writes in flight
  // at the cap, or backing off after a failure) it is dropped if `may_drop`,
  // else it stays for a later try.
  void DemoteFromHost(BlockEntry* v, bool may_drop = true);
  // Whether a write-back may start now (writes in flight under the cap, no
  // back-off after a failure).
  bool DiskWriteMayStart() const;
  // The disk quota: its line of records; forgetting the oldest while over.
  void LogDiskRecord(TenantId owner, const StoredKey& key, const DiskLocation& where);
  // Looks at most `max_steps` entries; never forgets `newest`'s record.
  void EnforceDiskQuota(TenantId owner, uint32_t max_steps, const StoredKey* newest);
  bool IsCurrentRecord(const DiskWriteLog::Record& r);
  bool AboveLow(Tier t) const;
  // A walk over the disk tier's records a region at a time (Evict,
  // VerifyDisk): each listing is O(records in the region).
  struct DiskWalk {
    uint32_t device = 0;
    uint32_t region = 0;
    std::vector<DiskTier::RegionRecord> records;
    size_t next = 0;
    // The record the walk is at, listing the next region when this one is
    // done while `listings` last (each takes one); nullptr at the end, or
    // when out of listings.
    const DiskTier::RegionRecord* At(const DiskTier& disk, uint32_t& listings);
    bool Finished(const DiskTier& disk) const {
      return device >= disk.num_devices() && next == records.size();
    }
    void Stop() {
      records.clear();
      next = 0;
      device = UINT32_MAX;
    }
  };
  // An Evict: its filter, where its walk is, what it dropped so far.
  struct Eviction {
    EvictFilter filter;
    std::optional<uint32_t> ns;  // the filter's layout's id, pinned until the end
    std::function<void(uint64_t)> done;
    size_t chunk = 0;  // the memory walk's next chunk of the index
    DiskWalk disk;
    uint64_t evicted = 0;
  };
  // Evict's steps: the running one goes on for a bounded step.
  void PumpEvict();
  bool EvictMatches(const Eviction& job, TenantId owner, uint32_t ns) const;
  // VerifyDisk's steps: keep reads in flight; judge one read.
  struct Verification;
  void PumpVerify();
  void FinishVerifyRead(const std::shared_ptr<Verification>& held, size_t buffer,
                        const StoredKey& key, const DiskLocation& where, Status status);

  Options options_;
  BlockIndex index_;
  GhostFilter let_go_unwritten_;  // disk_admit_on_reuse and disk_admit_learned
  DiskGate gate_;                 // disk_admit_learned
  DiskOnlyIndex disk_only_;
  std::unique_ptr<Arena> arenas_[kNumTiers];
  std::unique_ptr<TierState> tiers_[kNumTiers];
  std::vector<TenantQuota> quotas_;
  // What the quotas need per tenant (by TenantId, created on first use).
  struct QuotaState {
    uint64_t host_bytes_leaving = 0;  // its host blocks being written out to disk
    DiskWriteLog disk_log;            // its disk records, while it has a disk quota
  };
  std::vector<QuotaState> quota_state_;
  QuotaState& QuotaStateOf(TenantId tenant);
  std::vector<TenantShare> tenant_shares_;  // by TenantId
  NamespaceTable namespaces_;
  std::vector<std::string> tenant_names_;
  uint64_t named_tenants_ = 0;  // of tenant_names_: the tenants a hint share is split among
  // Loads waiting for a block's disk read, by key.
  std::unordered_map<StoredKey, std::vector<std::function<void(bool)>>, Key128Hash> disk_waiters_;
  // Disk reads waiting for a host slot while host's blocks leave, in order:
  // a read never drops a block that is not on disk yet (ReadIntoHost). Their
  // entries are moving (parked) until they start.
  std::deque<StoredKey> reads_waiting_for_room_;
  uint64_t inflight_copies_ = 0;
  // QueueRemotePut's blocks (leased), and whether each is leaving host.
  std::vector<std::pair<BlockEntry*, bool>> remote_puts_;
  // After a put batch that did not reach the cluster, puts wait until then
  // (doubling per failure in a row); write-back without a disk tier waits
  // too, so that no block leaves host unput while the cluster is away.
  std::chrono::steady_clock::time_point remote_backoff_until_{};
  uint32_t remote_failures_in_a_row_ = 0;
  // Write-through puts that did not reach the cluster, to try again once
  // the pause is over (at most kMaxRemoteRetries; stale keys are skipped).
  std::deque<StoredKey> remote_retries_;
  uint64_t remote_put_bytes_ = 0;  // host slot bytes leased by puts queued or in flight
  // Disk writes waiting for a place in flight: key, and whether the block
  // stays in memory (write-through) or moves to disk (flush).
  struct QueuedDiskWrite {
    StoredKey key;
    bool keep_in_memory = false;
  };
  std::deque<QueuedDiskWrite> disk_write_queue_;
  uint32_t disk_writes_in_flight_ = 0;
  bool host_demoting_ = false;  // host passed its high watermark and is not below its low one yet
  bool hbm_demotion_deferred_ = false;  // hbm's demotion used its scan budget and goes on at the next pump
  bool pump_posted_ = false;
  // The background scans (hbm's demotion, host's write-back) look at no
  // more than options_.background_scan_budget blocks between two posted
  // pumps (SchedulePump) and leave the rest to the next: a burst of
  // completions (a group commit ends hundreds of disk writes, each asking
  // for background work) held the event loop for 5-15 ms with a scan each
  // (issue 32). Only their own scans count: a request's scans for room
  // (AllocateSlot) are the request's work.
  uint64_t background_scanned_ = 0;
  uint64_t scan_base_ = 0;  // background_scanned_ as of the last pump
  // Whether the background scans may go on; if not, posts the pump (once)
  // to go on later, and counts it.
  bool ScanBudgetLeft();
  // hbm's demotion victim (moves_down), or host's write-back victim, its
  // scan counted in background_scanned_.
  BlockEntry* PickBackgroundVictim(Tier t);
  bool flushing_ = false;  // a FlushToDisk's writes are still in line
  // After a failed disk write, write-back waits until then (doubling per
  // failure in a row), so a failing device costs no CPU.
  std::chrono::steady_clock::time_point disk_backoff_until_{};
  uint32_t disk_failures_in_a_row_ = 0;
  double budget_tokens_ = 0;  // bytes that may be written now
  std::chrono::steady_clock::time_point budget_refilled_{};
  std::chrono::steady_clock::time_point created_{};  // NowMs's origin
  CacheCounters counters_;  // its RequestCounters stay 0: they are kept per tenant
  uint64_t present_[4] = {};  // blocks present per Presence (present_blocks)
  uint64_t codec_staging_bytes_ = 0;  // encoded blocks' staging buffers held now
  // Raw host slots of blocks being compacted (MaybeCompact): at most 1 /
  // kMaxCompactingShare of the host tier.
  static constexpr uint64_t kMaxCompactingShare = 8;
  uint64_t compacting_bytes_ = 0;
  // Blocks whose compaction waits for that share (stale keys are skipped),
  // at most kMaxCompactLater; a few start as each compaction ends.
  static constexpr size_t kMaxCompactLater = 4096;
  std::deque<StoredKey> compact_later_;
  std::shared_ptr<Verification> verification_;  // the running or last VerifyDisk
  std::deque<std::unique_ptr<Eviction>> evicts_;  // the front one runs (a step posted)
  // Lets completions that arrive after destruction (none should: the daemon
  // drains first) see that the cache is gone.
  std::shared_ptr<BlockCache*> self_;
};

}  // namespace kvtier
