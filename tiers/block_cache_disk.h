// CacheDisk: BlockCache's disk side (issues 11, 19, 32 and 34): write-back
// of host blocks to the disk tier, reads back up to host (shared between
// loads), the write budget, the NVMe gates, and the disk tier's life cycle
// (adopting records at a restart, answering a region's reclaim). Its code is
// in block_cache_disk.cc and block_cache_reclaim.cc.
//
// It owns the writes in line and in flight, the pause after failed writes,
// the write budget, the gates, the loads waiting for a block's read and the
// reads waiting for host room. Its promises:
//   - A block being written or read is moving (parked: never evicted,
//     freed or dropped) until its write or read ends.
//   - A block is clean (on_disk) only once its record is durable; a block
//     whose writes keep failing is given up after kMaxDiskWriteTries, and
//     write-back pauses after each failure (doubling), one write at a time.
//   - Two loads of one block share one read; a failed read drops the record
//     (unless the error says nothing of it) and is never served.
//   - A read takes host room only through RoomGate::ForRead, within its
//     owner's host quota; with none, a load's read first writes back host's
//     coldest block not on disk yet (WriteBackForRead: host under its
//     watermark writes nothing back), and a read waits (parked) while host
//     blocks are leaving, else it misses: it never drops a block that
//     exists nowhere else.
//   - Admission (min hits, the gates) and the write budget decide every
//     write-back; write-through and flushes skip them.
//
// Who may call: BlockCache's core and sides, on the owner thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <unordered_map>
#include <vector>

#include "tiers/block_cache.h"
#include "tiers/disk_gate.h"
#include "tiers/ghost_filter.h"

namespace kvtier {

class CacheDisk {
 public:
  explicit CacheDisk(BlockCache& cache);
  CacheDisk(const CacheDisk&) = delete;
  CacheDisk& operator=(const CacheDisk&) = delete;

  // BlockCache's calls of the same names.
  uint64_t AdoptDiskRecords(std::vector<DiskRecord> records);
  ReclaimAnswer ReclaimFromDisk(const StoredKey& key, const DiskLocation& where, bool may_carry);
  void FinishRelocation(const StoredKey& key, Result<DiskLocation> now);
  uint64_t FlushToDisk();
  void CancelFlush();
  uint64_t pending_disk_writes() const { return disk_writes_in_flight_ + disk_write_queue_.size(); }
  uint32_t writes_in_flight() const { return disk_writes_in_flight_; }

  // The learned gate's tag for a block of a store of `request_blocks`.
  uint8_t GateTag(uint32_t request_blocks) { return gate_.TagFor(request_blocks); }

  // Starts reading `e` into a host slot; `then(ok)` runs when it is in host
  // (false: the read failed and the block was dropped, or host had no room
  // for it). Reads of one block are shared.
  void PromoteFromDisk(BlockEntry* e, std::function<void(bool)> then);
  // Starts the reads waiting for room that now find it, in order; those that
  // cannot wait any longer fail. Called by MaybeDemote.
  void RetryReadsWaitingForRoom();
  // A read's end. `coded_bytes`: the slot holds the record's payload as it
  // was coded.
  void FinishDiskRead(const StoredKey& key, uint8_t* dst, Status status, uint64_t checksum,
                      uint64_t coded_bytes = 0);

  // Whether host block `e` is ready to be written to disk: only in memory,
  // settled, checksummed, and not given up on.
  static bool DirtyInHost(const BlockEntry* e);
  // Puts a write of `key` in line (write-through, flush).
  void QueueDiskWrite(const StoredKey& key, bool keep_in_memory);
  // Starts queued disk writes, then write-back of host above its high
  // watermark down to its low one, while fewer than
  // disk_max_writes_in_flight are in flight and write-back is not backing
  // off after a failure. Bounded work per call (it posts itself to go on).
  void PumpDiskWrites();
  // Sends unleased, settled host block `v` on its way down: back to disk when
  // it still has its record, else written back; dropped when admission or
  // the write budget says no. When no write may start now (writes in flight
  // at the cap, or backing off after a failure) it is dropped if `may_drop`,
  // else it stays for a later try.
  void DemoteFromHost(BlockEntry* v, bool may_drop = true);
  // Starts writing dirty, unleased host block `v` back to disk (it leaves
  // host once written) when a write may start now and admission and the
  // write budget say yes; else nothing. Never drops it. Returns whether the
  // write started (RoomGate: room for a read within a host quota).
  bool WriteBack(BlockEntry* v);
  // The header of a disk record of what `e`'s slot holds.
  RecordHeader DiskHeader(const BlockEntry* e);

