// DiskTier: the NVMe tier's storage engine. One preallocated segment per path
// (a BlockDevice), split into regions; each block is a record (record.h)
// appended to the open region of one device; a RocksDB index maps stored keys
// to records so that the tier survives restarts warm.
//
// Durability order (docs/disk-format.md):
//   append:  the record written, device synced, THEN the index entry
//            written (WriteBatch, WAL synced), THEN the block counts as stored.
//            Records written while a commit runs share the next one: one
//            fdatasync and one index sync for many records (group commit);
//   reclaim: the index entries of a region deleted (synced) BEFORE the region
//            is written again.
// So after a crash the index names only records that were fully written; a
// record whose bytes are damaged anyway fails its checks on read and is a
// miss, never data.
//
// Space is reclaimed a region at a time, oldest first (FIFO), ahead of need:
// while fewer regions are free than the watermarks ask for, the oldest sealed
// region is reclaimed. The tier keeps the list of records appended to each
// region, so a reclaim asks the owner about exactly those records (O(records
// in the region), once per region written: amortised O(1) per record). The
// owner cannot veto a reclaim: it drops each block, or has a hot one carried
// forward, which the tier does itself: it reads the record out and appends
// it again (as CacheLib's flash engine reinserts), then tells the owner the
// new location. The region is free once those reads (and any other) are
// done and its deletes are durable. Index writes run on the IndexWriter's thread, never on the
// owner's. An append that finds no free region waits for the next reclaim; it fails only when
// reclaims fail (the index cannot be written).
//
// Threading: owned by one thread (the daemon's event loop), like BlockCache:
// every method must be called there, and every `done` runs there (through
// Options::post). Device I/O and index writes run on the devices', the
// engine's and the index writer's threads.
#pragma once

#include <rocksdb/write_batch.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/key128.h"
#include "common/status.h"
#include "tiers/disk/block_device.h"
#include "tiers/disk/index_writer.h"
#include "tiers/disk/record.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace kvtier {

struct DiskLocation {
  uint32_t device = 0;
  uint32_t region = 0;
  uint64_t offset = 0;        // of the record's first byte, in the device
  uint64_t record_bytes = 0;
  uint64_t sequence = 0;
  // Its payload is a codec's output (its record is packed), and its format
  // (record.h): bare, or one of an older release.
  bool packed = false;
  RecordFormat format = RecordFormat::kBare;
  // The payload's XXH3-64, from the index: what a read must find there (a
  // bare record has nothing else to be checked against).
  uint64_t checksum = 0;
};

// An indexed record, as recovered at start-up.
struct DiskRecord {
  RecordHeader header;  // key, ns, sequence, payload bytes and checksum, owner
  DiskLocation location;
};

// What the owner did with a record of a region being reclaimed.
enum class ReclaimAction : uint8_t {
  kStale,    // not the key's current record (it moved or left): nothing to delete
  kDropped,  // forgotten: a miss from now on, or its copy in memory is the only one
  kCarry,    // hot: the tier is to write it again, and report through Options::relocated
};
struct ReclaimAnswer {
  explicit(false) ReclaimAnswer(ReclaimAction a = ReclaimAction::kStale) : action(a) {}

  ReclaimAction action = ReclaimAction::kStale;
  // kCarry: the record as the owner knows it (from the index at recovery, or
  // from the block's own append): key, namespace, payload size and checksum,
  // codec, owner and annotation. Written again as a bare record; the bytes
  // read out must match its checksum (and, for an older format, its header).
  RecordHeader header;
  RecordFormat format = RecordFormat::kBare;  // of the record being carried
};

struct DiskCounters {
  uint64_t writes = 0;
  uint64_t write_bytes = 0;
  uint64_t reads = 0;
  uint64_t read_bytes = 0;
  uint64_t io_errors = 0;
  uint64_t checksum_failures = 0;  // records that failed a check on read
  uint64_t regions_reclaimed = 0;
  uint64_t records_reclaimed = 0;  // dropped or carried by reclaims
  uint64_t records_carried = 0;    // hot records read out of a region being reclaimed
  uint64_t reclaim_failures = 0;   // reclaims whose index deletes failed (retried later)
  uint64_t appends_waited = 0;     // appends that found no free region and waited for a reclaim
  uint64_t index_errors = 0;       // index writes that failed
  uint64_t index_recoveries = 0;   // index writes that succeeded after one failed
  uint64_t recovered_records = 0;
  uint64_t recovery_dropped = 0;   // index entries that could not be right
  uint64_t group_commits = 0;      // fdatasync + index batches (writes / this = batching)
};

