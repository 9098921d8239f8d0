// Fuzz target: the disk tier's recovery as a whole, through the code the
// daemon runs at start-up (DiskTier::Open, BlockCache::AdoptDiskRecords) and
// on every load after it.
//
// Each input:
//   1. stores a few blocks of two tenants through a BlockCache and flushes
//      them to a disk tier on a memory device (a RocksDB index in a
//      temporary directory): an honest disk tier, closed cleanly. Tenant 1
//      stores KV-like blocks with the lossless codec, so its records are
//      packed; tenant 0's are raw. The input picks the records' format:
//      bare (index value version 4), or an older release's (a header page,
//      versions 1 and 2, or a trailer, version 3);
//   2. damages it as the input says: bytes of the device flipped, pages
//      zeroed or copied over others; index entries deleted, rewritten with
//      fields or bytes the input chooses, copied under other keys, or added
//      with keys and values of its own;
//   3. reopens it and loads every key it knows.
// Properties: nothing crashes or trips a sanitizer; a load that succeeds
// returns exactly the bytes stored under that key (anything else is a wrong
// block served); and once recovered, the tier does not overwrite what it
// recovered: blocks that loaded after the damage still load, exactly, after
// new blocks were written and the tier reopened again (when no region had to
// be reclaimed for them).
#include <fuzzer/FuzzedDataProvider.h>
#include <rocksdb/db.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/mutex.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/tiers_test_util.h"
#include "common/block_pattern.h"
#include "tiers/block_cache.h"
#include "tiers/codec_pool.h"
#include "tiers/disk/disk_tier.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

constexpr uint64_t kRegionBytes = 64 << 10;
constexpr uint64_t kRegions = 24;
constexpr uint32_t kEngineBlocks = 8;
constexpr uint32_t kLoadBlock = 7;  // the engine block loads land in

// The index lives where fsync costs nothing, when it can; removed at exit.
struct IndexDirectory {
  const std::string path = (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") +
                           std::string("/kvtier-fuzz-recovery-") + std::to_string(::getpid());
  ~IndexDirectory() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
} index_dir;

const std::string& IndexDir() { return index_dir.path; }

// One disk tier on `device` under a cache of two tenants, as the daemon sets
// them up, with the daemon's loop replaced by a queue this thread drains.
class Rig {
 public:
  // `legacy`: records as an older release wrote them (legacy_records).
  Rig(DeviceBackend& backend, tiers_test::EngineMemory& engine, MemoryDevice& device, bool legacy = false)
      : backend_(backend), engine_(engine) {
    BlockCache::Post post = [this](std::function<void()> f) {
      MutexLock lock(&mu_);
      posted_.push_back(std::move(f));
      cv_.SignalAll();
    };
    Result<std::unique_ptr<DiskTier>> disk = DiskTier::Open(
        {.devices = {&device},
         .index_path = IndexDir(),
         .region_bytes = kRegionBytes,
         .post = post,
         .reclaim = [this](
                        const StoredKey& key, const DiskLocation& where,
                        bool may_carry) { return cache_->ReclaimFromDisk(key, where, may_carry); },
         .relocated =
             [this](const StoredKey& key, Result<DiskLocation> now) {
               return cache_->FinishRelocation(key, std::move(now));
             },
         .legacy_records = legacy});
    // A damaged index may fail to open (RocksDB's own checks); that is a
    // clean refusal, not a crash.
    if (!disk) return;
    disk_ = std::move(*disk);
    const uint64_t stride = SlotPool::StrideFor(engine_.block_bytes());
    BlockCache::Options o;
    o.backend = &backend_;
    o.post = post;
    o.host_bytes = 8 * stride;
    o.disk = disk_.get();
    o.codecs = pool_.get();
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(0, "t0");
    cache_->SetTenantName(1, "t1");
    cache_->AdoptDiskRecords(disk_->TakeRecovered());
  }
  ~Rig() {
    if (cache_) Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; });
    cache_.reset();
    disk_.reset();
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;