 private:
  // host -> disk (write-back). keep_in_memory: write-through, the block
  // stays where it is and becomes clean; otherwise it moves to the disk
  // tier. `budgeted`: bytes taken from the write budget, given back if it
  // fails.
  void StartDiskWrite(BlockEntry* e, bool keep_in_memory, uint64_t budgeted = 0);
  // `payload_bytes`: the record's (a codec's output when where->packed).
  void FinishDiskWrite(const StoredKey& key, uint64_t stride, bool keep_in_memory, uint64_t budgeted,
                       uint64_t payload_bytes, Result<DiskLocation> where);
  // The header of a disk record of `e` with this payload: its checksum, and
  // whether it is coded by its namespace's codec (a coded host slot, or a
  // packed record being carried forward).
  RecordHeader RecordHeaderOf(const BlockEntry* e, uint64_t payload_bytes, uint64_t checksum, bool coded);
  // The host slot `e`'s disk read needs: the record's payload, kept coded
  // (KeepsCoded), or the block.
  uint64_t ReadSlotBytes(const BlockEntry* e) const;
  // The read of `e` for its disk_waiters_: it starts now, waits in
  // reads_waiting_for_room_ while host room is coming, or fails (its
  // waiters miss it).
  void ReadIntoHost(BlockEntry* e);
  // A host slot for `e`'s read (RoomGate::ForRead); nullptr without its
  // record.
  uint8_t* SlotForDiskRead(const BlockEntry* e);
  // Whether a read of `e` that found no slot should wait: it has its record
  // and host blocks are leaving (MaybeDemote runs as each has left).
  bool HostRoomIsComing(const BlockEntry* e) const;
  // For a load's read of `e` that found no slot: starts writing back host's
  // coldest block not on disk yet (its slot frees once written; never
  // dropped), as host's watermark may not. Returns whether it started one.
  bool WriteBackForRead(const BlockEntry* e);
  // Ends a read that cannot start (counted in disk_reads_without_room when
  // the record is there): its waiters miss the block (posted), and an entry
  // nobody holds goes back to the disk-only table.
  void FailDiskRead(BlockEntry* e);
  // The loads waiting for `key`'s read, taken out of disk_waiters_ (none:
  // empty).
  std::vector<std::function<void(bool)>> TakeWaiters(const StoredKey& key);
  // Reads `e` (on disk, not moving) into host slot `dst`.
  void StartDiskRead(BlockEntry* e, uint8_t* dst);
  // Whether a failed disk read says nothing of its record (cancelled at a
  // stop, EAGAIN, ENOMEM): the record is kept.
  static bool TransientReadError(const Status& st);
  // Takes `bytes` from the disk write budget; false when it is spent.
  bool TakeWriteBudget(uint64_t bytes);
  void RefundWriteBudget(uint64_t bytes);
  // Whether a write-back may start now (writes in flight under the cap, no
  // back-off after a failure).
  bool DiskWriteMayStart() const;
  // What admission (disk_min_hits, the gates, the disk quota) says of a
  // write-back of `v`, and the record's bytes the budget is asked for.
  struct Admission {
    bool gated = false;     // a reuse gate is on
    bool returned = false;  // stored again after host let it go unwritten
    bool reused = false;
    bool admitted = false;
    uint64_t record = 0;
  };
  Admission Admit(const BlockEntry* v);

  BlockCache& cache_;
  GhostFilter let_go_unwritten_;  // disk_admit_on_reuse and disk_admit_learned
  DiskGate gate_;                 // disk_admit_learned
  // Loads waiting for a block's disk read, by key.
  std::unordered_map<StoredKey, std::vector<std::function<void(bool)>>, Key128Hash> disk_waiters_;
  // Disk reads waiting for a host slot while host's blocks leave, in order:
  // a read never drops a block that is not on disk yet (ReadIntoHost). Their
  // entries are moving (parked) until they start.
  std::deque<StoredKey> reads_waiting_for_room_;
  // Disk writes waiting for a place in flight: key, and whether the block
  // stays in memory (write-through) or moves to disk (flush).
  struct QueuedDiskWrite {
    StoredKey key;
    bool keep_in_memory = false;
  };
  std::deque<QueuedDiskWrite> disk_write_queue_;
  uint32_t disk_writes_in_flight_ = 0;
  bool host_demoting_ = false;  // host passed its high watermark and is not below its low one yet
  bool flushing_ = false;       // a FlushToDisk's writes are still in line
  // After a failed disk write, write-back waits until then (doubling per
  // failure in a row), so a failing device costs no CPU.
  std::chrono::steady_clock::time_point disk_backoff_until_{};
  uint32_t disk_failures_in_a_row_ = 0;
  double budget_tokens_ = 0;  // bytes that may be written now
  std::chrono::steady_clock::time_point budget_refilled_{};
};

}  // namespace kvtier
