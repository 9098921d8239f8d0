#include "tiers/disk/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/check.h"
#include "common/layout.h"
#include "common/mutex.h"

namespace kvtier {
namespace {

constexpr uint8_t kIndexValueVersion = 1;
constexpr uint64_t kRecoveryProgressEvery = 200000;

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  return Status(s.IsNotFound() ? StatusCode::kNotFound
                : s.IsCorruption() ? StatusCode::kCorruption
                                   : StatusCode::kIoError,
                what + ": " + s.ToString(), ErrorSource::kRocksDb, static_cast<int>(s.code()));
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedPage = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedPage NewPage() {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, RecordHeader::kBytes));
  KVTIER_CHECK(p != nullptr);
  std::memset(p, 0, RecordHeader::kBytes);
  return AlignedPage(p);
}

rocksdb::Slice KeySlice(const StoredKey& key) {
  return rocksdb::Slice(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size());
}

// Index value: version u8, device u32, region u32, offset u64, record_bytes
// u64, sequence u64, payload_bytes u64, payload_checksum u64, ns 16 bytes,
// owner_len u8, owner. Little-endian; docs/disk-format.md.
void PutU32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}
bool GetU32(std::string_view& in, uint32_t* v) {
  if (in.size() < 4) return false;
  *v = 0;
  for (int i = 0; i < 4; ++i) *v |= uint32_t{static_cast<uint8_t>(in[i])} << (8 * i);
  in.remove_prefix(4);
  return true;
}
bool GetU64(std::string_view& in, uint64_t* v) {
  if (in.size() < 8) return false;
  *v = 0;
  for (int i = 0; i < 8; ++i) *v |= uint64_t{static_cast<uint8_t>(in[i])} << (8 * i);
  in.remove_prefix(8);
  return true;
}

bool ParseValue(const StoredKey& key, std::string_view in, DiskRecord* out) {
  if (in.empty() || static_cast<uint8_t>(in[0]) != kIndexValueVersion) return false;
  in.remove_prefix(1);
  RecordHeader& h = out->header;
  DiskLocation& l = out->location;
  h.key = key;
  if (!GetU32(in, &l.device) || !GetU32(in, &l.region) || !GetU64(in, &l.offset) ||
      !GetU64(in, &l.record_bytes) || !GetU64(in, &l.sequence) || !GetU64(in, &h.payload_bytes) ||
      !GetU64(in, &h.payload_checksum) || in.size() < 17) {
    return false;
  }
  h.sequence = l.sequence;
  std::memcpy(h.ns.bytes.data(), in.data(), 16);
  in.remove_prefix(16);
  const size_t owner_len = static_cast<uint8_t>(in[0]);
  in.remove_prefix(1);
  if (owner_len > RecordHeader::kMaxOwnerBytes || in.size() != owner_len) return false;
  h.owner.assign(in.data(), owner_len);
  return true;
}

// A record's I/O is two requests (header page and payload); the last one to
// finish carries on with the first error, if any. Thread-safe.
struct TwoPartIo {
  AlignedPage page = NewPage();  // the header's 4 KiB
  std::atomic<int> pending{2};   // acq_rel: the last arrival sees both parts' effects
  Mutex mu;
  Status status KVTIER_GUARDED_BY(mu);

  // Records one part's result; returns true (and the combined status) for
  // the second, false for the first.
  bool Arrive(const Result<uint64_t>& part, Status* combined) {
    if (!part) {
      MutexLock lock(&mu);
      if (status.ok()) status = part.error();
    }
    if (pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;
    MutexLock lock(&mu);
    *combined = status;
    return true;
  }
};

std::string RegionKey(uint32_t device, uint32_t region) {
  std::string k;
  // Big-endian, so that the regions sort by device, then region.
  for (int i = 3; i >= 0; --i) k.push_back(static_cast<char>(device >> (8 * i)));
  for (int i = 3; i >= 0; --i) k.push_back(static_cast<char>(region >> (8 * i)));
  return k;
}

std::string RegionValue(uint8_t state, uint64_t sequence) {
  std::string v(1, static_cast<char>(state));
  PutU64(v, sequence);
  return v;
}

}  // namespace

