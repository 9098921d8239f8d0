// BlockCache: kvtier's index and tiers. It maps stored keys to blocks in the
// hbm and host pools and on disk, leases blocks for loads and stores, moves
// them between tiers (demotion hbm -> host -> disk between watermarks,
// promotion disk -> host -> hbm on load and prefetch) and evicts by
// prefix-aware LRU. A block on disk is read into a host slot before it is
// loaded; two loads of it share that one read.
//
// Its parts (issue 34, docs/architecture.md): this class is the contract of
// every caller and the core every side shares (the index, the tiers' pools
// and accounting, leases, presence, the data path of stores and loads).
// Each side is an object that owns its state, in block_cache_*.h:
//   - RoomGate (room): the only way to a slot in a memory tier; a read never
//     drops a block that exists nowhere else.
//   - CachePolicy (policy): quotas, tenant names, arrivals and hints.
//   - CacheCodec (codec): coded host blocks, packed writes, staging.
//   - CacheRemote (remote): fetches from the cluster and puts to it.
//   - CacheDisk (disk): write-back, reads back up, the budget and gates,
//     recovery and reclaim.
//   - CacheWalks (walks): Evict and VerifyDisk.
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
//     tenant at its host quota make room the same way. A fetch from the
//     remote tier lets only the tenant's blocks held below host go: a read
//     never drops a block that exists nowhere else (RoomGate).
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
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/device_backend.h"
#include "common/key128.h"
#include "common/status.h"
#include "tiers/block_index.h"
#include "tiers/cache_types.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk_only_index.h"
#include "tiers/namespace_table.h"
#include "tiers/slot_pool.h"

namespace kvtier {

class CodecPool;
class RemoteTier;
class RoomGate;
class CachePolicy;
class CacheCodec;
class CacheRemote;
class CacheDisk;
class CacheWalks;

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
  // disk first, else 0. `engine_holds`: the engine keeps the blocks in its
  // own cache (Load.engine_holds): after this use they go among the blocks
  // engines hold (EvictionOrder::TouchHeld).
  uint32_t Load(TenantId tenant, std::span<const StoredKey> keys, std::span<const uint32_t> block_ids,
            EngineTarget target, std::weak_ptr<void> owner, OpDone done, bool engine_holds = false);

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
  // `choose`, given the present keys' tiers, may take fewer of them (load or
  // recompute): only those move, and their number is returned.
  std::pair<uint32_t, uint32_t> Prefetch(TenantId tenant, std::span<const StoredKey> keys,
                                         const std::function<uint32_t(std::span<const Tier>)>& choose = nullptr);

  // Leading keys some local tier holds (servable now), without counting a
  // lookup.
  uint32_t LeadingLocal(std::span<const StoredKey> keys);
  // The remote tier's part of a load: fetches the blocks of `keys` after the
  // leading local ones into host slots (as many as fit) and commits those the
  // remote tier had, as host blocks of `tenant` (a remote hit is promoted).
  // Returns the leading local count when there is nothing to fetch (no
  // remote tier, every key local, no host room); else nullopt, and `done`
  // runs on the owner thread with the leading keys held locally then, and
  // how many of them the fetch brought.
  using FetchDone = std::function<void(uint32_t leading, uint32_t fetched)>;
  std::optional<uint32_t> FetchFromRemote(TenantId tenant, const Layout& layout, const CodecParams& codec,
                                          std::span<const StoredKey> keys, FetchDone done);

  // Queues a write to disk of every host block that has no disk record
  // (kvtierctl flush, and at stop), at most disk_max_writes_in_flight at a
  // time. Returns how many were queued; 0 without a disk tier. O(blocks in
  // memory) once, to list them.
  uint64_t FlushToDisk();
  // Drops the writes still waiting in line (a stop past its deadline);
  // writes in flight finish.
  void CancelFlush();
  // Disk writes in flight or waiting in line.
  uint64_t pending_disk_writes() const;
  // Walks every entry (O(blocks): tests and audits, never a request's
  // path) and says the first where the eviction orders' own state is not
  // what it stands for: a block set aside as held by its children with no
  // child left in its tier or above, or a block marked clean (or not) that
  // the tier below does not hold (or does). Else how many are set aside and
  // marked.
  struct OrderCounts {
    uint64_t held = 0;
    uint64_t marked = 0;
  };
  Result<OrderCounts> CheckOrders();

