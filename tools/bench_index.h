// In-process index lookup rate for `kvtier-bench lookup`: kvtier::BlockIndex
// (tiers/block_index.h, the daemon's index of stored keys) on one core, next
// to a std::unordered_map<StoredKey, uint64_t> of the same keys built and
// probed the same way in the same run.
//
// What it measures is BlockIndex::Find alone: a prompt's keys are looked up
// one after another, all of them present; BlockCache::Lookup's LRU touches,
// counters and reply building, and the daemon's socket round trip (measured
// separately), are not in it.
//
// Thread-compatible: runs on the calling thread.
#pragma once

#include <cstdint>

namespace kvtier::bench {

struct IndexFindOptions {
  uint64_t index_keys = uint64_t{1} << 20;  // keys inserted into each structure
  uint32_t prompt_keys = 128;               // keys per prompt (consecutive finds)
  uint64_t finds_per_round = uint64_t{1} << 20;
  uint32_t rounds = 7;  // median reported
};

struct IndexFindRates {
  double index_finds_per_s = 0;  // BlockIndex::Find, median over rounds
  double map_finds_per_s = 0;    // std::unordered_map::find, median over rounds
  uint64_t entry_bytes = 0;      // sizeof(BlockEntry), the index's value
};

// Builds both structures with the same pseudo-random keys, then times
// prompts of keys drawn at random from them, alternating the two structures
// round by round. Progress goes to stdout.
IndexFindRates MeasureIndexFind(const IndexFindOptions& options);

}  // namespace kvtier::bench
