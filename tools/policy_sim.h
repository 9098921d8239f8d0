// Policy simulation for kvtier-bench (issue 19): the Mooncake trace through
// kvtier's own BlockIndex and eviction orders (tiers/eviction_order.h),
// without a daemon, so that a policy is measured by the code that runs it.
//
// Semantics, as kvtierd's host tier applies them to one engine's requests:
// a request's hits are its leading cached blocks (prefix hits); they are
// touched deepest first (as Lookup does), then its missing blocks are stored
// in position order, each the child of the one before, evicting while the
// tier is full: the policy's first candidate without cached children, else
// its first (RoomGate::PickVictim, scan limit 1024). Blocks already cached
// past the first miss are left as they are (a store finds them present).
//
// Pure functions over values: thread-safe.
#pragma once

#include <cstdint>
#include <span>

#include "tiers/eviction_order.h"
#include "tools/trace_sim.h"

namespace kvtier::trace {

struct PolicySimOptions {
  uint64_t capacity_blocks = 0;
  PolicyKind policy = PolicyKind::kLru;
  // Count hits only from this request on (the ones before warm the cache
  // and, for the held-out half of a split, tune nothing).
  uint64_t count_from_request = 0;
};

struct PolicySimResult {
  SimResult sim;
  uint64_t last_resorts = 0;  // evictions of blocks with cached children
  double ns_per_access = 0;  // wall time of the replay over its block accesses
};

PolicySimResult SimulatePolicy(std::span<const TraceRequest> trace, const PolicySimOptions& options);

// The index of the first request at or after `minutes` into the trace,
// trace.size() when there is none.
uint64_t RequestAtMinute(std::span<const TraceRequest> trace, double minutes);
// Where tuning ends and reporting begins: 30 minutes into the trace, or a
// third of it when it is shorter than 90 minutes (the Mooncake synthetic
// trace lasts 17).
uint64_t TuningSplit(std::span<const TraceRequest> trace);

}  // namespace kvtier::trace
