// CacheCodec: BlockCache's codec side (block_cache_codec.h).
#include "tiers/block_cache_codec.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>

#include "common/check.h"
#include "tiers/block_cache_disk.h"
#include "tiers/block_cache_remote.h"
#include "tiers/block_cache_room.h"
#include "tiers/codec_pool.h"

namespace kvtier {

void CacheCodec::CountEncoded(uint64_t raw_bytes, uint64_t stored_bytes) {
  ++cache_.counters_.codec_encoded;
  cache_.counters_.codec_raw_bytes += raw_bytes;
  cache_.counters_.codec_stored_bytes += stored_bytes;
}

std::shared_ptr<uint8_t> CacheCodec::TakeStaging(uint64_t bytes) {
  const uint64_t capacity = AlignUpToPage(bytes);
  if (codec_staging_bytes_ + capacity > cache_.options_.codec_staging_bytes) return nullptr;
  auto* raw = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, capacity));
  if (raw == nullptr) return nullptr;
  codec_staging_bytes_ += capacity;
  // Counted off when the last holder lets go (its work done, or the cache gone).
  return std::shared_ptr<uint8_t>(raw, [this, capacity, self = std::weak_ptr<BlockCache*>(cache_.self_)](uint8_t* p) {
    std::free(p);
    if (self.lock()) codec_staging_bytes_ -= capacity;
  });
}

bool CacheCodec::ReserveStaging(uint64_t bytes) {
  if (codec_staging_bytes_ + bytes > cache_.options_.codec_staging_bytes) return false;
  codec_staging_bytes_ += bytes;
  return true;
}

void CacheCodec::ReleaseStaging(uint64_t bytes) { codec_staging_bytes_ -= bytes; }

bool CacheCodec::KeepsCoded(uint32_t ns) const {
  if (cache_.options_.codecs == nullptr) return false;
  const CodecKind kind = cache_.namespaces_.FormatOf(ns).codec.kind;
  return kind != CodecKind::kNone && cache_.options_.backend->DecodesOnLoad(kind);
}

void CacheCodec::MaybeCompact(BlockEntry* e) {
  if (!e->compress || e->coded_bytes != 0 || e->tier != Tier::kHost || e->state != EntryState::kReady ||
      e->moving || e->retired_slot != nullptr || !e->has_checksum || !KeepsCoded(e->ns)) {
    return;
  }
  const NamespaceFormat& format = cache_.namespaces_.FormatOf(e->ns);
  if (format.block_bytes != e->block_bytes) return;
  // Blocks being coded cannot be evicted: at most a share of the tier, so
  // that stores always find room among the rest.
  const uint64_t stride = SlotPool::StrideFor(e->block_bytes);
  const uint64_t capacity = BlockCodec::MaxEncodedBytes(format.codec, e->block_bytes);
  if (compacting_bytes_ + stride > cache_.tier(Tier::kHost)->pool->capacity_bytes() / kMaxCompactingShare) {
    // Its turn comes as others end (a bounded line; past it, kept raw).
    if (compact_later_.size() < kMaxCompactLater) {
      compact_later_.push_back(e->key);
    } else {
      ++cache_.counters_.codec_pool_busy;
    }
    return;
  }
  // With a tier below to write back to, the pool's encodes for those writes
  // come first: a compaction takes only the first half of its queue.
  if ((cache_.options_.disk != nullptr || cache_.remote_->RemoteWriteBack()) &&
      cache_.options_.codecs->counters().queued * 2 >= cache_.options_.codecs->max_queued()) {
    ++cache_.counters_.codec_pool_busy;
    return;
  }
  std::shared_ptr<uint8_t> staging = TakeStaging(capacity);
  if (staging == nullptr) {
    ++cache_.counters_.codec_pool_busy;
    return;
  }
  // Moving: nothing frees, moves or writes its slot meanwhile; loads may
  // still lease and read it.
  e->moving = true;
  e->compacting = true;
  cache_.index_.Park(e);
  ++cache_.inflight_copies_;
  compacting_bytes_ += stride;
  const std::span<const uint8_t> block(e->slot, e->block_bytes);
  auto job = [this, codec = format.codec, block, staging, capacity, key = e->key, post = cache_.options_.post,
              self = std::weak_ptr<BlockCache*>(cache_.self_)](BlockCodec& coder) mutable {
    const std::optional<size_t> n = coder.Encode(codec, block, std::span(staging.get(), capacity));
    post([this, self, key, staging = std::move(staging), n]() mutable {
      if (!self.lock()) return;
      FinishHostEncode(key, std::move(staging), n);
    });
  };
  if (!cache_.options_.codecs->TryRun(std::move(job))) {
    ++cache_.counters_.codec_pool_busy;
    --cache_.inflight_copies_;
    EndCompaction(e);
  }
}

