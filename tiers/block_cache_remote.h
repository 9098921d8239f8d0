// CacheRemote: BlockCache and the remote tier (issues 21, 31 and 34; see
// tiers/remote/remote_tier.h). Loads fetch what no local tier holds into
// host slots (a remote hit is promoted), and host blocks are put there as
// they are stored or as they leave host (Options::remote_write). Blocks
// whose store asked for a codec are encoded on the codec pool before they
// are put, and decoded by the remote tier as they are fetched.
//
// It owns the puts queued, the pause after failed puts, the write-through
// retries and the host bytes puts hold. Its promises:
//   - A block is on_remote only once the cluster answered its put (or it
//     was read from there): only then is it clean for host's room.
//   - A block being put is leased until its put ends; puts hold at most a
//     quarter of host (RemotePutRoom), so stores always find blocks to let go.
//   - After a batch that did not reach the cluster, puts pause (doubling
//     per failure in a row); write-through retries wait in a bounded line.
//   - A fetch takes room only through RoomGate::ForRead: it never drops a
//     block that exists nowhere else.
//
// Who may call: BlockCache's core and sides, on the owner thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tiers/block_cache.h"
#include "tiers/remote/put_outcome.h"

namespace kvtier {

class CacheRemote {
 public:
  using RemoteWrite = BlockCache::Options::RemoteWrite;

  explicit CacheRemote(BlockCache& cache) : cache_(cache) {}
  CacheRemote(const CacheRemote&) = delete;
  CacheRemote& operator=(const CacheRemote&) = delete;

  // BlockCache::FetchFromRemote.
  std::optional<uint32_t> FetchFromRemote(TenantId tenant, const Layout& layout, const CodecParams& codec,
                                          std::span<const StoredKey> keys, BlockCache::FetchDone done);
  // Whether host blocks are put to the remote tier as they leave host.
  bool RemoteWriteBack() const;
  // Whether `policy` wants host block `e` put to the remote tier (it is
  // not there, nor on its way, nor refused); and whether it is put now
  // (puts are not pausing after a failure, and hold less than their share).
  bool WantsRemotePut(const BlockEntry* e, RemoteWrite policy) const;
  bool PutsToRemote(const BlockEntry* e, RemoteWrite policy) const;
  // Whether remote puts pause after a failure.
  bool RemoteBackingOff() const;
  // Whether puts hold less than their share of host (kRemotePutShareOfHost).
  bool RemotePutRoom() const;
  // Write-through (write: store): puts host block `e` now, or once the
  // pause after a failed put is over (RetryRemotePut, remote_retries_).
  void PutOnStore(BlockEntry* e);
  // Queues a put of host block `e` to the remote tier: leased for its owner
  // until the put ends, and on_remote once it landed. A block
  // `leaving` host counts as moving out of it meanwhile (write-back stops
  // at the low watermark without waiting for the put).
  void QueueRemotePut(BlockEntry* e, bool leaving);
  // Starts the queued puts, one batch per namespace (after each
  // PumpDiskWrites, and in MaybeDemote), and write-through retries once a
  // pause is over.
  void FlushRemotePuts();

 private:
  void RetryRemotePut(const StoredKey& key);
  // A put's end: each block on_remote where it landed, refused for good,
  // or to try again after a pause.
  void FinishRemotePut(const std::vector<std::pair<BlockEntry*, bool>>& batch,
                       const std::vector<RemotePutOutcome>& outcomes);
  // A put's blocks that asked for a codec are encoded on the codec pool
  // first, then sent (SendRemotePut); false (nothing started) when there is
  // nothing to encode, or the pool or staging is full (counted).
  struct RemoteEncoding;
  bool StartRemoteEncode(uint32_t ns, const std::vector<std::pair<BlockEntry*, bool>>& batch);
  void SendRemotePut(uint32_t ns, std::vector<std::pair<BlockEntry*, bool>> batch,
                     std::shared_ptr<RemoteEncoding> encoding);

  BlockCache& cache_;
  // QueueRemotePut's blocks (leased), and whether each is leaving host.
  std::vector<std::pair<BlockEntry*, bool>> remote_puts_;
  // After a put batch that did not reach the cluster, puts wait until then
  // (doubling per failure in a row); write-back without a disk tier waits
  // too, so that no block leaves host unput while the cluster is away.
  std::chrono::steady_clock::time_point remote_backoff_until_{};
  uint32_t remote_failures_in_a_row_ = 0;
  // Write-through puts that did not reach the cluster, to try again once
  // the pause is over (at most kMaxRemoteRetries; stale keys are skipped).
  std::deque<StoredKey> remote_retries_;
  uint64_t remote_put_bytes_ = 0;  // host slot bytes leased by puts queued or in flight
};

}  // namespace kvtier
