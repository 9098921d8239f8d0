// DiskTier's implementation (its contract is in disk_tier.h). Past 800 lines
// on purpose: appends, group commits, reclaim with carry-forward and recovery
// all change the same Region states and their invariants, so they stay side
// by side; the index writer and the record format already live apart.
#include "tiers/disk/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <tuple>

#include "common/check.h"
#include "common/le_bytes.h"
#include "common/disk_limits.h"
#include "common/layout.h"
#include "common/mutex.h"
#include "common/version.h"

namespace kvtier {
namespace {

constexpr uint8_t kIndexValueVersion = 1;
constexpr uint8_t kAnnotatedIndexValueVersion = 2;  // with the record's annotation after the owner
// A packed record's: codec, dtype, group and raw bytes after the owner, then
// the annotation's length (0: none) and the annotation.
constexpr uint8_t kPackedIndexValueVersion = 3;
// A bare record's (record.h), raw or coded: version 3's fields, the codec
// kNone (0, with dtype, group and raw bytes 0) for a raw payload, and the
// payload checksum bound to the key (KeyedChecksum).
constexpr uint8_t kBareIndexValueVersion = 4;

// A bare record names no key, so its entry binds its checksum to one: the
// payload's XXH3-64 XOR the key's. An entry copied under another key (a
// damaged index) then names a checksum that no payload matches, as an older
// record's header named its key. Its own inverse.
uint64_t KeyedChecksum(const StoredKey& key, uint64_t checksum) {
  return checksum ^ XXH3_64bits(key.bytes.data(), key.bytes.size());
}
constexpr uint64_t kRecoveryProgressEvery = 200000;
// Forgotten blocks' index deletes are handed to the writer in batches of
// this many (or sooner, ahead of any other index write).
constexpr uint32_t kForgetBatch = 1024;

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  return Status(s.IsNotFound() ? StatusCode::kNotFound
                : s.IsCorruption() ? StatusCode::kCorruption
                                   : StatusCode::kIoError,
                what + ": " + s.ToString(), ErrorSource::kRocksDb, static_cast<int>(s.code()));
}

// The index's format marker: in the default column family, key "format",
// value the disk format (u32, little-endian) of the release that wrote it.
constexpr char kFormatKey[] = "format";

// Refuses an index of a newer disk format than this release reads, and marks
// any other (a new one, or one of a release before the marker) as of this
// release's format, which reads them all.
Status CheckFormat(rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf, const std::string& path) {
  std::string value;
  const rocksdb::Status s = db->Get(rocksdb::ReadOptions(), cf, kFormatKey, &value);
  if (!s.ok() && !s.IsNotFound()) return FromRocks(s, "reading the disk format of " + path);
  if (s.ok()) {
    if (value.size() != sizeof(uint32_t)) {
      return Status(StatusCode::kCorruption, "the disk index " + path + " has a format marker of " +
                                                 std::to_string(value.size()) + " bytes; 4 were expected");
    }
    uint32_t format = 0;
    std::string_view in = value;
    le::Get(in, &format);
    if (format > DiskTier::kFormatVersion) {
      return Status(StatusCode::kFailedPrecondition,
                    "the disk index " + path + " is in disk format " + std::to_string(format) +
                        ", written by a newer kvtier; this kvtierd (" + kVersion + ") reads disk formats 1 to " +
                        std::to_string(DiskTier::kFormatVersion) +
                        ". Run the newer kvtierd, or start the disk tier cold: remove " + path +
                        " and the segment files of tiers.disk.paths");
    }
    if (format == DiskTier::kFormatVersion) return Status::Ok();
  }
  std::string mark;
  le::Put<uint32_t>(mark, DiskTier::kFormatVersion);
  rocksdb::WriteOptions sync;
  sync.sync = true;
  if (const rocksdb::Status w = db->Put(sync, cf, kFormatKey, mark); !w.ok()) {
    return FromRocks(w, "writing the disk format of " + path);
  }
  return Status::Ok();
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedPage = std::unique_ptr<uint8_t, FreeDeleter>;

// Zeroed, 4 KiB aligned; `bytes` a multiple of 4 KiB.
AlignedPage NewPages(uint64_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, bytes));
  KVTIER_CHECK(p != nullptr);
  std::memset(p, 0, bytes);
  return AlignedPage(p);
}

