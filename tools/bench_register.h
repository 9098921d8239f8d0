// kvtier-bench register: what it costs a CPU engine to register its KV cache
// with kvtierd (AdoptedHostMemory::Adopt: the engine's pages become a memfd
// the daemon maps), for caches of 1, 4 and 16 GiB, next to a memcpy of the
// same bytes into fresh memory in the same run. Two fills: a fresh cache
// (zeros, as vLLM's torch.zeros hands it over) and one full of data (an
// engine that registers after use). The memcpy goes in slices of at most
// 1 GiB, each into memory of its own that is freed after, so that a 16 GiB
// cache fits beside it. Medians of the reps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::bench {

struct RegisterOptions {
  std::vector<uint32_t> gib = {1, 4, 16};
  uint32_t reps = 3;
  std::string json;
};

// Returns the exit code: 0, or 1 when an adoption failed or changed a byte.
int RegisterCost(const RegisterOptions& options);

}  // namespace kvtier::bench
