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
  struct Item {
    StoredKey key;
    DiskLocation where;
    uint32_t block_bytes = 0;
  };
  std::shared_ptr<VerifyProgress> progress = std::make_shared<VerifyProgress>();
  std::vector<Item> items;
  size_t next = 0;
  // Scratch payload buffers, 4 KiB aligned (the disk tier reads with
  // O_DIRECT); one per read in flight.
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> buffers;
  std::vector<size_t> free_buffers;
  uint64_t buffer_bytes = 0;
};

namespace {

bool SameRecord(const DiskLocation& a, const DiskLocation& b) { return a.device == b.device && a.offset == b.offset; }

}  // namespace

std::shared_ptr<const VerifyProgress> BlockCache::VerifyDisk(uint32_t max_inflight) {
  if (verification_ && !verification_->progress->done) return verification_->progress;
  auto v = std::make_shared<Verification>();
  if (options_.disk == nullptr) {
    v->progress->done = true;
    verification_ = v;
    return v->progress;
  }
  uint32_t largest = 0;
  index_.ForEach([&](BlockEntry* e) {
    if (!e->on_disk) return;
    v->items.push_back({e->key, e->disk, e->block_bytes});
    largest = std::max(largest, e->block_bytes);
  });
  disk_only_.ForEach([&](const DiskOnlyBlock& b) {
    v->items.push_back({b.key,
                        options_.disk->LocationOf(b.device, uint64_t{b.offset_pages} * kRecordAlignBytes, b.block_bytes),
                        b.block_bytes});
    largest = std::max(largest, b.block_bytes);
  });
  v->progress->total = v->items.size();
  v->buffer_bytes = (uint64_t{largest} + kRecordAlignBytes - 1) / kRecordAlignBytes * kRecordAlignBytes;
  for (uint32_t i = 0; i < std::max(1u, max_inflight) && v->buffer_bytes > 0; ++i) {
    void* p = nullptr;
    if (::posix_memalign(&p, kRecordAlignBytes, v->buffer_bytes) != 0) break;
    v->buffers.emplace_back(static_cast<uint8_t*>(p), &std::free);
    v->free_buffers.push_back(i);
  }
  verification_ = v;
  if (v->items.empty() || v->buffers.empty()) {
    v->progress->skipped = v->items.size();
    v->progress->done = true;
    return v->progress;
  }
  PumpVerify();
  return v->progress;
}

void BlockCache::PumpVerify() {
  Verification& v = *verification_;
  while (!v.free_buffers.empty() && v.next < v.items.size()) {
    const Verification::Item item = v.items[v.next++];
    // Still that record? A block may have left the disk tier, or been
    // written again elsewhere, since the list was made.
    bool current = false;
    if (const DiskOnlyBlock* b = disk_only_.Find(item.key); b != nullptr) {
      current = b->device == item.where.device &&
                uint64_t{b->offset_pages} * kRecordAlignBytes == item.where.offset;
    } else if (const BlockEntry* e = index_.Find(item.key); e != nullptr) {
      current = e->on_disk && SameRecord(e->disk, item.where);
    }
    if (!current) {
      ++v.progress->skipped;
      continue;
    }
    const size_t buffer = v.free_buffers.back();
    v.free_buffers.pop_back();
    ++inflight_copies_;
    options_.disk->Read(item.key, item.where, item.block_bytes, v.buffers[buffer].get(),
                        [this, buffer, key = item.key, where = item.where](Status st, uint64_t /*checksum*/) {
                          FinishVerifyRead(buffer, key, where, std::move(st));
                        });
  }
  if (v.next == v.items.size() && v.free_buffers.size() == v.buffers.size()) v.progress->done = true;
}

void BlockCache::FinishVerifyRead(size_t buffer, const StoredKey& key, const DiskLocation& where, Status status) {
  --inflight_copies_;
  Verification& v = *verification_;
  v.free_buffers.push_back(buffer);
  ++v.progress->checked;
  if (!status.ok()) {
    ++v.progress->bad;
    ++counters_.disk_read_failures;
    // Dropped as a load would drop it, if the record is still the block's
    // and nothing is reading it right now (a load that is reads it and
    // finds the same fault itself).
    if (DiskOnlyBlock* b = disk_only_.Find(key); b != nullptr) {
      if (b->device == where.device && uint64_t{b->offset_pages} * kRecordAlignBytes == where.offset) {
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
  PumpVerify();
}

}  // namespace kvtier