  bool open() const { return cache_ != nullptr; }
  DiskTier& disk() { return *disk_; }

  void Store(TenantId tenant, const StoredKey& key) {
    Expected(tenant, key, engine_.block(0));
    const uint32_t block = 0;
    bool done = false;
    cache_->Store(tenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(tenant), alive_,
                  [&](OpOutcome) { done = true; });
    Drain([&] { return done; });
  }

  // Writes every host block to disk and waits until the writes are durable.
  void Flush() {
    cache_->FlushToDisk();
    Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; });
  }

  // Loads `key` (of `tenant`); true if it loaded. A load that returns bytes
  // other than the key's is the bug this target hunts, and aborts.
  bool LoadExact(TenantId tenant, const StoredKey& key) {
    engine_.Zero(kLoadBlock);
    bool done = false;
    uint32_t blocks = 0;
    cache_->Load(tenant, std::span(&key, 1), std::span(&kLoadBlock, 1), Target(tenant), alive_,
                 [&](OpOutcome o) {
                   blocks = o.blocks;
                   done = true;
                 });
    Drain([&] { return done; });
    if (blocks == 0) return false;
    std::vector<uint8_t> want(engine_.block_bytes());
    Expected(tenant, key, want);
    KVTIER_CHECK_MSG(std::memcmp(want.data(), engine_.block(kLoadBlock).data(), want.size()) == 0,
                     "a load served bytes that were not stored under its key");
    return true;
  }

 private:
  // Tenant 1's blocks are KV-like and stored lossless (packed on disk).
  EngineTarget Target(TenantId tenant) {
    const CodecKind codec = tenant == 1 ? CodecKind::kLossless : CodecKind::kNone;
    return {engine_.layout(), engine_.mapping(), -1, {.kind = codec, .dtype = DType::kFp16, .group_elems = 0}};
  }
  static void Expected(TenantId tenant, const StoredKey& key, std::span<uint8_t> out) {
    if (tenant == 1) {
      FillKvFromKey(BlockKey{key.bytes}, out);
    } else {
      tiers_test::PatternFor(key, out);
    }
  }

  void Drain(const std::function<bool()>& until) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!until()) {
      std::deque<std::function<void()>> batch;
      {
        MutexLock lock(&mu_);
        while (posted_.empty()) {
          KVTIER_CHECK_MSG(cv_.WaitFor(&mu_, deadline - std::chrono::steady_clock::now()),
                           "the disk tier or the cache stopped answering");
        }
        batch.swap(posted_);
      }
      for (auto& f : batch) f();
    }
  }

  DeviceBackend& backend_;
  tiers_test::EngineMemory& engine_;
  std::unique_ptr<CodecPool> pool_ = CodecPool::Create({.threads = 1, .max_queued = 64}).value();
  std::shared_ptr<void> alive_ = std::make_shared<int>(0);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> posted_ KVTIER_GUARDED_BY(mu_);
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
};

StoredKey KeyFrom(FuzzedDataProvider& in, uint8_t salt) {
  StoredKey k;
  const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(StoredKey::kSize);
  for (size_t i = 0; i < StoredKey::kSize; ++i) {
    k.bytes[i] = static_cast<uint8_t>((i < bytes.size() ? bytes[i] : 0) ^ (salt * 131 + i * 7));
  }
  return k;
}

