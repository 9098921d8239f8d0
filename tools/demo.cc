// kvtier-demo: what tools/quickstart.sh runs against a fresh kvtierd. Several
// client processes (forked) hold multi-turn conversations that share a few
// system prompts: each turn looks up its prompt, loads the cached prefix into
// its KV cache (checking every byte against the key-derived content), fills
// the rest as an engine's prefill would, and stores it. At the end it prints
// what happened in each tier, from the daemon's own counters.
//
//   kvtier-demo --socket PATH [--clients 4] [--conversations 6] [--turns 4]
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/block_pattern.h"
#include "kvtier/client.h"

namespace {

using kvtier::BlockKey;

constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kSystemPromptBlocks = 8;
constexpr uint32_t kBlocksPerTurn = 2;
constexpr uint32_t kSystemPrompts = 3;

kvtier::Layout DemoLayout() {
  // A small model's KV: 8 layers x (K, V) x 16 tokens x 8 heads x 128 x bf16 = 512 KiB blocks.
  return kvtier::Layout::Create({.model_id = "kvtier/demo-8l", .num_layers = 8,
                                 .kv_kind = kvtier::KvKind::kSeparateKv, .num_kv_heads = 8, .head_dim = 128,
                                 .dtype = kvtier::DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0,
                                 .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

void AppendTokens(std::vector<uint32_t>& tokens, uint64_t seed, uint32_t blocks) {
  const std::vector<uint32_t> more = kvtier::PseudoTokens(seed, blocks * kBlockTokens);
  tokens.insert(tokens.end(), more.begin(), more.end());
}

struct ClientTally {
  uint64_t turns = 0, prompt_blocks = 0, hit_blocks = 0, stored_blocks = 0, verified = 0, mismatches = 0;
};

// One client process. Returns its exit code.
int RunClient(const std::string& socket, uint32_t index, uint32_t conversations, uint32_t turns) {
  auto client = kvtier::Client::Connect({.socket_path = socket, .client_name = "demo-" + std::to_string(index)});
  if (!client) {
    std::fprintf(stderr, "client %u: %s\n", index, client.error().ToString().c_str());
    return 1;
  }
  const uint32_t max_blocks = kSystemPromptBlocks + kBlocksPerTurn * turns;
  auto cache = kvtier::ShmKvCache::Create(DemoLayout(), max_blocks);
  if (!cache) return 1;
  auto id = (*client)->RegisterKvCache(*cache);
  if (!id) {
    std::fprintf(stderr, "client %u: %s\n", index, id.error().ToString().c_str());
    return 1;
  }
  ClientTally tally;
  for (uint32_t c = 0; c < conversations; ++c) {
    std::vector<uint32_t> tokens;
    AppendTokens(tokens, 1000 + (index + c) % kSystemPrompts, kSystemPromptBlocks);  // shared system prompt
    for (uint32_t t = 0; t < turns; ++t) {
      AppendTokens(tokens, (uint64_t{index} << 32) | (c << 16) | t, kBlocksPerTurn);  // this turn's messages
      auto keys = (*client)->ComputeKeys(*id, tokens);
      if (!keys) return 1;
      const uint32_t n = static_cast<uint32_t>(keys->size());
      std::vector<uint32_t> blocks(n);
      for (uint32_t i = 0; i < n; ++i) blocks[i] = i;
      auto hit = (*client)->Lookup(*id, *keys);
      uint32_t loaded = 0;
      if (hit && hit->hits > 0) {
        auto r = (*client)->Load(*id, std::span(*keys).first(hit->hits), std::span(blocks).first(hit->hits));
        if (r) loaded = r->blocks;
        for (uint32_t i = 0; i < loaded; ++i) {
          (kvtier::MatchesKey((*keys)[i], cache->block(i)) ? tally.verified : tally.mismatches) += 1;
        }
      }
      // "Prefill" what was not cached, then offload it.
      for (uint32_t i = loaded; i < n; ++i) kvtier::FillFromKey((*keys)[i], cache->block(i));
      if (loaded < n) {
        std::optional<BlockKey> parent;
        if (loaded > 0) parent = (*keys)[loaded - 1];
        auto r = (*client)->Store(*id, std::span(*keys).subspan(loaded), std::span(blocks).subspan(loaded), parent);
        if (r) tally.stored_blocks += r->blocks;
      }
      ++tally.turns;
      tally.prompt_blocks += n;
      tally.hit_blocks += loaded;
    }
  }
  std::printf("  client %u (pid %d): %lu turns, %lu prompt blocks, %lu loaded from kvtier (%lu verified, %lu wrong), %lu stored\n",
              index, ::getpid(), tally.turns, tally.prompt_blocks, tally.hit_blocks, tally.verified,
              tally.mismatches, tally.stored_blocks);
  std::fflush(stdout);
  return tally.mismatches == 0 ? 0 : 2;
}

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier-demo: multi-turn chat clients against a running kvtierd", "kvtier-demo"};
  std::string socket;
  uint32_t clients = 4, conversations = 6, turns = 4;
  app.add_option("-s,--socket", socket, "kvtierd's socket")->required();
  app.add_option("--clients", clients, "client processes")->check(CLI::Range(1, 64));
  app.add_option("--conversations", conversations, "conversations per client")->check(CLI::Range(1, 1000));
  app.add_option("--turns", turns, "turns per conversation")->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);

  std::printf("kvtier-demo: %u clients x %u conversations x %u turns; %u shared system prompts of %u blocks, "
              "%u new blocks a turn, %.1f MiB per block\n",
              clients, conversations, turns, kSystemPrompts, kSystemPromptBlocks, kBlocksPerTurn,
              MiB(DemoLayout().block_bytes()));
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (uint32_t i = 0; i < clients; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(RunClient(socket, i, conversations, turns));
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }

  auto client = kvtier::Client::Connect({.socket_path = socket, .client_name = "demo-report"});
  if (!client) return 1;
  auto s = (*client)->Stats();
  if (!s) return 1;
  const uint64_t keys = s->Counter("lookup_keys");
  const uint64_t hbm = s->Counter("hits_hbm"), host = s->Counter("hits_host"), disk = s->Counter("hits_disk");
  std::printf("\nkvtierd counters:\n");
  std::printf("  lookups        %lu (%lu block keys)\n", s->Counter("lookups"), keys);
  std::printf("  hits           hbm %lu, host %lu, disk %lu, misses %lu  (hit rate %.1f%%)\n", hbm, host, disk,
              s->Counter("misses"),
              keys ? 100.0 * static_cast<double>(hbm + host + disk) / static_cast<double>(keys) : 0.0);
  std::printf("  blocks         stored %lu, loaded %lu, already stored %lu\n", s->Counter("stores"),
              s->Counter("loads"), s->Counter("already_stored"));
  std::printf("  moved          engine->kvtier %.1f MiB, kvtier->engine %.1f MiB, hbm->host %.1f MiB, host->hbm %.1f MiB,\n"
              "                 host->disk %.1f MiB, disk->host %.1f MiB\n",
              MiB(s->Counter("bytes_engine_to_cache")), MiB(s->Counter("bytes_cache_to_engine")),
              MiB(s->Counter("bytes_hbm_to_host")), MiB(s->Counter("bytes_host_to_hbm")),
              MiB(s->Counter("bytes_host_to_disk")), MiB(s->Counter("bytes_disk_to_host")));
  std::printf("  tier moves     demotions hbm->host %lu, host->disk %lu; promotions host->hbm %lu, disk->host %lu\n",
              s->Counter("demotions"), s->Counter("disk_demotions"), s->Counter("promotions"),
              s->Counter("disk_promotions"));
  std::printf("  evictions      hbm %lu, host %lu, disk %lu; disk checksum failures %lu\n", s->Counter("evictions_hbm"),
              s->Counter("evictions_host"), s->Counter("evictions_disk"), s->Counter("disk_checksum_failures"));
  for (const auto& t : s->tiers) {
    const char* name = kvtier::BlockTierName(t.tier).data();
    std::printf("  %-4s tier      %lu blocks, %.1f of %.1f MiB\n", name,
                t.blocks, MiB(t.used_bytes), MiB(t.capacity_bytes));
  }
  std::printf("  leases %lu, client mappings %lu (after all clients exited)\n", s->leases, s->mappings);
  if (failed) std::printf("\n%d client process(es) failed\n", failed);
  return failed ? 1 : 0;
}
