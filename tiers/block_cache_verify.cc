// BlockCache's inspection of itself: usage per namespace, and VerifyDisk,
// which reads back every disk record and checks it (kvtierctl namespaces,
// kvtierctl verify).
#include <cstdlib>
#include <memory>

#include "common/check.h"
#include "tiers/block_cache.h"

namespace kvtier {

std::vector<NamespaceUsage> BlockCache::UsageByNamespace(std::optional<TenantId> owner) {
  std::vector<NamespaceUsage> by_id(namespace_fingerprints_.size());
  for (size_t i = 0; i < by_id.size(); ++i) by_id[i].fingerprint = namespace_fingerprints_[i];
  auto add = [&](uint32_t ns, TenantId o, Tier t, uint64_t bytes) {
    if ((owner && o != *owner) || ns >= by_id.size()) return;
    ++by_id[ns].blocks;
    by_id[ns].used_bytes[static_cast<size_t>(t)] += bytes;
  };
  index_.ForEach([&](BlockEntry* e) {
    if (e->state == EntryState::kReady) add(e->ns, e->owner, e->tier, e->block_bytes);
  });
  disk_only_.ForEach([&](const DiskOnlyBlock& b) { add(b.ns, b.owner, Tier::kDisk, b.block_bytes); });
  std::vector<NamespaceUsage> out;
  for (NamespaceUsage& u : by_id) {
    if (u.blocks > 0) out.push_back(u);
  }
  return out;
}

struct BlockCache::Verification {
  std::shared_ptr<VerifyProgress> progress = std::make_shared<VerifyProgress>();
  // Where the walk is: a region at a time, its records listed when reached.
  uint32_t device = 0;
  uint32_t region = 0;
  std::vector<DiskTier::RegionRecord> records;
  size_t next = 0;
  bool cancelled = false;
  // Scratch payload buffers, 4 KiB aligned (the disk tier reads with
  // O_DIRECT), of the largest block size seen; one per read in flight.
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> buffers;
  std::vector<size_t> free_buffers;
  uint32_t max_inflight = 8;
  uint64_t buffer_bytes = 0;
};

namespace {

bool SameRecord(const DiskLocation& a, const DiskLocation& b) { return a.device == b.device && a.offset == b.offset; }

// Regions whose records PumpVerify lists per call at most (each listing is
// O(records in the region)).
constexpr uint32_t kVerifyRegionsPerStep = 4;

}  // namespace

std::shared_ptr<const VerifyProgress> BlockCache::VerifyDisk(uint32_t max_inflight) {
  if (verification_ && !verification_->progress->done) return verification_->progress;
  auto v = std::make_shared<Verification>();
  verification_ = v;
  if (options_.disk == nullptr) {
    v->progress->done = true;
    return v->progress;
  }
  v->progress->total = options_.disk->live_records();
  v->max_inflight = std::max(1u, max_inflight);
  PumpVerify();
  return v->progress;
}

void BlockCache::CancelVerify() {
  if (!verification_ || verification_->progress->done) return;
  verification_->cancelled = true;
  verification_->records.clear();
  if (verification_->free_buffers.size() == verification_->buffers.size())
    verification_->progress->done = true;
}

void BlockCache::PumpVerify() {
  // Held: a read's completion may start the next verification.
  const std::shared_ptr<Verification> held = verification_;
  Verification& v = *held;
  DiskTier& disk = *options_.disk;
  uint32_t listed = 0;
  bool paused = false;
  while (!v.cancelled && v.device < disk.num_devices()) {
    if (v.next == v.records.size()) {
      if (listed == kVerifyRegionsPerStep) {
        paused = true;  // goes on at the next read's completion, or on a later turn
        break;
      }
      v.records = disk.RecordsIn(v.device, v.region);
      v.next = 0;
      ++listed;
      if (++v.region == disk.num_regions(v.device)) {
        v.region = 0;
        ++v.device;
      }
      continue;
    }
    const DiskTier::RegionRecord& item = v.records[v.next];
    // Still that block's record? Records left behind by blocks that moved
    // or left are no records to check.
    uint32_t block_bytes = 0;
    if (const DiskOnlyBlock* b = disk_only_.Find(item.key); b != nullptr) {
      if (b->device == item.location.device && b->offset_bytes() == item.location.offset) {
        block_bytes = b->block_bytes;
      }
    } else if (const BlockEntry* e = index_.Find(item.key);
               e != nullptr && e->on_disk && !e->moving && SameRecord(e->disk, item.location)) {
      // (A moving block on disk is being read, or carried forward by a
      // reclaim, whose region may already hold other records.)
      block_bytes = e->block_bytes;
    }
    if (block_bytes == 0) {
      ++v.next;
      continue;
    }
    const uint64_t need = SlotPool::StrideFor(block_bytes);
    if (need > v.buffer_bytes) {
      // A larger block than any before: the buffers grow once it is their
      // turn (none in flight); until then, wait.
      if (v.free_buffers.size() != v.buffers.size()) break;
      v.buffers.clear();
      v.free_buffers.clear();
      v.buffer_bytes = need;
    }
    if (v.free_buffers.empty()) {
      if (v.buffers.size() == v.max_inflight) break;
      void* p = nullptr;
      if (::posix_memalign(&p, kRecordAlignBytes, v.buffer_bytes) != 0) break;
      v.buffers.emplace_back(static_cast<uint8_t*>(p), &std::free);
      v.free_buffers.push_back(v.buffers.size() - 1);
    }
    const size_t buffer = v.free_buffers.back();
    v.free_buffers.pop_back();
    ++v.next;
    ++inflight_copies_;
    const DiskLocation where =
        options_.disk->LocationOf(item.location.device, item.location.offset, block_bytes);
    options_.disk->Read(
        item.key, where, block_bytes, v.buffers[buffer].get(),
        [this, held, buffer, key = item.key, where](Status st, uint64_t /*checksum*/) {
          FinishVerifyRead(held, buffer, key, where, std::move(st));
        });
  }
  const bool idle = v.free_buffers.size() == v.buffers.size();
  const bool walked = v.cancelled || (v.device >= disk.num_devices() && v.next == v.records.size());
  if (walked && idle) v.progress->done = true;
  if (paused && idle) {
    options_.post([this, held, self = std::weak_ptr<BlockCache*>(self_)] {
      if (self.lock() && held == verification_) PumpVerify();
    });
  }
}

void BlockCache::FinishVerifyRead(const std::shared_ptr<Verification>& held, size_t buffer,
                                  const StoredKey& key, const DiskLocation& where, Status status) {
  --inflight_copies_;
  Verification& v = *held;
  v.free_buffers.push_back(buffer);
  ++v.progress->checked;
  if (!status.ok()) {
    ++v.progress->bad;
    ++counters_.disk_read_failures;
    // Dropped as a load would drop it, if the record is still the block's
    // and nothing is reading it right now (a load that is reads it and
    // finds the same fault itself).
    if (DiskOnlyBlock* b = disk_only_.Find(key); b != nullptr) {
      if (b->device == where.device && b->offset_bytes() == where.offset) {
        options_.disk->Forget(key, where);
        Charge(Tier::kDisk, b->owner, b->block_bytes, -1);
        CountEviction(Tier::kDisk, b->owner);
        disk_only_.Erase(b);
      }
    } else if (BlockEntry* e = index_.Find(key); e != nullptr && e->on_disk && SameRecord(e->disk, where) &&
                                                 !e->moving && e->leases == 0) {
      if (e->tier == Tier::kDisk) {
        Drop(e);
      } else {  // the copy in memory is good; only the disk copy goes
        options_.disk->Forget(key, e->disk);
        e->on_disk = false;
      }
    }
  }
  if (held == verification_) {
    PumpVerify();
  } else if (v.free_buffers.size() == v.buffers.size()) {
    v.progress->done = true;  // a cancelled one, replaced by a newer
  }
}

}  // namespace kvtier