class DiskTier {
 public:
  using Post = std::function<void(std::function<void()>)>;
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  // Reclaim asks the owner once about each record of the region: the
  // record at `location` (its device and offset; record_bytes and sequence
  // are 0) under `key`. The owner answers what it did. `may_carry` says
  // whether the region's carry budget has room; without it, the owner must
  // not answer kCarry. The owner must not call into the tier from here,
  // except Read.
  using ReclaimFn = std::function<ReclaimAnswer(const StoredKey& key, const DiskLocation& location,
                                                bool may_carry)>;
  // A carried record is durable at its new location, or could not be
  // carried (`now` has the error; the block is gone). The owner keeps the
  // block (it must not drop it while it is carried).
  using RelocatedFn = std::function<void(const StoredKey& key, Result<DiskLocation> now)>;

  struct Options {
    std::vector<BlockDevice*> devices;  // REQUIRED, borrowed, one per path
    std::string index_path;             // RocksDB directory
    uint64_t region_bytes = 64ull << 20;
    Post post;                          // REQUIRED: runs a closure on the owner thread
    ReclaimFn reclaim;                  // REQUIRED
    RelocatedFn relocated;              // REQUIRED
    // Reclaim ahead of need (policy.watermarks.disk): when more than `high`
    // of the regions hold data, reclaim the oldest until no more than `low`
    // do; at least one region is always kept free.
    double high_watermark = 0.98;
    double low_watermark = 0.96;
    // At most this fraction of a region's records are carried forward by its
    // reclaim (the rest of its hot records are dropped), so that a reclaim
    // always frees a good part of a region (and a block is carried once per
    // hit: carrying resets its hits). Each carried record takes a staging
    // buffer of its size until it is written again. 3/4 measured best on
    // the Mooncake trace (59.9% hits at 20x, against 59.3% at 1/2).
    double carry_fraction = 0.75;
    // Staging buffers of carried records in flight at most (past it, hot
    // records of a reclaim are dropped, not carried).
    uint64_t max_carry_staging_bytes = 256ull << 20;
    // For the retry delay after a failed reclaim; steady_clock if unset.
    Clock clock = nullptr;
    // Writes records as releases before version 4 did (a header page before
    // a raw payload, a trailer after a coded one), for the tests that an
    // older disk is still read and the bench's before-and-after. Never set
    // by the daemon.
    bool legacy_records = false;
  };

