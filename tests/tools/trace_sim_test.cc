// The trace parser and the reference caches of kvtier-bench trace: small
// traces with answers worked out by hand, LRU against a list-based
// reimplementation, Belady against an exhaustive search for the optimum, and
// the Mooncake trace's published figures (LRU 27.9%, Belady 52.6% at 5,000
// blocks, prefix hits).
#include "tools/trace_sim.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <list>
#include <map>
#include <random>
#include <set>

namespace kvtier::trace {
namespace {

std::vector<TraceRequest> Trace(std::vector<std::vector<uint64_t>> requests) {
  std::vector<TraceRequest> out;
  for (size_t i = 0; i < requests.size(); ++i) {
    out.push_back(TraceRequest{.timestamp_ms = i, .hash_ids = std::move(requests[i])});
  }
  return out;
}

TEST(TraceParseTest, ReadsTheMooncakeFields) {
  auto r = ParseTraceLine(
      R"({"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 4796]})");
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_EQ(r->timestamp_ms, 27482u);
  EXPECT_EQ(r->input_tokens, 6955u);
  EXPECT_EQ(r->output_tokens, 52u);
  EXPECT_EQ(r->hash_ids, (std::vector<uint64_t>{46, 47, 4796}));
}

TEST(TraceParseTest, AnyOrderUnknownFieldsAndSpacing) {
  auto r = ParseTraceLine(
      R"(  {"hash_ids":[],"note":"a, \"b\" [c]","tags":[1,"x",[2]],"ok":true,"p":null,"timestamp":5}  )");
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->hash_ids.empty());
  EXPECT_EQ(r->timestamp_ms, 5u);
  EXPECT_EQ(r->input_tokens, 0u);
}