std::string DiskTier::LocationValue(const RecordHeader& h, const DiskLocation& l) const {
  std::string v(1, static_cast<char>(kIndexValueVersion));
  PutU32(v, l.device);
  PutU32(v, l.region);
  PutU64(v, l.offset);
  PutU64(v, l.record_bytes);
  PutU64(v, l.sequence);
  PutU64(v, h.payload_bytes);
  PutU64(v, h.payload_checksum);
  v.append(reinterpret_cast<const char*>(h.ns.bytes.data()), 16);
  v.push_back(static_cast<char>(h.owner.size()));
  v.append(h.owner);
  return v;
}

Result<std::unique_ptr<DiskTier>> DiskTier::Open(Options options) {
  if (options.devices.empty() || !options.post || !options.reclaim || !options.resident) {
    return Err(InvalidArgument("DiskTier: devices, post, reclaim and resident are required"));
  }
  if (options.region_bytes == 0 || options.region_bytes % kRecordAlignBytes != 0) {
    return Err(InvalidArgument("DiskTier: region_bytes must be a positive multiple of 4 KiB"));
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(std::move(options)));
  for (BlockDevice* d : tier->options_.devices) {
    const uint64_t regions = d->size_bytes() / tier->options_.region_bytes;
    if (regions < 2) {
      return Err(InvalidArgument("disk device " + d->name() + " holds fewer than two regions"));
    }
    tier->devices_.push_back(Device{d, std::vector<Region>(regions), -1});
  }

  std::error_code ec;
  std::filesystem::create_directories(tier->options_.index_path, ec);
  if (ec) return Err(Status::FromErrno(ec.value(), "creating " + tier->options_.index_path));
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  // The index is read once at start-up and then only written: small
  // memtables keep the daemon's memory per indexed block down.
  db_options.write_buffer_size = 8 << 20;
  rocksdb::ColumnFamilyOptions cf_options;
  cf_options.write_buffer_size = 8 << 20;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, cf_options},
      {"blocks", cf_options},
      {"regions", cf_options}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  const rocksdb::Status s = rocksdb::DB::Open(db_options, tier->options_.index_path, cfs, &handles, &db);
  if (!s.ok()) return Err(FromRocks(s, "opening the disk index " + tier->options_.index_path));
  tier->db_.reset(db);
  db->DestroyColumnFamilyHandle(handles[0]);  // the default family is unused
  tier->blocks_cf_ = handles[1];
  tier->regions_cf_ = handles[2];
  KVTIER_RETURN_IF_ERROR(tier->Recover());
  return tier;
}

DiskTier::DiskTier(Options options) : options_(std::move(options)), self_(std::make_shared<DiskTier*>(this)) {}

DiskTier::~DiskTier() {
  KVTIER_CHECK_MSG(inflight_ == 0, "DiskTier destroyed with I/O in flight");
  if (db_) {
    if (blocks_cf_ != nullptr) db_->DestroyColumnFamilyHandle(blocks_cf_);
    if (regions_cf_ != nullptr) db_->DestroyColumnFamilyHandle(regions_cf_);
    db_->Close().PermitUncheckedError();
  }
}

Status DiskTier::Recover() {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), blocks_cf_));
  std::vector<std::string> bad;
  uint64_t seen = 0;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (++seen % kRecoveryProgressEvery == 0) spdlog::info("disk index recovery: {} entries read", seen);
    DiskRecord r;
    StoredKey key;
    const bool key_ok = it->key().size() == StoredKey::kSize;
    if (key_ok) std::memcpy(key.bytes.data(), it->key().data(), StoredKey::kSize);
    const bool ok = key_ok &&
                    ParseValue(key, std::string_view(it->value().data(), it->value().size()), &r) &&
                    PlausibleLocation(r);
    if (!ok) {
      bad.push_back(it->key().ToString());
      continue;
    }
    const DiskLocation& l = r.location;
    Region& region = devices_[l.device].regions[l.region];
    region.state = RegionState::kSealed;
    region.sequence = std::max(region.sequence, l.sequence);
    region.write_offset = std::max(region.write_offset, l.offset + l.record_bytes - uint64_t{l.region} * options_.region_bytes);
    region.live_bytes += l.record_bytes;
    used_bytes_ += l.record_bytes;
    next_sequence_ = std::max(next_sequence_, l.sequence + 1);
    recovered_.push_back(std::move(r));
  }
  if (!it->status().ok()) return FromRocks(it->status(), "reading the disk index");
  for (const std::string& k : bad) {
    const rocksdb::Status s = db_->Delete(rocksdb::WriteOptions(), blocks_cf_, k);
    if (!s.ok()) return FromRocks(s, "dropping a bad disk index entry");
  }
  // The WAL replayed at open sits in the memtables: write it out now, so
  // that the memory holds the blocks and not a second copy of the index.
  if (const rocksdb::Status f = db_->Flush(rocksdb::FlushOptions(), {blocks_cf_, regions_cf_}); !f.ok()) {
    spdlog::warn("disk index: flushing the replayed log: {}", f.ToString());
  }
  counters_.recovered_records = recovered_.size();
  counters_.recovery_dropped = bad.size();
  spdlog::info("disk index: {} records recovered ({} bytes), {} bad entries dropped", recovered_.size(),
               used_bytes_, bad.size());
  return Status::Ok();
}

