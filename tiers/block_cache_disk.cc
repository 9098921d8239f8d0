// BlockCache's disk side: write-back to the disk tier, reads back up to
// host (shared between loads), the write budget and disk quotas. Recovery
// and reclaim are in block_cache_reclaim.cc. The class is declared in
// block_cache.h; this file only keeps block_cache.cc to the memory tiers.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/check.h"
#include "tiers/block_cache.h"
#include "tiers/codec_pool.h"

namespace kvtier {

namespace {

// Disk quota (block_cache.h, "Quotas"): entries of a tenant's DiskWriteLog
// looked at per write (or return to disk) to bring it back within its
// quota, and entries compacted per record logged.
constexpr uint32_t kDiskQuotaStepsPerWrite = 64;
constexpr uint32_t kDiskLogCompactSteps = 4;

}  // namespace

bool BlockCache::BackToDisk(BlockEntry* e) {
  if (!e->on_disk || e->tier != Tier::kHost || e->leases != 0 || e->moving || e->retired_slot != nullptr) {
    return false;
  }
  uint8_t* slot = e->slot;
  const uint64_t slot_bytes = SlotBytes(e);
  Charge(e, -1);
  MoveToTier(e, Tier::kDisk);
  e->slot = nullptr;
  e->coded_bytes = 0;
  Charge(e, +1);
  tier(Tier::kHost)->pool->Free(slot, slot_bytes);
  ++counters_.disk_returns;
  const TenantId owner = e->owner;
  const StoredKey key = e->key;
  Dematerialize(e);
  EnforceDiskQuota(owner, kDiskQuotaStepsPerWrite, &key);  // its disk bytes grew
  return true;
}

BlockEntry* BlockCache::Materialize(const StoredKey& key) {
  DiskOnlyBlock* b = disk_only_.Find(key);
  if (b == nullptr) return nullptr;
  const DiskOnlyBlock copy = *b;
  disk_only_.Erase(b);
  // Same tier, owner and record: the accounting does not change.
  BlockEntry* e = index_.Insert(key, Tier::kDisk, nullptr);
  const NamespaceFormat& format = namespaces_.FormatOf(copy.ns);
  e->block_bytes = copy.packed ? static_cast<uint32_t>(format.block_bytes) : copy.block_bytes;
  e->ns = copy.ns;
  e->owner = copy.owner;
  e->hits = copy.hits;
  e->disk_gate = copy.disk_gate;
  e->state = EntryState::kReady;
  e->on_disk = true;
  e->disk = options_.disk->LocationOf(RecordRefOf(copy));
  e->disk_payload_bytes = copy.block_bytes;
  // Written again (its record lost) as it was, or coded when its namespace
  // is fp8's (a block stored raw there had a NaN or met a busy pool).
  e->compress = copy.packed || format.codec.kind == CodecKind::kFp8;
  return e;  // its checksum comes with the read (has_checksum stays false until then)
}

DiskTier::RecordRef BlockCache::RecordRefOf(const DiskOnlyBlock& b) {
  return {.device = b.device,
          .offset = b.offset_bytes(),
          .payload_bytes = b.block_bytes,
          .packed = b.packed != 0,
          .format = b.bare != 0 ? RecordFormat::kBare : LegacyFormat(b.packed != 0),
          .checksum = b.checksum};
}

void BlockCache::Dematerialize(BlockEntry* e) {
  if (e->tier != Tier::kDisk || e->state != EntryState::kReady || e->moving || e->leases != 0 ||
      e->retired_slot != nullptr) {
    return;
  }
  if (!e->on_disk) {
    // Its record went with a reclaim while a load held it: nothing is left.
    CountEviction(Tier::kDisk, e->owner);
    Charge(e, -1);
    Erase(e);
    return;
  }
  // The tier's devices are at most kMaxDiskPathBytes (DiskTier::Open): every
  // offset fits (set_offset_bytes checks it).
  KVTIER_CHECK(e->disk.device <= UINT8_MAX && e->ns <= UINT16_MAX);
  DiskOnlyBlock b;
  b.key = e->key;
  b.set_offset_bytes(e->disk.offset);
  b.block_bytes = e->disk_payload_bytes;
  b.packed = e->disk.packed ? 1 : 0;
  b.bare = e->disk.format == RecordFormat::kBare ? 1 : 0;
  b.checksum = e->disk.checksum;
  b.owner = e->owner;
  b.ns = static_cast<uint16_t>(e->ns);
  b.hits = std::min(e->hits, DiskOnlyBlock::kMaxHits);
  b.device = static_cast<uint8_t>(e->disk.device);
  b.disk_gate = e->disk_gate & DiskGate::kTagMask;
  Erase(e);
  disk_only_.Insert(b);
}

void BlockCache::PromoteFromDisk(BlockEntry* e, std::function<void(bool)> then) {
  auto [it, first] = disk_waiters_.try_emplace(e->key);
  if (then) it->second.push_back(std::move(then));
  if (first) ReadIntoHost(e);  // else a read of this block is under way: shared
}

void BlockCache::ReadIntoHost(BlockEntry* e) {
  if (uint8_t* dst = SlotForDiskRead(e); dst != nullptr) {
    StartDiskRead(e, dst);
  } else if (HostRoomIsComing(e)) {
    // Parked until then (never dropped), and counted as a copy in flight.
    e->moving = true;
    index_.Park(e);
    ++inflight_copies_;
    reads_waiting_for_room_.push_back(e->key);
    ++counters_.disk_reads_waited_for_room;
  } else {
    FailDiskRead(e);
  }
}

uint8_t* BlockCache::SlotForDiskRead(const BlockEntry* e) {
  // No record left (a reclaim took it while a load held the block): nothing
  // to read. A read takes free room or a clean block's slot, never one of a
  // block not on disk yet: the block read is safe there already.
  return e->on_disk ? AllocateSlot(Tier::kHost, ReadSlotBytes(e), Room::kCleanOnly) : nullptr;
}

bool BlockCache::HostRoomIsComing(const BlockEntry* e) const {
  // Host blocks leaving (written to disk, put to the remote tier, promoted
  // to hbm) free their slots, and MaybeDemote runs when each has left.
  return e->on_disk && tier(Tier::kHost)->moving_out_bytes > 0;
}

void BlockCache::RetryReadsWaitingForRoom() {
  while (!reads_waiting_for_room_.empty()) {
    BlockEntry* e = index_.Find(reads_waiting_for_room_.front());  // moving: never dropped
    KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
    uint8_t* dst = SlotForDiskRead(e);
    if (dst == nullptr && HostRoomIsComing(e)) return;  // in line still, and the rest behind it
    reads_waiting_for_room_.pop_front();
    --inflight_copies_;
    if (dst != nullptr) {
      StartDiskRead(e, dst);
      continue;
    }
    e->moving = false;
    index_.Unpark(e, /*hot=*/false);
    FailDiskRead(e);
  }
}

void BlockCache::FailDiskRead(BlockEntry* e) {
  // The block stays on disk, or is gone with its record; its loads miss it
  // (their Unlease lets go of the entry) and a prefetch's goes now.
  ++(e->on_disk ? counters_.disk_reads_without_room : counters_.disk_reads_record_gone);
  auto it = disk_waiters_.find(e->key);
  std::vector<std::function<void(bool)>> waiters;
  if (it != disk_waiters_.end()) {
    waiters = std::move(it->second);
    disk_waiters_.erase(it);
  }
  options_.post([waiters = std::move(waiters)] {
    for (const auto& w : waiters) w(false);
  });
  Dematerialize(e);
}

bool BlockCache::TransientReadError(const Status& st) {
  return st.code() == StatusCode::kCancelled || st.code() == StatusCode::kUnavailable ||
         st.code() == StatusCode::kResourceExhausted;
}

void BlockCache::StartDiskRead(BlockEntry* e, uint8_t* dst) {
  disk_waiters_.try_emplace(e->key);  // loads that come meanwhile share this read
  e->moving = true;
  index_.Park(e);
  ++inflight_copies_;
  if (e->disk.packed && KeepsCoded(e->ns)) {
    // Straight into a host slot of the payload's size, kept coded.
    const uint64_t payload = e->disk_payload_bytes;
    options_.disk->Read(e->key, e->disk, payload, dst,
                        [this, key = e->key, dst, payload,
                         start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) {
                          counters_.disk_read_latency.RecordSince(start);
                          FinishDiskRead(key, dst, std::move(st), checksum, payload);
                        });
    return;
  }
  if (e->disk.packed) {
    // Into a buffer of the record's payload, then decoded into the slot.
    const uint64_t payload = e->disk_payload_bytes;
    auto* raw = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, AlignUpToPage(payload)));
    KVTIER_CHECK(raw != nullptr);
    std::shared_ptr<uint8_t> staging(raw, &std::free);
    options_.disk->Read(e->key, e->disk, payload, raw,
                        [this, key = e->key, dst, staging = std::move(staging),
                         start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) mutable {
                          counters_.disk_read_latency.RecordSince(start);
                          BlockEntry* read = index_.Find(key);  // moving: never dropped
                          KVTIER_CHECK(read != nullptr && read->moving);
                          if (!st.ok() || options_.codecs == nullptr) {
                            FinishDiskRead(key, dst, st.ok() ? Status(StatusCode::kUnavailable, "no codec pool")
                                                             : std::move(st), checksum);
                            return;
                          }
                          DecodeDiskRead(read, std::move(staging), dst);
                        });
    return;
  }
  options_.disk->Read(e->key, e->disk, e->block_bytes, dst,
                      [this, key = e->key, dst, start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) {
                        counters_.disk_read_latency.RecordSince(start);
                        FinishDiskRead(key, dst, std::move(st), checksum);
                      });
}