TEST(TraceParseTest, RefusesWhatItCannotRead) {
  for (const char* bad :
       {R"({"timestamp": 1})", R"({})", R"({"hash_ids": [1, 2)", R"({"hash_ids": [1, -2]})",
        R"({"hash_ids": [1.5]})", R"({"hash_ids": [1]} x)",
        R"({"hash_ids": [99999999999999999999]})", R"({"a": {"b": 1}, "hash_ids": []})",
        R"(["hash_ids"])", R"({"hash_ids" [1]})"}) {
    auto r = ParseTraceLine(bad);
    ASSERT_FALSE(r.has_value()) << bad;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(TraceParseTest, SortsByTimestampStablyAndNamesTheBadLine) {
  auto t = ParseTrace(
      "{\"timestamp\": 9, \"hash_ids\": [1]}\n"
      "\n"
      "{\"timestamp\": 3, \"hash_ids\": [2]}\r\n"
      "{\"timestamp\": 9, \"hash_ids\": [3]}\n");
  ASSERT_TRUE(t.has_value()) << t.error();
  ASSERT_EQ(t->size(), 3u);
  EXPECT_EQ((*t)[0].hash_ids[0], 2u);
  EXPECT_EQ((*t)[1].hash_ids[0], 1u);
  EXPECT_EQ((*t)[2].hash_ids[0], 3u);

  auto bad = ParseTrace("{\"hash_ids\": [1]}\n{\"hash_ids\": [2,]}\n");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("line 2"), std::string::npos) << bad.error();
  EXPECT_EQ(LoadTrace("/nonexistent/trace.jsonl").error().code(), StatusCode::kNotFound);
}

TEST(TraceSimTest, PrefixSemanticsEndAtTheFirstMiss) {
  // Block 2 is cached when the second request comes, but 9 before it is not.
  const auto t = Trace({{1, 2}, {9, 2}, {1, 2, 3}});
  const SimResult u = SimulateUnbounded(t);
  EXPECT_EQ(u.accesses, 7u);
  EXPECT_EQ(u.requests, 3u);
  EXPECT_EQ(u.hits, 2u);      // {1, 2} of the third request
  EXPECT_EQ(u.any_hits, 3u);  // and 2 in the second
  EXPECT_EQ(u.insertions, 4u);
  EXPECT_EQ(CountAccesses(t), 7u);
  EXPECT_EQ(CountUniqueBlocks(t), 4u);
}

TEST(TraceSimTest, LruAndBeladyByHand) {
  // Capacity 2. LRU: {1,2}; 3 evicts 1 -> {2,3}; the last request misses 1
  // (no prefix hit) and finds 2. Belady: 3 is never used again, so it is not
  // admitted (bypass) and the last request hits both.
  const auto t = Trace({{1, 2}, {3}, {1, 2}});
  const SimResult lru = SimulateLru(t, 2);
  EXPECT_EQ(lru.hits, 0u);
  EXPECT_EQ(lru.any_hits, 1u);
  EXPECT_EQ(lru.evictions, 3u);  // 1 (by 3), 2 (by 1), 3 (by 2)
  const SimResult opt = SimulateBelady(t, 2);
  EXPECT_EQ(opt.hits, 2u);
  EXPECT_EQ(opt.any_hits, 2u);
  EXPECT_EQ(opt.insertions, 2u);
  EXPECT_EQ(opt.evictions, 0u);
  EXPECT_EQ(SimulateUnbounded(t).hits, 2u);

  // Cyclic 1 2 3 with room for two: LRU never hits. MIN keeps 1 and 2 and
  // never admits 3 (each time it comes, both cached blocks are needed
  // sooner): 4 hits, the optimum (see the exhaustive search below).
  const auto cyc = Trace({{1}, {2}, {3}, {1}, {2}, {3}, {1}, {2}, {3}});
  EXPECT_EQ(SimulateLru(cyc, 2).hits, 0u);
  EXPECT_EQ(SimulateBelady(cyc, 2).hits, 4u);
}

TEST(TraceSimTest, FullBlocksOnlyDropsPartialTails) {
  // 1,300 tokens: two full blocks and a partial one. 1,024: two full. No
  // input_length: left alone. An id list that does not cover the input (a
  // trace of other semantics) is left alone too.
  std::vector<TraceRequest> t = {
      {.input_tokens = 1300, .hash_ids = {1, 2, 3}},
      {.input_tokens = 1024, .hash_ids = {1, 2}},
      {.input_tokens = 0, .hash_ids = {1, 2, 4}},
      {.input_tokens = 1300, .hash_ids = {1, 2}},
      {.input_tokens = 1300, .hash_ids = {1, 2, 5}},
  };
  EXPECT_EQ(DropPartialTails(&t), 2u);
  EXPECT_EQ(t[0].hash_ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(t[1].hash_ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(t[2].hash_ids, (std::vector<uint64_t>{1, 2, 4}));
  EXPECT_EQ(t[3].hash_ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(t[4].hash_ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(DropPartialTails(&t), 0u) << "a second pass finds none";

  // Prefill tokens saved: a hit block covers 512 tokens, the last one what
  // is left of the input. Requests 2 to 5 hit {1, 2}: 1,024 tokens each
  // (request 3, with no input_length, counts 3 blocks of 512).
  const SimResult u = SimulateUnbounded(t);
  EXPECT_EQ(u.tokens, 1300u + 1024u + 1536u + 1300u + 1300u);
  EXPECT_EQ(u.hit_tokens, 4u * 1024u);
  EXPECT_EQ(SimulateLru(t, 10).hit_tokens, u.hit_tokens);
  EXPECT_EQ(SimulateBelady(t, 10).hit_tokens, u.hit_tokens);

  // Kept, a hit on a partial tail covers only its tokens.
  const std::vector<TraceRequest> kept = {{.input_tokens = 1300, .hash_ids = {1, 2, 3}},
                                          {.input_tokens = 1300, .hash_ids = {1, 2, 3}}};
  EXPECT_EQ(SimulateUnbounded(kept).hit_tokens, 1300u);
  EXPECT_DOUBLE_EQ(SimulateUnbounded(kept).token_hit_rate(), 0.5);
}

TEST(TraceSimTest, ZeroCapacityNeverHits) {
  const auto t = Trace({{1, 2}, {1, 2}});
  EXPECT_EQ(SimulateLru(t, 0).hits, 0u);
  EXPECT_EQ(SimulateBelady(t, 0).hits, 0u);
  EXPECT_EQ(SimulateLru(t, 0).insertions, 0u);
}

TEST(TraceSimTest, EmptyTrace) {
  EXPECT_EQ(SimulateLru({}, 10).hit_rate(), 0.0);
  EXPECT_EQ(SimulateBelady({}, 10).accesses, 0u);
  EXPECT_EQ(SimulateUnbounded({}).requests, 0u);
}

// Random traces of requests that share prefixes, as the real one does.
std::vector<TraceRequest> RandomTrace(std::mt19937_64& rng, size_t requests, uint64_t id_space,
                                      size_t max_len) {
  std::vector<std::vector<uint64_t>> out;
  for (size_t i = 0; i < requests; ++i) {
    std::vector<uint64_t> r;
    if (!out.empty() && rng() % 2 == 0) {
      const auto& base = out[rng() % out.size()];
      r.assign(base.begin(), base.begin() + static_cast<ptrdiff_t>(rng() % (base.size() + 1)));
    }
    const size_t extra = 1 + rng() % max_len;
    for (size_t j = 0; j < extra; ++j) r.push_back(rng() % id_space);
    // Ids unique within a request (as in the trace).
    std::set<uint64_t> seen;
    std::vector<uint64_t> dedup;
    for (uint64_t id : r) {
      if (seen.insert(id).second) dedup.push_back(id);
    }
    out.push_back(std::move(dedup));
  }
  return Trace(std::move(out));
}

TEST(TraceSimTest, LruMatchesAListImplementation) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const auto t = RandomTrace(rng, 40, 30, 6);
    const uint64_t cap = rng() % 20;
    std::list<uint64_t> order;  // front = least recently used
    std::map<uint64_t, std::list<uint64_t>::iterator> where;
    uint64_t hits = 0, any = 0, evictions = 0;
    for (const TraceRequest& r : t) {
      bool prefix = true;
      for (uint64_t b : r.hash_ids) {
        const bool hit = where.count(b) != 0;
        prefix = prefix && hit;
        hits += prefix;
        any += hit;
      }
      for (uint64_t b : r.hash_ids) {
        if (cap == 0) break;
        if (auto it = where.find(b); it != where.end()) {
          order.erase(it->second);
        } else if (where.size() == cap) {
          where.erase(order.front());
          order.pop_front();
          ++evictions;
        }
        where[b] = order.insert(order.end(), b);
      }
    }
    const SimResult s = SimulateLru(t, cap);
    ASSERT_EQ(s.hits, hits) << "round " << round;
    ASSERT_EQ(s.any_hits, any) << "round " << round;
    ASSERT_EQ(s.evictions, evictions) << "round " << round;
  }
}

// The most hits any policy gets on a string of single-block requests (where
// prefix hits are all hits), by exhaustive search: on a miss, bypass, or
// insert (evicting any one block when full).
uint64_t OptimalHits(const std::vector<uint64_t>& refs, size_t i, std::set<uint64_t>& cache,
                     uint64_t cap,
                     std::map<std::pair<size_t, std::set<uint64_t>>, uint64_t>& memo) {
  if (i == refs.size()) return 0;
  const auto key = std::make_pair(i, cache);
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  uint64_t best;
  const uint64_t b = refs[i];
  if (cache.count(b)) {
    best = 1 + OptimalHits(refs, i + 1, cache, cap, memo);
  } else {
    best = OptimalHits(refs, i + 1, cache, cap, memo);  // bypass
    if (cap > 0) {
      if (cache.size() < cap) {
        cache.insert(b);
        best = std::max(best, OptimalHits(refs, i + 1, cache, cap, memo));
        cache.erase(b);
      } else {
        const std::vector<uint64_t> cached(cache.begin(), cache.end());
        for (uint64_t v : cached) {
          cache.erase(v);
          cache.insert(b);
          best = std::max(best, OptimalHits(refs, i + 1, cache, cap, memo));
          cache.erase(b);
          cache.insert(v);
        }
      }
    }
  }
  memo[key] = best;
  return best;
}

TEST(TraceSimTest, BeladyIsOptimalOnSingleBlockRequests) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    std::vector<uint64_t> refs(4 + rng() % 10);
    const uint64_t ids = 2 + rng() % 4;
    for (uint64_t& r : refs) r = rng() % ids;
    const uint64_t cap = rng() % 4;
    std::vector<std::vector<uint64_t>> reqs;
    for (uint64_t r : refs) reqs.push_back({r});
    const auto t = Trace(reqs);
    std::set<uint64_t> cache;
    std::map<std::pair<size_t, std::set<uint64_t>>, uint64_t> memo;
    const uint64_t opt = OptimalHits(refs, 0, cache, cap, memo);
    const SimResult s = SimulateBelady(t, cap);
    ASSERT_EQ(s.hits, opt) << "round " << round << " capacity " << cap;
    ASSERT_GE(s.hits, SimulateLru(t, cap).hits);
  }
}

TEST(TraceSimTest, BeladyBoundsLruAndTheCeilingBoundsBoth) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 100; ++round) {
    const auto t = RandomTrace(rng, 60, 50, 8);
    const uint64_t cap = 1 + rng() % 40;
    const SimResult lru = SimulateLru(t, cap), opt = SimulateBelady(t, cap),
                    ceiling = SimulateUnbounded(t);
    EXPECT_GE(opt.any_hits, lru.any_hits) << "round " << round;
    EXPECT_GE(opt.any_hits, opt.hits);
    EXPECT_LE(opt.hits, ceiling.hits);
    EXPECT_LE(lru.hits, ceiling.hits);
    // At the trace's distinct blocks, nothing is ever evicted.
    const uint64_t all = CountUniqueBlocks(t);
    EXPECT_EQ(SimulateLru(t, all).hits, ceiling.hits);
    EXPECT_EQ(SimulateBelady(t, all).hits, ceiling.hits);
  }
}