bool DiskTier::PlausibleLocation(const DiskRecord& r) const {
  // Written so that no sum can overflow: the index is trusted no further
  // than the layout of the devices allows.
  const DiskLocation& l = r.location;
  if (l.device >= devices_.size() || l.region >= devices_[l.device].regions.size()) return false;
  if (r.header.payload_bytes > Layout::kMaxBlockBytes) return false;
  if (l.record_bytes != RecordBytes(r.header.payload_bytes) ||
      l.record_bytes > options_.region_bytes)
    return false;
  const uint64_t region_start = uint64_t{l.region} * options_.region_bytes;
  return l.offset % kRecordAlignBytes == 0 && l.offset >= region_start &&
         l.offset - region_start <= options_.region_bytes - l.record_bytes;
}

std::vector<DiskRecord> DiskTier::TakeRecovered() { return std::exchange(recovered_, {}); }

uint64_t DiskTier::capacity_bytes() const {
  uint64_t total = 0;
  for (const Device& d : devices_) total += d.regions.size() * options_.region_bytes;
  return total;
}

bool DiskTier::Reclaim(uint32_t device, uint32_t region) {
  Region& r = devices_[device].regions[region];
  const std::vector<StoredKey> resident = options_.resident(device, region);
  // Two phases, so that a block the owner must keep stops the reclaim before
  // anything was dropped.
  for (const StoredKey& key : resident) {
    if (!options_.reclaim(key, /*commit=*/false)) return false;
  }
  rocksdb::WriteBatch batch;
  for (const StoredKey& key : resident) batch.Delete(blocks_cf_, KeySlice(key));
  batch.Put(regions_cf_, RegionKey(device, region), RegionValue(static_cast<uint8_t>(RegionState::kFree), 0));
  rocksdb::WriteOptions sync;
  sync.sync = true;
  if (const rocksdb::Status s = db_->Write(sync, &batch); !s.ok()) {
    ++counters_.io_errors;
    spdlog::error("disk tier: reclaiming region {}/{}: {}", device, region, s.ToString());
    return false;
  }
  // Persisted: now the owner forgets them and the space is reusable.
  for (const StoredKey& key : resident) options_.reclaim(key, /*commit=*/true);
  used_bytes_ -= r.live_bytes;
  counters_.records_reclaimed += resident.size();
  ++counters_.regions_reclaimed;
  r = Region{};
  return true;
}