// RocksDB's own log goes to the daemon's log, not to a LOG file beside the
// index: one log for operators, and nothing written to the index volume
// that could fail (RocksDB 7.8 asserts when its LOG file keeps failing).
class SpdlogLogger : public rocksdb::Logger {
 public:
  SpdlogLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel()) return;
    char line[1024];
    // RocksDB's own printf-style format: not a literal, by design.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    std::vsnprintf(line, sizeof(line), format, ap);
#pragma GCC diagnostic pop
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      spdlog::error("disk index (RocksDB): {}", line);
    } else {
      spdlog::warn("disk index (RocksDB): {}", line);
    }
  }
};

rocksdb::Slice KeySlice(const StoredKey& key) {
  return rocksdb::Slice(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size());
}

// Index value: version u8, device u32, region u32, offset u64, record_bytes
// u64, sequence u64, payload_bytes u64, payload_checksum u64, ns 16 bytes,
// owner_len u8, owner; version 2 then annotation_len u32 and the record's
// annotation; versions 3 and 4 the codec u8, dtype u8, group u32, raw_bytes
// u64, annotation_len u32 (0: none) and the annotation. Little-endian
// (common/le_bytes.h); docs/disk-format.md.
bool ParseValue(const StoredKey& key, std::string_view in, DiskRecord* out) {
  if (in.empty()) return false;
  const uint8_t version = static_cast<uint8_t>(in[0]);
  if (version != kIndexValueVersion && version != kAnnotatedIndexValueVersion &&
      version != kPackedIndexValueVersion && version != kBareIndexValueVersion) {
    return false;
  }
  in.remove_prefix(1);
  RecordHeader& h = out->header;
  DiskLocation& l = out->location;
  h.key = key;
  if (!le::Get(in, &l.device) || !le::Get(in, &l.region) || !le::Get(in, &l.offset) ||
      !le::Get(in, &l.record_bytes) || !le::Get(in, &l.sequence) || !le::Get(in, &h.payload_bytes) ||
      !le::Get(in, &h.payload_checksum) || in.size() < 17) {
    return false;
  }
  h.sequence = l.sequence;
  if (version == kBareIndexValueVersion) h.payload_checksum = KeyedChecksum(key, h.payload_checksum);
  l.checksum = h.payload_checksum;
  l.format = version == kBareIndexValueVersion ? RecordFormat::kBare
             : version == kPackedIndexValueVersion ? RecordFormat::kTrailer
                                                   : RecordFormat::kHeaderPage;
  std::memcpy(h.ns.bytes.data(), in.data(), 16);
  in.remove_prefix(16);
  const size_t owner_len = static_cast<uint8_t>(in[0]);
  in.remove_prefix(1);
  if (owner_len > RecordHeader::kMaxOwnerBytes || in.size() < owner_len) return false;
  h.owner.assign(in.data(), owner_len);
  in.remove_prefix(owner_len);
  if (version == kIndexValueVersion) return in.empty();
  const bool coded_fields = version == kPackedIndexValueVersion || version == kBareIndexValueVersion;
  if (coded_fields) {
    uint8_t codec = 0;
    uint8_t dtype = 0;
    if (!le::Get(in, &codec) || !le::Get(in, &dtype) || !le::Get(in, &h.group_elems) ||
        !le::Get(in, &h.raw_bytes)) {
      return false;
    }
    const bool raw = version == kBareIndexValueVersion && codec == static_cast<uint8_t>(CodecKind::kNone);
    if (raw) {
      if (dtype != 0 || h.group_elems != 0 || h.raw_bytes != 0) return false;
    } else {
      if (codec != static_cast<uint8_t>(CodecKind::kLossless) && codec != static_cast<uint8_t>(CodecKind::kFp8)) {
        return false;
      }
      h.codec = static_cast<CodecKind>(codec);
      h.dtype = static_cast<DType>(dtype);
      if (!CheckCodec(CodecParams{h.codec, h.dtype, h.group_elems}).ok()) return false;
      l.packed = true;
    }
  }
  uint32_t annotation_len = 0;
  const bool may_be_empty = coded_fields;
  if (!le::Get(in, &annotation_len) || (annotation_len == 0 && !may_be_empty) ||
      annotation_len > RecordHeader::kMaxAnnotationBytes || in.size() != annotation_len) {
    return false;
  }
  h.annotation.assign(in.data(), annotation_len);
  return true;
}

