// DiskTier's appends (its contract is in disk_tier.h): a region found for each
// record, its I/O started, and group commits that make a batch of records
// durable (fdatasync) and indexed together, in order, before their callers
// hear of them.
#include "tiers/disk/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include "tiers/disk/disk_tier_internal.h"

namespace kvtier {

using disk_tier_detail::KeySlice;
using disk_tier_detail::RecordIo;
using disk_tier_detail::RecordSplit;
using disk_tier_detail::RegionKey;
using disk_tier_detail::RegionValue;
using disk_tier_detail::SplitRecord;

std::optional<std::pair<uint32_t, uint32_t>> DiskTier::RegionFor(uint64_t bytes) {
  for (size_t attempt = 0; attempt < devices_.size(); ++attempt) {
    const uint32_t di = static_cast<uint32_t>((next_device_ + attempt) % devices_.size());
    Device& d = devices_[di];
    if (d.open_region >= 0) {
      const auto open_index = static_cast<uint32_t>(d.open_region);
      Region& open = d.regions[open_index];
      if (open.write_offset + bytes <= options_.region_bytes) {
        next_device_ = static_cast<uint32_t>((di + 1) % devices_.size());
        return std::pair(di, open_index);
      }
      // Full: sealed, and in line for reclaim. Its state row is diagnostics
      // only (the block index is authoritative), written with the next job.
      open.state = RegionState::kSealed;
      sealed_.emplace_back(di, open_index);
      forgotten_.Put(regions_cf_, RegionKey(di, open_index),
                     RegionValue(static_cast<uint8_t>(RegionState::kSealed), open.sequence));
      ++forgotten_count_;
      d.open_region = -1;
    }
    if (!d.free.empty()) {
      const uint32_t ri = d.free.back();
      d.free.pop_back();
      --free_regions_;
      d.regions[ri].state = RegionState::kOpen;
      d.open_region = static_cast<int32_t>(ri);
      next_device_ = static_cast<uint32_t>((di + 1) % devices_.size());
      ScheduleReclaim();  // a free region was taken: keep the reserve
      return std::pair(di, ri);
    }
  }
  return std::nullopt;
}

RecordFormat DiskTier::WriteFormat(const RecordHeader& header) const {
  return options_.legacy_records ? LegacyFormat(header.packed()) : RecordFormat::kBare;
}

uint64_t DiskTier::NewRecordBytes(const RecordHeader& header) const {
  return RecordBytes(header.payload_bytes, WriteFormat(header));
}

void DiskTier::Append(RecordHeader header, const uint8_t* payload,
                      std::function<void(Result<DiskLocation>)> done) {
  const uint64_t record_bytes = NewRecordBytes(header);
  if (record_bytes > options_.region_bytes) {
    options_.post([done = std::move(done), record_bytes, region = options_.region_bytes] {
      done(Err(InvalidArgument("a record of " + std::to_string(record_bytes) +
                               " bytes is larger than a region (" + std::to_string(region) +
                               " bytes, tiers.disk.region_bytes)")));
    });
    return;
  }
  // Behind appends already waiting, so that they keep their order.
  const std::optional<std::pair<uint32_t, uint32_t>> where =
      waiting_.empty() ? RegionFor(record_bytes) : std::nullopt;
  if (!where) {
    if (!failed_reclaims_.empty()) {
      ScheduleReclaim();  // retries them once their delay has passed
      options_.post([done = std::move(done)] {
        done(Err(Status(StatusCode::kResourceExhausted,
                        "disk tier: no free region (reclaims are failing to write the index)")));
      });
      return;
    }
    ++counters_.appends_waited;
    waiting_.push_back(WaitingAppend{std::move(header), payload, std::move(done)});
    ScheduleReclaim();
    return;
  }
  StartAppend(where->first, where->second, std::move(header), payload, std::move(done));
}

void DiskTier::StartAppend(uint32_t di, uint32_t ri, RecordHeader header, const uint8_t* payload,
                           std::function<void(Result<DiskLocation>)> done) {
  const RecordFormat format = WriteFormat(header);
  const uint64_t record_bytes = RecordBytes(header.payload_bytes, format);
  Region& r = devices_[di].regions[ri];
  header.sequence = next_sequence_++;
  const uint64_t region_start = uint64_t{ri} * options_.region_bytes;
  const DiskLocation loc{di,        ri,     region_start + r.write_offset,
                         record_bytes, header.sequence, header.packed(), format, header.payload_checksum};
  r.members.push_back(
      Member{header.key, static_cast<uint32_t>(r.write_offset / kRecordAlignBytes)});
  r.write_offset += record_bytes;
  filled_bytes_ += record_bytes;
  r.sequence = header.sequence;
  ++r.writes;
  ++inflight_;

  // Bare: the payload's whole pages (if any), then its tail: its last bytes
  // and zeros (if any). Trailer: the same, the tail ending with the
  // trailer. Header page: the header page, then the payload.
  const RecordSplit split = SplitRecord(header.payload_bytes, format);
  const bool header_page = split.header_page;
  const uint64_t head_bytes = split.head_bytes;
  const uint64_t page_bytes = split.page_bytes;
  auto op = std::make_shared<RecordIo>(split.parts, page_bytes);
  if (header_page) {
    EncodeRecordHeader(header, std::span(op->page.get(), RecordHeader::kBytes));
  } else {
    std::memcpy(op->page.get(), payload + head_bytes, header.payload_bytes - head_bytes);
    if (format == RecordFormat::kTrailer) {
      EncodeRecordTrailer(header, std::span(op->page.get() + page_bytes - kRecordTrailerBytes, kRecordTrailerBytes));
    }
  }
  auto pending = std::make_shared<PendingAppend>(
      PendingAppend{header.key, loc, LocationValue(header, loc), std::move(done)});
  // Both writes done: on the owner thread, join the device's next group
  // commit (or fail now).
  auto written = [op, post = options_.post, self = std::weak_ptr<DiskTier*>(self_),
                  pending](Result<uint64_t> w) mutable {
    Status st;
    if (!op->Arrive(w, &st)) return;
    post([self, pending, st = std::move(st)]() mutable {
      auto tier = self.lock();
      if (!tier) return;
      const uint32_t device = pending->location.device;
      if (!st.ok()) {
        (*tier)->FinishAppend(*pending, std::move(st));
        return;
      }
      (*tier)->devices_[pending->location.device].awaiting_sync.push_back(std::move(pending));
      (*tier)->MaybeCommit(device);
    });
  };
  BlockDevice* device = devices_[di].device;
  if (!header_page) {
    if (head_bytes > 0) device->Write(loc.offset, std::span<const uint8_t>(payload, head_bytes), written);
    if (page_bytes > 0) {
      device->Write(loc.offset + head_bytes, std::span<const uint8_t>(op->page.get(), page_bytes), written);
    }
    return;
  }
  device->Write(loc.offset, std::span<const uint8_t>(op->page.get(), RecordHeader::kBytes), written);
  device->Write(loc.offset + RecordHeader::kBytes,
                std::span<const uint8_t>(payload, record_bytes - RecordHeader::kBytes), written);
}

void DiskTier::MaybeCommit(uint32_t device_index) {
  Device& d = devices_[device_index];
  if (d.commit_in_flight || d.awaiting_sync.empty()) return;
  // One fdatasync and one synced index write for every record written since
  // the last commit started: a group commit.
  // The next commit's sync may start once this one's is done, while this
  // one's index entries are written: the index writer keeps their order.
  d.commit_in_flight = true;
  auto batch = std::make_shared<std::vector<std::shared_ptr<PendingAppend>>>(std::move(d.awaiting_sync));
  d.awaiting_sync.clear();
  auto finish = [this, batch](Status st) {
    ++counters_.group_commits;
    for (const auto& p : *batch) FinishAppend(*p, st);
  };
  d.device->Sync([batch, finish, device_index, post = options_.post,
                  self = std::weak_ptr<DiskTier*>(self_)](Result<uint64_t> synced) mutable {
    post([self, batch, finish, device_index, synced = std::move(synced)]() mutable {
      auto tier = self.lock();
      if (!tier) return;
      DiskTier& t = **tier;
      t.devices_[device_index].commit_in_flight = false;
      if (!synced) {
        finish(synced.error().WithContext("syncing disk records"));
      } else {
        // The records are durable: now their index entries, off this thread.
        rocksdb::WriteBatch wb;
        for (const auto& p : *batch) wb.Put(t.blocks_cf_, KeySlice(p->key), p->value);
        t.SubmitIndex(std::move(wb), /*sync=*/true, std::move(finish));
      }
      t.MaybeCommit(device_index);
    });
  });
}

void DiskTier::SubmitIndex(rocksdb::WriteBatch batch, bool sync, std::function<void(Status)> done,
                           IndexWriter::Build build) {
  FlushForgotten();
  ++index_jobs_;
  writer_->Submit(std::move(batch), sync,
                  [post = options_.post, self = std::weak_ptr<DiskTier*>(self_),
                   done = std::move(done)](Status st) mutable {
                    post([self, done = std::move(done), st = std::move(st)]() mutable {
                      auto tier = self.lock();
                      if (!tier) return;
                      --(*tier)->index_jobs_;
                      (*tier)->NoteIndexWrite(st);
                      if (done) done(std::move(st));
                    });
                  },
                  std::move(build));
}

void DiskTier::NoteIndexWrite(const Status& st) {
  if (!st.ok()) {
    ++counters_.index_errors;
    if (!index_failing_) spdlog::error("disk tier: the index refuses writes, no block reaches the disk: {}", st.ToString());
    index_failing_ = true;
    return;
  }
  if (index_failing_) {
    ++counters_.index_recoveries;
    spdlog::info("disk tier: the index takes writes again");
  }
  index_failing_ = false;
}

void DiskTier::FlushForgotten() {
  if (forgotten_count_ == 0) return;
  rocksdb::WriteBatch batch = std::exchange(forgotten_, rocksdb::WriteBatch());
  forgotten_count_ = 0;
  ++index_jobs_;
  // Unsynced: a record whose entry comes back after a crash still holds
  // exactly its key's bytes (or fails its checks once its region is reused,
  // which a reclaim's synced deletes order after these).
  writer_->Submit(std::move(batch), /*sync=*/false,
                  [post = options_.post, self = std::weak_ptr<DiskTier*>(self_)](Status st) {
                    post([self, st = std::move(st)] {
                      auto tier = self.lock();
                      if (!tier) return;
                      --(*tier)->index_jobs_;
                      (*tier)->NoteIndexWrite(st);
                      if (!st.ok() && ++(*tier)->forget_failures_ % 1000 == 1) {
                        spdlog::warn("disk tier: dropping index entries ({} failures so far): {}",
                                     (*tier)->forget_failures_, st.ToString());
                      }
                    });
                  });
}

void DiskTier::FinishAppend(PendingAppend& p, Status st) {
  const DiskLocation& loc = p.location;
  Region& region = devices_[loc.device].regions[loc.region];
  --region.writes;
  --inflight_;
  if (!st.ok()) {
    ++counters_.io_errors;
    p.done(Err(std::move(st)));
  } else {
    region.live_bytes += loc.record_bytes;
    used_bytes_ += loc.record_bytes;
    ++live_records_;
    ++counters_.writes;
    counters_.write_bytes += loc.record_bytes;
    p.done(loc);
  }
  if (region.state == RegionState::kReclaiming) MaybeFree(loc.device, loc.region);
  ScheduleReclaim();  // the oldest region may have been waiting for this write
}

}  // namespace kvtier