Result<std::pair<uint32_t, uint32_t>> DiskTier::RegionFor(uint64_t bytes) {
  if (bytes > options_.region_bytes) {
    return Err(InvalidArgument("a record of " + std::to_string(bytes) + " bytes is larger than a region"));
  }
  for (size_t attempt = 0; attempt < devices_.size(); ++attempt) {
    const uint32_t di = (next_device_ + attempt) % devices_.size();
    Device& d = devices_[di];
    if (d.open_region >= 0) {
      Region& open = d.regions[static_cast<size_t>(d.open_region)];
      if (open.write_offset + bytes <= options_.region_bytes) {
        next_device_ = (di + 1) % devices_.size();
        return std::pair(di, static_cast<uint32_t>(d.open_region));
      }
      open.state = RegionState::kSealed;
      db_->Put(rocksdb::WriteOptions(), regions_cf_, RegionKey(di, static_cast<uint32_t>(d.open_region)),
               RegionValue(static_cast<uint8_t>(RegionState::kSealed), open.sequence))
          .PermitUncheckedError();  // diagnostics only; the block index is authoritative
      d.open_region = -1;
    }
    for (size_t ri = 0; ri < d.regions.size(); ++ri) {
      if (d.regions[ri].state == RegionState::kFree) {
        d.regions[ri].state = RegionState::kOpen;
        d.open_region = static_cast<int32_t>(ri);
        next_device_ = (di + 1) % devices_.size();
        return std::pair(di, static_cast<uint32_t>(ri));
      }
    }
  }
  // Every region is in use: reclaim the oldest sealed one that is idle.
  std::vector<std::pair<uint64_t, std::pair<uint32_t, uint32_t>>> candidates;
  for (uint32_t di = 0; di < devices_.size(); ++di) {
    for (uint32_t ri = 0; ri < devices_[di].regions.size(); ++ri) {
      const Region& r = devices_[di].regions[ri];
      if (r.state == RegionState::kSealed && r.inflight == 0) candidates.push_back({r.sequence, {di, ri}});
    }
  }
  std::sort(candidates.begin(), candidates.end());
  for (const auto& [seq, where] : candidates) {
    if (!Reclaim(where.first, where.second)) continue;
    Device& d = devices_[where.first];
    d.regions[where.second].state = RegionState::kOpen;
    d.open_region = static_cast<int32_t>(where.second);
    return where;
  }
  return Err(Status(StatusCode::kResourceExhausted, "disk tier: every region is busy or holds blocks in use"));
}

void DiskTier::Append(RecordHeader header, const uint8_t* payload,
                      std::function<void(Result<DiskLocation>)> done) {
  const uint64_t record_bytes = RecordBytes(header.payload_bytes);
  Result<std::pair<uint32_t, uint32_t>> where = RegionFor(record_bytes);
  if (!where) {
    options_.post([done = std::move(done), error = where.error()] { done(Err(error)); });
    return;
  }
  const auto [di, ri] = *where;
  Region& r = devices_[di].regions[ri];
  header.sequence = next_sequence_++;
  const DiskLocation loc{di, ri, uint64_t{ri} * options_.region_bytes + r.write_offset, record_bytes,
                         header.sequence};
  r.write_offset += record_bytes;
  r.sequence = header.sequence;
  ++r.inflight;
  ++inflight_;

  auto op = std::make_shared<TwoPartIo>();
  EncodeRecordHeader(header, std::span(op->page.get(), RecordHeader::kBytes));
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
  device->Write(loc.offset, std::span<const uint8_t>(op->page.get(), RecordHeader::kBytes), written);
  device->Write(loc.offset + RecordHeader::kBytes,
                std::span<const uint8_t>(payload, record_bytes - RecordHeader::kBytes), written);
}

void DiskTier::MaybeCommit(uint32_t device_index) {
  Device& d = devices_[device_index];
  if (d.commit_in_flight || d.awaiting_sync.empty()) return;
  // One fdatasync and one synced index write for every record written since
  // the last commit started: a group commit.
  d.commit_in_flight = true;
  auto batch = std::make_shared<std::vector<std::shared_ptr<PendingAppend>>>(std::move(d.awaiting_sync));
  d.awaiting_sync.clear();
  rocksdb::DB* db = db_.get();
  rocksdb::ColumnFamilyHandle* cf = blocks_cf_;
  d.device->Sync([db, cf, batch, device_index, post = options_.post,
                  self = std::weak_ptr<DiskTier*>(self_)](Result<uint64_t> synced) mutable {
    Status st = synced ? Status::Ok() : synced.error().WithContext("syncing disk records");
    if (st.ok()) {
      // On the I/O thread, so the event loop never waits for the WAL's fsync.
      rocksdb::WriteBatch wb;
      for (const auto& p : *batch) wb.Put(cf, KeySlice(p->key), p->value);
      rocksdb::WriteOptions sync;
      sync.sync = true;
      const rocksdb::Status s = db->Write(sync, &wb);
      if (!s.ok()) st = FromRocks(s, "indexing disk records");
    }
    post([self, batch, device_index, st = std::move(st)] {
      auto tier = self.lock();
      if (!tier) return;
      DiskTier& t = **tier;
      ++t.counters_.group_commits;
      for (const auto& p : *batch) t.FinishAppend(*p, st);
      t.devices_[device_index].commit_in_flight = false;
      t.MaybeCommit(device_index);
    });
  });
}