// A record's I/O is one or two requests: an old raw record's header page and
// payload; any other record's whole payload pages (none for a payload under
// 4 KiB) and tail page (none for a bare record of whole pages). The last one
// to finish carries on with the first error, if any. Thread-safe.
struct RecordIo {
  RecordIo(int parts, uint64_t page_bytes) : page(NewPages(page_bytes)), pending(parts) {}
  AlignedPage page;        // a raw record's header, or a packed one's tail
  std::atomic<int> pending;  // acq_rel: the last arrival sees every part's effects
  Mutex mu;
  Status status KVTIER_GUARDED_BY(mu);

  // Records one part's result; returns true (and the combined status) for
  // the last, false for the others.
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
  le::Put<uint64_t>(v, sequence);
  return v;
}

// How a record's I/O splits (StartAppend writes it so, Read reads it so):
// a header-page record is its header page, then its padded payload; any
// other is its payload's whole pages straight from or into the caller's
// buffer (head_bytes, maybe 0), then the rest through the tier's own page
// (page_bytes, maybe 0: a bare record of whole pages): the payload's last
// bytes, zeros and, for a trailer record, the trailer.
struct RecordSplit {
  bool header_page = false;
  uint64_t head_bytes = 0;
  uint64_t page_bytes = 0;
  int parts = 1;  // I/O requests
};
RecordSplit SplitRecord(uint64_t payload_bytes, RecordFormat format) {
  if (format == RecordFormat::kHeaderPage) return {true, 0, RecordHeader::kBytes, 2};
  const uint64_t head = PackedHeadBytes(payload_bytes);
  const uint64_t page = RecordBytes(payload_bytes, format) - head;
  return {false, head, page, head > 0 && page > 0 ? 2 : 1};
}

// Checks a record read back: an older record's header (its header page, or
// the record's tail ending with its trailer: `header`) must decode and name
// `key` and this payload, and the payload's XXH3-64 must be `checksum` (the
// index's, which an older header holds too). kCorruption says what failed.
Status CheckRecord(const StoredKey& key, RecordFormat format, std::span<const uint8_t> header,
                   std::span<const uint8_t> payload, uint64_t checksum) {
  if (format != RecordFormat::kBare) {
    Result<RecordHeader> h =
        format == RecordFormat::kTrailer ? DecodeRecordTrailer(header) : DecodeRecordHeader(header);
    if (!h) return h.error();
    if (h->key != key || h->payload_bytes != payload.size() || h->payload_checksum != checksum) {
      return Status(StatusCode::kCorruption, "the record at this location is another block's");
    }
  }
  if (PayloadChecksum(payload) != checksum) return Status(StatusCode::kCorruption, "payload checksum mismatch");
  return Status::Ok();
}

}  // namespace

