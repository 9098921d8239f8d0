// CacheRemote: BlockCache and the remote tier (block_cache_remote.h).
#include "tiers/block_cache_remote.h"

#include <memory>
#include <utility>
#include <vector>

#include "tiers/block_cache_codec.h"
#include "tiers/block_cache_room.h"
#include "tiers/codec_pool.h"
#include "tiers/remote/remote_tier.h"

namespace kvtier {


std::optional<uint32_t> CacheRemote::FetchFromRemote(TenantId tenant, const Layout& layout,
                                                    const CodecParams& codec, std::span<const StoredKey> keys,
                                                    BlockCache::FetchDone done) {
  const uint32_t local = cache_.LeadingLocal(keys);
  if (cache_.options_.remote == nullptr || local == keys.size()) return local;
  Result<uint32_t> ns = cache_.namespaces_.IdFor(cache_.NamespaceOf(layout, codec), [&] { return layout.ToString(); });
  if (!ns || !cache_.namespaces_.Admit(tenant, *ns).ok()) return local;
  cache_.namespaces_.SetFormat(*ns, cache_.FormatFor(layout, codec));
  const uint64_t bytes = layout.block_bytes();
  std::vector<BlockEntry*> filling;
  std::vector<StoredKey> fetch;
  std::vector<std::span<uint8_t>> out;
  const StoredKey* prev = local > 0 ? &keys[local - 1] : nullptr;
  for (size_t i = local; i < keys.size(); prev = &keys[i], ++i) {
    // Present but not servable (being stored, read or moved): the prefix
    // ends there for now.
    if (cache_.index_.Find(keys[i]) != nullptr || cache_.disk_only_.Find(keys[i]) != nullptr) break;
    // Room from free slots and blocks held below host only, as for a disk
    // read: a fetch never drops a block (anyone's, the tenant's own under
    // its quota too) that exists nowhere else. Past the tenant's quota,
    // free room for the load's time where no disk tier is (a fetched block
    // is not on disk: it could not go back there).
    uint8_t* slot = cache_.room_->ForRead(bytes, tenant, /*for_load=*/cache_.options_.disk == nullptr);
    if (slot == nullptr) break;
    filling.push_back(cache_.InsertFilling(keys[i], prev, Tier::kHost, slot, bytes, *ns, tenant));
    filling.back()->compress = codec.kind != CodecKind::kNone;
    fetch.push_back(keys[i]);
    out.emplace_back(slot, bytes);
  }
  if (filling.empty()) return local;
  // The fetch writes into host slots: an in-flight copy until it is done.
  ++cache_.inflight_copies_;
  auto checksums = std::make_shared<std::vector<uint64_t>>(filling.size());
  std::vector<uint64_t>* checksums_out = checksums.get();
  // Values a codec stored are decoded into the slots on the remote tier's
  // I/O threads: the namespace's codec, whatever this cache asked for.
  const CodecParams stored_codec = cache_.FormatFor(layout, codec).codec;
  cache_.options_.remote->Get(
      cache_.NamespaceOf(layout, codec), std::move(fetch), std::move(out),
      [this, tenant, local, filling = std::move(filling), checksums = std::move(checksums),
       done = std::move(done)](Result<uint32_t> got) {
        --cache_.inflight_copies_;
        const uint32_t n = got ? *got : 0;
        for (size_t i = 0; i < filling.size(); ++i) {
          BlockEntry* e = filling[i];
          cache_.Unlease(e, tenant);
          if (i < n) {
            e->checksum = (*checksums)[i];  // as the remote tier checked it
            e->has_checksum = true;
            cache_.SetOnRemote(e);
            cache_.MakeReady(e);
            cache_.SetRemotePresent(e, true);
            ++cache_.counters_.remote_promotions;
            cache_.codec_->MaybeCompact(e);
          } else {
            cache_.Drop(e);  // a miss, an error or the breaker: never served
          }
        }
        done(local + n, n);
        cache_.MaybeDemote();
      },
      checksums_out, stored_codec);
  return std::nullopt;
}

namespace {

// Remote put pauses after failures: the first, and the longest.
constexpr std::chrono::milliseconds kFirstRemoteBackoff{50};
constexpr std::chrono::milliseconds kMaxRemoteBackoff{5000};
// Write-through retries kept at most: the oldest go beyond it; and queued
// again per FlushRemotePuts at most (bounded work on the event loop).
constexpr size_t kMaxRemoteRetries = 1 << 16;
constexpr size_t kRetriesPerFlush = 512;
// Host bytes that puts may hold leased at once, as a fraction of the tier:
// a cluster that answers slowly (a master down until its replica takes
// over) holds each put until its deadline, and stores must still find
// blocks to let go meanwhile. Write-through puts beyond it wait in the
// retry line, unleased.
constexpr uint64_t kRemotePutShareOfHost = 4;  // a quarter

}  // namespace

bool CacheRemote::RemoteWriteBack() const {
  return cache_.options_.remote != nullptr && cache_.options_.remote_write == RemoteWrite::kOnDemote;
}

bool CacheRemote::WantsRemotePut(const BlockEntry* e, RemoteWrite policy) const {
  return cache_.options_.remote != nullptr && cache_.options_.remote_write == policy && !e->on_remote &&
         e->remote_put == RemotePut::kNone && e->tier == Tier::kHost &&
         e->state == EntryState::kReady && e->has_checksum;
}

bool CacheRemote::PutsToRemote(const BlockEntry* e, RemoteWrite policy) const {
  return WantsRemotePut(e, policy) && !RemoteBackingOff() && RemotePutRoom();
}

bool CacheRemote::RemotePutRoom() const {
  const BlockCache::TierState* host = cache_.tier(Tier::kHost);
  return host->pool && remote_put_bytes_ < host->pool->capacity_bytes() / kRemotePutShareOfHost;
}

bool CacheRemote::RemoteBackingOff() const {
  return remote_failures_in_a_row_ > 0 && cache_.options_.clock() < remote_backoff_until_;
}

void CacheRemote::PutOnStore(BlockEntry* e) {
  if (!WantsRemotePut(e, RemoteWrite::kOnStore)) return;
  if (PutsToRemote(e, RemoteWrite::kOnStore)) {
    QueueRemotePut(e, /*leaving=*/false);
    return;
  }
  RetryRemotePut(e->key);  // after the pause that follows a failure, or once puts in flight ended
}

void CacheRemote::RetryRemotePut(const StoredKey& key) {
  if (remote_retries_.size() >= kMaxRemoteRetries) {
    remote_retries_.pop_front();
    ++cache_.counters_.remote_retries_dropped;
  }
  remote_retries_.push_back(key);
}

void CacheRemote::QueueRemotePut(BlockEntry* e, bool leaving) {
  cache_.Lease(e, e->owner);  // its slot stays (a move retires it until the lease ends)
  e->remote_put = RemotePut::kPutting;
  remote_put_bytes_ += e->block_bytes;  // not its slot's: a compaction may code it meanwhile
  // Its slot cannot change while it leaves: it is neither moving nor
  // compacting, and its lease keeps it so.
  if (leaving) cache_.tier(Tier::kHost)->moving_out_bytes += SlotPool::StrideFor(cache_.SlotBytes(e));
  remote_puts_.emplace_back(e, leaving);
}

void CacheRemote::FlushRemotePuts() {
  // Write-through puts that failed, once the pause is over (a bounded step:
  // the rest wait for the next call).
  for (size_t step = 0;
       step < kRetriesPerFlush && !remote_retries_.empty() && !RemoteBackingOff() && RemotePutRoom(); ++step) {
    BlockEntry* e = cache_.index_.Find(remote_retries_.front());
    remote_retries_.pop_front();
    if (e != nullptr && PutsToRemote(e, RemoteWrite::kOnStore)) {
      QueueRemotePut(e, /*leaving=*/false);
    }
  }
  // A block being coded in host waits for it, and is sent coded: its
  // compaction's end flushes again.
  std::vector<std::pair<BlockEntry*, bool>> ready;
  std::erase_if(remote_puts_, [&](const std::pair<BlockEntry*, bool>& put) {
    if (put.first->compacting) return false;
    ready.push_back(put);
    return true;
  });
  while (!ready.empty()) {
    // One batch per namespace: the first block's, taken out of the line.
    const uint32_t ns = ready.front().first->ns;
    std::vector<std::pair<BlockEntry*, bool>> batch;
    std::erase_if(ready, [&](const std::pair<BlockEntry*, bool>& put) {
      if (put.first->ns != ns) return false;
      batch.push_back(put);
      return true;
    });
    ++cache_.inflight_copies_;  // the put reads host slots until it is done
    if (!StartRemoteEncode(ns, batch)) SendRemotePut(ns, std::move(batch), nullptr);
  }
}

// The blocks of a remote put that asked for a codec, encoded (or not, when
// it saves too little): what the put sends for them, kept until it is done.
struct CacheRemote::RemoteEncoding {
  std::vector<std::vector<uint8_t>> stored;  // by block: empty = sent raw
  std::vector<RemoteTier::Form> forms;
  uint64_t reserved = 0;  // staging bytes counted for it
};

bool CacheRemote::StartRemoteEncode(uint32_t ns, const std::vector<std::pair<BlockEntry*, bool>>& batch) {
  const NamespaceFormat& format = cache_.namespaces_.FormatOf(ns);
  if (cache_.options_.codecs == nullptr || format.codec.kind == CodecKind::kNone) return false;
  std::vector<std::span<const uint8_t>> blocks(batch.size());
  uint64_t reserve = 0;
  uint64_t to_encode = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BlockEntry* e = batch[i].first;
    // A coded host block is sent as it is.
    if (!e->compress || e->coded_bytes != 0 || e->block_bytes != format.block_bytes) continue;
    blocks[i] = {e->slot, e->block_bytes};  // leased: the slot stays until the put ends
    reserve += BlockCodec::MaxEncodedBytes(format.codec, e->block_bytes);
    ++to_encode;
  }
  if (to_encode == 0) return false;
  if (!cache_.codec_->ReserveStaging(reserve)) {
    cache_.counters_.codec_pool_busy += to_encode;
    return false;
  }
  auto encoding = std::make_shared<RemoteEncoding>();
  encoding->reserved = reserve;
  auto job = [this, ns, batch, blocks = std::move(blocks), codec = format.codec, encoding, post = cache_.options_.post,
              self = std::weak_ptr<BlockCache*>(cache_.self_)](BlockCodec& coder) mutable {
    encoding->stored.resize(blocks.size());
    encoding->forms.resize(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      encoding->forms[i] = {CodecKind::kNone, 0};
      if (blocks[i].empty()) continue;
      std::vector<uint8_t>& out = encoding->stored[i];
      out.resize(BlockCodec::MaxEncodedBytes(codec, blocks[i].size()));
      const std::optional<size_t> n = coder.Encode(codec, blocks[i], out);
      if (!n) {
        out.clear();
        continue;
      }
      out.resize(*n);
      encoding->forms[i] = {codec.kind, blocks[i].size()};
    }
    post([this, self, ns, batch = std::move(batch), encoding = std::move(encoding)]() mutable {
      if (!self.lock()) return;
      SendRemotePut(ns, std::move(batch), std::move(encoding));
    });
  };
  if (!cache_.options_.codecs->TryRun(std::move(job))) {
    cache_.codec_->ReleaseStaging(reserve);
    cache_.counters_.codec_pool_busy += to_encode;
    return false;
  }
  return true;
}