void DiskTier::FinishAppend(PendingAppend& p, Status st) {
  const DiskLocation& loc = p.location;
  Region& region = devices_[loc.device].regions[loc.region];
  --region.inflight;
  --inflight_;
  if (!st.ok()) {
    ++counters_.io_errors;
    p.done(Err(std::move(st)));
    return;
  }
  region.live_bytes += loc.record_bytes;
  used_bytes_ += loc.record_bytes;
  ++counters_.writes;
  counters_.write_bytes += loc.record_bytes;
  p.done(loc);
}

DiskLocation DiskTier::LocationOf(uint32_t device, uint64_t offset, uint64_t payload_bytes) const {
  return DiskLocation{device, static_cast<uint32_t>(offset / options_.region_bytes), offset,
                      RecordBytes(payload_bytes), 0};
}

void DiskTier::Read(const StoredKey& key, const DiskLocation& loc, uint64_t payload_bytes, uint8_t* dst,
                    std::function<void(Status, uint64_t)> done) {
  KVTIER_CHECK(loc.device < devices_.size() && loc.region < devices_[loc.device].regions.size());
  ++devices_[loc.device].regions[loc.region].inflight;
  ++inflight_;
  auto op = std::make_shared<TwoPartIo>();
  auto finish = [post = options_.post, self = std::weak_ptr<DiskTier*>(self_), loc,
                 done = std::move(done)](Status st, uint64_t checksum) mutable {
    post([self, loc, st = std::move(st), checksum, done = std::move(done)]() mutable {
      auto tier = self.lock();
      if (!tier) return;
      DiskTier& t = **tier;
      --t.devices_[loc.device].regions[loc.region].inflight;
      --t.inflight_;
      if (st.code() == StatusCode::kCorruption) {
        ++t.counters_.checksum_failures;
        spdlog::warn("disk tier: record at {}:{} not served: {}", t.devices_[loc.device].device->name(),
                     loc.offset, st.message());
      } else if (!st.ok()) {
        ++t.counters_.io_errors;
      } else {
        ++t.counters_.reads;
        t.counters_.read_bytes += loc.record_bytes;
      }
      done(std::move(st), checksum);
    });
  };
  auto read = [op, key, payload_bytes, dst, finish](Result<uint64_t> got) mutable {
    Status st;
    if (!op->Arrive(got, &st)) return;
    uint64_t checksum = 0;
    if (st.ok()) {
      // Checked here, on the I/O thread, while the bytes are fresh.
      Result<RecordHeader> h = DecodeRecordHeader(std::span<const uint8_t>(op->page.get(), RecordHeader::kBytes));
      if (!h) {
        st = h.error();
      } else if (h->key != key || h->payload_bytes != payload_bytes) {
        st = Status(StatusCode::kCorruption, "the record at this location is another block's");
      } else if (PayloadChecksum(std::span<const uint8_t>(dst, payload_bytes)) != h->payload_checksum) {
        st = Status(StatusCode::kCorruption, "payload checksum mismatch");
      } else {
        checksum = h->payload_checksum;
      }
    }
    finish(std::move(st), checksum);
  };
  BlockDevice* device = devices_[loc.device].device;
  device->Read(loc.offset, std::span<uint8_t>(op->page.get(), RecordHeader::kBytes), read);
  device->Read(loc.offset + RecordHeader::kBytes, std::span<uint8_t>(dst, loc.record_bytes - RecordHeader::kBytes),
               read);
}

void DiskTier::Forget(const StoredKey& key, const DiskLocation& loc) {
  if (loc.device >= devices_.size() || loc.region >= devices_[loc.device].regions.size()) return;
  Region& r = devices_[loc.device].regions[loc.region];
  r.live_bytes -= std::min(r.live_bytes, loc.record_bytes);
  used_bytes_ -= std::min(used_bytes_, loc.record_bytes);
  const rocksdb::Status s = db_->Delete(rocksdb::WriteOptions(), blocks_cf_, KeySlice(key));
  if (!s.ok()) {
    ++counters_.io_errors;
    spdlog::warn("disk tier: dropping an index entry: {}", s.ToString());
  }
}

}  // namespace kvtier