// Step 2 on the index: applies the input's changes to the blocks column
// family, as a crash, a bug or a hostile writer of the state directory might.
// Returns keys the input added.
std::vector<StoredKey> DamageIndex(FuzzedDataProvider& in) {
  rocksdb::Options options;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"regions", {}}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  KVTIER_CHECK(rocksdb::DB::Open(options, IndexDir(), cfs, &handles, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ColumnFamilyHandle* blocks = handles[1];
  std::vector<std::pair<std::string, std::string>> entries;
  {
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator({}, blocks));
    for (it->SeekToFirst(); it->Valid(); it->Next())
      entries.emplace_back(it->key().ToString(), it->value().ToString());
  }
  std::vector<StoredKey> added;
  const int ops = in.ConsumeIntegralInRange(0, 8);
  for (int op = 0; op < ops && in.remaining_bytes() > 0; ++op) {
    const size_t pick =
        entries.empty() ? 0 : in.ConsumeIntegralInRange<size_t>(0, entries.size() - 1);
    switch (in.ConsumeIntegralInRange(0, 5)) {
      case 0:  // delete an entry
        if (!entries.empty()) KVTIER_CHECK(db->Delete({}, blocks, entries[pick].first).ok());
        break;
      case 1:  // one byte of a value
        if (!entries.empty() && !entries[pick].second.empty()) {
          std::string& v = entries[pick].second;
          v[in.ConsumeIntegralInRange<size_t>(0, v.size() - 1)] =
              static_cast<char>(in.ConsumeIntegral<uint8_t>());
          KVTIER_CHECK(db->Put({}, blocks, entries[pick].first, v).ok());
        }
        break;
      case 2:  // a u32 or u64 field of a value, to any number (overflows included)
        if (!entries.empty()) {
          std::string& v = entries[pick].second;
          const bool wide = in.ConsumeBool();
          const size_t width = wide ? 8 : 4;
          if (v.size() >= width) {
            const size_t at = in.ConsumeIntegralInRange<size_t>(0, v.size() - width);
            const uint64_t value = in.ConsumeIntegral<uint64_t>();
            std::memcpy(v.data() + at, &value, width);  // little-endian, as the index writes
            KVTIER_CHECK(db->Put({}, blocks, entries[pick].first, v).ok());
          }
        }
        break;
      case 3:  // another key pointing at an entry's record
        if (!entries.empty()) {
          const StoredKey k = KeyFrom(in, 3);
          added.push_back(k);
          KVTIER_CHECK(
              db->Put({}, blocks,
                      rocksdb::Slice(reinterpret_cast<const char*>(k.bytes.data()), k.kSize),
                      entries[pick].second)
                  .ok());
        }
        break;
      case 4: {  // a key and value of the input's own
        const StoredKey k = KeyFrom(in, 4);
        added.push_back(k);
        const std::string value = in.ConsumeRandomLengthString(96);
        KVTIER_CHECK(db->Put({}, blocks,
                             rocksdb::Slice(reinterpret_cast<const char*>(k.bytes.data()), k.kSize),
                             value)
                         .ok());
        break;
      }
      case 5: {  // a key of the wrong size
        const std::string key = in.ConsumeRandomLengthString(40);
        if (key.size() != StoredKey::kSize) {
          KVTIER_CHECK(
              db->Put({}, blocks, key, entries.empty() ? std::string() : entries[pick].second)
                  .ok());
        }
        break;
      }
    }
  }
  for (rocksdb::ColumnFamilyHandle* h : handles)
    KVTIER_CHECK(db->DestroyColumnFamilyHandle(h).ok());
  KVTIER_CHECK(db->Close().ok());
  return added;
}

// Step 2 on the device's bytes.
void DamageDevice(FuzzedDataProvider& in, MemoryDevice& device) {
  const std::span<uint8_t> bytes = device.raw();
  const uint64_t pages = bytes.size() / kRecordAlignBytes;
  const int ops = in.ConsumeIntegralInRange(0, 8);
  for (int op = 0; op < ops && in.remaining_bytes() > 0; ++op) {
    switch (in.ConsumeIntegralInRange(0, 2)) {
      case 0:
        bytes[in.ConsumeIntegralInRange<uint64_t>(0, bytes.size() - 1)] ^=
            static_cast<uint8_t>(in.ConsumeIntegralInRange(1, 255));
        break;
      case 1:
        std::memset(
            bytes.data() + in.ConsumeIntegralInRange<uint64_t>(0, pages - 1) * kRecordAlignBytes, 0,
            kRecordAlignBytes);
        break;
      case 2: {
        const uint64_t from = in.ConsumeIntegralInRange<uint64_t>(0, pages - 1);
        const uint64_t to = in.ConsumeIntegralInRange<uint64_t>(0, pages - 1);
        std::memmove(bytes.data() + to * kRecordAlignBytes, bytes.data() + from * kRecordAlignBytes,
                     kRecordAlignBytes);
        break;
      }
    }
  }
}

