// BlockCache's side of the eviction policy (issue 19, docs/policy.md): what a
// store tells its tier's order of the request, and the engine's retention
// hints. The class is declared in block_cache.h; this file keeps
// block_cache.cc to the data path.
#include <algorithm>
#include <chrono>
#include <vector>

#include "tiers/block_cache.h"

namespace kvtier {

void BlockCache::ArrivedTogether(std::span<BlockEntry* const> filling, uint32_t parent_depth,
                                 uint32_t request_blocks) {
  const EvictionOrder::Arrival arrival{
      .prefix_hits = parent_depth, .request_blocks = request_blocks, .partial_tail = false};
  std::vector<BlockEntry*> in_tier;
  for (Tier t : {Tier::kHbm, Tier::kHost}) {
    in_tier.clear();
    for (BlockEntry* e : filling) {
      if (e->tier == t) in_tier.push_back(e);
    }
    if (!in_tier.empty()) index_.order(t).ArrivedTogether(in_tier, arrival);
  }
}

bool BlockCache::HintBlock(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms) {
  // Bytes hinted to be kept: the tier's share, and of it the owner's: its
  // quota's share where it has a quota of the tier, else an even part of
  // the tier among the tenants.
  const uint64_t capacity = Usage(e->tier).capacity_bytes;
  const double share = std::clamp(options_.hint_share, 0.0, 1.0);
  const uint64_t tenants = std::max<uint64_t>(1, named_tenants_);
  const std::optional<uint64_t> quota =
      e->owner < quotas_.size() ? quotas_[e->owner].bytes[static_cast<size_t>(e->tier)] : std::nullopt;
  const uint64_t owner_room = quota ? std::min(*quota, capacity) : capacity / tenants;
  return index_.Hint(e, hint, now_ms,
                     {.tier_bytes = static_cast<uint64_t>(share * static_cast<double>(capacity)),
                      .owner_bytes = static_cast<uint64_t>(share * static_cast<double>(owner_room))});
}

uint32_t BlockCache::NowMs() const {
  return static_cast<uint32_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.clock() - created_).count());
}

uint32_t BlockCache::Hint(std::span<const StoredKey> keys, const RetentionHint& hint, uint32_t* refused) {
  const uint32_t now = NowMs();
  uint32_t took = 0, kept_none = 0;
  for (const StoredKey& k : keys) {
    BlockEntry* e = index_.Find(k);
    if (e == nullptr) continue;
    ++took;
    kept_none += HintBlock(e, hint, now) ? 0 : 1;
  }
  counters_.hinted += took;
  counters_.hints_refused += kept_none;
  if (refused != nullptr) *refused = kept_none;
  return took;
}

}  // namespace kvtier
