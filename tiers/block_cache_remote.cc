// BlockCache and the remote tier: loads fetch what no local tier holds into
// host slots (a remote hit is promoted), and host blocks are put there as
// they are stored or as they leave host (Options::remote_write). See
// tiers/remote/remote_tier.h. Blocks whose store asked for a codec are
// encoded on the codec pool before they are put, and decoded by the remote
// tier as they are fetched.
#include <memory>
#include <utility>
#include <vector>

#include "tiers/block_cache.h"
#include "tiers/codec_pool.h"
#include "tiers/remote/remote_tier.h"

namespace kvtier {

uint32_t BlockCache::LeadingLocal(std::span<const StoredKey> keys) {
  uint32_t n = 0;
  for (const StoredKey& key : keys) {
    const BlockEntry* e = index_.Find(key);
    if (e != nullptr ? !Servable(e) : disk_only_.Find(key) == nullptr) break;
    ++n;
  }
  return n;
}

std::optional<uint32_t> BlockCache::FetchFromRemote(TenantId tenant, const Layout& layout,
                                                    const CodecParams& codec, std::span<const StoredKey> keys,
                                                    std::function<void(uint32_t)> done) {
  const uint32_t local = LeadingLocal(keys);
  if (options_.remote == nullptr || local == keys.size()) return local;
  Result<uint32_t> ns = namespaces_.IdFor(NamespaceOf(layout, codec), [&] { return layout.ToString(); });
  if (!ns || !namespaces_.Admit(tenant, *ns).ok()) return local;
  namespaces_.SetFormat(*ns, FormatFor(layout, codec));
  const uint64_t bytes = layout.block_bytes();
  std::vector<BlockEntry*> filling;
  std::vector<StoredKey> fetch;
  std::vector<std::span<uint8_t>> out;
  const StoredKey* prev = local > 0 ? &keys[local - 1] : nullptr;
  for (size_t i = local; i < keys.size(); prev = &keys[i], ++i) {
    // Present but not servable (being stored, read or moved): the prefix
    // ends there for now.
    if (index_.Find(keys[i]) != nullptr || disk_only_.Find(keys[i]) != nullptr) break;
    uint8_t* slot =
        MakeHostQuotaRoom(tenant, bytes) ? AllocateSlot(Tier::kHost, bytes, Room::kAny) : nullptr;
    if (slot == nullptr) break;
    filling.push_back(InsertFilling(keys[i], prev, Tier::kHost, slot, bytes, *ns, tenant));
    filling.back()->compress = codec.kind != CodecKind::kNone;
    fetch.push_back(keys[i]);
    out.emplace_back(slot, bytes);
  }
  if (filling.empty()) return local;
  // The fetch writes into host slots: an in-flight copy until it is done.
  ++inflight_copies_;
  auto checksums = std::make_shared<std::vector<uint64_t>>(filling.size());
  std::vector<uint64_t>* checksums_out = checksums.get();
  // Values a codec stored are decoded into the slots on the remote tier's
  // I/O threads: the namespace's codec, whatever this cache asked for.
  const CodecParams stored_codec = FormatFor(layout, codec).codec;
  options_.remote->Get(
      NamespaceOf(layout, codec), std::move(fetch), std::move(out),
      [this, tenant, local, filling = std::move(filling), checksums = std::move(checksums),
       done = std::move(done)](Result<uint32_t> got) {
        --inflight_copies_;
        const uint32_t n = got ? *got : 0;
        for (size_t i = 0; i < filling.size(); ++i) {
          BlockEntry* e = filling[i];
          Unlease(e, tenant);
          if (i < n) {
            e->checksum = (*checksums)[i];  // as the remote tier checked it
            e->has_checksum = true;
            e->on_remote = true;
            MakeReady(e);
            SetRemotePresent(e, true);
            ++counters_.remote_promotions;
            MaybeCompact(e);
          } else {
            Drop(e);  // a miss, an error or the breaker: never served
          }
        }
        done(local + n);
        MaybeDemote();
      },
      checksums_out, stored_codec);
  return std::nullopt;
}

bool BlockCache::PutsToRemote(const BlockEntry* e, Options::RemoteWrite policy) const {
  return options_.remote != nullptr && options_.remote_write == policy && !e->on_remote &&
         e->tier == Tier::kHost && e->state == EntryState::kReady && e->has_checksum;
}

void BlockCache::QueueRemotePut(BlockEntry* e, bool leaving) {
  Lease(e, e->owner);  // its slot stays (a move retires it until the lease ends)
  e->on_remote = true;
  // Its slot cannot change while it leaves: it is neither moving nor
  // compacting, and its lease keeps it so.
  if (leaving) tier(Tier::kHost)->moving_out_bytes += SlotPool::StrideFor(SlotBytes(e));
  remote_puts_.emplace_back(e, leaving);
}

void BlockCache::FlushRemotePuts() {
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
    ++inflight_copies_;  // the put reads host slots until it is done
    if (!StartRemoteEncode(ns, batch)) SendRemotePut(ns, std::move(batch), nullptr);
  }
}

