#include "tools/policy_sim.h"

#include <chrono>
#include <vector>

#include "tiers/block_index.h"

namespace kvtier::trace {
namespace {

// A trace's hash id as a stored key: both halves mixed (splitmix64), as
// stored keys are uniform hashes.
StoredKey KeyOf(uint64_t id) {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  StoredKey k;
  const uint64_t lo = mix(id);
  const uint64_t hi = mix(lo ^ 0x5851f42d4c957f2dull);
  for (int i = 0; i < 8; ++i) {
    k.bytes[i] = static_cast<uint8_t>(lo >> (8 * i));
    k.bytes[8 + i] = static_cast<uint8_t>(hi >> (8 * i));
  }
  return k;
}

constexpr uint32_t kScanLimit = 1024;  // as kvtierd's eviction_scan_limit

}  // namespace

PolicySimResult SimulatePolicy(std::span<const TraceRequest> trace, const PolicySimOptions& options) {
  PolicySimResult out;
  SimResult& r = out.sim;
  r.capacity_blocks = options.capacity_blocks;
  BlockIndex index(options.policy);
  EvictionOrder& order = index.order(Tier::kHost);
  std::vector<StoredKey> keys;
  std::vector<BlockEntry*> hit;
  std::vector<BlockEntry*> stored;
  bool last_resort = false;
  uint64_t accesses = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& req = trace[i];
    keys.clear();
    for (uint64_t id : req.hash_ids) keys.push_back(KeyOf(id));
    accesses += keys.size();
    hit.clear();
    bool prefix = true;
    uint64_t hits = 0;
    uint64_t any = 0;
    for (const StoredKey& k : keys) {
      BlockEntry* e = index.Find(k);
      prefix = prefix && e != nullptr;
      if (prefix) hit.push_back(e);
      hits += prefix ? 1 : 0;
      any += e != nullptr ? 1 : 0;
    }
    if (i >= options.count_from_request) {
      r.hits += hits;
      r.any_hits += any;
      r.accesses += keys.size();
      r.tokens += req.Tokens();
      r.hit_tokens += req.TokensOf(hits);
      ++r.requests;
    }
    for (auto it = hit.rbegin(); it != hit.rend(); ++it) index.Touch(*it);
    if (options.capacity_blocks == 0) continue;
    stored.clear();
    for (size_t j = hit.size(); j < keys.size(); ++j) {
      if (index.Find(keys[j]) != nullptr) continue;
      while (order.size() >= options.capacity_blocks) {
        BlockEntry* victim = order.PickVictim(
            kScanLimit,
            [](const BlockEntry* e) {
              if (e->state != EntryState::kReady) return Candidate::kSkip;  // this store's own
              return BlockIndex::HasChildrenAtOrAbove(e, Tier::kHost) ? Candidate::kLastResort : Candidate::kEvict;
            },
            &last_resort);
        out.last_resorts += last_resort ? 1 : 0;
        if (victim == nullptr) break;
        index.Erase(victim);
        ++r.evictions;
      }
      stored.push_back(index.Insert(keys[j], Tier::kHost, j == 0 ? nullptr : &keys[j - 1]));  // kFilling
      ++r.insertions;
    }
    for (BlockEntry* e : stored) e->state = EntryState::kReady;
    // As kvtierd tells the order (CachePolicy::ArrivedTogether): the blocks
    // before the store (its parent's depth) and the request's length.
    order.ArrivedTogether(stored, {.prefix_hits = static_cast<uint32_t>(hit.size()),
                                   .request_blocks = static_cast<uint32_t>(keys.size()),
                                   .partial_tail = req.Tokens() < keys.size() * kTraceBlockTokens});
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  out.ns_per_access = accesses == 0 ? 0.0 : ns / static_cast<double>(accesses);
  return out;
}

uint64_t RequestAtMinute(std::span<const TraceRequest> trace, double minutes) {
  if (trace.empty()) return 0;
  const double at = static_cast<double>(trace.front().timestamp_ms) + minutes * 60'000.0;
  for (uint64_t i = 0; i < trace.size(); ++i) {
    if (static_cast<double>(trace[i].timestamp_ms) >= at) return i;
  }
  return trace.size();
}

uint64_t TuningSplit(std::span<const TraceRequest> trace) {
  if (trace.empty()) return 0;
  const double minutes = static_cast<double>(trace.back().timestamp_ms - trace.front().timestamp_ms) / 60'000.0;
  return RequestAtMinute(trace, minutes < 90 ? minutes / 3 : 30);
}

}  // namespace kvtier::trace
