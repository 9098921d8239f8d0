// CacheCodec: BlockCache's codec side (issues 18 and 34,
// docs/compression.md): host blocks kept in slots of their coded size,
// packed disk writes, the decode of packed records read back, and the
// staging buffers all of these hold. All codec work runs on the codec pool;
// the event loop only hands it blocks and takes back what it made.
//
// It owns the staging bytes held, the host bytes being compacted and the
// line of compactions waiting for their share. Its promises:
//   - Staging buffers (TakeStaging, ReserveStaging) never hold more than
//     Options::codec_staging_bytes; past it the block is kept raw (counted
//     as codec_pool_busy).
//   - A block being compacted is moving (parked, never evicted, freed or
//     written) until EndCompaction; such blocks hold at most 1 /
//     kMaxCompactingShare of host. A disk write asked for meanwhile is
//     deferred (BlockEntry::deferred_write) and queued at the end.
//   - Compaction takes room only through RoomGate::ForCompaction.
//
// Who may call: BlockCache's core and sides, on the owner thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>

#include "tiers/block_cache.h"

namespace kvtier {

class CacheCodec {
 public:
  explicit CacheCodec(BlockCache& cache) : cache_(cache) {}
  CacheCodec(const CacheCodec&) = delete;
  CacheCodec& operator=(const CacheCodec&) = delete;

  // A block written coded (to disk or the remote tier), in the counters.
  void CountEncoded(uint64_t raw_bytes, uint64_t stored_bytes);
  // Coded host blocks: whether namespace `ns`'s blocks are kept coded in
  // host (a codec pool, and a backend that decodes them on load).
  bool KeepsCoded(uint32_t ns) const;
  // The coded size of namespace `ns`'s host slots when the backend codes its
  // stores on the way (EncodesOnStore) and that takes a smaller slot; else 0.
  uint64_t CodedOnStore(uint32_t ns, uint64_t bytes) const;
  // Encodes ready host block `e` (stored raw, its store asked for a codec)
  // on the codec pool and moves it into a host slot of its coded size; kept
  // raw when the pool is busy, the codec saves too little or no slot of
  // that size can be had (each counted). A block being compacted is moving.
  void MaybeCompact(BlockEntry* e);
  // Decodes a packed record read into `staging` into host slot `dst` on the
  // codec pool, then CacheDisk::FinishDiskRead.
  void DecodeDiskRead(BlockEntry* e, std::shared_ptr<uint8_t> staging, uint8_t* dst);
  // Encodes `e` on the codec pool and appends it packed, or raw when the
  // codec saves too little; `done` as Append's, with the payload's bytes.
  // False (nothing started) when the pool or staging is full.
  using DiskWriteDone = std::function<void(uint64_t payload_bytes, Result<DiskLocation>)>;
  bool StartPackedWrite(BlockEntry* e, const CodecParams& codec, DiskWriteDone done);
  // Staging bytes for a remote put's encodes: false (none taken) when they
  // would pass codec_staging_bytes; given back with ReleaseStaging.
  bool ReserveStaging(uint64_t bytes);
  void ReleaseStaging(uint64_t bytes);

 private:
  // A staging buffer of `bytes` (4 KiB aligned) counted against
  // codec_staging_bytes until its last holder lets go; null when that is
  // spent.
  std::shared_ptr<uint8_t> TakeStaging(uint64_t bytes);
  void FinishHostEncode(const StoredKey& key, std::shared_ptr<uint8_t> staging, std::optional<size_t> n);
  void FinishCompaction(const StoredKey& key, uint8_t* dst, uint64_t coded_bytes, CopyResult result);
  // Ends `e`'s compaction (it stays raw, or went coded): the disk write
  // asked for meanwhile goes in line.
  void EndCompaction(BlockEntry* e);
  // Starts compactions that waited for their share of the tier.
  void CompactDeferred();

  BlockCache& cache_;
  uint64_t codec_staging_bytes_ = 0;  // encoded blocks' staging buffers held now
  // Raw host slots of blocks being compacted (MaybeCompact): at most 1 /
  // kMaxCompactingShare of the host tier.
  static constexpr uint64_t kMaxCompactingShare = 8;
  uint64_t compacting_bytes_ = 0;
  // Blocks whose compaction waits for that share (stale keys are skipped),
  // at most kMaxCompactLater; a few start as each compaction ends.
  static constexpr size_t kMaxCompactLater = 4096;
  std::deque<StoredKey> compact_later_;
};

}  // namespace kvtier
