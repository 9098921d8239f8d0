// Trace simulation for kvtier-bench trace: the Mooncake request trace
// (../shared/traces/README.md) and the hit rates of reference caches over it.
//
// A trace is one JSON object per line:
//   {"timestamp": ms, "input_length": tokens, "output_length": tokens,
//    "hash_ids": [id, ...]}
// with one id per 512-token block of the input; equal ids mean equal
// prefixes up to and including that block.
//
// Hit semantics (all three simulations): PREFIX hits. A request hits its
// leading blocks that are cached; the first miss ends the hit prefix (an
// engine can only reuse a prefix). After the request, all its blocks are in
// the cache as the engine stores them: in position order, each cached block
// is touched and each missing one inserted (with eviction when full).
//
//   SimulateUnbounded  an unbounded cache: the trace's reuse ceiling.
//   SimulateLru        LRU of `capacity_blocks`; touches and insertions in
//                      position order (a request's last block is the most
//                      recently used).
//   SimulateBelady     Belady's MIN of `capacity_blocks` over the block
//                      reference string, described at the function.
//
// Pure functions over values: thread-safe. No kvtier daemon involved.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::trace {

// The trace's block size, in tokens.
inline constexpr uint32_t kTraceBlockTokens = 512;

struct TraceRequest {
  uint64_t timestamp_ms = 0;
  uint64_t input_tokens = 0;
  uint64_t output_tokens = 0;
  std::vector<uint64_t> hash_ids;  // one per 512-token block of the input

  // The prefill tokens that `hits` leading blocks cover; with no
  // input_length, 512 a block.
  uint64_t TokensOf(uint64_t hits) const {
    const uint64_t t = hits * kTraceBlockTokens;
    return input_tokens == 0 ? t : std::min(t, input_tokens);
  }
  uint64_t Tokens() const { return input_tokens == 0 ? hash_ids.size() * kTraceBlockTokens : input_tokens; }
};

// Parses one line of the trace: a flat JSON object whose values are numbers,
// strings, booleans, null or arrays of numbers; "hash_ids" is required, the
// other known fields default to 0, unknown fields are ignored. Errors:
// kInvalidArgument saying what is wrong and at which byte.
Result<TraceRequest> ParseTraceLine(std::string_view line);

// Every non-blank line of `text`, in order of timestamp (stable: requests
// with equal timestamps keep the trace's order). Errors: ParseTraceLine's,
// with the line number.
Result<std::vector<TraceRequest>> ParseTrace(std::string_view text);

// ParseTrace of a file. Errors: kNotFound / kIoError for the file, else
// ParseTrace's.
Result<std::vector<TraceRequest>> LoadTrace(const std::string& path);

struct SimResult {
  uint64_t capacity_blocks = 0;  // UINT64_MAX for the unbounded cache
  uint64_t requests = 0;
  uint64_t accesses = 0;  // block accesses: the sum of the requests' lengths
  uint64_t hits = 0;      // prefix hits
  // Accesses to a cached block anywhere in a request, prefix or not (every
  // simulation counts it; for Belady it bounds every policy's prefix hits
  // from above, see SimulateBelady).
  uint64_t any_hits = 0;
  uint64_t insertions = 0;  // blocks stored (misses that were inserted)
  uint64_t evictions = 0;
  // Prefill tokens: the requests' input tokens, and those their prefix hits
  // cover (a hit block covers 512, the input's last block what is left of
  // it). The same with partial tail blocks dropped or kept.
  uint64_t tokens = 0;
  uint64_t hit_tokens = 0;

  // hits / accesses, in [0, 1]; 0 for an empty trace.
  double hit_rate() const {
    return accesses == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(accesses);
  }
  double token_hit_rate() const {
    return tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(tokens);
  }
  double any_hit_rate() const {
    return accesses == 0 ? 0.0 : static_cast<double>(any_hits) / static_cast<double>(accesses);
  }
};

// What an engine that stores only full blocks (vLLM, SGLang) looks up and
// stores of each request: drops the last hash id of every request whose
// input ends in a partial block (input_length not a multiple of 512, and one
// id per started block). Requests without input_length are left alone.
// Returns the number of ids dropped.
uint64_t DropPartialTails(std::vector<TraceRequest>* trace);

// Block accesses of the trace and its distinct blocks (the capacity at which
// every simulation reaches the ceiling).
uint64_t CountAccesses(std::span<const TraceRequest> trace);
uint64_t CountUniqueBlocks(std::span<const TraceRequest> trace);

SimResult SimulateUnbounded(std::span<const TraceRequest> trace);

SimResult SimulateLru(std::span<const TraceRequest> trace, uint64_t capacity_blocks);

// Belady's MIN over the block reference string: the requests' blocks in
// trace order, one reference per (request, position). Each reference knows
// when its block is referenced next (its index in that string; never = +inf).
// Hits are counted first, with prefix semantics, for the whole request; then
// its references are applied in position order: a cached block takes its
// new next-reference time; a missing block is inserted if there is room, and
// otherwise evicts the cached block referenced farthest in the future, or is
// not admitted at all ("bypass") when it is itself referenced no sooner than
// every cached block. Ties between blocks never referenced again do not
// change any count.
//
// MIN is the classic optimum of hits anywhere in a reference string
// (any_hits) at this capacity, bypassing allowed. Prefix hits <= any hits
// for every policy, so any_hits bounds every policy's prefix hits from above,
// and `hits` is the prefix-hit optimum whenever hits == any_hits: the case
// for the Mooncake trace at 5,000 blocks, where MIN keeps no block without
// its prefix. (Counting a request's hits before its insertions, rather than
// reference by reference, changes nothing when a request is shorter than the
// capacity: MIN never evicts a block referenced within the same request then.)
//
// With `count_from_request`, hits are counted only from that request on
// (the ones before warm the cache).
SimResult SimulateBelady(std::span<const TraceRequest> trace, uint64_t capacity_blocks,
                         uint64_t count_from_request = 0);

}  // namespace kvtier::trace
