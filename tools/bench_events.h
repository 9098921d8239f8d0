// kvtier-bench host --events: what publishing KV events costs. Four kvtierd
// of the same config but for events (off, on, on, off, started in that
// order so that where one sits cancels out; a ZMQ subscriber of the bench's
// own reads every batch of one), the same stores and loads with the
// engine's block metadata on all, each rep visiting them in turn so that
// the machine's noise falls on all alike. Prints the
// store+load throughput with events on next to events off (goal: >= 0.97x),
// and the events published per second of the timed reps' store, load and
// evict (a BlockStored and a BlockRemoved per block), with any gap the
// subscriber saw in their sequence numbers and the drops kvtierd counted.
#pragma once

#include <cstdint>
#include <string>

#include "tools/bench_engine.h"

namespace kvtier::bench {

struct HostEventsOptions {
  uint32_t blocks = 64;      // per op
  uint32_t block_tokens = 16;  // 2 MiB blocks of Llama 3 8B; fewer tokens, smaller blocks and more events
  uint32_t reps = 7;         // median reported; +1 warm-up
  std::string json;
};

// Returns the exit code: 0, or 1 on any failure, mismatched byte or gap.
int HostEvents(const HostEventsOptions& options, const StartDaemonFn& start_daemon);

}  // namespace kvtier::bench