// The blocks of a remote put that asked for a codec, encoded (or not, when
// it saves too little): what the put sends for them, kept until it is done.
struct BlockCache::RemoteEncoding {
  std::vector<std::vector<uint8_t>> stored;  // by block: empty = sent raw
  std::vector<RemoteTier::Form> forms;
  uint64_t reserved = 0;  // staging bytes counted for it
};

bool BlockCache::StartRemoteEncode(uint32_t ns, const std::vector<std::pair<BlockEntry*, bool>>& batch) {
  const NamespaceFormat& format = namespaces_.FormatOf(ns);
  if (options_.codecs == nullptr || format.codec.kind == CodecKind::kNone) return false;
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
  if (codec_staging_bytes_ + reserve > options_.codec_staging_bytes) {
    counters_.codec_pool_busy += to_encode;
    return false;
  }
  auto encoding = std::make_shared<RemoteEncoding>();
  encoding->reserved = reserve;
  codec_staging_bytes_ += reserve;
  auto job = [this, ns, batch, blocks = std::move(blocks), codec = format.codec, encoding, post = options_.post,
              self = std::weak_ptr<BlockCache*>(self_)](BlockCodec& coder) mutable {
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
  if (!options_.codecs->TryRun(std::move(job))) {
    codec_staging_bytes_ -= reserve;
    counters_.codec_pool_busy += to_encode;
    return false;
  }
  return true;
}

void BlockCache::SendRemotePut(uint32_t ns, std::vector<std::pair<BlockEntry*, bool>> batch,
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
      CountEncoded(e->block_bytes, encoding->stored[i].size());
      form = encoding->forms[i];
    } else if (e->coded_bytes != 0) {  // coded in host (also since the encode began)
      payloads.emplace_back(e->slot, e->coded_bytes);
      form = {namespaces_.FormatOf(ns).codec.kind, e->block_bytes};
    } else {
      payloads.emplace_back(e->slot, e->block_bytes);
      if (encoding != nullptr && e->compress) ++counters_.codec_not_worth_it;
    }
    forms.push_back(form);
  }
  options_.remote->Put(namespaces_.FingerprintOf(ns), std::move(keys), std::move(payloads),
                       [this, batch = std::move(batch), encoding](Result<uint32_t> put) {
                         --inflight_copies_;
                         if (encoding != nullptr) codec_staging_bytes_ -= encoding->reserved;
                         // Per block, the tier says only how many landed:
                         // a batch that wholly did is announced.
                         const bool all = put && *put == batch.size();
                         for (const auto& [e, leaving] : batch) {
                           if (all) SetRemotePresent(e, true);
                           if (leaving) {
                             tier(Tier::kHost)->moving_out_bytes -= SlotPool::StrideFor(SlotBytes(e));
                           }
                           Unlease(e, e->owner);
                         }
                         const uint64_t n = put ? *put : 0;
                         counters_.remote_writes += n;
                         counters_.remote_write_failures += batch.size() - n;
                         MaybeDemote();
                       },
                       std::move(forms));
}

}  // namespace kvtier