std::string DiskTier::LocationValue(const RecordHeader& h, const DiskLocation& l) const {
  const bool bare = l.format == RecordFormat::kBare;
  const uint8_t version = bare                   ? kBareIndexValueVersion
                          : h.packed()           ? kPackedIndexValueVersion
                          : h.annotation.empty() ? kIndexValueVersion
                                                 : kAnnotatedIndexValueVersion;
  std::string v(1, static_cast<char>(version));
  le::Put<uint32_t>(v, l.device);
  le::Put<uint32_t>(v, l.region);
  le::Put<uint64_t>(v, l.offset);
  le::Put<uint64_t>(v, l.record_bytes);
  le::Put<uint64_t>(v, l.sequence);
  le::Put<uint64_t>(v, h.payload_bytes);
  le::Put<uint64_t>(v, bare ? KeyedChecksum(h.key, h.payload_checksum) : h.payload_checksum);
  v.append(reinterpret_cast<const char*>(h.ns.bytes.data()), 16);
  v.push_back(static_cast<char>(h.owner.size()));
  v.append(h.owner);
  if (h.packed() || bare) {
    le::Put<uint8_t>(v, static_cast<uint8_t>(h.codec));
    le::Put<uint8_t>(v, h.packed() ? static_cast<uint8_t>(h.dtype) : uint8_t{0});
    le::Put<uint32_t>(v, h.packed() ? h.group_elems : 0);
    le::Put<uint64_t>(v, h.packed() ? h.raw_bytes : 0);
  }
  if (h.packed() || bare || !h.annotation.empty()) {
    le::Put<uint32_t>(v, static_cast<uint32_t>(h.annotation.size()));
    v.append(h.annotation);
  }
  return v;
}

Result<std::unique_ptr<DiskTier>> DiskTier::Open(Options options) {
  if (options.devices.empty() || !options.post || !options.reclaim || !options.relocated) {
    return Err(InvalidArgument("DiskTier: devices, post, reclaim and relocated are required"));
  }
  if (options.region_bytes == 0 || options.region_bytes % kRecordAlignBytes != 0 ||
      options.region_bytes > kMaxDiskRegionBytes) {
    return Err(InvalidArgument(
        "DiskTier: region_bytes must be a positive multiple of 4 KiB, below 16 TiB"));
  }
  if (!options.clock) options.clock = [] { return std::chrono::steady_clock::now(); };
  std::unique_ptr<DiskTier> tier(new DiskTier(std::move(options)));
  tier->SetWatermarks(tier->options_.high_watermark, tier->options_.low_watermark);
  for (BlockDevice* d : tier->options_.devices) {
    // Record offsets and region numbers past these would not fit the
    // owner's and the tier's own fields.
    if (d->size_bytes() > kMaxDiskPathBytes) {
      return Err(InvalidArgument("disk device " + d->name() + " has " +
                                 std::to_string(d->size_bytes()) + " bytes; at most " +
                                 std::to_string(kMaxDiskPathBytes) + " (2 PiB) are supported"));
    }
    const uint64_t regions = d->size_bytes() / tier->options_.region_bytes;
    if (regions < 2) {
      return Err(InvalidArgument("disk device " + d->name() + " holds fewer than two regions"));
    }
    if (regions > UINT32_MAX) {
      return Err(InvalidArgument("disk device " + d->name() + " holds " + std::to_string(regions) +
                                 " regions; at most " + std::to_string(UINT32_MAX) +
                                 "; raise tiers.disk.region_bytes"));
    }
    tier->devices_.push_back(Device{d, std::vector<Region>(regions), -1});
    tier->total_regions_ += regions;
  }

  std::error_code ec;
  std::filesystem::create_directories(tier->options_.index_path, ec);
  if (ec) return Err(Status::FromErrno(ec.value(), "creating " + tier->options_.index_path));
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  db_options.info_log = std::make_shared<SpdlogLogger>();
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
  tier->blocks_cf_ = handles[1];
  tier->regions_cf_ = handles[2];
  // The default family holds only the format marker.
  const Status format = CheckFormat(db, handles[0], tier->options_.index_path);
  db->DestroyColumnFamilyHandle(handles[0]);
  KVTIER_RETURN_IF_ERROR(format);
  KVTIER_RETURN_IF_ERROR(tier->Recover());
  tier->writer_ = std::make_unique<IndexWriter>(db);
  return tier;
}