void CacheRemote::SendRemotePut(uint32_t ns, std::vector<std::pair<BlockEntry*, bool>> batch,
                               std::shared_ptr<RemoteEncoding> encoding) {
  std::vector<StoredKey> keys;
  std::vector<std::span<const uint8_t>> payloads;
  std::vector<RemoteTier::Form> forms;
  for (size_t i = 0; i < batch.size(); ++i) {
    BlockEntry* e = batch[i].first;
    keys.push_back(e->key);
    RemoteTier::Form form;
    if (encoding != nullptr && !encoding->stored[i].empty()) {
      payloads.emplace_back(encoding->stored[i]);
      cache_.codec_->CountEncoded(e->block_bytes, encoding->stored[i].size());
      form = encoding->forms[i];
    } else if (e->coded_bytes != 0) {  // coded in host (also since the encode began)
      payloads.emplace_back(e->slot, e->coded_bytes);
      form = {cache_.namespaces_.FormatOf(ns).codec.kind, e->block_bytes};
    } else {
      payloads.emplace_back(e->slot, e->block_bytes);
      if (encoding != nullptr && e->compress) ++cache_.counters_.codec_not_worth_it;
    }
    forms.push_back(form);
  }
  auto outcomes = std::make_shared<std::vector<RemotePutOutcome>>(batch.size());
  std::vector<RemotePutOutcome>* outcomes_out = outcomes.get();
  cache_.options_.remote->Put(
      cache_.namespaces_.FingerprintOf(ns), std::move(keys), std::move(payloads),
      [this, batch = std::move(batch), encoding,
       outcomes = std::move(outcomes)](Result<uint32_t> /*put*/) {
        --cache_.inflight_copies_;
        if (encoding != nullptr) cache_.codec_->ReleaseStaging(encoding->reserved);
        FinishRemotePut(batch, *outcomes);
      },
      std::move(forms), outcomes_out);
}

