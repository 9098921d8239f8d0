// DiskTier's reclaim (its contract is in disk_tier.h): regions freed oldest
// first ahead of need, their records hit since they were written carried
// forward (read out and appended again), the rest deleted from the index, and
// appends waiting for a region served once one is free.
#include "tiers/disk/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/check.h"

#include "tiers/disk/disk_tier_internal.h"

namespace kvtier {

using disk_tier_detail::CheckRecord;
using disk_tier_detail::KeySlice;
using disk_tier_detail::ParseValue;
using disk_tier_detail::RegionKey;
using disk_tier_detail::RegionValue;

void DiskTier::MaybeReclaim() {
  const auto now = options_.clock();
  if (!failed_reclaims_.empty() && now >= retry_reclaims_at_) {
    std::vector<FailedReclaim> retry = std::exchange(failed_reclaims_, {});
    for (FailedReclaim& f : retry) SubmitReclaimDeletes(f.device, f.region, std::move(f.keys));
  }
  if (!failed_reclaims_.empty()) return;  // the index cannot be written: wait
  // Regions free or on their way: a reclaim under way counts, or appends
  // waiting for its index write would start one reclaim after another.
  const uint64_t available = free_regions_ + reclaiming_;
  if (available < FreeTarget(options_.high_watermark)) reclaim_burst_ = true;
  if (available >= FreeTarget(options_.low_watermark)) reclaim_burst_ = false;
  if (!reclaim_burst_ || sealed_.empty()) return;
  const auto [di, ri] = sealed_.front();
  // Oldest first; its last appends finish before it can go (FinishAppend
  // calls back here).
  if (devices_[di].regions[ri].writes > 0) return;
  sealed_.pop_front();
  StartReclaim(di, ri);
  ScheduleReclaim();  // the next region, if the watermarks want it, on a later turn
}

void DiskTier::ScheduleReclaim() {
  if (reclaim_scheduled_) return;
  reclaim_scheduled_ = true;
  // Posted, not called: a reclaim asks the owner about many blocks, which
  // must not happen inside the owner's own call into the tier (Append).
  options_.post([self = std::weak_ptr<DiskTier*>(self_)] {
    auto tier = self.lock();
    if (!tier) return;
    (*tier)->reclaim_scheduled_ = false;
    (*tier)->MaybeReclaim();
  });
}

void DiskTier::StartReclaim(uint32_t device, uint32_t region) {
  Region& r = devices_[device].regions[region];
  KVTIER_CHECK(r.state == RegionState::kSealed);
  r.state = RegionState::kReclaiming;
  ++reclaiming_;
  // The owner decides for every record it still has here; nothing can keep
  // the region. Carried records are read out before the region is reused.
  std::vector<StoredKey> deleted;
  const size_t carry_budget =
      static_cast<size_t>(options_.carry_fraction * static_cast<double>(r.members.size()));
  size_t carried = 0;
  const uint64_t start = uint64_t{region} * options_.region_bytes;
  for (const Member& m : r.members) {
    const DiskLocation where{device, region, start + uint64_t{m.page} * kRecordAlignBytes, 0, 0};
    const bool may_carry =
        carried < carry_budget && carry_staging_bytes_ < options_.max_carry_staging_bytes;
    ReclaimAnswer answer = options_.reclaim(m.key, where, may_carry);
    if (answer.action == ReclaimAction::kStale) continue;
    deleted.push_back(m.key);
    ++counters_.records_reclaimed;
    if (live_records_ > 0) --live_records_;
    if (answer.action == ReclaimAction::kCarry) {
      ++carried;
      StartCarry(m.key, where, std::move(answer));
    }
  }
  SubmitReclaimDeletes(device, region, std::move(deleted));
}

void DiskTier::StartCarry(const StoredKey& key, const DiskLocation& where, ReclaimAnswer answer) {
  const RecordFormat format = answer.format;
  const uint64_t payload_bytes = answer.header.payload_bytes;
  const uint64_t record_bytes = RecordBytes(payload_bytes, format);
  ++counters_.records_carried;
  ++devices_[where.device].regions[where.region].reads;
  ++inflight_;
  // The whole record in one read, into a buffer of its own: it is written
  // again from there.
  auto* raw = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, record_bytes));
  KVTIER_CHECK(raw != nullptr);
  carry_staging_bytes_ += record_bytes;
  // Freed, and counted off, once the record is written again (or failed).
  std::shared_ptr<uint8_t> staging(
      raw, [this, record_bytes, self = std::weak_ptr<DiskTier*>(self_)](uint8_t* p) {
        std::free(p);
        if (self.lock()) carry_staging_bytes_ -= record_bytes;
      });
  const uint64_t payload_offset = format == RecordFormat::kHeaderPage ? RecordHeader::kBytes : 0;
  auto finish = [this, key, where, record_bytes, staging, payload_offset, header = std::move(answer.header),
                 self = std::weak_ptr<DiskTier*>(self_)](Status st) mutable {
    auto tier = self.lock();
    if (!tier) return;
    Region& region = devices_[where.device].regions[where.region];
    --region.reads;
    --inflight_;
    if (!st.ok()) {
      ++(st.code() == StatusCode::kCorruption ? counters_.checksum_failures : counters_.io_errors);
      spdlog::warn("disk tier: record at {}:{} not carried forward: {}", devices_[where.device].device->name(),
                   where.offset, st.message());
      options_.relocated(key, Err(std::move(st)));
    } else {
      ++counters_.reads;
      counters_.read_bytes += record_bytes;
      Append(std::move(header), staging.get() + payload_offset, [this, key, staging](Result<DiskLocation> now) {
        options_.relocated(key, std::move(now));
      });
    }
    if (region.state == RegionState::kReclaiming) MaybeFree(where.device, where.region);
  };
  devices_[where.device].device->Read(
      where.offset, std::span<uint8_t>(raw, record_bytes),
      [raw, key, format, payload_bytes, payload_offset, record_bytes, checksum = answer.header.payload_checksum,
       finish = std::move(finish), post = options_.post](Result<uint64_t> got) mutable {
        const std::span<const uint8_t> header = format == RecordFormat::kHeaderPage
                                                    ? std::span<const uint8_t>(raw, RecordHeader::kBytes)
                                                    : std::span<const uint8_t>(raw, record_bytes);
        Status st = got ? CheckRecord(key, format, header,
                                      std::span<const uint8_t>(raw + payload_offset, payload_bytes), checksum)
                        : got.error();
        post([finish = std::move(finish), st = std::move(st)]() mutable { finish(std::move(st)); });
      });
}

