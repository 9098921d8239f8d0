// DiskTier: the NVMe tier's storage engine. One preallocated segment per path
// (a BlockDevice), split into regions; each block is a record (record.h)
// appended to the open region of one device; a RocksDB index maps stored keys
// to records so that the tier survives restarts warm.
//
// Durability order (docs/disk-format.md):
//   append:  header and payload written, device synced, THEN the index entry
//            written (WriteBatch, WAL synced), THEN the block counts as stored.
//            Records written while a commit runs share the next one: one
//            fdatasync and one index batch for many records (group commit);
//   reclaim: the index entries of a region deleted (synced) BEFORE the region
//            is written again.
// So after a crash the index names only records that were fully written; a
// record whose bytes are damaged anyway fails its checks on read and is a
// miss, never data.
//
// Space is reclaimed a region at a time, oldest first (FIFO); the owner
// decides for each block of the region whether it may go (a block being read
// keeps its region alive this round).
//
// Threading: owned by one thread (the daemon's event loop), like BlockCache:
// every method must be called there, and every `done` runs there (through
// Options::post). Device I/O and index writes run on the devices' and the
// engine's threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/key128.h"
#include "common/status.h"
#include "tiers/disk/block_device.h"
#include "tiers/disk/record.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace kvtier {

struct DiskLocation {
  uint32_t device = 0;
  uint32_t region = 0;
  uint64_t offset = 0;        // of the record's header, in the device
  uint64_t record_bytes = 0;
  uint64_t sequence = 0;
};

// An indexed record, as recovered at start-up.
struct DiskRecord {
  RecordHeader header;  // key, ns, sequence, payload bytes and checksum, owner
  DiskLocation location;
};

struct DiskCounters {
  uint64_t writes = 0;
  uint64_t write_bytes = 0;
  uint64_t reads = 0;
  uint64_t read_bytes = 0;
  uint64_t io_errors = 0;
  uint64_t checksum_failures = 0;  // records that failed a check on read
  uint64_t regions_reclaimed = 0;
  uint64_t records_reclaimed = 0;
  uint64_t recovered_records = 0;
  uint64_t recovery_dropped = 0;   // index entries that could not be right
  uint64_t group_commits = 0;      // fdatasync + index batches (writes / this = batching)
};

class DiskTier {
 public:
  using Post = std::function<void(std::function<void()>)>;
  // Reclaim asks the owner twice per block of a region: with commit=false,
  // may this block go now (false keeps the whole region this round); then,
  // once the index deletes are durable, with commit=true: forget it.
  using ReclaimFn = std::function<bool(const StoredKey& key, bool commit)>;
  // The keys whose current record is in (device, region): the owner knows
  // where each of its blocks is, so the tier keeps no list of its own.
  using ResidentFn = std::function<std::vector<StoredKey>(uint32_t device, uint32_t region)>;

  struct Options {
    std::vector<BlockDevice*> devices;  // REQUIRED, borrowed, one per path
    std::string index_path;             // RocksDB directory
    uint64_t region_bytes = 64ull << 20;
    Post post;                          // REQUIRED: runs a closure on the owner thread
    ReclaimFn reclaim;                  // REQUIRED
    ResidentFn resident;                // REQUIRED
  };

  // Opens (or creates) the index and recovers the regions' state from it.
  // Errors keep the RocksDB status code.
  static Result<std::unique_ptr<DiskTier>> Open(Options options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // The records the index held at Open, for the owner to rebuild its index.
  std::vector<DiskRecord> TakeRecovered();

  // Appends a record. `payload` must be 4 KiB aligned, readable for
  // RecordBytes(payload_bytes) - 4096 bytes, and stay untouched until `done`.
  // The header's sequence is assigned here. `done` gets the location once the
  // record is durable and indexed. Errors: kResourceExhausted when no region
  // can be reclaimed; the device's or RocksDB's error otherwise (counted).
  void Append(RecordHeader header, const uint8_t* payload,
              std::function<void(Result<DiskLocation>)> done);

  // Reads a record's payload into `dst` (4 KiB aligned, room for the padded
  // payload) and checks it: the header must decode and name `key`, and the
  // payload's XXH3-64 must match. Errors: kCorruption (counted) or the I/O
  // error (counted); either way the caller must not serve `dst`.
  // `done` also gets the payload's checksum (from its verified header).
  void Read(const StoredKey& key, const DiskLocation& location, uint64_t payload_bytes, uint8_t* dst,
            std::function<void(Status, uint64_t checksum)> done);

  // The full location of the record at `offset` of `device` with a payload
  // of `payload_bytes` (sequence 0: it is not needed to read or forget it).
  DiskLocation LocationOf(uint32_t device, uint64_t offset, uint64_t payload_bytes) const;

  // The block left the disk tier (promoted, evicted): drops its index entry.
  // The delete need not be synced: a record that comes back after a crash
  // still holds exactly its key's bytes.
  void Forget(const StoredKey& key, const DiskLocation& location);

  uint64_t capacity_bytes() const;
  uint64_t used_bytes() const { return used_bytes_; }
  uint64_t inflight() const { return inflight_; }
  const DiskCounters& counters() const { return counters_; }

 private:
  enum class RegionState : uint8_t { kFree = 0, kOpen = 1, kSealed = 2 };
  struct Region {
    RegionState state = RegionState::kFree;
    uint64_t sequence = 0;       // newest record's: reclaim goes oldest first
    uint64_t write_offset = 0;   // bytes used from the region's start
    uint64_t live_bytes = 0;
    uint32_t inflight = 0;       // reads and writes in flight
  };
  // A record written, waiting for its group commit (sync, then index).
  struct PendingAppend {
    StoredKey key;
    DiskLocation location;
    std::string value;  // its index entry
    std::function<void(Result<DiskLocation>)> done;
  };
  struct Device {
    BlockDevice* device = nullptr;
    std::vector<Region> regions;
    int32_t open_region = -1;
    std::vector<std::shared_ptr<PendingAppend>> awaiting_sync = {};
    bool commit_in_flight = false;
  };

  explicit DiskTier(Options options);
  Status Recover();
  // Whether an index entry names a record that can exist: on a device and
  // region this tier has, aligned, inside its region, of a payload size a
  // block can have. Recovery drops any other.
  bool PlausibleLocation(const DiskRecord& r) const;
  // A region with room for `bytes` on some device; may reclaim one.
  Result<std::pair<uint32_t, uint32_t>> RegionFor(uint64_t bytes);
  bool Reclaim(uint32_t device, uint32_t region);
  // Starts a group commit of the device's written records, unless one runs.
  void MaybeCommit(uint32_t device);
  void FinishAppend(PendingAppend& p, Status st);
  std::string LocationValue(const RecordHeader& h, const DiskLocation& l) const;

  Options options_;
  std::vector<Device> devices_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* blocks_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* regions_cf_ = nullptr;
  std::vector<DiskRecord> recovered_;
  uint64_t next_sequence_ = 1;
  uint32_t next_device_ = 0;
  uint64_t used_bytes_ = 0;
  uint64_t inflight_ = 0;
  DiskCounters counters_;
  std::shared_ptr<DiskTier*> self_;  // completions check the tier still exists
};

}  // namespace kvtier
