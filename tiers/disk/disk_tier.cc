// DiskTier's implementation (its contract is in disk_tier.h): opening and
// recovering the tier, reads, forgets, and the index's values. Appends and
// group commits are in disk_tier_append.cc, reclaim in disk_tier_reclaim.cc;
// what the three share is in disk_tier_internal.h.
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
#include "tiers/disk/disk_tier_internal.h"

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

}  // namespace

namespace disk_tier_detail {

// Zeroed, 4 KiB aligned; `bytes` a multiple of 4 KiB.
AlignedPage NewPages(uint64_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, bytes));
  KVTIER_CHECK(p != nullptr);
  std::memset(p, 0, bytes);
  return AlignedPage(p);
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

}  // namespace disk_tier_detail

using disk_tier_detail::CheckRecord;
using disk_tier_detail::KeySlice;
using disk_tier_detail::ParseValue;
using disk_tier_detail::RecordIo;
using disk_tier_detail::RecordSplit;
using disk_tier_detail::SplitRecord;

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
  db_options.max_open_files = kIndexMaxOpenFiles;
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