// ../shared/ exists only beside development checkouts.
std::string MooncakeTrace() {
  return std::string(KVTIER_SOURCE_DIR) + "/../shared/traces/mooncake_synthetic_trace.jsonl";
}

TEST(MooncakeTraceTest, ReproducesThePublishedHitRates) {
  if (!std::filesystem::exists(MooncakeTrace())) GTEST_SKIP() << "no " << MooncakeTrace();
  auto t = LoadTrace(MooncakeTrace());
  ASSERT_TRUE(t.has_value()) << t.error();
  EXPECT_EQ(t->size(), 3993u);
  const SimResult lru = SimulateLru(*t, 5000);
  const SimResult opt = SimulateBelady(*t, 5000);
  const SimResult ceiling = SimulateUnbounded(*t);
  EXPECT_NEAR(100 * lru.hit_rate(), 27.9, 0.5);
  EXPECT_NEAR(100 * opt.hit_rate(), 52.6, 0.5);
  // MIN keeps no block without its prefix here: its prefix hits are the
  // any-position optimum, so they are the prefix optimum too.
  EXPECT_EQ(opt.hits, opt.any_hits);
  EXPECT_GT(ceiling.hit_rate(), opt.hit_rate());
  EXPECT_EQ(lru.accesses, 121877u);
  EXPECT_EQ(CountUniqueBlocks(*t), 43924u);

  // Full blocks only, as vLLM and SGLang store them: every request but 4
  // ends in a partial block, and no partial block is reused as a prefix
  // hit unless the same prompt comes again.
  std::vector<TraceRequest> full = *t;
  EXPECT_EQ(DropPartialTails(&full), 3989u);
  EXPECT_EQ(CountAccesses(full), 121877u - 3989u);
  const SimResult lru_full = SimulateLru(full, 5000);
  EXPECT_GE(lru_full.hit_tokens, lru.hit_tokens) << "partial tails only took room";
}

}  // namespace
}  // namespace kvtier::trace