void CacheRemote::FinishRemotePut(const std::vector<std::pair<BlockEntry*, bool>>& batch,
                                 const std::vector<RemotePutOutcome>& outcomes) {
  bool stored_any = false;
  bool failed_any = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto [e, leaving] = batch[i];
    e->remote_put = RemotePut::kNone;
    switch (outcomes[i]) {
      case RemotePutOutcome::kStored:
        cache_.SetOnRemote(e);  // only now: a block is clean only where it landed
        cache_.SetRemotePresent(e, true);
        ++cache_.counters_.remote_writes;
        stored_any = true;
        break;
      case RemotePutOutcome::kRefused:
        e->remote_put = RemotePut::kRefused;
        ++cache_.counters_.remote_writes_refused;
        break;
      case RemotePutOutcome::kNotReached:
        // Tried again after a pause: write-back picks it again, and a
        // write-through put waits in remote_retries_.
        ++cache_.counters_.remote_write_failures;
        failed_any = true;
        if (!leaving) RetryRemotePut(e->key);
        break;
    }
    if (leaving) cache_.tier(Tier::kHost)->moving_out_bytes -= SlotPool::StrideFor(cache_.SlotBytes(e));
    remote_put_bytes_ -= e->block_bytes;
    cache_.Unlease(e, e->owner);
  }
  if (failed_any && !stored_any) {
    ++remote_failures_in_a_row_;
    ++cache_.counters_.remote_write_backoffs;
    const uint32_t doublings = std::min<uint32_t>(remote_failures_in_a_row_ - 1, 16);
    const auto pause =
        std::min<std::chrono::milliseconds>(kFirstRemoteBackoff * (uint64_t{1} << doublings), kMaxRemoteBackoff);
    remote_backoff_until_ = cache_.options_.clock() + pause;
  } else if (stored_any) {
    remote_failures_in_a_row_ = 0;
  }
  cache_.MaybeDemote();
}

}  // namespace kvtier