  // Drops unleased, settled blocks matching `filter`. With tier = host, a
  // block that also has its disk record stays on disk. Runs in the
  // background, a bounded step per turn of the loop (memory blocks a chunk
  // of the index at a time, disk blocks a region at a time), one Evict at a
  // time in the order asked; `done` gets how many blocks went. A block that
  // is leased, moving, or stored after the walk passed its place stays.
  void Evict(EvictFilter filter, std::function<void(uint64_t)> done);
  // Evicts waiting or running.
  size_t pending_evicts() const;

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
  // BlockCache's sides (issue 34): each owns its state and reaches the
  // core's (below) through the core's methods and the shared tables; none
  // reaches another side's state, only its public methods. Room in a memory
  // tier comes only through room_ (RoomGate), which keeps the rule that a
  // read never drops a block that exists nowhere else.
  friend class RoomGate;
  friend class CachePolicy;
  friend class CacheCodec;
  friend class CacheRemote;
  friend class CacheDisk;
  friend class CacheWalks;

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
  bool AboveHigh(Tier t) const;
  bool AboveLow(Tier t) const;

  // --- Presence: the only ways a block's presence changes (each tells the
  // listener): ready to serve from its tier; moved to another tier (index
  // and presence); its disk record gained or lost.
  void MakeReady(BlockEntry* e);
  void MoveToTier(BlockEntry* e, Tier to);
  void SetOnDisk(BlockEntry* e, bool on_disk);
  // The remote tier holds it (a put landed, or it was fetched from there).
  void SetOnRemote(BlockEntry* e);
  // Marks e in its tier's order when the tier below host holds it (its
  // disk record, or without a disk tier its remote copy): clean, found by
  // clean-only victim scans without walking past dirty blocks.
  void MarkClean(BlockEntry* e) { index_.Mark(e, options_.disk != nullptr ? e->on_disk : e->on_remote); }
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

  // --- Accounting: bytes and blocks per tier, namespace and tenant.
  void Charge(BlockEntry* e, int sign);
  void Charge(const DiskOnlyBlock& b, int sign);
  void Charge(Tier t, TenantId owner, uint32_t ns, uint64_t bytes, int sign);
  // `tenant`'s share, created on first use.
  TenantShare& Counted(TenantId tenant);
  // One lookup of `num_keys` keys whose leading hits were in `hit_tiers`.
  void CountLookup(TenantId tenant, std::span<const Tier> hit_tiers, size_t num_keys);
  void CountEviction(Tier t, TenantId owner);
  // What `e`'s memory slot holds (and was allocated for): its coded bytes
  // or the block.
  static uint64_t SlotBytes(const BlockEntry* e) { return e->coded_bytes != 0 ? e->coded_bytes : e->block_bytes; }
  // The bytes `e` is charged in its tier: its record's payload on disk.
  static uint64_t ChargedBytes(const BlockEntry* e) {
    return e->tier == Tier::kDisk ? e->disk_payload_bytes : SlotBytes(e);
  }
  // The namespace of `layout`'s blocks stored under `codec`, and the codec
  // its packed records use.
  static LayoutFingerprint NamespaceOf(const Layout& layout, const CodecParams& codec);
  static NamespaceFormat FormatFor(const Layout& layout, const CodecParams& codec);

  // --- Entries: created filling, leased, kept only on disk, dropped.
  // A new entry for `key` (child of `parent`) whose bytes are on their way
  // into `slot` of tier `t`: filling, leased for `tenant`, charged.
  // `coded_bytes`: the slot is of that size, for the block coded by its copy.
  BlockEntry* InsertFilling(const StoredKey& key, const StoredKey* parent, Tier t, uint8_t* slot, uint64_t bytes,
                            uint32_t ns, TenantId tenant, uint64_t coded_bytes = 0);
  // A lease for `tenant`'s load or store (counted as its leases). Releasing
  // the last one frees a retired slot.
  void Lease(BlockEntry* e, TenantId tenant);
  void Unlease(BlockEntry* e, TenantId tenant);
  // A block only on disk is kept in disk_only_ (40 bytes), and becomes a
  // BlockEntry while it is read, leased or in memory.
  BlockEntry* Materialize(const StoredKey& key);
  void Dematerialize(BlockEntry* e);
  // Where the disk-only block's record is, for DiskTier::LocationOf.
  static DiskTier::RecordRef RecordRefOf(const DiskOnlyBlock& b);
  // Whether lookups, loads and prefetches may find `e`: it is ready and,
  // when its tier is disk, its record is still there or a read (or carry)
  // of it is in flight. A disk block whose record went with a reclaim while
  // a load held it stays only for that load (it may still read a retired
  // host slot) and is a miss for everyone else until its last lease erases
  // it: a read of its old location would find whatever the region holds now.
  static bool Servable(const BlockEntry* e) {
    return e->state == EntryState::kReady && (e->tier != Tier::kDisk || e->on_disk || e->moving);
  }
  void Drop(BlockEntry* e);
  // Drops a block that lives only on disk (counted as a disk eviction); its
  // record is forgotten unless `forget` is false (a reclaim deletes it).
  void DropDiskOnly(DiskOnlyBlock* b, bool forget = true);
  // A host block that still has its disk record goes back to the disk tier,
  // no write needed. Returns whether it did.
  bool BackToDisk(BlockEntry* e);
  // A host block the tier below holds leaves host: back to disk, or
  // dropped where (no disk tier) the cluster holds it. Not while leased,
  // moving or filling. Returns whether it left.
  bool LeaveHostHeldBelow(BlockEntry* e);
  // A host block whose owner is past its host quota (a load's read that the
  // quota had no room for: RoomGate::ForRead) leaves host as above, once
  // no load holds it. Returns whether it left (counted: reads_not_kept).
  bool LeaveHostPastQuota(BlockEntry* e);
  // Gives up `e`'s memory slot (the block left its tier): freed now, or kept
  // as its retired slot until the loads that leased it let go.
  void RetireSlot(BlockEntry* e, Tier from, uint8_t* old, uint64_t old_bytes);
  void Touch(BlockEntry* e);