void CacheCodec::FinishHostEncode(const StoredKey& key, std::shared_ptr<uint8_t> staging,
                                  std::optional<size_t> n) {
  BlockEntry* e = cache_.index_.Find(key);  // moving entries are never dropped
  KVTIER_CHECK(e != nullptr && e->compacting);
  // A slot of the coded size; its raw slot is freed once it has moved.
  // With a tier below to write back to, only from free room (write-back
  // keeps some): making room would drop blocks not written yet. Without
  // one, as a store makes room: the coldest blocks go.
  // A coded block that takes a slot of the raw one's size (slots are 4 KiB
  // steps) gains nothing in host: it stays raw (its disk record still packs).
  const bool smaller = n && SlotPool::StrideFor(*n) < SlotPool::StrideFor(e->block_bytes);
  uint8_t* dst = smaller ? cache_.room_->ForCompaction(*n) : nullptr;
  if (!n) e->compress = false;  // deterministic: its disk and remote writes need not try again
  if (dst == nullptr) {
    ++(smaller ? cache_.counters_.codec_host_no_room : cache_.counters_.codec_not_worth_it);
    --cache_.inflight_copies_;
    EndCompaction(e);
    CompactDeferred();
    cache_.MaybeDemote();
    return;
  }
  CountEncoded(e->block_bytes, *n);
  CopyBatch batch{.direction = CopyDirection::kSlotToSlot,
                  .priority = CopyPriority::kBackground,
                  .flow = e->owner,
                  .slot_copies = {SlotCopy{staging.get(), dst, *n}},
                  .checksum_destination = true};
  --cache_.inflight_copies_;  // SubmitCopy counts the copy
  cache_.SubmitCopy(std::move(batch), [this, key, dst, n = *n, staging = std::move(staging)](CopyResult r) {
    FinishCompaction(key, dst, n, std::move(r));
  });
}

void CacheCodec::FinishCompaction(const StoredKey& key, uint8_t* dst, uint64_t coded_bytes, CopyResult result) {
  BlockEntry* e = cache_.index_.Find(key);
  KVTIER_CHECK(e != nullptr && e->compacting && e->tier == Tier::kHost);
  if (!result.status.ok()) {
    cache_.tier(Tier::kHost)->pool->Free(dst, coded_bytes);
    EndCompaction(e);
    CompactDeferred();
    cache_.MaybeDemote();
    return;
  }
  uint8_t* old = e->slot;
  cache_.Charge(e, -1);
  e->slot = dst;
  e->coded_bytes = static_cast<uint32_t>(coded_bytes);
  e->checksum = result.checksums.at(0);  // of what the slot holds now
  cache_.tier(Tier::kHost)->pool->SetOwner(dst, e);
  cache_.Charge(e, +1);
  cache_.RetireSlot(e, Tier::kHost, old, e->block_bytes);
  ++cache_.counters_.codec_host_coded;
  EndCompaction(e);
  CompactDeferred();
  cache_.MaybeDemote();
}

void CacheCodec::CompactDeferred() {
  // A few per ended compaction: the loop's work stays bounded.
  for (int i = 0; i < 8 && !compact_later_.empty(); ++i) {
    const StoredKey key = compact_later_.front();
    compact_later_.pop_front();
    if (BlockEntry* e = cache_.index_.Find(key); e != nullptr) MaybeCompact(e);
    if (!compact_later_.empty() && compact_later_.back() == key) break;  // it went back in line: no room yet
  }
}

void CacheCodec::EndCompaction(BlockEntry* e) {
  compacting_bytes_ -= SlotPool::StrideFor(e->block_bytes);
  e->moving = false;
  e->compacting = false;
  cache_.index_.Unpark(e, /*hot=*/true);
  const uint8_t deferred = std::exchange(e->deferred_write, 0);
  if (deferred != 0 && cache_.options_.disk != nullptr && cache_.disk_->DirtyInHost(e)) {
    cache_.disk_->QueueDiskWrite(e->key, /*keep_in_memory=*/deferred == 2);
  }
}

