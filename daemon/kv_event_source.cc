#include "daemon/kv_event_source.h"

#include <algorithm>
#include <set>
#include <utility>

#include "common/le_bytes.h"
#include "tiers/disk/record.h"

namespace kvtier {
namespace {

constexpr uint8_t kAnnotationFormat = 1;

KvEventMedium MediumOf(Presence where) {
  switch (where) {
    case Presence::kHbm: return KvEventMedium::kGpu;
    case Presence::kHost: return KvEventMedium::kCpu;
    case Presence::kDisk: return KvEventMedium::kDisk;
    case Presence::kRemote: return KvEventMedium::kExternal;
  }
  return KvEventMedium::kCpu;
}

uint8_t Bit(Presence where) { return static_cast<uint8_t>(1u << static_cast<unsigned>(where)); }

EngineBlockHash HashAt(std::span<const uint8_t> hashes, uint32_t width, size_t i) {
  return *EngineBlockHash::From(hashes.subspan(i * width, width));
}

void PutBytes8(std::string& out, std::span<const uint8_t> bytes) {
  out.push_back(static_cast<char>(bytes.size()));
  out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
bool GetBytes8(std::string_view& in, std::string_view* bytes) {
  if (in.empty()) return false;
  const size_t n = static_cast<uint8_t>(in[0]);
  if (in.size() < 1 + n) return false;
  *bytes = in.substr(1, n);
  in.remove_prefix(1 + n);
  return true;
}
std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

std::string EncodeBlockAnnotation(const EngineBlockHash& hash, const std::optional<EngineBlockHash>& parent,
                                  std::span<const uint32_t> tokens, uint32_t block_size, std::string_view lora) {
  std::string out(1, static_cast<char>(kAnnotationFormat));
  PutBytes8(out, hash.view());
  PutBytes8(out, parent ? parent->view() : std::span<const uint8_t>());
  le::Put<uint32_t>(out, block_size);
  PutBytes8(out, AsBytes(lora));
  // Token ids that would not fit in a record header are left out.
  const bool fits = out.size() + 4 + tokens.size() * 4 <= RecordHeader::kMaxAnnotationBytes;
  le::Put<uint32_t>(out, fits ? static_cast<uint32_t>(tokens.size()) : 0);
  if (fits) {
    for (const uint32_t t : tokens) le::Put<uint32_t>(out, t);
  }
  return out;
}

std::optional<DecodedBlockAnnotation> DecodeBlockAnnotation(std::string_view in) {
  if (in.empty() || static_cast<uint8_t>(in[0]) != kAnnotationFormat) return std::nullopt;
  in.remove_prefix(1);
  DecodedBlockAnnotation d;
  std::string_view hash, parent, lora;
  uint32_t n = 0;
  if (!GetBytes8(in, &hash) || !GetBytes8(in, &parent) || !le::Get(in, &d.block_size) || !GetBytes8(in, &lora) ||
      !le::Get(in, &n) || in.size() != size_t{n} * 4 || hash.empty()) {
    return std::nullopt;
  }
  std::optional<EngineBlockHash> h = EngineBlockHash::From(AsBytes(hash));
  if (!h) return std::nullopt;
  d.hash = *h;
  if (!parent.empty()) {
    d.parent = EngineBlockHash::From(AsBytes(parent));
    if (!d.parent) return std::nullopt;
  }
  d.lora = lora;
  d.tokens.resize(n);
  for (uint32_t& t : d.tokens) le::Get(in, &t);
  return d;
}

KvEventSource::KvEventSource(std::unique_ptr<KvEventPublisher> publisher, std::vector<TenantTopic> tenants,
                             uint64_t max_metadata_bytes)
    : publisher_(std::move(publisher)),
      tenants_(std::move(tenants)),
      present_(tenants_.size(), 0),
      max_metadata_bytes_(max_metadata_bytes) {
  // Every bucket the bound allows, now: the table never rehashes on the
  // event loop (a rehash of a million entries would stall it).
  blocks_.reserve(static_cast<size_t>(std::min<uint64_t>(max_metadata_bytes_ / kNodeBytes, uint64_t{1} << 24)));
}

uint64_t KvEventSource::BytesOf(const BlockMeta& m) {
  return kNodeBytes + m.tokens.capacity() * sizeof(uint32_t) + (m.lora.size() > 15 ? m.lora.capacity() : 0);
}

void KvEventSource::Track(const StoredKey& key, BlockMeta meta) {
  const uint64_t bytes = BytesOf(meta);
  if (counters_.metadata_bytes + bytes > max_metadata_bytes_) {
    ++counters_.metadata_refused;
    return;
  }
  counters_.metadata_bytes += bytes;
  ++counters_.blocks_tracked;
  blocks_.emplace(key, std::move(meta));
}

void KvEventSource::Untrack(std::unordered_map<StoredKey, BlockMeta, Key128Hash>::iterator it) {
  counters_.metadata_bytes -= BytesOf(it->second);
  --counters_.blocks_tracked;
  blocks_.erase(it);
}

void KvEventSource::Remember(std::span<const StoredKey> keys, const StoreEventFields& f) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto it = blocks_.find(keys[i]); it != blocks_.end()) {
      ++it->second.pending;
      continue;
    }
    BlockMeta m;
    m.hash = HashAt(f.engine_hashes, f.hash_bytes, i);
    if (i > 0) {
      m.parent = HashAt(f.engine_hashes, f.hash_bytes, i - 1);
    } else if (!f.parent_hash.empty()) {
      m.parent = EngineBlockHash::From(f.parent_hash);
    }
    if (!f.token_ids.empty()) {
      const auto tokens = f.token_ids.subspan(i * f.block_size, f.block_size);
      m.tokens.assign(tokens.begin(), tokens.end());
    }
    m.lora = f.lora_name;
    m.block_size = f.block_size;
    m.pending = 1;
    Track(keys[i], std::move(m));
  }
}