  // --- The data path: stores, loads, moves between hbm and host.
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
  // Why a store found no slot: what holds the blocks that could go.
  std::string NoRoomReason() const;
  // Loads `leased` (all resident in memory tiers) into the engine. Returns
  // whether copies were queued (with target.event).
  bool CopyToEngine(TenantId tenant, Tier source, std::vector<BlockEntry*> leased,
                    std::vector<uint32_t> block_ids, EngineTarget target, OpDone done);
  // Starts a host -> hbm move of `e` if hbm has a free slot below its high
  // watermark and the owner's quota allows; returns whether it started.
  bool MaybePromote(BlockEntry* e);
  // Moves `e` to `dst` in tier `to` in the background.
  void StartMove(BlockEntry* e, Tier to, uint8_t* dst);
  void FinishMove(const StoredKey& key, Tier to, uint8_t* dst, CopyResult result);
  // Returns DeviceBackend::Submit's answer: whether the copies (and their
  // signal event) were queued.
  bool SubmitCopy(CopyBatch batch, std::function<void(CopyResult)> on_done);

  // --- Background work.
  // After anything changed: demote hbm above its watermark, keep disk
  // writes and remote puts going, start the reads waiting for room.
  void MaybeDemote();
  // MaybeDemote on a later turn of the loop (once, however often asked).
  void SchedulePump();
  // Whether the background scans may go on; if not, posts the pump (once)
  // to go on later, and counts it.
  bool ScanBudgetLeft();
  // hbm's demotion victim (moves_down), or host's write-back victim, its
  // scan counted in background_scanned_.
  BlockEntry* PickBackgroundVictim(Tier t);

  // The core's state: what every side shares.
  Options options_;
  BlockIndex index_;
  DiskOnlyIndex disk_only_;
  std::unique_ptr<Arena> arenas_[kNumTiers];
  std::unique_ptr<TierState> tiers_[kNumTiers];
  std::vector<TenantShare> tenant_shares_;  // by TenantId
  NamespaceTable namespaces_;
  uint64_t inflight_copies_ = 0;
  bool hbm_demotion_deferred_ = false;  // hbm's demotion used its scan budget and goes on at the next pump
  bool pump_posted_ = false;
  // The background scans (hbm's demotion, host's write-back) look at no
  // more than options_.background_scan_budget blocks between two posted
  // pumps (SchedulePump) and leave the rest to the next: a burst of
  // completions (a group commit ends hundreds of disk writes, each asking
  // for background work) held the event loop for 5-15 ms with a scan each
  // (issue 32). Only their own scans count: a request's scans for room
  // (RoomGate) are the request's work.
  uint64_t background_scanned_ = 0;
  uint64_t scan_base_ = 0;  // background_scanned_ as of the last pump
  std::chrono::steady_clock::time_point created_{};  // NowMs's origin
  CacheCounters counters_;  // its RequestCounters stay 0: they are kept per tenant
  uint64_t present_[4] = {};  // blocks present per Presence (present_blocks)

  // The sides, each with its own state (tiers/block_cache_*.h).
  std::unique_ptr<RoomGate> room_;
  std::unique_ptr<CachePolicy> policy_;
  std::unique_ptr<CacheCodec> codec_;
  std::unique_ptr<CacheRemote> remote_;
  std::unique_ptr<CacheDisk> disk_;
  std::unique_ptr<CacheWalks> walks_;
  // Lets completions that arrive after destruction (none should: the daemon
  // drains first) see that the cache is gone.
  std::shared_ptr<BlockCache*> self_;
};

}  // namespace kvtier