DiskTier::DiskTier(Options options) : options_(std::move(options)), self_(std::make_shared<DiskTier*>(this)) {}

DiskTier::~DiskTier() {
  KVTIER_CHECK_MSG(inflight_ == 0 && waiting_.empty(), "DiskTier destroyed with I/O in flight");
  writer_.reset();  // runs what was submitted
  if (db_) {
    if (forgotten_count_ > 0)
      db_->Write(rocksdb::WriteOptions(), &forgotten_).PermitUncheckedError();
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
    const uint64_t region_start = uint64_t{l.region} * options_.region_bytes;
    region.state = RegionState::kSealed;
    region.sequence = std::max(region.sequence, l.sequence);
    region.write_offset = std::max(region.write_offset, l.offset + l.record_bytes - region_start);
    region.live_bytes += l.record_bytes;
    region.members.push_back(
        Member{key, static_cast<uint32_t>((l.offset - region_start) / kRecordAlignBytes)});
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
  // Every region that holds records is sealed; reclaim takes them oldest first.
  std::vector<std::tuple<uint64_t, uint32_t, uint32_t>> sealed;
  for (uint32_t di = 0; di < devices_.size(); ++di) {
    Device& d = devices_[di];
    for (uint32_t ri = static_cast<uint32_t>(d.regions.size()); ri-- > 0;) {
      if (d.regions[ri].state == RegionState::kSealed) {
        filled_bytes_ += d.regions[ri].write_offset;
        sealed.emplace_back(d.regions[ri].sequence, di, ri);
      } else {
        d.free.push_back(ri);  // lowest region on top
        ++free_regions_;
      }
    }
  }
  std::sort(sealed.begin(), sealed.end());
  for (const auto& [seq, di, ri] : sealed) sealed_.emplace_back(di, ri);
  counters_.recovered_records = recovered_.size();
  live_records_ = recovered_.size();
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
  if (r.header.packed() &&
      (r.header.raw_bytes > Layout::kMaxBlockBytes || r.header.payload_bytes >= r.header.raw_bytes)) {
    return false;
  }
  if (l.record_bytes != RecordBytes(r.header.payload_bytes, l.format) || l.record_bytes > options_.region_bytes) {
    return false;
  }
  const uint64_t region_start = uint64_t{l.region} * options_.region_bytes;
  return l.offset % kRecordAlignBytes == 0 && l.offset >= region_start &&
         l.offset - region_start <= options_.region_bytes - l.record_bytes;
}

std::vector<DiskRecord> DiskTier::TakeRecovered() { return std::exchange(recovered_, {}); }

uint64_t DiskTier::capacity_bytes() const { return total_regions_ * options_.region_bytes; }

void DiskTier::SetWatermarks(double high, double low) {
  options_.high_watermark = std::clamp(high, 0.0, 1.0);
  options_.low_watermark = std::clamp(low, 0.0, options_.high_watermark);
  if (writer_) ScheduleReclaim();
}

uint64_t DiskTier::FreeTarget(double watermark) const {
  const double free = (1.0 - watermark) * static_cast<double>(total_regions_);
  return std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(free)));
}

std::vector<DiskTier::RegionRecord> DiskTier::RecordsIn(uint32_t device, uint32_t region) const {
  std::vector<RegionRecord> out;
  if (device >= devices_.size() || region >= devices_[device].regions.size()) return out;
  const Region& r = devices_[device].regions[region];
  out.reserve(r.members.size());
  const uint64_t start = uint64_t{region} * options_.region_bytes;
  for (const Member& m : r.members) {
    out.push_back(
        {m.key, DiskLocation{device, region, start + uint64_t{m.page} * kRecordAlignBytes, 0, 0}});
  }
  return out;
}

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

DiskLocation DiskTier::LocationOf(const RecordRef& ref) const {
  return DiskLocation{ref.device, static_cast<uint32_t>(ref.offset / options_.region_bytes),
                      ref.offset, RecordBytes(ref.payload_bytes, ref.format),
                      0, ref.packed, ref.format, ref.checksum};
}