void KvEventSource::Release(std::span<const StoredKey> keys) {
  for (const StoredKey& key : keys) {
    auto it = blocks_.find(key);
    if (it == blocks_.end() || it->second.pending == 0) continue;
    if (--it->second.pending == 0 && it->second.places == 0) Untrack(it);
  }
}

void KvEventSource::Adopt(const std::vector<DiskRecord>& records) {
  for (const DiskRecord& r : records) {
    if (r.header.annotation.empty() || blocks_.contains(r.header.key)) continue;
    std::optional<DecodedBlockAnnotation> d = DecodeBlockAnnotation(r.header.annotation);
    if (!d) continue;  // written by a newer kvtierd: not published
    BlockMeta m;
    m.hash = d->hash;
    m.parent = d->parent;
    m.tokens = std::move(d->tokens);
    m.lora = std::move(d->lora);
    m.block_size = d->block_size;
    m.pending = 1;  // until Snapshot, which drops it unless the cache adopted the block
    Track(r.header.key, std::move(m));
  }
}

void KvEventSource::Snapshot(BlockCache& cache) {
  std::set<std::string> topics;
  for (const TenantTopic& t : tenants_) {
    if (t.publish) topics.insert(t.topic);
  }
  // Before kvtierd serves: every block goes out, however many there are.
  snapshotting_ = true;
  for (const std::string& topic : topics) PublishCleared(topic);
  cache.ForEachPresent([&](const StoredKey& key, TenantId owner, uint32_t ns, Presence where) {
    OnBlockPresent(key, owner, ns, where);
  });
  snapshotting_ = false;
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    auto next = std::next(it);
    if (it->second.pending > 0) --it->second.pending;  // Adopt's hold
    if (it->second.pending == 0 && it->second.places == 0) Untrack(it);
    it = next;
  }
}

void KvEventSource::AfterEvictAll(const std::optional<std::vector<TenantId>>& owners) {
  std::set<std::string> topics;
  for (TenantId id = 0; id < tenants_.size(); ++id) {
    const bool named = !owners || std::find(owners->begin(), owners->end(), id) != owners->end();
    if (named && tenants_[id].publish) topics.insert(tenants_[id].topic);
  }
  for (const std::string& topic : topics) {
    uint64_t held = 0;
    for (TenantId id = 0; id < tenants_.size(); ++id) {
      if (tenants_[id].topic == topic) held += present_[id];
    }
    if (held == 0) PublishCleared(topic);
  }
}

void KvEventSource::OnBlockPresent(const StoredKey& key, TenantId owner, uint32_t, Presence where) {
  if (!Publishes(owner)) return;
  auto it = blocks_.find(key);
  if (it == blocks_.end() || (it->second.places & Bit(where)) != 0) return;
  it->second.places |= Bit(where);
  ++present_[owner];
  PublishStored(owner, it->second, where);
}

void KvEventSource::OnBlockGone(const StoredKey& key, TenantId owner, uint32_t, Presence where) {
  if (!Publishes(owner)) return;
  auto it = blocks_.find(key);
  if (it == blocks_.end() || (it->second.places & Bit(where)) == 0) return;
  it->second.places &= static_cast<uint8_t>(~Bit(where));
  --present_[owner];
  Publish(tenants_[owner].topic, BlockRemovedEvent{.block_hashes = {it->second.hash}, .medium = MediumOf(where)});
  if (it->second.places == 0 && it->second.pending == 0) Untrack(it);
}

std::string KvEventSource::DiskAnnotation(const StoredKey& key, TenantId owner) {
  if (!Publishes(owner)) return {};
  auto it = blocks_.find(key);
  if (it == blocks_.end()) return {};
  const BlockMeta& m = it->second;
  return EncodeBlockAnnotation(m.hash, m.parent, m.tokens, m.block_size, m.lora);
}

void KvEventSource::PublishStored(TenantId owner, const BlockMeta& m, Presence where) {
  Publish(tenants_[owner].topic, BlockStoredEvent{.block_hashes = {m.hash},
                                                  .parent_block_hash = m.parent,
                                                  .token_ids = m.tokens,
                                                  .block_size = m.block_size,
                                                  .lora_name = m.lora.empty() ? std::nullopt : std::optional(m.lora),
                                                  .medium = MediumOf(where)});
}

void KvEventSource::Publish(const std::string& topic, KvEvent event) {
  if (snapshotting_) {
    publisher_->PublishWaiting(topic, std::move(event));
  } else {
    publisher_->Publish(topic, std::move(event));
  }
}

void KvEventSource::PublishCleared(const std::string& topic) {
  Publish(topic, AllBlocksClearedEvent{});
  ++counters_.clears_published;
}

}  // namespace kvtier