uint64_t BlockCache::ReadSlotBytes(const BlockEntry* e) const {
  return e->disk.packed && KeepsCoded(e->ns) ? e->disk_payload_bytes : e->block_bytes;
}

void BlockCache::FinishDiskRead(const StoredKey& key, uint8_t* dst, Status status, uint64_t checksum,
                                uint64_t coded_bytes) {
  --inflight_copies_;
  BlockEntry* e = index_.Find(key);  // moving entries are never dropped
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
  e->moving = false;
  const bool ok = status.ok();
  if (ok) {
    Charge(e, -1);
    MoveToTier(e, Tier::kHost);
    e->slot = dst;
    e->coded_bytes = static_cast<uint32_t>(coded_bytes);
    tier(Tier::kHost)->pool->SetOwner(dst, e);
    e->checksum = checksum;
    e->has_checksum = true;
    Charge(e, +1);
    ++counters_.disk_promotions;
    counters_.bytes_disk_to_host += SlotBytes(e);
  } else {
    tier(Tier::kHost)->pool->Free(dst, coded_bytes != 0 ? coded_bytes : e->block_bytes);
    ++counters_.disk_read_failures;
    // The record is bad (it failed its checks, or the device could not read
    // it): it is no disk copy any more (and the block must not go back to
    // the disk-only table when the loads below let go of it). A read that
    // was cancelled (a stop) or refused for a moment (EAGAIN, ENOMEM) says
    // nothing of the record: it stays, and this read is only a miss.
    if (!TransientReadError(status)) {
      if (e->on_disk) options_.disk->Forget(e->key, e->disk);
      SetOnDisk(e, false);
    }
  }
  index_.Unpark(e, /*hot=*/true);  // in host now, or still on disk after a failure
  auto it = disk_waiters_.find(key);
  std::vector<std::function<void(bool)>> waiters;
  if (it != disk_waiters_.end()) {
    waiters = std::move(it->second);
    disk_waiters_.erase(it);
  }
  for (const auto& w : waiters) w(ok);  // loads release their leases of a failed block here
  if (!ok) {
    e = index_.Find(key);
    // Never served: a record that failed its checks (or its read) is
    // dropped; an intact one goes back to the disk-only table.
    if (e != nullptr && e->leases == 0 && !e->moving) {
      if (e->on_disk) {
        Dematerialize(e);
      } else {
        Drop(e);
      }
    }
  } else if (e = index_.Find(key); e != nullptr && e->tier == Tier::kHost) {
    MaybeCompact(e);  // a raw record of a block that asked for a codec
  }
  MaybeDemote();
}