void CacheCodec::DecodeDiskRead(BlockEntry* e, std::shared_ptr<uint8_t> staging, uint8_t* dst) {
  const CodecParams codec = cache_.namespaces_.FormatOf(e->ns).codec;
  const std::span<const uint8_t> stored(staging.get(), e->disk_payload_bytes);
  const std::span<uint8_t> out(dst, e->block_bytes);
  // A load has nowhere else to go: queued past the pool's bound (reads in
  // flight are bounded by the host slots they read into).
  cache_.options_.codecs->Run([this, key = e->key, codec, stored, out, staging = std::move(staging), post = cache_.options_.post,
                        self = std::weak_ptr<BlockCache*>(cache_.self_)](BlockCodec& coder) mutable {
    Status st = coder.Decode(codec, stored, out);
    const uint64_t checksum = st.ok() ? PayloadChecksum(out) : 0;
    staging.reset();
    post([this, self, key, dst = out.data(), st = std::move(st), checksum]() mutable {
      if (!self.lock()) return;
      ++(st.ok() ? cache_.counters_.codec_decoded : cache_.counters_.codec_decode_failures);
      if (!st.ok()) spdlog::warn("disk tier: a packed record did not decode: {}", st.ToString());
      cache_.disk_->FinishDiskRead(key, dst, std::move(st), checksum);
    });
  });
}




bool CacheCodec::StartPackedWrite(BlockEntry* e, const CodecParams& codec, DiskWriteDone done) {
  const uint64_t capacity = BlockCodec::MaxEncodedBytes(codec, e->block_bytes);
  std::shared_ptr<uint8_t> staging = TakeStaging(capacity);
  if (staging == nullptr) return false;
  // The slot stays put while the block is moving (nothing frees it before
  // FinishDiskWrite), so the pool reads it in place.
  const std::span<const uint8_t> block(e->slot, e->block_bytes);
  RecordHeader header = cache_.disk_->DiskHeader(e);
  auto job = [this, codec, block, staging, capacity, header = std::move(header),
              done = std::move(done), post = cache_.options_.post,
              self = std::weak_ptr<BlockCache*>(cache_.self_)](BlockCodec& coder) mutable {
    const std::optional<size_t> n = coder.Encode(codec, block, std::span(staging.get(), capacity));
    const uint64_t checksum = n ? PayloadChecksum(std::span<const uint8_t>(staging.get(), *n)) : 0;
    post([this, self, n, checksum, codec, block, staging = std::move(staging), header = std::move(header),
          done = std::move(done)]() mutable {
      if (!self.lock()) return;
      // Saved too little, or a NaN or Inf: the block itself goes. So does
      // a lossless block that saves no page of disk (records are whole
      // pages): its reads would decode for nothing. An fp8 block stays
      // coded, as its namespace's blocks are in host.
      if (!n || (codec.kind == CodecKind::kLossless && AlignUpToPage(*n) >= AlignUpToPage(block.size()))) {
        ++cache_.counters_.codec_not_worth_it;
        const uint64_t payload_bytes = block.size();
        cache_.options_.disk->Append(std::move(header), block.data(),
                              [done = std::move(done), payload_bytes](Result<DiskLocation> where) {
                                done(payload_bytes, std::move(where));
                              });
        return;
      }
      CountEncoded(block.size(), *n);
      header.codec = codec.kind;
      header.dtype = codec.dtype;
      header.group_elems = codec.kind == CodecKind::kFp8 ? codec.group_elems : 0;
      header.raw_bytes = block.size();
      header.payload_bytes = *n;
      header.payload_checksum = checksum;
      const uint8_t* payload = staging.get();
      cache_.options_.disk->Append(std::move(header), payload,
                            [done = std::move(done), staging = std::move(staging), n = *n](Result<DiskLocation> where) {
                              done(n, std::move(where));
                            });
    });
  };
  return cache_.options_.codecs->TryRun(std::move(job));
}

uint64_t CacheCodec::CodedOnStore(uint32_t ns, uint64_t bytes) const {
  const NamespaceFormat& format = cache_.namespaces_.FormatOf(ns);
  if (format.block_bytes != bytes || !KeepsCoded(ns) || !cache_.options_.backend->EncodesOnStore(format.codec.kind)) {
    return 0;
  }
  const uint64_t n = BlockCodec::MaxEncodedBytes(format.codec, bytes);
  return SlotPool::StrideFor(n) < SlotPool::StrideFor(bytes) ? n : 0;
}

}  // namespace kvtier