  // The disk format this release writes, and the newest it reads (it reads
  // every older one): the index's "format" marker (docs/disk-format.md).
  // An index of a newer format is refused whole (kFailedPrecondition), and
  // left as it is: its entries would look damaged to this release, and be
  // dropped.
  static constexpr uint32_t kFormatVersion = 4;
  // Table files the RocksDB index keeps open at most (the rest are opened
  // on demand): the descriptors kvtierd keeps for it out of RLIMIT_NOFILE.
  static constexpr int kIndexMaxOpenFiles = 256;
  // Opens (or creates) the index and recovers the regions' state from it.
  // Errors keep the RocksDB status code.
  static Result<std::unique_ptr<DiskTier>> Open(Options options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // The records the index held at Open, for the owner to rebuild its index.
  std::vector<DiskRecord> TakeRecovered();

  // Appends a bare record of a raw or coded payload (header.codec).
  // `payload` must be 4 KiB aligned, readable for payload_bytes, and stay
  // untouched until `done` (a partial last page is copied into the tier's
  // own zero-padded page). Its checksum must be header.payload_checksum.
  // The header's sequence is assigned here. `done` gets the location once the
  // record is durable and indexed. Errors: kInvalidArgument for a record
  // larger than a region (max_record_bytes); kResourceExhausted when no
  // region is free and reclaims are failing; the device's or RocksDB's error
  // otherwise (counted). `done` always runs later, never inside Append.
  void Append(RecordHeader header, const uint8_t* payload,
              std::function<void(Result<DiskLocation>)> done);

  // Reads a record's payload into `dst` (4 KiB aligned, room for
  // payload_bytes; the padded payload for kHeaderPage) and checks it: the
  // payload's XXH3-64 must be location.checksum, and an older record's
  // header must decode, name `key` and hold that checksum. Errors:
  // kCorruption (counted) or the I/O error (counted); either way the caller
  // must not serve `dst`. `done` also gets the payload's checksum.
  void Read(const StoredKey& key, const DiskLocation& location, uint64_t payload_bytes, uint8_t* dst,
            std::function<void(Status, uint64_t checksum)> done);

  // What the owner keeps of a record to find and check it again.
  struct RecordRef {
    uint32_t device = 0;
    uint64_t offset = 0;
    uint64_t payload_bytes = 0;
    bool packed = false;
    RecordFormat format = RecordFormat::kBare;
    uint64_t checksum = 0;
  };
  // The full location of that record (sequence 0: it is not needed to read
  // or forget it).
  DiskLocation LocationOf(const RecordRef& ref) const;

  // The block left the disk tier (promoted, evicted): drops its index entry.
  // The delete need not be synced: a record that comes back after a crash
  // still holds exactly its key's bytes.
  void Forget(const StoredKey& key, const DiskLocation& location);

  // A record of `location`'s region, as the tier listed it when appended.
  struct RegionRecord {
    StoredKey key;
    DiskLocation location;  // device, region and offset; record_bytes and sequence are 0
  };
  // The records appended to (device, region) since it was last free, live or
  // not (the owner knows which are current). O(records in the region).
  std::vector<RegionRecord> RecordsIn(uint32_t device, uint32_t region) const;
  uint32_t num_devices() const { return static_cast<uint32_t>(devices_.size()); }
  uint32_t num_regions(uint32_t device) const {
    return static_cast<uint32_t>(devices_[device].regions.size());
  }

  // Changes the reclaim watermarks (SIGHUP).
  void SetWatermarks(double high, double low);

  uint64_t capacity_bytes() const;
  uint64_t max_record_bytes() const { return options_.region_bytes; }
  uint64_t used_bytes() const { return used_bytes_; }
  // Bytes written into regions not free: live records, records no block
  // needs any more (waiting for their region's reclaim), and nothing else;
  // what regions not free hold beyond it is their unwritten tails.
  uint64_t filled_bytes() const { return filled_bytes_; }
  uint64_t region_bytes() const { return options_.region_bytes; }
  // Records the owner holds (appended, not forgotten or reclaimed).
  uint64_t live_records() const { return live_records_; }
  // I/O, index writes and appends in flight or waiting: the tier is idle
  // (and may be destroyed) at 0.
  uint64_t inflight() const { return inflight_ + waiting_.size() + index_jobs_; }
  uint64_t free_regions() const { return free_regions_; }
  const DiskCounters& counters() const { return counters_; }
  // Whether the last index write failed: no block reaches the disk until one
  // succeeds (a full index volume, until it has room again; IndexWriter).
  bool index_stopped() const { return index_failing_; }

 private:
  enum class RegionState : uint8_t { kFree = 0, kOpen = 1, kSealed = 2, kReclaiming = 3 };
  // A record appended to a region: its key and where it starts, in 4 KiB
  // pages from the region's start (20 bytes).
  struct Member {
    StoredKey key;
    uint32_t page = 0;
  };
  struct Region {
    RegionState state = RegionState::kFree;
    uint64_t sequence = 0;       // newest record's
    uint64_t write_offset = 0;   // bytes used from the region's start
    uint64_t live_bytes = 0;
    uint32_t reads = 0;            // in flight
    uint32_t writes = 0;           // appends started and not finished
    bool deletes_pending = false;  // a reclaim's index deletes are not durable yet
    std::vector<Member> members;
  };
  // A record written, waiting for its group commit (sync, then index).
  struct PendingAppend {
    StoredKey key;
    DiskLocation location;
    std::string value;  // its index entry
    std::function<void(Result<DiskLocation>)> done;
  };
  // An append that found no free region.
  struct WaitingAppend {
    RecordHeader header;
    const uint8_t* payload = nullptr;
    std::function<void(Result<DiskLocation>)> done;
  };
  struct Device {
    BlockDevice* device = nullptr;
    std::vector<Region> regions;
    int32_t open_region = -1;
    std::vector<uint32_t> free = {};  // free regions (a stack)
    std::vector<std::shared_ptr<PendingAppend>> awaiting_sync = {};
    bool commit_in_flight = false;
  };
  // A reclaim whose index deletes failed, to be written again.
  struct FailedReclaim {
    uint32_t device = 0;
    uint32_t region = 0;
    std::vector<StoredKey> keys;  // whose entries it deletes
  };

  explicit DiskTier(Options options);
  Status Recover();
  // Whether an index entry names a record that can exist: on a device and
  // region this tier has, aligned, inside its region, of a payload size a
  // block can have. Recovery drops any other.
  bool PlausibleLocation(const DiskRecord& r) const;
  // The open region of some device with room for `bytes`, opening a free
  // one when needed; nullopt when no region is free.
  std::optional<std::pair<uint32_t, uint32_t>> RegionFor(uint64_t bytes);
  // The format a new record is written in (bare, unless legacy_records),
  // and the bytes it takes.
  RecordFormat WriteFormat(const RecordHeader& header) const;
  uint64_t NewRecordBytes(const RecordHeader& header) const;
  void StartAppend(uint32_t device, uint32_t region, RecordHeader header, const uint8_t* payload,
                   std::function<void(Result<DiskLocation>)> done);
  // Starts reclaiming the oldest sealed region while the watermarks ask for
  // free regions (one region per call: bounded work), and retries failed
  // reclaims once their delay has passed.
  void MaybeReclaim();
  void ScheduleReclaim();  // MaybeReclaim on a later turn of the owner's loop
  void StartReclaim(uint32_t device, uint32_t region);
  // Reads the record at `where` out of its region being reclaimed, then
  // appends it again and tells the owner.
  void StartCarry(const StoredKey& key, const DiskLocation& where, ReclaimAnswer answer);
  void SubmitReclaimDeletes(uint32_t device, uint32_t region, std::vector<StoredKey> keys);
  // Frees a reclaimed region once its deletes are durable and its I/O is done.
  void MaybeFree(uint32_t device, uint32_t region);
  // Starts waiting appends on free regions; fails them with `error` when set.
  void ServeWaiting(const Status* error = nullptr);
  // How many regions the watermarks want free: to start, and to stop.
  uint64_t FreeTarget(double watermark) const;
  // Starts a group commit of the device's written records, unless one runs.
  void MaybeCommit(uint32_t device);
  void FinishAppend(PendingAppend& p, Status st);
  // Hands an index change to the writer, after the unsynced deletes
  // gathered so far (so that every change lands in the order it was made).
  // Each index write's outcome, on the loop, in the order written: counts
  // errors and recoveries, and logs the recovery.
  void NoteIndexWrite(const Status& st);
  void SubmitIndex(rocksdb::WriteBatch batch, bool sync, std::function<void(Status)> done,
                   IndexWriter::Build build = nullptr);
  void FlushForgotten();
  std::string LocationValue(const RecordHeader& h, const DiskLocation& l) const;

  Options options_;
  std::vector<Device> devices_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* blocks_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* regions_cf_ = nullptr;
  std::unique_ptr<IndexWriter> writer_;  // destroyed before db_
  std::vector<DiskRecord> recovered_;
  uint64_t next_sequence_ = 1;
  uint32_t next_device_ = 0;
  uint64_t used_bytes_ = 0;
  uint64_t filled_bytes_ = 0;  // filled_bytes()
  uint64_t live_records_ = 0;
  uint64_t inflight_ = 0;    // device reads and appends
  uint64_t index_jobs_ = 0;  // index writes whose done has not run
  uint64_t total_regions_ = 0;
  uint64_t free_regions_ = 0;
  uint64_t reclaiming_ = 0;     // regions in kReclaiming
  bool reclaim_burst_ = false;  // between the high and the low watermark
  bool reclaim_scheduled_ = false;
  std::deque<std::pair<uint32_t, uint32_t>> sealed_;  // oldest first
  std::deque<WaitingAppend> waiting_;
  std::vector<FailedReclaim> failed_reclaims_;
  std::chrono::steady_clock::time_point retry_reclaims_at_{};
  uint32_t reclaim_failures_in_a_row_ = 0;
  rocksdb::WriteBatch forgotten_;  // unsynced deletes, not yet handed to the writer
  uint32_t forgotten_count_ = 0;
  uint64_t forget_failures_ = 0;      // for rate-limited warnings
  bool index_failing_ = false;        // the last index write's outcome (NoteIndexWrite)
  uint64_t carry_staging_bytes_ = 0;  // staging buffers of carried records in flight
  DiskCounters counters_;
  std::shared_ptr<DiskTier*> self_;  // completions check the tier still exists
};

}  // namespace kvtier