void BlockCache::StartDiskWrite(BlockEntry* e, bool keep_in_memory, uint64_t budgeted) {
  // A block whose old slot a load still reads (its move to host landed
  // meanwhile) cannot leave host now: an entry keeps one retired slot. It is
  // written and stays, clean (a flush, a reclaim's rewrite, a write deferred
  // until its compaction ended). Nothing moves it while it is written.
  keep_in_memory = keep_in_memory || e->retired_slot != nullptr;
  e->moving = true;
  e->leaving = !keep_in_memory;
  index_.Park(e);  // out of the eviction path while it is written
  // A write-through copy leaves nothing in host: no space is on its way out.
  const uint64_t stride = keep_in_memory ? 0 : SlotPool::StrideFor(SlotBytes(e));
  tier(Tier::kHost)->moving_out_bytes += stride;
  if (!keep_in_memory) QuotaStateOf(e->owner).host_bytes_leaving += SlotBytes(e);
  ++inflight_copies_;
  ++disk_writes_in_flight_;
  DiskWriteDone done = [this, key = e->key, stride, keep_in_memory, budgeted,
                        start = std::chrono::steady_clock::now()](uint64_t payload_bytes,
                                                                  Result<DiskLocation> where) {
    counters_.disk_write_latency.RecordSince(start);
    FinishDiskWrite(key, stride, keep_in_memory, budgeted, payload_bytes, std::move(where));
  };
  // A coded host block is written as it is: DiskHeader says so.
  if (e->compress && e->coded_bytes == 0 && options_.codecs != nullptr) {
    const NamespaceFormat& format = namespaces_.FormatOf(e->ns);
    if (format.block_bytes == e->block_bytes) {
      if (StartPackedWrite(e, format.codec, done)) return;
      ++counters_.codec_pool_busy;
    }
  }
  const uint64_t payload_bytes = SlotBytes(e);
  options_.disk->Append(DiskHeader(e), e->slot, [done = std::move(done), payload_bytes](Result<DiskLocation> where) {
    done(payload_bytes, std::move(where));
  });
}

