// The engine side of kvtier-bench trace: K client processes replaying a
// request trace (tools/trace_sim.h) through a running kvtierd.
//
// Mapping: one kvtier block per 512-token trace block. The engine layout is
// one layer, separate K and V, one KV head, bf16, block_tokens = 512 and
// head_dim = block_bytes / 2048, so that a block is exactly `block_bytes`.
// Block i of a request is keyed by a 16-byte chain hash of the request's
// hash_ids[0..i] and a per-run salt (so blocks of an earlier run in a
// running daemon never hit), passed through Client::KeyFromEngineHash: equal
// ids at equal positions give equal keys.
//
// Replay: the processes are forked (nothing CUDA-related is touched), each
// with its own ShmKvCache and connection. Requests are dealt in the plan's
// order to whichever client is free (a ticket counter in shared memory), as
// fast as possible or at `speed` times the trace's pace. Per request: Lookup
// (hits, per tier); Load the hit prefix into engine blocks and check it
// byte for byte; Store the blocks after what was loaded, each filled from
// its key.
//
// Called from one thread; it forks, so call it before starting threads.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/layout.h"
#include "common/status.h"
#include "tools/trace_sim.h"

namespace kvtier::bench {

inline constexpr uint32_t kMaxReplayClients = 64;

struct ReplayPlan {
  std::vector<trace::TraceRequest> requests;  // dealt in this order
  uint64_t block_bytes = 64 << 10;            // a multiple of 2 KiB
  std::string socket;                         // REQUIRED: the daemon
  double speed = 0;                           // 0 = as fast as possible; else x the trace's pace
  uint64_t salt = 0;
  // The codec the clients register their caches with; with one, blocks hold
  // KV-like bf16 values (FillKvFromKey) and an fp8 load counts as exact when
  // within fp8's bound.
  CodecKind codec = CodecKind::kNone;
  bool kv_data = false;  // KV-like block contents also without a codec
  // Lookups are counted (requests, accesses, hits) only from this request
  // on; the ones before warm the cache.
  uint64_t count_from_request = 0;
};

// What the clients did, summed.
struct ReplayCounts {
  uint64_t requests = 0;
  uint64_t accesses = 0;       // block accesses (keys looked up)
  uint64_t hits = 0;           // the lookups' hit prefixes
  uint64_t tokens = 0;         // the requests' input tokens
  uint64_t hit_tokens = 0;     // of which the hit prefixes cover (TraceRequest::TokensOf)
  uint64_t tier_hits[3] = {};  // of which in hbm, host, disk
  uint64_t loaded = 0;         // blocks loaded into the engine
  uint64_t short_loads = 0;    // loads that returned fewer blocks than their lookup's hits
  uint64_t mismatches = 0;     // loaded blocks whose bytes were not their key's (fp8: not within its bound)
  uint64_t stored = 0;         // newly stored
  uint64_t already = 0;        // stores answered "already stored"
  uint64_t rejected = 0;       // blocks of stores refused with kResourceExhausted
  double busy_s = 0;           // time spent in requests, all clients together

  void Add(const ReplayCounts& r);
};

struct ReplayResult {
  ReplayCounts counts;
  double wall_s = 0;  // from the moment every client was ready
};

// The engine layout whose blocks are `block_bytes`. Errors: Layout::Create's.
Result<Layout> TraceLayout(uint64_t block_bytes);

// Block i's engine hash: depends on `salt` and hash_ids[0..i] only.
std::vector<std::array<uint8_t, 16>> ChainHashes(std::span<const uint64_t> hash_ids, uint64_t salt);

// Runs `clients` (1..kMaxReplayClients) processes over the plan and waits
// for them. Errors: kInvalidArgument for the client count or the layout;
// the errno of mmap/pipe/fork; else the first failed client's error (e.g.
// kUnavailable when the daemon went away), its message naming the client
// and the call.
//
// `tick`, when set, runs on the calling thread about every 5 ms while the
// clients run, with the number of requests handed out so far and the time
// since they started (after the fork: it may open connections).
using ReplayTick = std::function<void(uint64_t requests_started, double elapsed_s)>;
Result<ReplayResult> Replay(const ReplayPlan& plan, uint32_t clients,
                            const ReplayTick& tick = nullptr);

}  // namespace kvtier::bench