// Whether `k` is among the keys the input stored or added. The harness gives
// each key one tenant's bytes; in the daemon, stored keys are salted per
// tenant, so two tenants never share one.
bool Known(const std::vector<std::pair<TenantId, StoredKey>>& stored, const StoredKey& k) {
  return std::any_of(stored.begin(), stored.end(), [&](const auto& s) { return s.second == k; });
}

struct Fixture {
  std::unique_ptr<HostBackend> backend = HostBackend::Create({.copy_threads = 1}).value();
  std::unique_ptr<tiers_test::EngineMemory> engine =
      tiers_test::EngineMemory::Create(*backend, tiers_test::SmallSpec(), kEngineBlocks).value();
};

}  // namespace
}  // namespace kvtier

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvtier;
  static Fixture* fixture = new Fixture();  // lives as long as the process
  FuzzedDataProvider in(data, size);
  std::filesystem::remove_all(IndexDir());
  MemoryDevice device(kRegions * kRegionBytes);

  // 1. An honest tier.
  std::vector<std::pair<TenantId, StoredKey>> stored;
  {
    Rig rig(*fixture->backend, *fixture->engine, device, /*legacy=*/in.ConsumeBool());
    KVTIER_CHECK(rig.open());
    const int n = in.ConsumeIntegralInRange(1, 12);
    for (int i = 0; i < n; ++i) {
      const TenantId tenant = in.ConsumeBool() ? 1 : 0;
      const StoredKey k = KeyFrom(in, static_cast<uint8_t>(i));
      if (Known(stored, k)) continue;  // stored keys are salted per tenant: never the same for two
      stored.emplace_back(tenant, k);
      rig.Store(tenant, k);
    }
    rig.Flush();
  }
  device.WaitIdle();

  // 2. Damage.
  // An added key that was stored keeps what was stored under it: a load
  // of it returns that block, or misses (its entry may now point elsewhere).
  for (const StoredKey& k : DamageIndex(in)) {
    if (!Known(stored, k)) stored.emplace_back(0, k);
  }
  DamageDevice(in, device);

  // 3. Recover and load everything.
  std::set<size_t> good;
  {
    Rig rig(*fixture->backend, *fixture->engine, device);
    if (!rig.open()) return 0;
    for (size_t i = 0; i < stored.size(); ++i) {
      if (rig.LoadExact(stored[i].first, stored[i].second)) good.insert(i);
    }
    // New blocks after recovery.
    const int more = in.ConsumeIntegralInRange(0, 6);
    for (int i = 0; i < more; ++i) {
      const StoredKey k = KeyFrom(in, static_cast<uint8_t>(100 + i));
      if (Known(stored, k)) continue;
      stored.emplace_back(0, k);
      rig.Store(0, k);
      good.insert(stored.size() - 1);
    }
    rig.Flush();
    if (rig.disk().counters().regions_reclaimed > 0) return 0;  // blocks may have gone, rightly
  }
  device.WaitIdle();

  // 4. Nothing that was recovered, or written since, was overwritten.
  Rig rig(*fixture->backend, *fixture->engine, device);
  KVTIER_CHECK(rig.open());
  for (size_t i : good) {
    KVTIER_CHECK_MSG(rig.LoadExact(stored[i].first, stored[i].second),
                     "a block that was readable after recovery was lost without a reclaim");
  }
  return 0;
}