RecordHeader BlockCache::DiskHeader(const BlockEntry* e) {
  return RecordHeaderOf(e, SlotBytes(e), e->checksum, e->coded_bytes != 0);  // what its slot holds
}

RecordHeader BlockCache::RecordHeaderOf(const BlockEntry* e, uint64_t payload_bytes, uint64_t checksum,
                                        bool coded) {
  RecordHeader h;
  h.key = e->key;
  h.ns = namespaces_.FingerprintOf(e->ns);
  h.payload_bytes = payload_bytes;
  h.payload_checksum = checksum;
  if (coded) {
    const CodecParams& codec = namespaces_.FormatOf(e->ns).codec;
    h.codec = codec.kind;
    h.dtype = codec.dtype;
    h.group_elems = codec.kind == CodecKind::kFp8 ? codec.group_elems : 0;
    h.raw_bytes = e->block_bytes;
  }
  if (e->owner < tenant_names_.size()) h.owner = tenant_names_[e->owner];
  if (options_.listener != nullptr) h.annotation = options_.listener->DiskAnnotation(e->key, e->owner);
  return h;
}

// Tries per block before its write is given up, and write-back's pause after
// a failure: the first, doubling with each failure in a row, at most the last.
constexpr uint8_t kMaxDiskWriteTries = 3;
constexpr std::chrono::milliseconds kFirstWriteBackoff{10};
constexpr std::chrono::milliseconds kMaxWriteBackoff{5000};

