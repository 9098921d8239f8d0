// CacheDisk: BlockCache's disk side (block_cache_disk.h): write-back to the
// disk tier, reads back up to host (shared between loads), the write budget
// and the gates. Recovery and reclaim are in block_cache_reclaim.cc.
#include "tiers/block_cache_disk.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/check.h"
#include "tiers/block_cache_codec.h"
#include "tiers/block_cache_policy.h"
#include "tiers/block_cache_remote.h"
#include "tiers/block_cache_room.h"
#include "tiers/codec_pool.h"

namespace kvtier {

CacheDisk::CacheDisk(BlockCache& cache)
    : cache_(cache),
      gate_(cache.options_.disk_gate_sample_every),
      budget_tokens_(static_cast<double>(cache.options_.disk_write_budget_bytes_per_day)),
      budget_refilled_(cache.created_) {}

void CacheDisk::PromoteFromDisk(BlockEntry* e, std::function<void(bool)> then) {
  auto [it, first] = disk_waiters_.try_emplace(e->key);
  if (then) it->second.push_back(std::move(then));
  if (first) ReadIntoHost(e);  // else a read of this block is under way: shared
}

void CacheDisk::ReadIntoHost(BlockEntry* e) {
  if (uint8_t* dst = SlotForDiskRead(e); dst != nullptr) {
    StartDiskRead(e, dst);
  } else if (WriteBackForRead(e) || HostRoomIsComing(e)) {
    // Parked until then (never dropped), and counted as a copy in flight.
    e->moving = true;
    cache_.index_.Park(e);
    ++cache_.inflight_copies_;
    reads_waiting_for_room_.push_back(e->key);
    ++cache_.counters_.disk_reads_waited_for_room;
  } else {
    FailDiskRead(e);
  }
}

uint8_t* CacheDisk::SlotForDiskRead(const BlockEntry* e) {
  // No record left (a reclaim took it while a load held the block): nothing
  // to read. A read takes free room or a clean block's slot, never one of a
  // block not on disk yet: the block read is safe there already. It is held
  // to its owner's host quota, as a store is: the owner's colder host blocks
  // go back to disk for it; past that, a load's read takes free room and
  // goes back to disk after the load (RoomGate::ForRead).
  const auto waiting = disk_waiters_.find(e->key);
  const bool for_load = waiting != disk_waiters_.end() && !waiting->second.empty();
  return e->on_disk ? cache_.room_->ForRead(ReadSlotBytes(e), e->owner, for_load) : nullptr;
}

bool CacheDisk::HostRoomIsComing(const BlockEntry* e) const {
  // Host blocks leaving (written to disk, put to the remote tier, promoted
  // to hbm) free their slots, and MaybeDemote runs when each has left.
  return e->on_disk && cache_.tier(Tier::kHost)->moving_out_bytes > 0;
}

bool CacheDisk::WriteBackForRead(const BlockEntry* e) {
  // Host under its watermark writes nothing back, and the rest of it may be
  // this load's own reads: the block the load needs is worth the write of
  // one nobody asked for (a prefetch's read does not wait for it).
  const auto waiting = disk_waiters_.find(e->key);
  if (!e->on_disk || waiting == disk_waiters_.end() || waiting->second.empty()) return false;
  BlockEntry* dirty = cache_.room_->PickVictim(Tier::kHost, ReadSlotBytes(e), std::nullopt);
  return dirty != nullptr && WriteBack(dirty);
}

void CacheDisk::RetryReadsWaitingForRoom() {
  while (!reads_waiting_for_room_.empty()) {
    BlockEntry* e = cache_.index_.Find(reads_waiting_for_room_.front());  // moving: never dropped
    KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
    uint8_t* dst = SlotForDiskRead(e);
    // In line still, and the rest behind it:
    if (dst == nullptr && (WriteBackForRead(e) || HostRoomIsComing(e))) return;
    reads_waiting_for_room_.pop_front();
    --cache_.inflight_copies_;
    if (dst != nullptr) {
      StartDiskRead(e, dst);
      continue;
    }
    e->moving = false;
    cache_.index_.Unpark(e, /*hot=*/false);
    FailDiskRead(e);
  }
}

void CacheDisk::FailDiskRead(BlockEntry* e) {
  // The block stays on disk, or is gone with its record; its loads miss it
  // (their Unlease lets go of the entry) and a prefetch's goes now.
  ++(e->on_disk ? cache_.counters_.disk_reads_without_room : cache_.counters_.disk_reads_record_gone);
  cache_.options_.post([waiters = TakeWaiters(e->key)] {
    for (const auto& w : waiters) w(false);
  });
  cache_.Dematerialize(e);
}

std::vector<std::function<void(bool)>> CacheDisk::TakeWaiters(const StoredKey& key) {
  std::vector<std::function<void(bool)>> waiters;
  if (auto it = disk_waiters_.find(key); it != disk_waiters_.end()) {
    waiters = std::move(it->second);
    disk_waiters_.erase(it);
  }
  return waiters;
}

bool CacheDisk::TransientReadError(const Status& st) {
  return st.code() == StatusCode::kCancelled || st.code() == StatusCode::kUnavailable ||
         st.code() == StatusCode::kResourceExhausted;
}

void CacheDisk::StartDiskRead(BlockEntry* e, uint8_t* dst) {
  disk_waiters_.try_emplace(e->key);  // loads that come meanwhile share this read
  cache_.policy_->HostArriving(e->owner, ReadSlotBytes(e), /*more=*/true);
  e->moving = true;
  cache_.index_.Park(e);
  ++cache_.inflight_copies_;
  if (e->disk.packed && cache_.codec_->KeepsCoded(e->ns)) {
    // Straight into a host slot of the payload's size, kept coded.
    const uint64_t payload = e->disk_payload_bytes;
    cache_.options_.disk->Read(e->key, e->disk, payload, dst,
                        [this, key = e->key, dst, payload,
                         start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) {
                          cache_.counters_.disk_read_latency.RecordSince(start);
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
    cache_.options_.disk->Read(e->key, e->disk, payload, raw,
                        [this, key = e->key, dst, staging = std::move(staging),
                         start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) mutable {
                          cache_.counters_.disk_read_latency.RecordSince(start);
                          BlockEntry* read = cache_.index_.Find(key);  // moving: never dropped
                          KVTIER_CHECK(read != nullptr && read->moving);
                          if (!st.ok() || cache_.options_.codecs == nullptr) {
                            FinishDiskRead(key, dst, st.ok() ? Status(StatusCode::kUnavailable, "no codec pool")
                                                             : std::move(st), checksum);
                            return;
                          }
                          cache_.codec_->DecodeDiskRead(read, std::move(staging), dst);
                        });
    return;
  }
  cache_.options_.disk->Read(e->key, e->disk, e->block_bytes, dst,
                      [this, key = e->key, dst, start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) {
                        cache_.counters_.disk_read_latency.RecordSince(start);
                        FinishDiskRead(key, dst, std::move(st), checksum);
                      });
}

uint64_t CacheDisk::ReadSlotBytes(const BlockEntry* e) const {
  return e->disk.packed && cache_.codec_->KeepsCoded(e->ns) ? e->disk_payload_bytes : e->block_bytes;
}

void CacheDisk::FinishDiskRead(const StoredKey& key, uint8_t* dst, Status status, uint64_t checksum,
                                uint64_t coded_bytes) {
  --cache_.inflight_copies_;
  BlockEntry* e = cache_.index_.Find(key);  // moving entries are never dropped
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
  e->moving = false;
  cache_.policy_->HostArriving(e->owner, coded_bytes != 0 ? coded_bytes : e->block_bytes, /*more=*/false);
  const bool ok = status.ok();
  if (ok) {
    cache_.Charge(e, -1);
    cache_.MoveToTier(e, Tier::kHost);
    e->slot = dst;
    e->coded_bytes = static_cast<uint32_t>(coded_bytes);
    cache_.tier(Tier::kHost)->pool->SetOwner(dst, e);
    e->checksum = checksum;
    e->has_checksum = true;
    cache_.Charge(e, +1);
    ++cache_.counters_.disk_promotions;
    cache_.counters_.bytes_disk_to_host += cache_.SlotBytes(e);
  } else {
    cache_.tier(Tier::kHost)->pool->Free(dst, coded_bytes != 0 ? coded_bytes : e->block_bytes);
    ++cache_.counters_.disk_read_failures;
    // The record is bad (it failed its checks, or the device could not read
    // it): it is no disk copy any more (and the block must not go back to
    // the disk-only table when the loads below let go of it). A read that
    // was cancelled (a stop) or refused for a moment (EAGAIN, ENOMEM) says
    // nothing of the record: it stays, and this read is only a miss.
    if (!TransientReadError(status)) {
      if (e->on_disk) cache_.options_.disk->Forget(e->key, e->disk);
      cache_.SetOnDisk(e, false);
    }
  }
  cache_.index_.Unpark(e, /*hot=*/true);  // in host now, or still on disk after a failure
  for (const auto& w : TakeWaiters(key)) w(ok);  // loads release their leases of a failed block here
  if (!ok) {
    e = cache_.index_.Find(key);
    // Never served: a record that failed its checks (or its read) is
    // dropped; an intact one goes back to the disk-only table.
    if (e != nullptr && e->leases == 0 && !e->moving) {
      if (e->on_disk) {
        cache_.Dematerialize(e);
      } else {
        cache_.Drop(e);
      }
    }
  } else if (e = cache_.index_.Find(key); e != nullptr && e->tier == Tier::kHost) {
    cache_.codec_->MaybeCompact(e);  // a raw record of a block that asked for a codec
  }
  cache_.MaybeDemote();
}

void CacheDisk::StartDiskWrite(BlockEntry* e, bool keep_in_memory, uint64_t budgeted) {
  // A block whose old slot a load still reads (its move to host landed
  // meanwhile) cannot leave host now: an entry keeps one retired slot. It is
  // written and stays, clean (a flush, a reclaim's rewrite, a write deferred
  // until its compaction ended). Nothing moves it while it is written.
  keep_in_memory = keep_in_memory || e->retired_slot != nullptr;
  e->moving = true;
  e->leaving = !keep_in_memory;
  cache_.index_.Park(e);  // out of the eviction path while it is written
  // A write-through copy leaves nothing in host: no space is on its way out.
  const uint64_t stride = keep_in_memory ? 0 : SlotPool::StrideFor(cache_.SlotBytes(e));
  cache_.tier(Tier::kHost)->moving_out_bytes += stride;
  if (!keep_in_memory) cache_.policy_->HostLeaving(e->owner, cache_.SlotBytes(e), /*more=*/true);
  ++cache_.inflight_copies_;
  ++disk_writes_in_flight_;
  CacheCodec::DiskWriteDone done = [this, key = e->key, stride, keep_in_memory, budgeted,
                        start = std::chrono::steady_clock::now()](uint64_t payload_bytes,
                                                                  Result<DiskLocation> where) {
    cache_.counters_.disk_write_latency.RecordSince(start);
    FinishDiskWrite(key, stride, keep_in_memory, budgeted, payload_bytes, std::move(where));
  };
  // A coded host block is written as it is: DiskHeader says so.
  if (e->compress && e->coded_bytes == 0 && cache_.options_.codecs != nullptr) {
    const NamespaceFormat& format = cache_.namespaces_.FormatOf(e->ns);
    if (format.block_bytes == e->block_bytes) {
      if (cache_.codec_->StartPackedWrite(e, format.codec, done)) return;
      ++cache_.counters_.codec_pool_busy;
    }
  }
  const uint64_t payload_bytes = cache_.SlotBytes(e);
  cache_.options_.disk->Append(DiskHeader(e), e->slot, [done = std::move(done), payload_bytes](Result<DiskLocation> where) {
    done(payload_bytes, std::move(where));
  });
}

RecordHeader CacheDisk::DiskHeader(const BlockEntry* e) {
  return RecordHeaderOf(e, cache_.SlotBytes(e), e->checksum, e->coded_bytes != 0);  // what its slot holds
}

RecordHeader CacheDisk::RecordHeaderOf(const BlockEntry* e, uint64_t payload_bytes, uint64_t checksum,
                                        bool coded) {
  RecordHeader h;
  h.key = e->key;
  h.ns = cache_.namespaces_.FingerprintOf(e->ns);
  h.payload_bytes = payload_bytes;
  h.payload_checksum = checksum;
  if (coded) {
    const CodecParams& codec = cache_.namespaces_.FormatOf(e->ns).codec;
    h.codec = codec.kind;
    h.dtype = codec.dtype;
    h.group_elems = codec.kind == CodecKind::kFp8 ? codec.group_elems : 0;
    h.raw_bytes = e->block_bytes;
  }
  h.owner = cache_.policy_->NameOf(e->owner);
  if (cache_.options_.listener != nullptr) h.annotation = cache_.options_.listener->DiskAnnotation(e->key, e->owner);
  return h;
}

// Tries per block before its write is given up, and write-back's pause after
// a failure: the first, doubling with each failure in a row, at most the last.
constexpr uint8_t kMaxDiskWriteTries = 3;
constexpr std::chrono::milliseconds kFirstWriteBackoff{10};
constexpr std::chrono::milliseconds kMaxWriteBackoff{5000};

void CacheDisk::FinishDiskWrite(const StoredKey& key, uint64_t stride, bool keep_in_memory, uint64_t budgeted,
                                 uint64_t payload_bytes, Result<DiskLocation> where) {
  --cache_.inflight_copies_;
  --disk_writes_in_flight_;
  cache_.tier(Tier::kHost)->moving_out_bytes -= stride;
  BlockEntry* e = cache_.index_.Find(key);
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kHost);
  e->moving = false;
  e->leaving = false;
  if (stride != 0) cache_.policy_->HostLeaving(e->owner, cache_.SlotBytes(e), /*more=*/false);
  if (!where) {
    ++cache_.counters_.disk_write_failures;
    RefundWriteBudget(budgeted);
    if (where.error().code() == StatusCode::kInvalidArgument) {
      // It can never be written (larger than a region): given up at once.
      // No fault of the device's: write-back goes on for other blocks.
      e->disk_write_failures = kMaxDiskWriteTries;
      ++cache_.counters_.disk_writes_given_up;
    } else {
      // Write-back pauses, so a failing device (or index) costs no CPU.
      ++disk_failures_in_a_row_;
      ++cache_.counters_.disk_write_backoffs;
      const auto pause = std::min<std::chrono::milliseconds>(
          kFirstWriteBackoff * (uint64_t{1} << std::min<uint32_t>(disk_failures_in_a_row_ - 1, 16)),
          kMaxWriteBackoff);
      disk_backoff_until_ = cache_.options_.clock() + pause;
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
      if (!index_failed && e->disk_write_failures == kMaxDiskWriteTries) ++cache_.counters_.disk_writes_given_up;
    }
    cache_.index_.Unpark(e, /*hot=*/false);
    cache_.MaybeDemote();
    return;
  }
  disk_failures_in_a_row_ = 0;
  e->disk_write_failures = 0;
  e->hits = 0;  // hits since it was written: what a reclaim will ask
  ++cache_.counters_.disk_demotions;
  cache_.counters_.bytes_host_to_disk += e->block_bytes;
  const TenantId owner = e->owner;
  cache_.policy_->LogDiskRecord(owner, key, *where);
  // Write-through: now clean, still served from memory. So is a block a load
  // holds (it may have leased it while the write ran): moved to disk, its
  // slot retired, it would end that load's prefix there if the load is
  // still reading another block up from disk (Load counts a block on disk
  // as not read). Clean, it goes back to disk at its next demotion, no write.
  if (keep_in_memory || e->leases > 0) {
    e->disk = *where;
    e->disk_payload_bytes = static_cast<uint32_t>(payload_bytes);
    cache_.SetOnDisk(e, true);
    cache_.index_.Unpark(e, /*hot=*/true);
    cache_.MaybeDemote();
    return;
  }
  uint8_t* old = e->slot;
  const uint64_t old_bytes = cache_.SlotBytes(e);
  cache_.Charge(e, -1);
  e->disk = *where;
  e->disk_payload_bytes = static_cast<uint32_t>(payload_bytes);
  cache_.SetOnDisk(e, true);
  cache_.MoveToTier(e, Tier::kDisk);
  e->slot = nullptr;
  e->coded_bytes = 0;
  cache_.Charge(e, +1);
  cache_.index_.Unpark(e, /*hot=*/true);
  cache_.RetireSlot(e, Tier::kHost, old, old_bytes);
  cache_.Dematerialize(e);  // unless loads still hold it
  cache_.policy_->DiskGrew(owner, key);
  cache_.MaybeDemote();
}

bool CacheDisk::TakeWriteBudget(uint64_t bytes) {
  const uint64_t per_day = cache_.options_.disk_write_budget_bytes_per_day;
  if (per_day == 0) return true;
  const auto now = cache_.options_.clock();
  const double elapsed_s = std::chrono::duration<double>(now - budget_refilled_).count();
  budget_refilled_ = now;
  budget_tokens_ = std::min(static_cast<double>(per_day),
                            budget_tokens_ + elapsed_s * static_cast<double>(per_day) / 86400.0);
  if (budget_tokens_ < static_cast<double>(bytes)) return false;
  budget_tokens_ -= static_cast<double>(bytes);
  return true;
}

void CacheDisk::RefundWriteBudget(uint64_t bytes) {
  if (cache_.options_.disk_write_budget_bytes_per_day == 0) return;  // unlimited: nothing was taken
  budget_tokens_ = std::min(static_cast<double>(cache_.options_.disk_write_budget_bytes_per_day),
                            budget_tokens_ + static_cast<double>(bytes));
}

bool CacheDisk::DirtyInHost(const BlockEntry* e) {
  return e->tier == Tier::kHost && e->state == EntryState::kReady && !e->on_disk && !e->moving &&
         e->has_checksum && e->disk_write_failures < kMaxDiskWriteTries;
}

namespace {

// Most entries PumpDiskWrites looks at per call before it posts itself.
constexpr uint32_t kPumpStepsPerCall = 512;

}  // namespace

uint64_t CacheDisk::FlushToDisk() {
  if (cache_.options_.disk == nullptr) return 0;
  uint64_t queued = 0;
  cache_.index_.ForEach([&](BlockEntry* e) {
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
  cache_.remote_->FlushRemotePuts();
  return queued;
}

void CacheDisk::CancelFlush() {
  disk_write_queue_.clear();
  flushing_ = false;
}

void CacheDisk::QueueDiskWrite(const StoredKey& key, bool keep_in_memory) {
  // Each entry names a block in memory, or a stale one that is skipped; while
  // writes cannot keep up (or the disk is down), the oldest go first, so the
  // line stays within a few times what memory holds.
  const uint64_t in_memory = cache_.tier(Tier::kHost)->blocks + cache_.tier(Tier::kHbm)->blocks;
  if (disk_write_queue_.size() >= 2 * in_memory + 1024) disk_write_queue_.pop_front();
  disk_write_queue_.push_back(QueuedDiskWrite{key, keep_in_memory});
}

void CacheDisk::PumpDiskWrites() {
  // Without a disk tier, write-back runs only to put blocks to the remote
  // tier as they leave host (then drops them).
  if (cache_.options_.disk == nullptr && !cache_.remote_->RemoteWriteBack()) return;
  if (disk_failures_in_a_row_ > 0 && cache_.options_.clock() < disk_backoff_until_) return;
  // Without a disk tier, write-back only puts blocks to the remote tier:
  // while puts pause after a failure, or hold their share of host, it
  // waits, and drops nothing unput.
  if (cache_.options_.disk == nullptr && (cache_.remote_->RemoteBackingOff() || !cache_.remote_->RemotePutRoom())) return;
  // After a failure, one write at a time until one succeeds: a failing
  // device costs one try per pause, not a crowd of them (each takes room in
  // the disk's log).
  const uint32_t cap =
      disk_failures_in_a_row_ > 0 ? 1 : std::max<uint32_t>(1, cache_.options_.disk_max_writes_in_flight);
  uint32_t steps = 0;
  // Writes in line first (write-through, flush): a stale one is skipped.
  while (disk_writes_in_flight_ < cap && !disk_write_queue_.empty() && steps < kPumpStepsPerCall) {
    ++steps;
    const QueuedDiskWrite w = disk_write_queue_.front();
    disk_write_queue_.pop_front();
    BlockEntry* e = cache_.index_.Find(w.key);
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
  // on demand (RoomGate), which is plain prefix-aware LRU.
  // A flush writes every host block anyway: write-back waits for it, so a
  // clean block is not handed back to an old region that the flush's own
  // appends then reclaim.
  if (cache_.AboveHigh(Tier::kHost)) host_demoting_ = true;
  while (host_demoting_ && !flushing_ && disk_writes_in_flight_ < cap && steps < kPumpStepsPerCall) {
    if (!cache_.ScanBudgetLeft()) break;  // the rest on a later turn
    ++steps;
    if (!cache_.AboveLow(Tier::kHost)) {
      host_demoting_ = false;
      break;
    }
    BlockEntry* v = cache_.PickBackgroundVictim(Tier::kHost);
    if (v == nullptr) break;
    if (cache_.remote_->PutsToRemote(v, CacheRemote::RemoteWrite::kOnDemote)) {
      cache_.remote_->QueueRemotePut(v, /*leaving=*/true);  // it leaves once the put has ended
      continue;
    }
    // Puts hold their share of host: without a disk it waits for them to
    // end, and drops nothing unput.
    if (cache_.options_.disk == nullptr && cache_.remote_->WantsRemotePut(v, CacheRemote::RemoteWrite::kOnDemote)) break;
    DemoteFromHost(v);
  }
  // A flush ends once the tier is idle: until then a reclaim (also one that
  // carried blocks' appends start) may still take a host block's disk copy.
  if (disk_write_queue_.empty() && disk_writes_in_flight_ == 0 &&
      (cache_.options_.disk == nullptr || cache_.options_.disk->inflight() == 0)) {
    flushing_ = false;
  }
  if (steps >= kPumpStepsPerCall) cache_.SchedulePump();  // more to do, after other work
}

bool CacheDisk::DiskWriteMayStart() const {
  if (disk_failures_in_a_row_ > 0 && cache_.options_.clock() < disk_backoff_until_) return false;
  const uint32_t cap =
      disk_failures_in_a_row_ > 0 ? 1 : std::max<uint32_t>(1, cache_.options_.disk_max_writes_in_flight);
  return disk_writes_in_flight_ < cap;
}

void CacheDisk::DemoteFromHost(BlockEntry* v, bool may_drop) {
  if (cache_.options_.disk == nullptr) {  // remote write-back: put already, or tried
    cache_.Drop(v);
    return;
  }
  if (cache_.BackToDisk(v)) return;
  if (v->disk_write_failures >= kMaxDiskWriteTries) {
    cache_.Drop(v);  // given up: it cannot be written
    return;
  }
  if (!DiskWriteMayStart()) {
    if (may_drop) {
      ++cache_.counters_.disk_writes_missed;
      cache_.Drop(v);
    }
    return;
  }
  const Admission a = Admit(v);
  if (a.admitted && TakeWriteBudget(a.record)) {
    cache_.counters_.disk_admitted_on_return += a.returned ? 1 : 0;
    StartDiskWrite(v, /*keep_in_memory=*/false, /*budgeted=*/a.record);
  } else {
    ++(a.admitted ? cache_.counters_.disk_over_budget : cache_.counters_.disk_not_admitted);
    if (a.gated && !a.reused) {
      let_go_unwritten_.SetRemember(4 * cache_.index_.order(Tier::kHost).size());
      let_go_unwritten_.Add(v->key.Low64());
    }
    cache_.Drop(v);
  }
}

bool CacheDisk::WriteBack(BlockEntry* v) {
  if (cache_.options_.disk == nullptr || !DirtyInHost(v) || v->leases != 0 || !DiskWriteMayStart()) return false;
  const Admission a = Admit(v);
  if (!a.admitted || !TakeWriteBudget(a.record)) return false;
  cache_.counters_.disk_admitted_on_return += a.returned ? 1 : 0;
  StartDiskWrite(v, /*keep_in_memory=*/false, /*budgeted=*/a.record);
  return true;
}

CacheDisk::Admission CacheDisk::Admit(const BlockEntry* v) {
  Admission a;
  // A disk quota evicts the tenant's own oldest records as it writes
  // (CachePolicy::DiskGrew): only a block larger than the whole quota is
  // refused.
  const std::optional<uint64_t> disk_quota = cache_.policy_->QuotaOf(v->owner, Tier::kDisk);
  // The gates: reuse (a hit, or a store again after host let it go
  // unwritten) is always written; the learned gate also writes what its
  // class's samples say is hit on disk often enough.
  a.gated = cache_.options_.disk_admit_on_reuse || cache_.options_.disk_admit_learned;
  if (a.gated && v->hits == 0) a.returned = let_go_unwritten_.Contains(v->key.Low64());
  a.reused = !a.gated || v->hits > 0 || a.returned ||
             (cache_.options_.disk_admit_learned && gate_.Admits(v->disk_gate));
  a.admitted = v->has_checksum && v->hits >= cache_.options_.disk_min_hits && a.reused &&
               (!disk_quota || *disk_quota >= cache_.SlotBytes(v));
  a.record = RecordBytes(cache_.SlotBytes(v));
  return a;
}

}  // namespace kvtier
