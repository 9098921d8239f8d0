// What kvtier-bench's daemon workloads share as an engine: the 2 MiB-block
// layout they store and load, block ids and tokens, and registering a KV
// cache with a refusal reported instead of thrown. Header-only; for
// tools/bench*.cc.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/block_pattern.h"
#include "kvtier/client.h"

namespace kvtier::bench {

inline kvtier::Layout Llama8BLayout() {
  // Llama-3.1-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks = 2 MiB.
  return kvtier::Layout::Create({.model_id = "meta-llama/Llama-3.1-8B",
                                 .num_layers = 32,
                                 .kv_kind = kvtier::KvKind::kSeparateKv,
                                 .num_kv_heads = 8,
                                 .head_dim = 128,
                                 .dtype = kvtier::DType::kBf16,
                                 .block_tokens = 16,
                                 .tp_rank = 0,
                                 .tp_size = 1,
                                 .scale_bytes_per_layer = 0})
      .value();
}

inline std::vector<uint32_t> Iota(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

inline std::vector<uint32_t> Tokens(uint64_t seed, uint32_t n) {
  return kvtier::PseudoTokens(seed, n);
}

// Registers `cache`; on a refusal (e.g. blocks larger than the daemon's disk
// regions) prints why and returns nullopt.
inline std::optional<kvtier::CacheId> Register(kvtier::Client& client,
                                               const kvtier::ShmKvCache& cache) {
  kvtier::Result<kvtier::CacheId> id = client.RegisterKvCache(cache);
  if (!id) {
    std::fprintf(stderr, "kvtier-bench: the daemon refused the KV cache: %s\n",
                 id.error().ToString().c_str());
    return std::nullopt;
  }
  return *id;
}

// A kvtierd started for a workload: its socket, and how to stop it.
struct StartedDaemon {
  std::string socket;
  std::function<void()> stop;
};
// Starts a kvtierd with `tiers.host.bytes` and these --set overrides (which
// win over the starter's own defaults); it may return before the daemon
// listens (the workload then fails to connect and says so).
using StartDaemonFn = std::function<StartedDaemon(uint64_t host_bytes, std::vector<std::string> sets)>;

}  // namespace kvtier::bench