void BlockCache::FinishDiskWrite(const StoredKey& key, uint64_t stride, bool keep_in_memory, uint64_t budgeted,
                                 uint64_t payload_bytes, Result<DiskLocation> where) {
  --inflight_copies_;
  --disk_writes_in_flight_;
  tier(Tier::kHost)->moving_out_bytes -= stride;
  BlockEntry* e = index_.Find(key);
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kHost);
  e->moving = false;
  e->leaving = false;
  if (stride != 0) QuotaStateOf(e->owner).host_bytes_leaving -= SlotBytes(e);
  if (!where) {
    ++counters_.disk_write_failures;
    RefundWriteBudget(budgeted);
    if (where.error().code() == StatusCode::kInvalidArgument) {
      // It can never be written (larger than a region): given up at once.
      // No fault of the device's: write-back goes on for other blocks.
      e->disk_write_failures = kMaxDiskWriteTries;
      ++counters_.disk_writes_given_up;
    } else {
      // Write-back pauses, so a failing device (or index) costs no CPU.
      ++disk_failures_in_a_row_;
      ++counters_.disk_write_backoffs;
      const auto pause = std::min<std::chrono::milliseconds>(
          kFirstWriteBackoff * (uint64_t{1} << std::min<uint32_t>(disk_failures_in_a_row_ - 1, 16)),
          kMaxWriteBackoff);
      disk_backoff_until_ = options_.clock() + pause;
      if (disk_failures_in_a_row_ == 1 || disk_failures_in_a_row_ % 1000 == 0) {
        spdlog::warn("disk tier: a write failed ({} in a row): {}; write-back pauses for {} ms",
                     disk_failures_in_a_row_, where.error().ToString(), pause.count());
      }
      // Tried too often: given up. It stays in memory as long as LRU keeps
      // it, and is dropped, not written, when it leaves. A failure of the
      // index (a full index volume, until it has room again) is no fault of
      // the block's: it is written once the index takes writes again.
      const bool index_failed = where.error().source() == ErrorSource::kRocksDb ||
                                where.error().code() == StatusCode::kResourceExhausted;
      if (!index_failed && e->disk_write_failures < UINT8_MAX) ++e->disk_write_failures;
      if (!index_failed && e->disk_write_failures == kMaxDiskWriteTries) ++counters_.disk_writes_given_up;
    }
    index_.Unpark(e, /*hot=*/false);
    MaybeDemote();
    return;
  }
  disk_failures_in_a_row_ = 0;
  e->disk_write_failures = 0;
  e->hits = 0;  // hits since it was written: what a reclaim will ask
  ++counters_.disk_demotions;
  counters_.bytes_host_to_disk += e->block_bytes;
  const TenantId owner = e->owner;
  LogDiskRecord(owner, key, *where);
  // Write-through: now clean, still served from memory. So is a block a load
  // holds (it may have leased it while the write ran): moved to disk, its
  // slot retired, it would end that load's prefix there if the load is
  // still reading another block up from disk (Load counts a block on disk
  // as not read). Clean, it goes back to disk at its next demotion, no write.
  if (keep_in_memory || e->leases > 0) {
    e->disk = *where;
    e->disk_payload_bytes = static_cast<uint32_t>(payload_bytes);
    SetOnDisk(e, true);
    index_.Unpark(e, /*hot=*/true);
    MaybeDemote();
    return;
  }
  uint8_t* old = e->slot;
  const uint64_t old_bytes = SlotBytes(e);
  Charge(e, -1);
  e->disk = *where;
  e->disk_payload_bytes = static_cast<uint32_t>(payload_bytes);
  SetOnDisk(e, true);
  MoveToTier(e, Tier::kDisk);
  e->slot = nullptr;
  e->coded_bytes = 0;
  Charge(e, +1);
  index_.Unpark(e, /*hot=*/true);
  RetireSlot(e, Tier::kHost, old, old_bytes);
  Dematerialize(e);  // unless loads still hold it
  EnforceDiskQuota(owner, kDiskQuotaStepsPerWrite, &key);  // its disk bytes grew
  MaybeDemote();
}