void DiskTier::Read(const StoredKey& key, const DiskLocation& loc, uint64_t payload_bytes, uint8_t* dst,
                    std::function<void(Status, uint64_t)> done) {
  KVTIER_CHECK(loc.device < devices_.size() && loc.region < devices_[loc.device].regions.size());
  ++devices_[loc.device].regions[loc.region].reads;
  ++inflight_;
  const RecordFormat format = loc.format;
  const uint64_t record_bytes = RecordBytes(payload_bytes, format);
  // As StartAppend wrote it: the tail of a bare or trailer record comes
  // into the op's page, and its last payload bytes are copied out of it.
  const RecordSplit split = SplitRecord(payload_bytes, format);
  const bool header_page = split.header_page;
  const uint64_t head_bytes = split.head_bytes;
  const uint64_t page_bytes = split.page_bytes;
  auto op = std::make_shared<RecordIo>(split.parts, page_bytes);
  auto finish = [post = options_.post, self = std::weak_ptr<DiskTier*>(self_), loc, record_bytes,
                 done = std::move(done)](Status st, uint64_t checksum) mutable {
    post([self, loc, record_bytes, st = std::move(st), checksum, done = std::move(done)]() mutable {
      auto tier = self.lock();
      if (!tier) return;
      DiskTier& t = **tier;
      Region& region = t.devices_[loc.device].regions[loc.region];
      --region.reads;
      --t.inflight_;
      if (st.code() == StatusCode::kCorruption) {
        ++t.counters_.checksum_failures;
        spdlog::warn("disk tier: record at {}:{} not served: {}", t.devices_[loc.device].device->name(),
                     loc.offset, st.message());
      } else if (!st.ok()) {
        ++t.counters_.io_errors;
      } else {
        ++t.counters_.reads;
        t.counters_.read_bytes += record_bytes;
      }
      done(std::move(st), checksum);
      if (region.state == RegionState::kReclaiming) t.MaybeFree(loc.device, loc.region);
    });
  };
  auto read = [op, key, payload_bytes, dst, finish, format, expected = loc.checksum, head_bytes,
               page_bytes](Result<uint64_t> got) mutable {
    Status st;
    if (!op->Arrive(got, &st)) return;
    if (st.ok()) {
      // Checked here, on the I/O thread, while the bytes are fresh.
      const std::span<const uint8_t> page(op->page.get(), page_bytes);
      if (format != RecordFormat::kHeaderPage) {
        std::memcpy(dst + head_bytes, page.data(), payload_bytes - head_bytes);
      }
      st = CheckRecord(key, format, page, std::span<const uint8_t>(dst, payload_bytes), expected);
    }
    finish(std::move(st), st.ok() ? expected : 0);
  };
  BlockDevice* device = devices_[loc.device].device;
  if (!header_page) {
    if (head_bytes > 0) device->Read(loc.offset, std::span<uint8_t>(dst, head_bytes), read);
    if (page_bytes > 0) device->Read(loc.offset + head_bytes, std::span<uint8_t>(op->page.get(), page_bytes), read);
    return;
  }
  device->Read(loc.offset, std::span<uint8_t>(op->page.get(), RecordHeader::kBytes), read);
  device->Read(loc.offset + RecordHeader::kBytes,
               std::span<uint8_t>(dst, record_bytes - RecordHeader::kBytes), read);
}

void DiskTier::Forget(const StoredKey& key, const DiskLocation& loc) {
  if (loc.device >= devices_.size() || loc.region >= devices_[loc.device].regions.size()) return;
  Region& r = devices_[loc.device].regions[loc.region];
  r.live_bytes -= std::min(r.live_bytes, loc.record_bytes);
  used_bytes_ -= std::min(used_bytes_, loc.record_bytes);
  if (live_records_ > 0) --live_records_;
  forgotten_.Delete(blocks_cf_, KeySlice(key));
  if (++forgotten_count_ >= kForgetBatch) FlushForgotten();
}

}  // namespace kvtier