void DiskTier::SubmitReclaimDeletes(uint32_t device, uint32_t region, std::vector<StoredKey> keys) {
  devices_[device].regions[region].deletes_pending = true;
  // Each entry is deleted only while it still names this region, read on
  // the writer thread after every earlier index write: a retry (after the
  // index failed) must not delete the entry of a key appended again
  // elsewhere since, which is durable. The keys are kept for that retry: a
  // failed write leaves the region unusable until its deletes are durable.
  auto kept = std::make_shared<std::vector<StoredKey>>(std::move(keys));
  IndexWriter::Build build = [db = db_.get(), blocks = blocks_cf_, regions = regions_cf_, device, region,
                              kept](rocksdb::WriteBatch* batch) {
    std::string value;
    for (const StoredKey& key : *kept) {
      const rocksdb::Status s = db->Get(rocksdb::ReadOptions(), blocks, KeySlice(key), &value);
      if (s.IsNotFound()) continue;
      DiskRecord now;
      // An entry that does not parse goes too, as recovery would drop it.
      if (s.ok() && ParseValue(key, value, &now) &&
          (now.location.device != device || now.location.region != region)) {
        continue;
      }
      batch->Delete(blocks, KeySlice(key));
    }
    batch->Put(regions, RegionKey(device, region), RegionValue(static_cast<uint8_t>(RegionState::kFree), 0));
  };
  SubmitIndex(rocksdb::WriteBatch(), /*sync=*/true, [this, device, region, kept](Status st) {
    Region& r = devices_[device].regions[region];
    if (!st.ok()) {
      ++counters_.reclaim_failures;
      ++reclaim_failures_in_a_row_;
      // 100 ms, doubling, at most 10 s between tries.
      const auto delay = std::chrono::milliseconds(100) *
                         (int64_t{1} << std::min<uint32_t>(reclaim_failures_in_a_row_ - 1, 7));
      retry_reclaims_at_ =
          options_.clock() + std::min<std::chrono::milliseconds>(delay, std::chrono::seconds(10));
      if (reclaim_failures_in_a_row_ == 1 || reclaim_failures_in_a_row_ % 100 == 0) {
        spdlog::error("disk tier: reclaiming region {}/{}: {} ({} failures in a row; retrying)",
                      device, region, st.ToString(), reclaim_failures_in_a_row_);
      }
      failed_reclaims_.push_back(FailedReclaim{device, region, std::move(*kept)});
      // Nothing frees a region until the index can be written: appends
      // waiting for one fail now instead of waiting without end.
      const Status error(
          StatusCode::kResourceExhausted,
          "disk tier: no free region (reclaim cannot write the index: " + st.message() + ")");
      ServeWaiting(&error);
      return;
    }
    reclaim_failures_in_a_row_ = 0;
    r.deletes_pending = false;
    MaybeFree(device, region);
  }, std::move(build));
}

void DiskTier::MaybeFree(uint32_t device, uint32_t region) {
  Region& r = devices_[device].regions[region];
  if (r.state != RegionState::kReclaiming || r.deletes_pending || r.reads > 0 || r.writes > 0)
    return;
  used_bytes_ -= std::min(used_bytes_, r.live_bytes);
  filled_bytes_ -= std::min(filled_bytes_, r.write_offset);
  std::vector<Member> members = std::move(r.members);
  members.clear();  // keeps its capacity for the region's next fill
  r = Region{};
  r.members = std::move(members);
  devices_[device].free.push_back(region);
  ++free_regions_;
  --reclaiming_;
  ++counters_.regions_reclaimed;
  ServeWaiting();
  ScheduleReclaim();
}

void DiskTier::ServeWaiting(const Status* error) {
  while (!waiting_.empty()) {
    if (error == nullptr) {
      const uint64_t bytes = NewRecordBytes(waiting_.front().header);
      const std::optional<std::pair<uint32_t, uint32_t>> where = RegionFor(bytes);
      if (!where) return;
      WaitingAppend w = std::move(waiting_.front());
      waiting_.pop_front();
      StartAppend(where->first, where->second, std::move(w.header), w.payload, std::move(w.done));
    } else {
      WaitingAppend w = std::move(waiting_.front());
      waiting_.pop_front();
      options_.post([done = std::move(w.done), e = *error] { done(Err(e)); });
    }
  }
}

}  // namespace kvtier