bool BlockCache::TakeWriteBudget(uint64_t bytes) {
  const uint64_t per_day = options_.disk_write_budget_bytes_per_day;
  if (per_day == 0) return true;
  const auto now = options_.clock();
  const double elapsed_s = std::chrono::duration<double>(now - budget_refilled_).count();
  budget_refilled_ = now;
  budget_tokens_ = std::min(static_cast<double>(per_day),
                            budget_tokens_ + elapsed_s * static_cast<double>(per_day) / 86400.0);
  if (budget_tokens_ < static_cast<double>(bytes)) return false;
  budget_tokens_ -= static_cast<double>(bytes);
  return true;
}

void BlockCache::RefundWriteBudget(uint64_t bytes) {
  if (options_.disk_write_budget_bytes_per_day == 0) return;  // unlimited: nothing was taken
  budget_tokens_ = std::min(static_cast<double>(options_.disk_write_budget_bytes_per_day),
                            budget_tokens_ + static_cast<double>(bytes));
}

bool BlockCache::DirtyInHost(const BlockEntry* e) {
  return e->tier == Tier::kHost && e->state == EntryState::kReady && !e->on_disk && !e->moving &&
         e->has_checksum && e->disk_write_failures < kMaxDiskWriteTries;
}

namespace {

// Most entries PumpDiskWrites looks at per call before it posts itself.
constexpr uint32_t kPumpStepsPerCall = 512;

}  // namespace

uint64_t BlockCache::FlushToDisk() {
  if (options_.disk == nullptr) return 0;
  uint64_t queued = 0;
  index_.ForEach([&](BlockEntry* e) {
    if (e->compacting && !e->on_disk) {
      e->deferred_write = std::max<uint8_t>(e->deferred_write, 1);  // written once it is coded
    } else if (DirtyInHost(e)) {
      QueueDiskWrite(e->key, /*keep_in_memory=*/false);
    } else {
      return;
    }
    ++queued;
  });
  flushing_ = queued > 0;
  PumpDiskWrites();
  FlushRemotePuts();
  return queued;
}

void BlockCache::CancelFlush() {
  disk_write_queue_.clear();
  flushing_ = false;
}

void BlockCache::QueueDiskWrite(const StoredKey& key, bool keep_in_memory) {
  // Each entry names a block in memory, or a stale one that is skipped; while
  // writes cannot keep up (or the disk is down), the oldest go first, so the
  // line stays within a few times what memory holds.
  const uint64_t in_memory = tier(Tier::kHost)->blocks + tier(Tier::kHbm)->blocks;
  if (disk_write_queue_.size() >= 2 * in_memory + 1024) disk_write_queue_.pop_front();
  disk_write_queue_.push_back(QueuedDiskWrite{key, keep_in_memory});
}

void BlockCache::PumpDiskWrites() {
  // Without a disk tier, write-back runs only to put blocks to the remote
  // tier as they leave host (then drops them).
  if (options_.disk == nullptr && !RemoteWriteBack()) return;
  if (disk_failures_in_a_row_ > 0 && options_.clock() < disk_backoff_until_) return;
  // Without a disk tier, write-back only puts blocks to the remote tier:
  // while puts pause after a failure, or hold their share of host, it
  // waits, and drops nothing unput.
  if (options_.disk == nullptr && (RemoteBackingOff() || !RemotePutRoom())) return;
  // After a failure, one write at a time until one succeeds: a failing
  // device costs one try per pause, not a crowd of them (each takes room in
  // the disk's log).
  const uint32_t cap =
      disk_failures_in_a_row_ > 0 ? 1 : std::max<uint32_t>(1, options_.disk_max_writes_in_flight);
  uint32_t steps = 0;
  // Writes in line first (write-through, flush): a stale one is skipped.
  while (disk_writes_in_flight_ < cap && !disk_write_queue_.empty() && steps < kPumpStepsPerCall) {
    ++steps;
    const QueuedDiskWrite w = disk_write_queue_.front();
    disk_write_queue_.pop_front();
    BlockEntry* e = index_.Find(w.key);
    if (e != nullptr && e->compacting && !e->on_disk) {
      e->deferred_write = std::max<uint8_t>(e->deferred_write, w.keep_in_memory ? 2 : 1);
      continue;
    }
    if (e == nullptr || !DirtyInHost(e)) continue;
    StartDiskWrite(e, w.keep_in_memory);
  }
  // Then write-back: host above its high watermark writes its coldest blocks
  // to disk (or drops them when admission says no) until it is below the
  // low one. Without a disk tier there is nowhere to write them: dropping
  // blocks early would only lose hits, so the host tier fills up and evicts
  // on demand (AllocateSlot), which is plain prefix-aware LRU.
  // A flush writes every host block anyway: write-back waits for it, so a
  // clean block is not handed back to an old region that the flush's own
  // appends then reclaim.
  if (AboveHigh(Tier::kHost)) host_demoting_ = true;
  while (host_demoting_ && !flushing_ && disk_writes_in_flight_ < cap && steps < kPumpStepsPerCall) {
    if (!ScanBudgetLeft()) break;  // the rest on a later turn
    ++steps;
    if (!AboveLow(Tier::kHost)) {
      host_demoting_ = false;
      break;
    }
    BlockEntry* v = PickBackgroundVictim(Tier::kHost);
    if (v == nullptr) break;
    if (PutsToRemote(v, Options::RemoteWrite::kOnDemote)) {
      QueueRemotePut(v, /*leaving=*/true);  // it leaves once the put has ended
      continue;
    }
    // Puts hold their share of host: without a disk it waits for them to
    // end, and drops nothing unput.
    if (options_.disk == nullptr && WantsRemotePut(v, Options::RemoteWrite::kOnDemote)) break;
    DemoteFromHost(v);
  }
  // A flush ends once the tier is idle: until then a reclaim (also one that
  // carried blocks' appends start) may still take a host block's disk copy.
  if (disk_write_queue_.empty() && disk_writes_in_flight_ == 0 &&
      (options_.disk == nullptr || options_.disk->inflight() == 0)) {
    flushing_ = false;
  }
  if (steps >= kPumpStepsPerCall) SchedulePump();  // more to do, after other work
}

bool BlockCache::DiskWriteMayStart() const {
  if (disk_failures_in_a_row_ > 0 && options_.clock() < disk_backoff_until_) return false;
  const uint32_t cap =
      disk_failures_in_a_row_ > 0 ? 1 : std::max<uint32_t>(1, options_.disk_max_writes_in_flight);
  return disk_writes_in_flight_ < cap;
}

void BlockCache::DemoteFromHost(BlockEntry* v, bool may_drop) {
  if (options_.disk == nullptr) {  // remote write-back: put already, or tried
    Drop(v);
    return;
  }
  if (BackToDisk(v)) return;
  if (v->disk_write_failures >= kMaxDiskWriteTries) {
    Drop(v);  // given up: it cannot be written
    return;
  }
  if (!DiskWriteMayStart()) {
    if (may_drop) {
      ++counters_.disk_writes_missed;
      Drop(v);
    }
    return;
  }
  // A disk quota evicts the tenant's own oldest records as it writes
  // (EnforceDiskQuota): only a block larger than the whole quota is refused.
  const std::optional<uint64_t>& disk_quota =
      v->owner < quotas_.size() ? quotas_[v->owner].bytes[static_cast<size_t>(Tier::kDisk)]
                                : std::nullopt;
  // The gates: reuse (a hit, or a store again after host let it go
  // unwritten) is always written; the learned gate also writes what its
  // class's samples say is hit on disk often enough.
  const bool gated = options_.disk_admit_on_reuse || options_.disk_admit_learned;
  bool returned = false;  // stored again after host let it go unwritten
  if (gated && v->hits == 0) returned = let_go_unwritten_.Contains(v->key.Low64());
  const bool reused = !gated || v->hits > 0 || returned || (options_.disk_admit_learned && gate_.Admits(v->disk_gate));
  const bool admitted = v->has_checksum && v->hits >= options_.disk_min_hits && reused &&
                        (!disk_quota || *disk_quota >= SlotBytes(v));
  const uint64_t record = RecordBytes(SlotBytes(v));
  if (admitted && TakeWriteBudget(record)) {
    counters_.disk_admitted_on_return += returned ? 1 : 0;
    StartDiskWrite(v, /*keep_in_memory=*/false, /*budgeted=*/record);
  } else {
    ++(admitted ? counters_.disk_over_budget : counters_.disk_not_admitted);
    if (gated && !reused) {
      let_go_unwritten_.SetRemember(4 * index_.order(Tier::kHost).size());
      let_go_unwritten_.Add(v->key.Low64());
    }
    Drop(v);
  }
}

bool BlockCache::IsCurrentRecord(const DiskWriteLog::Record& r) {
  if (DiskOnlyBlock* b = disk_only_.Find(r.key); b != nullptr) {
    return DiskWriteLog::Where(b->device, b->offset_bytes()) == r.where;
  }
  const BlockEntry* e = index_.Find(r.key);
  return e != nullptr && e->on_disk &&
         DiskWriteLog::Where(e->disk.device, e->disk.offset) == r.where;
}

void BlockCache::LogDiskRecord(TenantId owner, const StoredKey& key, const DiskLocation& where) {
  if (owner >= quotas_.size() || !quotas_[owner].bytes[static_cast<size_t>(Tier::kDisk)]) return;
  DiskWriteLog& log = QuotaStateOf(owner).disk_log;
  log.Push(DiskWriteLog::Record{key, DiskWriteLog::Where(where.device, where.offset)});
  // Its live entries are records of its blocks: at most the blocks it holds.
  const TenantShare& share = Counted(owner);
  log.Compact([this](const DiskWriteLog::Record& r) { return IsCurrentRecord(r); },
              share.blocks[0] + share.blocks[1] + share.blocks[2], kDiskLogCompactSteps);
}

void BlockCache::EnforceDiskQuota(TenantId owner, uint32_t max_steps, const StoredKey* newest) {
  if (owner >= quotas_.size() || owner >= quota_state_.size()) return;
  const std::optional<uint64_t>& quota = quotas_[owner].bytes[static_cast<size_t>(Tier::kDisk)];
  if (!quota) return;
  DiskWriteLog& log = quota_state_[owner].disk_log;
  for (uint32_t step = 0; step < max_steps && TenantUsedBytes(owner, Tier::kDisk) > *quota;
       ++step) {
    const DiskWriteLog::Record* oldest = log.Oldest();
    if (oldest == nullptr) break;  // what is left predates its quota: reclaims take it
    const DiskWriteLog::Record r = *oldest;
    if (newest != nullptr && r.key == *newest) break;  // all that is left is what just came
    log.PopOldest();
    if (!IsCurrentRecord(r)) continue;  // gone, or written again elsewhere
    DiskOnlyBlock* b = disk_only_.Find(r.key);
    if (b == nullptr) {
      log.Push(r);  // in memory (hit since) or busy (read, leased, carried): another round
      continue;
    }
    ++counters_.disk_quota_evictions;
    DropDiskOnly(b);
  }
}

BlockEntry* BlockCache::PickBackgroundVictim(Tier t) {
  const uint64_t before = counters_.victim_scan_blocks;
  BlockEntry* v = PickVictim(t, 0, std::nullopt, /*clean_only=*/false, /*moves_down=*/t == Tier::kHbm);
  background_scanned_ += counters_.victim_scan_blocks - before;
  return v;
}

bool BlockCache::ScanBudgetLeft() {
  if (background_scanned_ - scan_base_ < std::max<uint32_t>(1, options_.background_scan_budget)) return true;
  if (!pump_posted_) ++counters_.scan_budget_deferrals;
  SchedulePump();
  return false;
}

void BlockCache::SchedulePump() {
  if (pump_posted_) return;
  pump_posted_ = true;
  options_.post([self = std::weak_ptr<BlockCache*>(self_)] {
    auto cache = self.lock();
    if (!cache) return;
    (*cache)->pump_posted_ = false;
    (*cache)->scan_base_ = (*cache)->background_scanned_;  // a new budget
    (*cache)->MaybeDemote();  // hbm's demotion, write-back, and what they queued
  });
}

}  // namespace kvtier
